"""A batch of rollouts: every (task, rollout) episode at once, at most ``max_concurrent_episodes``
running, the stragglers cancelled once enough have finished (:meth:`.engine.RolloutEngine.collect_async`);
and :func:`run_coroutine`, which runs such a coroutine from synchronous code."""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar, cast

from tqdm.auto import tqdm

from ..interrupts import deferred_interrupt
from ..trajectory import Trajectory
from .records import RolloutBatch, RolloutFailureBudgetExceeded, mix_seed

T = TypeVar("T")

EpisodeRunner = Callable[[Mapping[str, Any], int, int | None], Awaitable[Trajectory]]
"""Runs one episode of a task: ``(task, group, seed) -> trajectory`` (:meth:`.engine.RolloutEngine.run_episode`)."""


async def collect_batch(
    run_episode: EpisodeRunner,
    tasks: Sequence[Mapping[str, Any]],
    rollouts_per_task: int,
    *,
    max_concurrent_episodes: int,
    show_progress: bool,
    seed: int | None = None,
    group_ids: Sequence[int] | None = None,
    done_fraction: float = 1.0,
    task_fraction: float = 1.0,
    max_failed_fraction: float = 1.0,
    description: str = "rollouts",
) -> RolloutBatch:
    """``rollouts_per_task`` episodes of every task with ``run_episode``, as
    :meth:`.engine.RolloutEngine.collect_async` documents."""
    group_ids = list(group_ids) if group_ids is not None else list(range(len(tasks)))
    started = time.perf_counter()
    total = len(tasks) * rollouts_per_task
    need_total = math.ceil(done_fraction * total)
    need_per_task = round(task_fraction * rollouts_per_task)
    limiter = asyncio.Semaphore(max_concurrent_episodes)

    async def limited(task: Mapping[str, Any], group: int, k: int) -> Trajectory:
        async with limiter:
            episode_seed = None if seed is None else mix_seed(seed, group_ids[group], k)
            trajectory = await run_episode(task, group, episode_seed)
            trajectory.rollout = k
            return trajectory

    running = {
        asyncio.ensure_future(limited(task, group, k)): (group, k)
        for group, task in enumerate(tasks)
        for k in range(rollouts_per_task)
    }
    finished: dict[tuple[int, int], Trajectory] = {}
    per_task = Counter[int]()
    pending = set(running)
    # disable=None: no bar where it would not be seen as one (stderr not a terminal: a log file gets no
    # carriage-return fragments); a notebook still gets its widget.
    with tqdm(total=total, desc=description, disable=None if show_progress else True, leave=False) as bar:
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    key = running[future]
                    finished[key] = future.result()
                    per_task[key[0]] += 1
                bar.update(len(done))
                if len(finished) >= need_total and all(per_task[g] >= need_per_task for g in range(len(tasks))):
                    break
        finally:
            for future in pending:
                future.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
    ordered = [finished[key] for key in sorted(finished)]
    batch = RolloutBatch(
        trajectories=[t for t in ordered if t.status == "completed"],
        failed=[t for t in ordered if t.status == "failed"],
        num_cancelled=len(pending),
        seconds=time.perf_counter() - started,
    )
    check_failure_budget(batch, max_failed_fraction)
    return batch


def check_failure_budget(batch: RolloutBatch, max_failed_fraction: float) -> None:
    """Raise :class:`RolloutFailureBudgetExceeded` if more than ``max_failed_fraction`` of the batch's rollouts
    failed: training on the survivors would lean towards whatever does not crash."""
    num_run = len(batch.trajectories) + len(batch.failed)
    if batch.failed and len(batch.failed) > max_failed_fraction * num_run:
        errors = Counter(t.error for t in batch.failed).most_common(1)[0]
        raise RolloutFailureBudgetExceeded(
            f"{len(batch.failed)} of {num_run} rollouts failed (budget {max_failed_fraction:.0%}); "
            f"most common error ({errors[1]}x): {errors[0]}"
        )


class _Held:
    """A coroutine's result behind a repr that does not show it (:func:`run_coroutine`)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"<{type(self.value).__name__}>"


async def _held(coroutine: Coroutine[Any, Any, T]) -> _Held:
    return _Held(await coroutine)


def make_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop, made with Ctrl-C held off until it is whole. A KeyboardInterrupt inside the loop's
    constructor leaves a half-made loop whose finaliser fails ("Exception ignored ... no attribute '_ssock'"),
    printed after loop-train's interrupt line; one held meanwhile is raised once the loop is made, and closed."""
    loop = None
    try:
        with deferred_interrupt():
            loop = asyncio.new_event_loop()
    except KeyboardInterrupt:
        if loop is not None:
            loop.close()
        raise
    return loop


def _run_held(coroutine: Coroutine[Any, Any, T]) -> T:
    held = None
    try:
        held = _held(coroutine)
        with asyncio.Runner(loop_factory=make_event_loop) as runner:
            return cast(T, runner.run(held).value)
    except BaseException:
        # A Ctrl-C before the task's first step leaves ``held`` (interrupted before the task was made) or
        # ``coroutine`` (the task cancelled unstarted) never awaited, which Python would report at exit, after
        # loop-train's last line: closed, it is not.
        for unstarted in (held, coroutine):
            if unstarted is not None and inspect.getcoroutinestate(unstarted) == inspect.CORO_CREATED:
                unstarted.close()
        raise


def run_coroutine(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even where an event loop is already running
    (a notebook): then it runs on a fresh loop in a helper thread."""
    # Why _Held: on the main thread, asyncio's Runner puts SIGINT's handler back at the end, and signal.signal
    # formats the handler it replaces (a partial of the finished task) while converting it to an enum, which
    # reprs the task's result in full before shortening it: a RolloutBatch, every token id of every trajectory,
    # tens of MB of text for a batch of long trajectories, made and thrown away at the end of every collection.
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return cast(T, _run_held(coroutine))
    result: list[T] = []
    errors: list[BaseException] = []

    def runner() -> None:
        try:
            result.append(_run_held(coroutine))
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(error)

    thread = threading.Thread(target=runner, name="loop-trainer-rollouts")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]
