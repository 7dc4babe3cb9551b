"""The multi-turn rollout engine: tasks in, token-exact trajectories out.

Every (task, rollout) pair is its own asyncio task. An episode alternates between awaiting the
generation backend and awaiting its environment; while one episode waits on its environment,
the others keep generating. The backend batches whatever requests are waiting, so there is no
per-turn barrier across episodes.

Failures are isolated: an exception or a timeout in an episode marks that one rollout failed
(counted and logged) and the rest of the iteration goes on, unless more than
``max_failed_fraction`` of the iteration's rollouts failed -- then one clear error, because
training on the survivors would bias the update towards whatever does not crash.

Synchronous environment methods run on daemon threads (:class:`EnvThreads`). Python cannot kill a
thread, so a sync call that outlives ``env_timeout`` is abandoned: its rollout fails at once, the
call keeps its thread until it returns (if ever), it is counted (``abandoned_calls``), the
episode's ``close`` waits for it (then runs in that thread, never beside it), and since the thread
is a daemon it never holds up the process's exit.

A batch's collection (early stop, cancelled stragglers, the failure budget) is :mod:`.collection`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..chat import ChatFormatter
from ..envs.base import Environment, Episode, EpisodeContractError, Message, Reply, Step, as_score, check_messages
from ..trajectory import Trajectory
from .collection import collect_batch, run_coroutine
from .context import ContextPolicy, extends
from .env_threads import AbandonedCalls, EnvThreads, EpisodeCalls, deliver
from .records import (
    MAX_CHARS_PER_TOKEN,
    Completion,
    DroppedEpisode,
    EpisodeLimits,
    GenerationBackend,
    GenerationError,
    RolloutBatch,
    mix_seed,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TurnPolicy(Protocol):
    """What samples each turn of an episode that may outlive a weight update (partial rollouts:
    :class:`~.partial.PolicyGate`)."""

    def turn(self, versions: Sequence[int]) -> AbstractAsyncContextManager[tuple[GenerationBackend, int]]:
        """The backend and policy version for the next turn of an episode whose turns so far were sampled by
        ``versions``; held while the turn is sampled. May raise :class:`DroppedEpisode`."""
        ...


class RolloutEngine:
    """Runs episodes of ``env`` with ``backend``, concurrently.

    ``context_policy`` rewrites what the model is shown of each episode's history (the ``context_*``
    keys; an episode's own :meth:`~loop_trainer.envs.base.Episode.context` hook comes first): an
    episode whose rewritten history stops extending its last context continues in a new segment
    (:mod:`.context`). None, or a policy with nothing set: append-only.

    The engine owns one thing, the daemon threads that run synchronous environment methods
    (:class:`EnvThreads`); the environment and the backend belong to the caller. Release them with
    :meth:`close` or ``with RolloutEngine(...) as engine:``.

    ``abandoned_calls`` counts the synchronous environment calls that did not return within
    ``env_timeout`` (or whose rollout was cancelled meanwhile) and were left running in their
    threads; ``abandoned_calls_running`` is how many of them have still not returned.
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
        context_policy: ContextPolicy | None = None,
    ):
        self.env = env
        self.context_policy = context_policy
        # observations are measured again at every reply of an episode: count each text once
        self._count_tokens = functools.lru_cache(maxsize=65536)(formatter.count_tokens)
        self.backend = backend
        self.formatter = formatter
        self.limits = limits
        self.env_timeout = env_timeout
        self.max_concurrent_episodes = max_concurrent_episodes
        self.show_progress = show_progress
        self.generation_retries = 0
        self._failures_shown: set[tuple[str, str]] = set()  # (error type, where it was raised)
        self._abandoned = AbandonedCalls()
        # Sync environment methods run here, so a sleeping or CPU-bound env never blocks the loop.
        self._threads = EnvThreads("env")
        self._closed = False

    @property
    def abandoned_calls(self) -> int:
        """Synchronous environment calls left running in their threads (timed out, or their
        rollout cancelled), since the engine was built."""
        with self._abandoned.lock:
            return self._abandoned.total

    @property
    def abandoned_calls_running(self) -> int:
        """Abandoned calls that have not returned yet; each holds a thread."""
        with self._abandoned.lock:
            return self._abandoned.running

    def _timeout_error(self, name: str, abandoned: bool) -> TimeoutError:
        note = "; it is still running in its thread (abandoned: Python cannot stop a thread)" if abandoned else ""
        return TimeoutError(f"Episode.{name}() did not return within env_timeout ({self.env_timeout:g}s){note}")

    async def _call(self, calls: EpisodeCalls, name: str, *args: Any) -> Any:
        """Call the episode's method ``name`` (``calls.episode``) within ``env_timeout``: a
        coroutine on the loop, a plain function on a daemon thread."""
        method = getattr(calls.episode, name)
        if inspect.iscoroutinefunction(method):
            return await self._within_timeout(method(*args), name)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()
        calls.begin(f"Episode.{name}()")

        def work() -> None:  # on a pool thread; never raises
            result, error = None, None
            try:
                result = method(*args)
            except BaseException as raised:  # noqa: BLE001 - handed to the awaiting episode
                error = raised
            late_close = calls.end()
            # RuntimeError: the collection's event loop is gone, nobody waits any more
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deliver, answer, result, error)
            if late_close is not None:
                late_close()

        self._threads.run(work)
        try:
            result = await self._within_timeout(answer, name, calls)
        except asyncio.CancelledError:
            calls.abandon()
            raise
        if inspect.isawaitable(result):
            result = await self._within_timeout(result, name)
        return result

    async def _within_timeout(self, awaitable: Awaitable[T], name: str, calls: EpisodeCalls | None = None) -> T:
        """``await awaitable`` within ``env_timeout``; running out of time is a TimeoutError that
        names the method (and says whether its thread was abandoned), told apart from a
        TimeoutError the method raised itself."""
        deadline = asyncio.timeout(self.env_timeout)
        try:
            async with deadline:
                return await awaitable
        except TimeoutError:
            if not deadline.expired():
                raise  # the environment's own
            abandoned = calls is not None and calls.abandon()
            raise self._timeout_error(name, abandoned) from None

    def _close_later(self, episode: Episode, task_id: str) -> Callable[[], None]:
        """``episode.close()`` for the thread of an abandoned call, once that call has returned."""

        def close() -> None:
            try:
                result = episode.close()
                if inspect.isawaitable(result):  # on a loop of its own: the collection's may be gone
                    asyncio.run(_awaited(result))
                logger.info("closed the episode of task %s once its abandoned call returned", task_id)
            except Exception as error:  # noqa: BLE001
                logger.warning(
                    "closing the episode of task %s (once its abandoned call returned) failed: %s", task_id, error
                )

        return close

    async def run_episode(
        self,
        task: Mapping[str, Any],
        group: int = 0,
        seed: int | None = None,
        *,
        backend: GenerationBackend | None = None,
        policy: TurnPolicy | None = None,
    ) -> Trajectory:
        """One episode, start to score, sampled by ``backend`` (default: the engine's), or turn by turn by what
        ``policy`` names (each turn's version recorded in ``turn_versions``; a :class:`DroppedEpisode` ends the
        episode cancelled). Never raises except on cancellation. With a ``seed``, turn t samples with seed
        ``mix_seed(seed, t)`` whatever else runs at the same time."""
        started = time.perf_counter()
        trajectory = Trajectory(task_id=str(task["task_id"]), group=group)
        episode: Episode | None = None
        try:
            episode = self.env.episode(task)
            calls = EpisodeCalls(episode, self._abandoned)
            messages = self._clean(await self._call(calls, "start"), trajectory, "Episode.start()")
            trajectory.messages.extend(messages)
            trajectory.num_opening_messages = len(messages)
            trajectory.append(self.formatter.opening_ids(messages, tools=episode.tools), sampled=False)
            trajectory.prompt_length = len(trajectory.token_ids)
            # A context policy's episode: what the current segment shows, and where its opening render ends.
            rewrite = self._rewriter(episode, calls, trajectory)
            shown, segment_opened = list(messages), trajectory.prompt_length
            trajectory.ending = "turn_limit"
            for turn in range(self.limits.max_turns):
                room = self.limits.max_trajectory_tokens - (len(trajectory.token_ids) - trajectory.context_start)
                if self.limits.max_completion_tokens is not None:
                    used = len(trajectory.token_ids) - segment_opened
                    room = min(room, self.limits.max_completion_tokens - used)
                if room < 1:
                    trajectory.ending = "trajectory_budget"
                    break
                max_new_tokens = min(self.limits.max_new_tokens_per_turn, room)
                turn_seed = None if seed is None else mix_seed(seed, turn)
                if policy is None:
                    completion = await self._generate(backend or self.backend, trajectory, max_new_tokens, turn_seed)
                else:
                    async with policy.turn(trajectory.turn_versions) as (sampler, version):
                        completion = await self._generate(sampler, trajectory, max_new_tokens, turn_seed)
                    trajectory.turn_versions.append(version)
                reply = Reply(
                    self.formatter.reply_text(completion.token_ids), completion.token_ids, context_of(trajectory)
                )
                trajectory.append(completion.token_ids, sampled=True, logprobs=completion.logprobs, turn=turn)
                trajectory.num_turns += 1
                trajectory.truncated_turns += not completion.stopped
                trajectory.messages.append({"role": "assistant", "content": str(reply)})
                step = await self._call(calls, "step", reply)
                if not isinstance(step, Step):
                    raise EpisodeContractError(f"Episode.step() must return a Step, got {type(step).__name__}")
                if step.done:
                    trajectory.ending = "done"
                    break
                step.messages = self._clean(step.messages, trajectory, "Episode.step()")
                trajectory.messages.extend(step.messages)
                after_reply = self.formatter.after_reply_ids(completion.token_ids, completion.stopped)
                if rewrite is None:  # append-only: the whole history, as sampled
                    trajectory.append(after_reply + self.formatter.continuation_ids(step.messages), sampled=False)
                    continue
                previous = [*shown, trajectory.messages[-1 - len(step.messages)]]  # ... and the reply
                shown = await rewrite(trajectory.messages)
                if extends(previous, shown):
                    tail = self.formatter.continuation_ids(shown[len(previous) :])
                    trajectory.append(after_reply + tail, sampled=False)
                else:  # a new segment: the rewritten history, rendered afresh
                    trajectory.segment_starts.append(len(trajectory.token_ids))
                    trajectory.append(self.formatter.opening_ids(shown, tools=episode.tools), sampled=False)
                    segment_opened = len(trajectory.token_ids)
            score = as_score(await self._call(calls, "score"), self.env.reward_range)
            trajectory.reward, trajectory.success, trajectory.info = score.reward, score.success, score.info
        except asyncio.CancelledError:
            trajectory.status, trajectory.ending = "cancelled", "cancelled"
            raise
        except DroppedEpisode as dropped:
            trajectory.status, trajectory.ending, trajectory.error = "cancelled", "cancelled", f"dropped: {dropped}"
        except Exception as error:  # noqa: BLE001 - one bad episode must not kill the run
            trajectory.status, trajectory.ending = "failed", "error"
            trajectory.error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            self._log_failure(trajectory, error)
        finally:
            trajectory.seconds = time.perf_counter() - started
            if episode is not None:
                await self._close_episode(calls, trajectory.task_id)
        return trajectory

    def _log_failure(self, trajectory: Trajectory, error: BaseException) -> None:
        """The first rollout failing with an error of a kind (its type and the line that raised it) is
        logged with its traceback, so the environment's own file:line is on screen; later ones of that kind
        only at debug level: the iteration line counts them (``FAILED n``), 16 repeats of one line do not."""
        frames = traceback.extract_tb(error.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        kind = (type(error).__name__, where)
        if kind in self._failures_shown:
            logger.debug("rollout of task %s failed: %s (at %s)", trajectory.task_id, trajectory.error, where)
            return
        self._failures_shown.add(kind)
        logger.warning(
            "rollout of task %s failed: %s (at %s; later rollouts failing the same way are counted in the "
            "iteration line's FAILED, not shown again)\n%s",
            trajectory.task_id,
            trajectory.error,
            where,
            # an explicit cause (raise ... from) is part of the story; an implicit context (the event loop's own
            # "no running event loop") is not the user's
            "".join(traceback.format_exception(error, chain=error.__cause__ is not None)).rstrip(),
        )

    def _rewriter(
        self, episode: Episode, calls: EpisodeCalls, trajectory: Trajectory
    ) -> Callable[[list[Message]], Awaitable[list[Message]]] | None:
        """How this episode's history is shown before each reply: the episode's own ``context`` hook,
        else the engine's :class:`ContextPolicy`; None where neither rewrites (append-only)."""
        if type(episode).context is not Episode.context:

            async def hook(history: list[Message]) -> list[Message]:
                shown = await self._call(calls, "context", list(history))
                return list(history) if shown is None else self._clean(shown, trajectory, "Episode.context()")

            return hook
        policy, opening = self.context_policy, trajectory.num_opening_messages
        if policy is None or not policy.active:
            return None

        async def rewritten(history: list[Message]) -> list[Message]:
            return policy.shown(history, opening, self._count_tokens)

        return rewritten

    async def _close_episode(self, calls: EpisodeCalls, task_id: str) -> None:
        """Close the episode, unless one of its calls was abandoned and still runs: then ``close``
        runs in that call's thread once it returns (never beside it; never, if it never returns)."""
        waiting_for = calls.defer_close(self._close_later(calls.episode, task_id))
        if waiting_for is not None:
            logger.warning(
                "the episode of task %s is not closed yet: its abandoned %s is still running; "
                "close() runs when that returns",
                task_id,
                waiting_for,
            )
            return
        try:
            await self._call(calls, "close")
        except Exception as error:  # noqa: BLE001
            logger.warning("closing the episode of task %s failed: %s", task_id, error)

    def _clean(self, messages: list[Message], trajectory: Trajectory, source: str) -> list[Message]:
        """Check environment output against the contract (a list of messages, each with a known
        role: :func:`~loop_trainer.envs.base.check_messages`) and make it safe to tokenise: bytes
        and lone surrogates become valid text (U+FFFD), and a message longer than any trajectory
        could hold is cut with a note. Both are counted on the trajectory, never silent."""
        limit = self.limits.max_trajectory_tokens * MAX_CHARS_PER_TOKEN
        cleaned = []
        for index, message in enumerate(check_messages(messages, source=source)):
            content = message.get("content", "")
            if isinstance(content, (bytes, bytearray)):
                content = bytes(content).decode("utf-8", errors="replace")
                trajectory.repaired_messages += 1
            elif not isinstance(content, str):
                raise EpisodeContractError(
                    f"{source} message {index} content must be str, got {type(content).__name__}"
                )
            else:
                repaired = content.encode("utf-8", errors="replace").decode("utf-8")
                if repaired != content:
                    content, trajectory.repaired_messages = repaired, trajectory.repaired_messages + 1
            if len(content) > limit:
                content = content[:limit] + f"\n[... {len(content) - limit} characters cut: longer than any trajectory]"
                trajectory.cut_messages += 1
            cleaned.append({**message, "content": content})
        return cleaned

    async def _generate(
        self, backend: GenerationBackend, trajectory: Trajectory, max_new_tokens: int, seed: int | None
    ) -> Completion:
        # A generator failure (an OOM, a dropped connection to a server) is retried once: the
        # same seed gives the same reply. A second failure fails the rollout, counted and logged.
        context = context_of(trajectory)
        try:
            return await backend.generate(context, max_new_tokens, seed=seed)
        except Exception as error:  # noqa: BLE001
            logger.warning(
                "generation for task %s failed (%s: %s); retrying once", trajectory.task_id, type(error).__name__, error
            )
            self.generation_retries += 1
        try:
            return await backend.generate(context, max_new_tokens, seed=seed)
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
        backend: GenerationBackend | None = None,
    ) -> RolloutBatch:
        """Run ``rollouts_per_task`` episodes of every task.

        Collection stops early once at least ``done_fraction`` of all rollouts have finished and
        every task has at least ``round(task_fraction * rollouts_per_task)`` finished; the
        stragglers are cancelled and discarded (the paper uses 0.9 and 0.75).

        With a ``seed``, rollout k of the task whose id in ``group_ids`` is g samples with seed
        ``mix_seed(seed, g, k)``: the same trajectories whatever the timing, the batching or the
        number of processes the tasks are split over.

        ``backend`` samples this batch instead of the engine's own (a view of one policy version, when the
        generator holds several: ``max_staleness`` above 1).
        """
        if self._closed:
            raise RuntimeError("this RolloutEngine was closed; create a new one to collect again")
        return await collect_batch(
            self.run_episode if backend is None else functools.partial(self.run_episode, backend=backend),
            tasks,
            rollouts_per_task,
            max_concurrent_episodes=self.max_concurrent_episodes,
            show_progress=self.show_progress,
            seed=seed,
            group_ids=group_ids,
            done_fraction=done_fraction,
            task_fraction=task_fraction,
            max_failed_fraction=max_failed_fraction,
            description=description,
        )

    def collect(self, tasks: Sequence[Mapping[str, Any]], rollouts_per_task: int, **kwargs: Any) -> RolloutBatch:
        """Synchronous :meth:`collect_async`."""
        return run_coroutine(self.collect_async(tasks, rollouts_per_task, **kwargs))

    def close(self) -> None:
        """Stop the environment threads. Idempotent; never waits. A thread still inside an
        abandoned environment call ends when that call returns, and since it is a daemon thread it
        never holds up the process's exit."""
        self._closed = True
        self._threads.close()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True)
class EngineSetup:
    """What a rollout engine is built from, but its backend: the run's engine and a collection process's
    (:mod:`.collection_process`, which receives it pickled) are built alike."""

    env: Environment
    formatter: ChatFormatter
    limits: EpisodeLimits
    env_timeout: float
    context_policy: ContextPolicy | None
    max_concurrent_episodes: int

    def build(self, backend: GenerationBackend, show_progress: bool = False) -> RolloutEngine:
        return RolloutEngine(
            self.env,
            backend,
            self.formatter,
            self.limits,
            env_timeout=self.env_timeout,
            context_policy=self.context_policy,
            show_progress=show_progress,
            max_concurrent_episodes=self.max_concurrent_episodes,
        )


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def context_of(trajectory: Trajectory) -> list[int]:
    """The tokens the model continues from: the segment it is writing in (the whole trajectory when
    append-only, as the same list)."""
    start = trajectory.context_start
    return trajectory.token_ids if start == 0 else trajectory.token_ids[start:]
