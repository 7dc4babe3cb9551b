"""Partial rollouts (``partial_rollouts: true``): episodes that continue across weight updates.

Without them, the straggler cut (``early_stop_done_fraction`` / ``early_stop_task_fraction``, the paper's 0.9 /
0.75) cancels the episodes still running when a batch is cut, and the longest episodes are the ones thrown away:
training leans towards short solutions. Here the cut only closes the batch:

- the cut is the paper's, over the batch's newly drawn episodes: once ``early_stop_done_fraction`` of them have
  ended and every new group has ``early_stop_task_fraction`` of its own;
- the batch is then the groups (a task's ``rollouts_per_task`` episodes), new or carried, whose every episode has
  ended: leave-one-out advantages always see the whole group;
- a group with an episode still running is carried into the next batch, its ended episodes waiting with it, and
  its running episodes go on: every turn is sampled by the newest policy the generator holds at that moment
  (:class:`PolicyGate`), and the trajectory records which (``Trajectory.turn_versions``), beside the sampler's
  log-probs of each token, so the decoupled objective weights every token by its own behaviour policy;
- an episode whose next turn would be sampled by a policy more than ``max_span`` (``max_staleness``) versions after
  its first turn's is dropped and counted (``dropped_stale_episodes``); its group goes on without it;
- the generator's weights change only between turns: :meth:`ContinuingCollection.hold` lets the turns being
  sampled finish and starts no other until :meth:`ContinuingCollection.release` names the new policy.

The episodes run on an event loop of the collection's own, on a thread of its own, so they outlive a batch (an
environment's episode cannot be stopped and restarted). A checkpoint cannot hold a running episode either, so
before one is saved :meth:`ContinuingCollection.finish_in_flight` runs every carried episode to its end with the
policy of the moment; the finished groups are written beside the weights (:func:`.carried_groups.save_carried`) and
join the next batch of the resumed run, as they join the next batch of the run that went on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tqdm.auto import tqdm

from ..trajectory import Trajectory
from .collection import check_failure_budget, make_event_loop
from .engine import RolloutEngine
from .records import DroppedEpisode, GenerationBackend, RolloutBatch, mix_seed

logger = logging.getLogger(__name__)
T = TypeVar("T")


class PolicyGate:
    """The policy that samples each turn of a :class:`ContinuingCollection`'s episodes: the newest the generator
    holds (the engine asks :meth:`turn` before each reply). Closed until the first :meth:`open`. Its coroutines
    run on the collection's event loop."""

    def __init__(self, max_span: int) -> None:
        self.max_span = max_span
        self.backend: GenerationBackend | None = None
        self.version = -1
        self._held = True
        self._in_flight = 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def turn(self, versions: Sequence[int]) -> AsyncIterator[tuple[GenerationBackend, int]]:
        """The backend and version to sample an episode's next turn with (``versions``: its turns' so far),
        once the policy is not changing; raises :class:`DroppedEpisode` if the episode would span more than
        ``max_span`` versions."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._held)
            if versions and self.version - versions[0] > self.max_span:
                raise DroppedEpisode(
                    f"its first turn was sampled by policy {versions[0]} and its next would be by policy "
                    f"{self.version}: more than max_staleness ({self.max_span}) versions apart"
                )
            assert self.backend is not None  # open() set it before anything was let through
            self._in_flight += 1
            backend, version = self.backend, self.version
        try:
            yield backend, version
        finally:
            async with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    async def close(self) -> None:
        """Start no turn; return once the turns being sampled have finished."""
        async with self._changed:
            self._held = True
            await self._changed.wait_for(lambda: self._in_flight == 0)

    async def open(self, version: int | None = None, backend: GenerationBackend | None = None) -> None:
        """Let turns start again, sampled by ``backend`` as policy ``version`` (default: the policy before)."""
        async with self._changed:
            if backend is not None:
                assert version is not None
                self.version, self.backend = version, backend
            if self.backend is not None:
                self._held = False
            self._changed.notify_all()


@dataclass
class CarriedGroup:
    """One task's episodes in a :class:`ContinuingCollection`."""

    iteration: int
    """The iteration whose tasks it was drawn among."""
    task_index: int
    """Its index among that iteration's tasks (all processes')."""
    size: int
    ended: dict[int, Trajectory] = field(default_factory=dict)
    """By rollout: the episodes that have ended (completed, failed, or dropped)."""
    running: dict[int, asyncio.Future[Trajectory]] = field(default_factory=dict)

    def group_id(self, iteration: int, num_tasks: int) -> int:
        """Its leave-one-out group in iteration ``iteration``'s batch of ``num_tasks`` tasks: its task index if
        drawn for it, past every new task's otherwise (the same on every process)."""
        return num_tasks * (iteration - self.iteration) + self.task_index


class ContinuingCollection:
    """This process's episodes, across batches: :meth:`collect` returns a batch at its straggler cut and keeps
    what is still running for the next. Call it from any thread but the collection's own."""

    def __init__(self, engine: RolloutEngine, max_span: int) -> None:
        self.engine = engine
        self.gate = PolicyGate(max_span)
        self.groups: list[CarriedGroup] = []
        self.num_dropped = 0
        """Episodes dropped for spanning more than ``max_span`` versions, since the collection was built."""
        self._loop = make_event_loop()  # on the trainer's main thread: a Ctrl-C waits until the loop is whole
        self._thread = threading.Thread(target=self._loop.run_forever, name="loop-partial-rollouts", daemon=True)
        self._thread.start()
        self._limiter = asyncio.Semaphore(engine.max_concurrent_episodes)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    @property
    def num_running(self) -> int:
        """Episodes that have not ended."""
        return sum(not future.done() for group in self.groups for future in group.running.values())

    def hold(self) -> None:
        """Before the generator's weights change: the turns being sampled finish, no other starts."""
        self._run(self.gate.close())

    def release(self, version: int | None = None, backend: GenerationBackend | None = None) -> None:
        """After :meth:`hold`: turns start again, sampled by ``backend`` as policy ``version`` (nothing given:
        the policy before, e.g. when the change failed)."""
        self._run(self.gate.open(version, backend))

    def collect(self, tasks: Sequence[Mapping[str, Any]], rollouts_per_task: int, **kwargs: Any) -> RolloutBatch:
        """Synchronous :meth:`collect_async`."""
        return self._run(self.collect_async(tasks, rollouts_per_task, **kwargs))

    async def collect_async(
        self,
        tasks: Sequence[Mapping[str, Any]],
        rollouts_per_task: int,
        *,
        iteration: int,
        task_indices: Sequence[int],
        num_tasks: int,
        seed: int | None,
        done_fraction: float,
        task_fraction: float,
        max_failed_fraction: float = 1.0,
        description: str = "rollouts",
        show_progress: bool = True,
    ) -> RolloutBatch:
        """Start ``rollouts_per_task`` episodes of each of ``tasks`` (indices ``task_indices`` among iteration
        ``iteration``'s ``num_tasks``) and return iteration ``iteration``'s batch at the straggler cut (once
        ``done_fraction`` of the new episodes have ended and every new group has ``task_fraction`` of its own): the
        groups, new or carried in, whose episodes have all ended. Episode k of task index g samples with seed
        ``mix_seed(seed, g, k)``, as :meth:`RolloutEngine.collect` does. Runs on the collection's loop."""
        started = time.perf_counter()
        new = []
        for task, index in zip(tasks, task_indices, strict=True):
            group = CarriedGroup(iteration, index, rollouts_per_task)
            for k in range(rollouts_per_task):
                episode_seed = None if seed is None else mix_seed(seed, index, k)
                group.running[k] = asyncio.ensure_future(self._episode(task, index, k, episode_seed))
            new.append(group)
        self.groups += new
        total = sum(group.size for group in new)
        need_total = math.ceil(done_fraction * total)

        def ended() -> int:
            return sum(len(group.ended) for group in new)

        def cut() -> bool:
            return ended() >= need_total and all(len(g.ended) >= round(task_fraction * g.size) for g in new)

        with tqdm(total=total, desc=description, disable=None if show_progress else True, leave=False) as bar:
            while not cut():
                running = [future for group in new for future in group.running.values()]
                if not running:
                    break
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                before = ended()
                self._move_ended(new)
                bar.update(ended() - before)
        self._move_ended(self.groups)
        whole = [group for group in self.groups if not group.running]
        self.groups = [group for group in self.groups if group.running]
        batch = self._batch(whole, iteration, num_tasks, time.perf_counter() - started)
        check_failure_budget(batch, max_failed_fraction)
        return batch

    async def _episode(self, task: Mapping[str, Any], index: int, rollout: int, seed: int | None) -> Trajectory:
        async with self._limiter:
            trajectory = await self.engine.run_episode(task, index, seed, policy=self.gate)
        trajectory.rollout = rollout
        return trajectory

    def _move_ended(self, groups: Sequence[CarriedGroup]) -> None:
        for group in groups:
            for k, future in list(group.running.items()):
                if future.done():
                    group.ended[k] = future.result()
                    del group.running[k]

    def _batch(self, whole: Sequence[CarriedGroup], iteration: int, num_tasks: int, seconds: float) -> RolloutBatch:
        trajectories, failed, dropped = [], [], 0
        for group in whole:
            for trajectory in group.ended.values():
                trajectory.group = group.group_id(iteration, num_tasks)
                if trajectory.status == "completed":
                    trajectories.append(trajectory)
                elif trajectory.status == "failed":
                    failed.append(trajectory)
                else:
                    dropped += 1
        self.num_dropped += dropped
        return RolloutBatch(
            trajectories=sorted(trajectories, key=_task_order),
            failed=sorted(failed, key=_task_order),
            seconds=seconds,
            num_carried=self.num_running,
            num_dropped_stale=dropped,
        )

    def finish_in_flight(self) -> None:
        """Run every episode still running to its end (before a checkpoint: a running episode cannot be saved),
        sampled by the policy of the moment; the groups stay carried, whole, for the next batch."""

        async def finish() -> None:
            running = [future for group in self.groups for future in group.running.values()]
            if running:
                await asyncio.wait(running)
            self._move_ended(self.groups)

        self._run(finish())

    def carried(self) -> list[CarriedGroup]:
        """The carried groups, every episode ended (after :meth:`finish_in_flight`), with no running part."""
        if self.num_running:
            raise RuntimeError(f"{self.num_running} carried episodes are still running: finish_in_flight() first")
        return [CarriedGroup(g.iteration, g.task_index, g.size, dict(g.ended)) for g in self.groups]

    def restore(self, groups: Sequence[CarriedGroup]) -> None:
        """Carry ``groups`` (from a checkpoint, every episode ended) into the next batch."""
        self.groups.extend(groups)

    def cancel_in_flight(self) -> int:
        """Cancel the episodes still running (nothing will train on them: the run's last batch is taken); returns
        how many."""

        async def cancel() -> int:
            running = [future for group in self.groups for future in group.running.values()]
            for future in running:
                future.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            self.groups = []
            return len(running)

        return self._run(cancel())

    def close(self) -> None:
        """Cancel what still runs and stop the collection's thread. Idempotent."""
        if self._loop.is_closed():
            return
        cancelled = self.cancel_in_flight()
        if cancelled:
            logger.info("%d carried episodes were still running at the end; cancelled", cancelled)

        async def stop_the_rest() -> None:  # what the backend started on this loop (a serving task), as asyncio.run
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await self._loop.shutdown_asyncgens()

        self._run(stop_the_rest())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def _task_order(trajectory: Trajectory) -> tuple[int, int]:
    return trajectory.group, trajectory.rollout
