"""One definition of how episodes run, shared by training (:class:`~loop_trainer.LOOPConfig`) and
evaluation (``loop-eval``), so the two can never disagree on a default or on a value's range.

It also holds the small range language the configuration tables are written in (:class:`Rule`,
:func:`check_ranges`): ``LOOPConfig``'s table (``loop_trainer.config.RANGES``) extends
:data:`EPISODE_RANGES`, and ``loop-eval`` checks its arguments with the same rules.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .rollout.engine import EpisodeLimits


class Rule(NamedTuple):
    """The values a configuration key allows, as one readable line.

    ``allowed`` is one or more alternatives joined by `` or ``: ``> 0``, ``>= 1``, ``in [0, 1)`` (an
    interval), ``a whole number >= 1``, ``None``, ``inf``, ``a number``. Bounds hold finite numbers only
    (NaN is refused everywhere, infinity only where ``inf`` is an alternative). ``meaning`` says what
    the key does, or what a value outside the range would do. ``when`` (``"save_strategy: steps"``)
    limits the rule to runs with that setting."""

    allowed: str
    meaning: str
    when: str | None = None


_BOUND = re.compile(r"(>=|>|<=|<) (-?[0-9.e+-]+)")
_INTERVAL = re.compile(r"in ([\[(])(-?[0-9.e+-]+), (-?[0-9.e+-]+)([\])])")
_WHOLE = re.compile(r"a whole number (.+)")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _allows_one(alternative: str, value: Any) -> bool:
    if alternative == "None":
        return value is None
    if alternative == "inf":
        return _is_number(value) and value == math.inf
    if alternative == "a number":
        return _is_number(value) and not math.isnan(value)
    if not (_is_number(value) and math.isfinite(value)):
        return False
    if match := _WHOLE.fullmatch(alternative):
        return float(value).is_integer() and _allows_one(match.group(1), value)
    if match := _BOUND.fullmatch(alternative):
        operator, bound = match.group(1), float(match.group(2))
        return {">=": value >= bound, ">": value > bound, "<=": value <= bound, "<": value < bound}[operator]
    if match := _INTERVAL.fullmatch(alternative):
        opening, low, high, closing = match.group(1), float(match.group(2)), float(match.group(3)), match.group(4)
        return (value >= low if opening == "[" else value > low) and (value <= high if closing == "]" else value < high)
    raise AssertionError(f"not a range this module can check: {alternative!r}")


def allows(allowed: str, value: Any) -> bool:
    """Whether ``value`` is in the range ``allowed`` (a :class:`Rule`'s first field)."""
    return any(_allows_one(alternative, value) for alternative in allowed.split(" or "))


def range_message(key: str, value: Any, rule: Rule) -> str:
    """The one line refusing ``key``'s ``value``: the key, the allowed range, the value, the meaning."""
    where = f" with {rule.when}" if rule.when else ""
    return f"{key} must be {rule.allowed}{where}, got {value!r} ({rule.meaning})"


def applies(rule: Rule, settings: Any) -> bool:
    if rule.when is None:
        return True
    key, _, wanted = rule.when.partition(": ")
    value = getattr(settings, key)
    return str(getattr(value, "value", value)) == wanted


def check_ranges(settings: Any, rules: Mapping[str, Rule]) -> None:
    """Raise ValueError with :func:`range_message` for the first key of ``rules`` whose value is out of range."""
    for key, rule in rules.items():
        value = getattr(settings, key)
        if applies(rule, settings) and not allows(rule.allowed, value):
            raise ValueError(range_message(key, value, rule))


@dataclass
class EpisodeSettings:
    """Limits and concurrency of episodes (the paper's values are the defaults)."""

    max_turns: int = field(default=40, metadata={"help": "Model replies per episode."})
    max_new_tokens_per_turn: int = field(default=1500, metadata={"help": "Token limit of one reply."})
    max_trajectory_tokens: int = field(
        default=32000, metadata={"help": "Whole-conversation budget; the episode ends when it is used up."}
    )
    max_completion_tokens: int | None = field(
        default=None, metadata={"help": "Budget of everything after the opening prompt (replies and environment "
                                "messages), as GRPOTrainer's max_completion_length; none: max_trajectory_tokens only."}
    )
    max_concurrent_episodes: int = field(default=256, metadata={"help": "Episodes in flight at once."})
    env_timeout: float = field(default=300.0, metadata={"help": "Seconds one environment call may take."})
    generation_batch_limit: int = field(
        default=64, metadata={"help": "Most sequences the transformers backend samples in one batch."}
    )

    def episode_limits(self) -> EpisodeLimits:
        return EpisodeLimits(self.max_turns, self.max_new_tokens_per_turn, self.max_trajectory_tokens,
                             self.max_completion_tokens)

    def concurrency_for(self, env_limit: int | None) -> int:
        """Episodes in flight at once, bounded by what the environment can run."""
        return min(self.max_concurrent_episodes, env_limit or self.max_concurrent_episodes)


# The ranges of the episode settings, shared by LOOPConfig and loop-eval.
EPISODE_RANGES: dict[str, Rule] = {
    "max_turns": Rule(">= 1", "model replies per episode"),
    "max_new_tokens_per_turn": Rule(">= 1", "the token limit of one reply"),
    "max_trajectory_tokens": Rule(">= 1", "the whole conversation's token budget"),
    "max_completion_tokens": Rule(">= 1 or None", "the token budget after the opening prompt; None: no budget but "
                                  "max_trajectory_tokens"),
    "max_concurrent_episodes": Rule(">= 1", "episodes in flight at once"),
    "env_timeout": Rule("> 0", "seconds one environment call may take; 0 would fail every call as timed out"),
    "generation_batch_limit": Rule(">= 1", "the most sequences the transformers backend samples in one batch"),
}
