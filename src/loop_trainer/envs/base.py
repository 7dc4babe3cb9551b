"""The environment interface: a source of tasks and a factory of episodes.

An environment is two small classes (see docs/environments.md):

* :class:`Environment` lists its tasks as a :class:`datasets.Dataset` (one row per task, with a
  ``task_id`` column) and opens an :class:`Episode` for a task.
* :class:`Episode` is one rollout's private, stateful world: ``start`` returns the opening chat
  messages, ``step`` takes the model's reply and returns the next messages and whether the episode
  is over, ``score`` grades the finished episode, ``close`` releases its resources.

Every ``Episode`` method may be a plain function or a coroutine. Plain functions run in a worker
thread so a slow one never blocks other episodes; I/O-bound environments (an HTTP server) should
use coroutines. The rollout engine calls ``close`` on every path, including failures and
cancellations, and turns an exception or timeout in any method into one failed rollout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from datasets import Dataset

Message = dict[str, str]
"""A chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``."""


@dataclass
class Step:
    """What the environment answers to one model reply."""

    messages: list[Message] = field(default_factory=list)
    """New messages to append to the conversation (usually one ``user`` or ``tool`` message)."""
    done: bool = False
    """True once the episode is over (the task was submitted); ``messages`` are then ignored."""


@dataclass
class Score:
    """How a finished episode went."""

    reward: float
    """Training reward in [0, 1] (AppWorld: fraction of the task's tests passed)."""
    success: bool | None = None
    """Evaluation outcome (AppWorld: all tests passed), if the environment defines one."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything worth keeping with the trajectory (per-check results, ...); JSON-serialisable."""


class Episode(ABC):
    """One rollout of one task. Methods may be sync or ``async``."""

    @abstractmethod
    def start(self) -> list[Message] | Awaitable[list[Message]]:
        """Set up the world and return the opening messages (system prompt, task)."""

    @abstractmethod
    def step(self, reply: str) -> Step | Awaitable[Step]:
        """Act on the model's reply (its decoded text, special tokens removed)."""

    @abstractmethod
    def score(self) -> float | Score | Awaitable[float | Score]:
        """Grade the finished episode. Called once, after the last ``step`` or when a limit hit."""

    def close(self) -> None | Awaitable[None]:  # noqa: B027 - optional hook
        """Release resources. Called exactly once on every path."""


class EnvironmentSetupError(RuntimeError):
    """The environment cannot run as configured (data missing, servers not starting): the user
    can fix it, so front ends print the message alone, without a traceback."""


class Environment(ABC):
    """A task source and an episode factory. Subclass it to plug in your own world."""

    name: str = "environment"
    max_concurrent_episodes: int | None = None
    """The most episodes this environment can run at once (e.g. one per server), if bounded."""

    @abstractmethod
    def tasks(self, split: str = "train") -> Dataset:
        """The tasks of ``split``: one row per task with at least a string ``task_id`` column."""

    @abstractmethod
    def episode(self, task: Mapping[str, Any]) -> Episode:
        """A fresh episode for ``task`` (a row of :meth:`tasks`). Keep this cheap: acquire
        resources in :meth:`Episode.start`, so that ``close`` always pairs with them."""

    def prepare(self) -> None:  # noqa: B027 - optional hook
        """Acquire environment-wide resources (start servers, ...) before the first episode, so
        a broken setup fails at once with :class:`EnvironmentSetupError`. The trainer calls it
        when training starts and ``loop-eval`` before evaluating: make a second call a no-op."""

    def set_tokenizer(self, tokenizer: Any) -> None:  # noqa: B027 - optional hook
        """Receive the policy's tokenizer (e.g. to cut observations to a token budget)."""

    def metrics(self) -> dict[str, float]:
        """Running totals worth logging each iteration (server restarts, retries, ...), logged
        with an ``env_`` prefix."""
        return {}

    def summarize(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """An evaluation's summary, logged with an ``eval_`` prefix and written to ``loop-eval``'s
        metrics.json. ``rows`` has one mapping per rollout, failed ones included: ``task_id``,
        ``rollout`` (0 .. K-1), ``status`` ("completed" or "failed"), ``reward`` (0 when failed),
        ``success`` (a bool; False when failed), ``info`` (the :class:`Score`'s) and the rest of
        the trajectory's fields. Override it to report your own measures (AppWorld: TGC and SGC per
        difficulty); the default is :func:`success_and_reward`."""
        return success_and_reward(rows)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release environment-wide resources (server pools, ...). Whoever created the environment
        calls it (``loop-train`` and ``loop-eval`` do; the trainer never closes an env it was given)."""


def success_and_reward(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``success_rate`` and ``reward_mean`` over every rollout: one that failed to run counts as
    unsuccessful with reward 0, so nothing is dropped (NaN when there are no rows)."""
    if not rows:
        return {"success_rate": float("nan"), "reward_mean": float("nan")}
    completed = [row for row in rows if row["status"] == "completed"]
    return {
        "success_rate": sum(bool(row["success"]) for row in completed) / len(rows),
        "reward_mean": sum(float(row["reward"]) for row in completed) / len(rows),
    }


def as_score(value: float | Score) -> Score:
    """Normalise what ``Episode.score`` returned, checking the reward's range."""
    score = value if isinstance(value, Score) else Score(reward=float(value))
    reward = float(score.reward)
    if not 0.0 <= reward <= 1.0 or reward != reward:
        raise ValueError(f"episode reward must be in [0, 1], got {score.reward!r}")
    score.reward = reward
    return score
