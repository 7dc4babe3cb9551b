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
cancellations, and turns an exception or timeout in any method into one failed rollout. A plain
function that times out cannot be stopped (Python cannot kill a thread): it is abandoned, and its
episode's ``close`` runs only once it returns, never beside it.

What an environment hands over is checked, each violation one clear line: :func:`check_tasks` for
the task list, :func:`check_messages` for episode messages, :func:`as_score` for scores.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from datasets import Dataset

Message = dict[str, str]
"""A chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``."""

ROLES = ("system", "user", "assistant", "tool")
"""The roles an episode's messages may have."""


class Reply(str):
    """The model's reply as :meth:`Episode.step` receives it: its decoded text (special tokens
    removed), which is all most environments need, carrying the tokens behind it for those that
    parse the model's output the way it was trained to emit it (tool calls, with TRL's
    ``parse_response``): ``token_ids``, the sampled ids, and ``prompt_ids``, the whole trajectory
    they continue."""

    token_ids: tuple[int, ...]
    prompt_ids: tuple[int, ...]

    def __new__(cls, text: str, token_ids: Sequence[int] = (), prompt_ids: Sequence[int] = ()) -> Reply:
        reply = super().__new__(cls, text)
        reply.token_ids, reply.prompt_ids = tuple(token_ids), tuple(prompt_ids)
        return reply


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

    tools: Sequence[Any] | None = None
    """Tools the model may call in this episode (Python functions with type hints and a docstring,
    or JSON schemas), shown to it the way its chat template shows tools (``apply_chat_template(
    tools=...)``) when the opening is rendered. Read after :meth:`start` returns. Calling them is
    the episode's business, in :meth:`step`."""

    @abstractmethod
    def start(self) -> list[Message] | Awaitable[list[Message]]:
        """Set up the world and return the opening messages (system prompt, task)."""

    @abstractmethod
    def step(self, reply: Reply) -> Step | Awaitable[Step]:
        """Act on the model's reply: its decoded text, special tokens removed (a :class:`Reply`, a
        ``str`` that also carries the sampled token ids)."""

    @abstractmethod
    def score(self) -> float | Score | Awaitable[float | Score]:
        """Grade the finished episode. Called once, after the last ``step`` or when a limit hit."""

    def close(self) -> None | Awaitable[None]:  # noqa: B027 - optional hook
        """Release resources. Called once on every path, never while another method of this episode
        is running: after a synchronous call that timed out, only once that call returns."""

    def context(self, history: list[Message]) -> list[Message] | None | Awaitable[list[Message] | None]:
        """The messages the model sees for its next reply, given the episode's whole ``history`` so
        far (the opening, every reply and every message you returned, as text). Override it to
        rewrite what the model is shown (elide old tool outputs, summarise, drop earlier thinking);
        the default, None, shows all of it, append-only. When what you return is not the model's
        last context with messages appended, the episode continues in a new segment, rendered
        afresh and trained token-exactly as the model saw it (:mod:`loop_trainer.rollout.context`).
        Return the same messages for the same history: a replay must see what the run saw."""
        return None


class EnvironmentSetupError(RuntimeError):
    """The environment cannot run as configured (data missing, servers not starting): the user
    can fix it, so front ends print the message alone, without a traceback."""


class UnknownSplitError(EnvironmentSetupError, ValueError):
    """The environment has no split of that name. Raise it from :meth:`Environment.tasks`, naming
    the splits there are (a ``ValueError`` too, as before it existed)."""


class EpisodeContractError(ValueError):
    """An episode returned something the contract does not allow (a message without a known role,
    a reward that is not a number, ...). It fails that one rollout, with this message."""


class Environment(ABC):
    """A task source and an episode factory. Subclass it to plug in your own world."""

    name: str = "environment"
    reward_range: tuple[float, float] = (0.0, 1.0)
    """Where every episode's reward lies (checked; a reward outside fails that rollout). LOOP's
    leave-one-out advantage needs no normalisation, so any finite range works: rewards on a larger
    scale give proportionally larger advantages, i.e. a larger effective learning rate."""
    max_concurrent_episodes: int | None = None
    """The most episodes this environment can run at once (e.g. one per server), if bounded."""
    in_process_only: str | None = None
    """Why this environment's episodes must run in the trainer's process, if they must: ``collection_process``
    is then refused with this reason. None: a copy pickled to a collection process may run them (that copy is
    the child's: it calls :meth:`prepare` on it, and :meth:`close` when the trainer closes the child)."""
    default_eval_split: str | None = None
    """The split ``loop-eval`` evaluates when neither ``--split`` nor the evaluated run's ``eval_split``
    names one (the built-in worlds: ``test``; AppWorld: ``dev``). None: ``--split`` is required."""
    warm_up_success: float | Mapping[str, float] | None = None
    """For ``tiny-instruct:<env>`` warm-ups until fitted: the greedy success rate on the first
    ``FitRule.probe_tasks`` training tasks the warm-up must reach before it stops (probed every
    ``FitRule.check_every`` steps). None: it stops when its held-out reply accuracy plateaus. Set it
    where greedy success is a cliff in that accuracy (``errands``: a task of 10-30 dependent calls
    fails on one wrong value, so a plateau at 0.87 gives 0.02 and one at 0.91 gives 0.97). A mapping
    names several of the probe's readings, each with its own rate: ``success_rate`` and the rates the
    environment's ``summarize`` reports beside it (``errands``: ``success_rate_level_N``), so a warm-up
    can wait for its hardest tasks as well as the mean."""
    tiny_layers: int | None = None
    """For ``tiny:<env>`` / ``tiny-instruct:<env>``: the tiny model's number of decoder layers (its
    width stays 128). None: 2. Set more where a reply needs look-ups composed on look-ups (which errand
    of a task line comes after the last one done in the history). On ``errands`` 4 layers cost 1.9 times
    2 layers' seconds a warm-up step and 1.7 times an iteration (``benchmarks/tiny_depth_cost.py``)."""

    @abstractmethod
    def tasks(self, split: str = "train") -> Dataset:
        """The tasks of ``split``: one row per task with at least a string ``task_id`` column, ids
        distinct (see :func:`check_tasks`). For a split it lacks, raise :class:`UnknownSplitError`
        naming the splits it has."""

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
        with an ``env_`` prefix. Called on a thread of its own, while episodes may run, within
        ``env_timeout``: a call that raises or does not return in time keeps the last answer and is
        counted (``metrics_call_failures``), and none starts again until a hung one returns."""
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
        calls it (``loop-train`` and ``loop-eval`` do; the trainer never closes an env it was given).
        A collection process (``collection_process: true``) closes its own copy, also when it ends
        early because the trainer's process is gone: then episodes may still be running, close()
        runs on a thread of its own (after a prepare() still under way), and the process ends once
        it returns or after 10 s in all."""


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


def check_pass_rates(rows: Sequence[Mapping[str, Any]], checks: Sequence[str]) -> dict[str, float]:
    """``passed_<check>``: the fraction of rollouts whose ``Score.info["checks"][check]`` is true,
    for environments that grade by named checks (which step of a task the agent gets wrong). Failed
    rollouts passed none; NaN when there are no rows."""
    rates = {}
    for check in checks:
        passed = sum(
            bool((row.get("info") or {}).get("checks", {}).get(check)) for row in rows if row["status"] == "completed"
        )
        rates[f"passed_{check}"] = passed / len(rows) if rows else float("nan")
    return rates


def refuse_unknown_split(environment: str, split: str, splits: Sequence[str]) -> None:
    """Raise :class:`UnknownSplitError` unless ``split`` is one of ``splits``, naming them and the keys
    that choose one (for a built-in environment's ``tasks``)."""
    if split not in splits:
        named = " and ".join(f"{name!r}" for name in splits) if len(splits) == 2 else ", ".join(map(repr, splits))
        raise UnknownSplitError(
            f"{environment} has no split {split!r}; its splits are {named} "
            "(set train_split / eval_split to one of them)"
        )


def check_tasks(tasks: Any, *, environment: str, split: str) -> Dataset:
    """``tasks``, what ``Environment.tasks(split)`` returned, if it keeps the contract: a
    :class:`datasets.Dataset` with at least one row and a ``task_id`` column whose values are set
    and distinct (as strings: trajectories, logs and checkpoints name tasks by ``str(task_id)``).
    Otherwise :class:`EnvironmentSetupError` with one line naming ``environment`` and ``split``."""
    where = f"environment {environment!r}, split {split!r}"
    if not isinstance(tasks, Dataset):
        hint = " (wrap rows with datasets.Dataset.from_list(rows))" if isinstance(tasks, (list, tuple)) else ""
        raise EnvironmentSetupError(f"{where}: tasks() returned a {type(tasks).__name__}, not a datasets.Dataset{hint}")
    if len(tasks) == 0:
        raise EnvironmentSetupError(
            f"{where}: the split has no tasks (check the environment's data, or the environment_kwargs "
            "that set its size)"
        )
    if "task_id" not in tasks.column_names:
        columns = ", ".join(tasks.column_names) or "none"
        raise EnvironmentSetupError(f"{where}: the tasks have no 'task_id' column (columns: {columns})")
    ids = tasks["task_id"]
    missing = sum(task_id is None for task_id in ids)
    if missing:
        raise EnvironmentSetupError(f"{where}: {missing} of {len(ids)} tasks have no task_id (None)")
    repeated = [(task_id, n) for task_id, n in Counter(str(task_id) for task_id in ids).items() if n > 1]
    if repeated:
        examples = ", ".join(f"{task_id!r} ({n}x)" for task_id, n in repeated[:3])
        more = f" and {len(repeated) - 3} more" if len(repeated) > 3 else ""
        raise EnvironmentSetupError(
            f"{where}: {len(repeated)} task ids occur more than once: {examples}{more}; "
            "every task needs its own task_id"
        )
    return tasks


def with_task_ids(dataset: Dataset, prefix: str) -> Dataset:
    """``dataset`` with a ``task_id`` column (``<prefix>-<row>``) if it has none: for adapters whose
    tasks come from someone else's rows (prompt datasets, reset() arguments)."""
    if "task_id" in dataset.column_names:
        return dataset
    return dataset.add_column("task_id", [f"{prefix}-{index}" for index in range(len(dataset))])


def load_tasks(env: Environment, split: str) -> Dataset:
    """``env.tasks(split)``, checked by :func:`check_tasks`. A ``KeyError`` or ``ValueError`` from
    ``tasks()`` (an environment's usual answer to a split it lacks) becomes one line."""
    try:
        tasks = env.tasks(split)
    except EnvironmentSetupError:
        raise
    except (KeyError, ValueError) as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise EnvironmentSetupError(
            f"environment {env.name!r} cannot list the tasks of split {split!r}: {detail}"
        ) from None
    return check_tasks(tasks, environment=env.name, split=split)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_messages(messages: Any, *, source: str) -> list[Message]:
    """``messages`` if they are a list of chat messages, each a mapping with a ``role`` from
    :data:`ROLES` (its ``content`` is checked and repaired by the rollout engine). ``source`` names
    the method that returned them (``"Episode.start()"``). Otherwise :class:`EpisodeContractError`
    naming the bad message."""
    if not isinstance(messages, (list, tuple)):
        raise EpisodeContractError(
            f"{source} must return a list of messages, got {type(messages).__name__}: {_short(messages)}"
        )
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise EpisodeContractError(
                f"{source} message {index} is a {type(message).__name__}, not a dict "
                f"with 'role' and 'content': {_short(message)}"
            )
        role = message.get("role")
        if role not in ROLES:
            problem = "has no 'role'" if role is None else f"has the unknown role {_short(role, 30)}"
            raise EpisodeContractError(
                f"{source} message {index} {problem} (roles: {', '.join(ROLES)}): {_short(dict(message))}"
            )
    return list(messages)


def _is_number(value: Any) -> bool:
    # bool is an int (True == 1): a 0/1 reward loses nothing. Strings, None, tensors and Decimals
    # are refused rather than converted: float("0.5") hides a bug in the environment.
    return isinstance(value, (numbers.Real, np.bool_))


def as_score(value: float | Score, reward_range: tuple[float, float] = (0.0, 1.0)) -> Score:
    """Normalise what ``Episode.score`` returned: a number in ``reward_range`` (the environment's;
    [0, 1] by default) or a :class:`Score` whose ``reward`` is one. Anything else (a string such as
    ``"0.5"``, ``None``, a tensor, NaN) is an :class:`EpisodeContractError` naming its type, never
    converted."""
    low, high = reward_range
    where = "[0, 1]" if (low, high) == (0.0, 1.0) else f"[{low:g}, {high:g}]"
    if isinstance(value, Score):
        score = value
    elif _is_number(value):
        score = Score(reward=value)
    else:
        raise EpisodeContractError(
            f"Episode.score() must return a number in {where} or a Score, got {type(value).__name__}: {_short(value)}"
        )
    if not _is_number(score.reward):
        raise EpisodeContractError(
            f"Score.reward must be a number in {where} (int or float), got "
            f"{type(score.reward).__name__}: {_short(score.reward)}"
        )
    reward = float(score.reward)
    if not low <= reward <= high or not math.isfinite(reward):
        raise EpisodeContractError(f"episode reward must be a finite number in {where}, got {score.reward!r}")
    score.reward = reward
    return score
