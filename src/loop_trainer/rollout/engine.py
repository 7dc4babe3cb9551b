"""The multi-turn rollout engine: tasks in, token-exact trajectories out.

Every (task, rollout) pair is its own asyncio task. An episode alternates between awaiting the
generation backend and awaiting its environment; while one episode waits on its environment,
the others keep generating. The backend batches whatever requests are waiting, so there is no
per-turn barrier across episodes.

Failures are isolated: an exception or a timeout in an episode marks that one rollout failed
(counted and logged) and the rest of the iteration goes on, unless more than
``max_failed_fraction`` of the iteration's rollouts failed -- then one clear error, because
training on the survivors would bias the update towards whatever does not crash.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tqdm.auto import tqdm

from ..chat import ChatFormatter
from ..envs.base import Environment, Episode, Message, as_score
from ..trajectory import Trajectory
from .backend import Completion, GenerationBackend

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RolloutFailureBudgetExceeded(RuntimeError):
    """Too many rollouts of one iteration failed to train on the rest."""


MAX_CHARS_PER_TOKEN = 16
"""Environment messages longer than ``max_trajectory_tokens`` times this many characters are cut."""


class GenerationError(RuntimeError):
    """The generation backend failed twice for one turn."""


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps): distinct inputs give unrelated seeds."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (part & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
    return state & 0x7FFFFFFFFFFFFFFF


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 40
    """Model replies per episode (AppWorld: interactions)."""
    max_new_tokens_per_turn: int = 1500
    max_trajectory_tokens: int = 32000
    """Whole-conversation budget; with less than one token of room left the episode ends."""


@dataclass
class RolloutBatch:
    """The outcome of one collection."""

    trajectories: list[Trajectory]
    """Completed rollouts (scored), in (task, rollout) order."""
    failed: list[Trajectory] = field(default_factory=list)
    num_cancelled: int = 0
    seconds: float = 0.0

    def stats(self) -> dict[str, float]:
        done = self.trajectories
        endings = Counter(t.ending for t in done)
        rewards = [t.reward for t in done]
        successes = [t.success for t in done if t.success is not None]
        mean = sum(rewards) / len(rewards) if rewards else float("nan")
        var = sum((r - mean) ** 2 for r in rewards) / len(rewards) if rewards else float("nan")
        return {
            "num_rollouts": float(len(done)),
            "num_failed": float(len(self.failed)),
            "num_cancelled": float(self.num_cancelled),
            "reward_mean": mean,
            "reward_std": math.sqrt(var) if rewards else float("nan"),
            "success_rate": sum(successes) / len(successes) if successes else float("nan"),
            "turns_mean": sum(t.num_turns for t in done) / len(done) if done else float("nan"),
            "sampled_tokens": float(sum(t.num_sampled_tokens for t in done)),
            "trajectory_tokens_max": float(max((len(t.token_ids) for t in done), default=0)),
            "truncated_turns": float(sum(t.truncated_turns for t in done)),
            "repaired_messages": float(sum(t.repaired_messages for t in done)),
            "cut_messages": float(sum(t.cut_messages for t in done)),
            "ended_turn_limit": float(endings["turn_limit"]),
            "ended_trajectory_budget": float(endings["trajectory_budget"]),
            "rollout_seconds": self.seconds,
        }


class RolloutEngine:
    """Runs episodes of ``env`` with ``backend``, concurrently.

    The engine owns one thing, the thread pool that runs synchronous environment methods; the
    environment and the backend belong to the caller. Release the pool with :meth:`close` or
    ``with RolloutEngine(...) as engine:``.
    """

    def __init__(
        self,
        env: Environment,
        backend: GenerationBackend,
        formatter: ChatFormatter,
        limits: EpisodeLimits = EpisodeLimits(),
        *,
        env_timeout: float = 300.0,
        max_concurrent_episodes: int = 256,
        show_progress: bool = True,
    ):
        self.env = env
        self.backend = backend
        self.formatter = formatter
        self.limits = limits
        self.env_timeout = env_timeout
        self.max_concurrent_episodes = max_concurrent_episodes
        self.show_progress = show_progress
        self.generation_retries = 0
        # Sync environment methods run here, so a sleeping or CPU-bound env never blocks the loop.
        self._executor = ThreadPoolExecutor(max_workers=max_concurrent_episodes, thread_name_prefix="env")
        self._closed = False

    async def _call(self, method: Callable[..., T | Awaitable[T]], *args: Any) -> T:
        if inspect.iscoroutinefunction(method):
            return await asyncio.wait_for(method(*args), self.env_timeout)
        loop = asyncio.get_running_loop()
        result = await asyncio.wait_for(loop.run_in_executor(self._executor, method, *args), self.env_timeout)
        if inspect.isawaitable(result):
            result = await asyncio.wait_for(result, self.env_timeout)
        return result

    async def run_episode(self, task: Mapping[str, Any], group: int = 0, seed: int | None = None) -> Trajectory:
        """One episode, start to score. Never raises except on cancellation. With a ``seed``, turn t
        samples with seed ``mix_seed(seed, t)`` whatever else runs at the same time."""
        started = time.perf_counter()
        trajectory = Trajectory(task_id=str(task["task_id"]), group=group)
        episode: Episode | None = None
        try:
            episode = self.env.episode(task)
            messages = self._clean(await self._call(episode.start), trajectory)
            trajectory.messages.extend(messages)
            trajectory.num_opening_messages = len(messages)
            trajectory.append(self.formatter.opening_ids(messages), sampled=False)
            trajectory.prompt_length = len(trajectory.token_ids)
            trajectory.ending = "turn_limit"
            for turn in range(self.limits.max_turns):
                room = self.limits.max_trajectory_tokens - len(trajectory.token_ids)
                if room < 1:
                    trajectory.ending = "trajectory_budget"
                    break
                completion = await self._generate(
                    trajectory, min(self.limits.max_new_tokens_per_turn, room),
                    None if seed is None else mix_seed(seed, turn),
                )
                trajectory.append(completion.token_ids, sampled=True, logprobs=completion.logprobs)
                trajectory.num_turns += 1
                trajectory.truncated_turns += not completion.stopped
                reply = self.formatter.reply_text(completion.token_ids)
                trajectory.messages.append({"role": "assistant", "content": reply})
                step = await self._call(episode.step, reply)
                if step.done:
                    trajectory.ending = "done"
                    break
                step.messages = self._clean(step.messages, trajectory)
                trajectory.messages.extend(step.messages)
                trajectory.append(
                    self.formatter.after_reply_ids(completion.token_ids, completion.stopped)
                    + self.formatter.continuation_ids(step.messages),
                    sampled=False,
                )
            score = as_score(await self._call(episode.score))
            trajectory.reward, trajectory.success, trajectory.info = score.reward, score.success, score.info
        except asyncio.CancelledError:
            trajectory.status, trajectory.ending = "cancelled", "cancelled"
            raise
        except Exception as error:  # noqa: BLE001 - one bad episode must not kill the run
            trajectory.status, trajectory.ending = "failed", "error"
            trajectory.error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            logger.warning("rollout of task %s failed: %s", trajectory.task_id, trajectory.error)
        finally:
            trajectory.seconds = time.perf_counter() - started
            if episode is not None:
                try:
                    await self._call(episode.close)
                except Exception as error:  # noqa: BLE001
                    logger.warning("closing the episode of task %s failed: %s", trajectory.task_id, error)
        return trajectory

    def _clean(self, messages: list[Message], trajectory: Trajectory) -> list[Message]:
        """Make environment output safe to tokenise: bytes and lone surrogates become valid text
        (U+FFFD), and a message longer than any trajectory could hold is cut with a note.
        Both are counted on the trajectory, never silent."""
        limit = self.limits.max_trajectory_tokens * MAX_CHARS_PER_TOKEN
        cleaned = []
        for message in messages:
            content = message.get("content", "")
            if isinstance(content, (bytes, bytearray)):
                content = bytes(content).decode("utf-8", errors="replace")
                trajectory.repaired_messages += 1
            elif not isinstance(content, str):
                raise TypeError(f"message content must be str, got {type(content).__name__}")
            else:
                repaired = content.encode("utf-8", errors="replace").decode("utf-8")
                if repaired != content:
                    content, trajectory.repaired_messages = repaired, trajectory.repaired_messages + 1
            if len(content) > limit:
                content = content[:limit] + f"\n[... {len(content) - limit} characters cut: longer than any trajectory]"
                trajectory.cut_messages += 1
            cleaned.append({**message, "content": content})
        return cleaned

    async def _generate(self, trajectory: Trajectory, max_new_tokens: int, seed: int | None) -> Completion:
        # A generator failure (an OOM, a dropped connection to a server) is retried once: the
        # same seed gives the same reply. A second failure fails the rollout, counted and logged.
        try:
            return await self.backend.generate(trajectory.token_ids, max_new_tokens, seed=seed)
        except Exception as error:  # noqa: BLE001
            logger.warning("generation for task %s failed (%s: %s); retrying once", trajectory.task_id,
                           type(error).__name__, error)
            self.generation_retries += 1
        try:
            return await self.backend.generate(trajectory.token_ids, max_new_tokens, seed=seed)
        except Exception as error:  # noqa: BLE001
            raise GenerationError(f"generation failed twice: {type(error).__name__}: {error}") from error

    async def collect_async(
        self,
        tasks: Sequence[Mapping[str, Any]],
        rollouts_per_task: int,
        *,
        seed: int | None = None,
        group_ids: Sequence[int] | None = None,
        done_fraction: float = 1.0,
        task_fraction: float = 1.0,
        max_failed_fraction: float = 1.0,
        description: str = "rollouts",
    ) -> RolloutBatch:
        """Run ``rollouts_per_task`` episodes of every task.

        Collection stops early once at least ``done_fraction`` of all rollouts have finished and
        every task has at least ``round(task_fraction * rollouts_per_task)`` finished; the
        stragglers are cancelled and discarded (the paper uses 0.9 and 0.75).

        With a ``seed``, rollout k of the task whose id in ``group_ids`` is g samples with seed
        ``mix_seed(seed, g, k)``: the same trajectories whatever the timing, the batching or the
        number of processes the tasks are split over.
        """
        if self._closed:
            raise RuntimeError("this RolloutEngine was closed; create a new one to collect again")
        group_ids = list(group_ids) if group_ids is not None else list(range(len(tasks)))
        started = time.perf_counter()
        total = len(tasks) * rollouts_per_task
        need_total = math.ceil(done_fraction * total)
        need_per_task = round(task_fraction * rollouts_per_task)
        limiter = asyncio.Semaphore(self.max_concurrent_episodes)

        async def limited(task: Mapping[str, Any], group: int, k: int) -> Trajectory:
            async with limiter:
                episode_seed = None if seed is None else mix_seed(seed, group_ids[group], k)
                trajectory = await self.run_episode(task, group, episode_seed)
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
        with tqdm(total=total, desc=description, disable=not self.show_progress, leave=False) as bar:
            try:
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for future in done:
                        key = running[future]
                        finished[key] = future.result()
                        per_task[key[0]] += 1
                    bar.update(len(done))
                    if len(finished) >= need_total and all(
                        per_task[g] >= need_per_task for g in range(len(tasks))
                    ):
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
        num_run = len(ordered)
        if batch.failed and len(batch.failed) > max_failed_fraction * num_run:
            errors = Counter(t.error for t in batch.failed).most_common(1)[0]
            raise RolloutFailureBudgetExceeded(
                f"{len(batch.failed)} of {num_run} rollouts failed (budget {max_failed_fraction:.0%}); "
                f"most common error ({errors[1]}x): {errors[0]}"
            )
        return batch

    def collect(self, tasks: Sequence[Mapping[str, Any]], rollouts_per_task: int, **kwargs: Any) -> RolloutBatch:
        """Synchronous :meth:`collect_async`."""
        return run_coroutine(self.collect_async(tasks, rollouts_per_task, **kwargs))

    def close(self) -> None:
        """Stop the environment threads. Idempotent. A thread still inside a hung environment call
        ends when that call returns: waiting for it here could block forever."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_coroutine(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even where an event loop is already running
    (a notebook): then it runs on a fresh loop in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    result: list[T] = []
    errors: list[BaseException] = []

    def runner() -> None:
        try:
            result.append(asyncio.run(coroutine))
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(error)

    thread = threading.Thread(target=runner, name="loop-trainer-rollouts")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]
