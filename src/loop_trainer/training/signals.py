"""What a run says about its own learning, beyond reward: the environment's per-check pass rates over
the training rollouts, and a one-line warning when the history shows a collapse signature.

The signatures (each must hold for :data:`PATIENCE` consecutive iterations):

* **entropy collapse** -- the policy's mean entropy over sampled tokens (``entropy``) is under
  :data:`ENTROPY_DROP` of its start (the mean of the first :data:`PATIENCE` iterations that measured it)
  while neither the success rate nor the mean reward (our environments' rewards lie in [0, 1]) has
  risen by :data:`SUCCESS_RISE` over its start (first :data:`PATIENCE` iterations): the policy is becoming
  deterministic without getting better, and what it no longer samples it can no longer learn (a policy
  that learns its task also grows sure of it: SmolLM2 on ``contacts`` halves its entropy on the way to
  success 0.7, docs/real-model.md);
* **tied groups** -- at least :data:`TIED_LIMIT` of the task groups got the same reward on every rollout
  (``tied_group_fraction``) while the success rate is under :data:`SOLVED`: their leave-one-out
  advantages are 0, so the update has (almost) nothing to learn from and the curve goes flat (groups
  that all succeed tie too, but there is nothing left to learn from them);
* **success lost** -- no rollout succeeded, after the success rate had averaged at least
  :data:`SUCCESS_SEEN` over some :data:`PATIENCE` iterations;
* **episodes stopped ending** -- at least :data:`TRUNCATED_LIMIT` of the episodes ended by a limit
  (``truncated_fraction``: ``max_turns`` or the trajectory budget), where at the start at most
  :data:`TRUNCATED_START` did: the policy no longer finishes its task.

The last two are the miniature Table 1's collapse (``benchmarks/results/ablations/``): on ``vault``,
partial credit from looking things up until ``max_turns`` beats a risky submit that ends the episode,
and once no rollout submits, no advantage points back to submitting.

The warning fires at the iteration a signature starts to hold (again after it lapsed), names it with its
numbers, and names the keys to try (docs/stabilisers.md). It reads only the history, so a resumed run
warns exactly where the uninterrupted one would.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ..envs.base import Environment
from ..evaluation import evaluation_row
from ..rollout import RolloutBatch

PATIENCE = 3
ENTROPY_DROP = 0.5
SUCCESS_RISE = 0.1
TIED_LIMIT = 0.8
SOLVED = 0.9
SUCCESS_SEEN = 0.05
TRUNCATED_LIMIT = 0.8
TRUNCATED_START = 0.4

LOWER_STEP = "try a lower learning_rate, or beta > 0 (a KL penalty to the starting weights)"
# each signature's advice, clause by clause: two signatures that share a clause print it once
ADVICE: dict[str, tuple[str, ...]] = {
    "entropy": ("try epsilon_high (clip-higher, e.g. 0.28 with epsilon 0.2) or a lower learning_rate",),
    "tied": (
        "try dynamic_sampling_rounds (e.g. 2), more rollouts_per_task, balance_tasks_by (when tasks of one "
        "kind fill an iteration), or more varied tasks",
    ),
    "success": (LOWER_STEP,),
    "ending": (LOWER_STEP, "check that finishing an episode is rewarded at least as well as running out of turns"),
}


def training_check_rates(env: Environment, batch: RolloutBatch) -> dict[str, float]:
    """``env.summarize`` of the training rollouts (as for evaluation: per-check pass rates for
    ``contacts``, TGC/SGC for AppWorld) with a ``train_`` prefix, less the success rate and mean
    reward the record already has."""
    rows = [evaluation_row(t) for t in (*batch.trajectories, *batch.failed)]
    summary = env.summarize(rows) if rows else {}
    return {f"train_{key}": value for key, value in summary.items() if key not in ("success_rate", "reward_mean")}


def _value(record: Mapping[str, Any], key: str) -> float:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def _at_least(fraction: float) -> str:
    """The lowest fraction over the window as a floor ("81%+"), or "100%" when it never fell below all."""
    return "100%" if fraction >= 1.0 else f"{fraction:.0%}+"


def collapse_signatures(history: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The signatures that hold at the end of ``history`` (one record per iteration), each with its
    description: ``{"entropy" | "tied" | "success" | "ending": text}``."""
    found: dict[str, str] = {}
    if len(history) < PATIENCE:
        return found
    recent = history[-PATIENCE:]
    successes = [_value(h, "success_rate") for h in history]
    recent_success = statistics.fmean(successes[-PATIENCE:])  # NaN where a record has none
    rewards = [_value(h, "reward_mean") for h in history]
    risen = any(  # NaN compares False
        statistics.fmean(series[-PATIENCE:]) >= statistics.fmean(series[:PATIENCE]) + SUCCESS_RISE
        for series in (successes, rewards)
    )
    entropies = [e for e in (_value(h, "entropy") for h in history) if not math.isnan(e)]
    recent_entropy = [_value(h, "entropy") for h in recent]
    if len(entropies) >= 2 * PATIENCE and not any(math.isnan(e) for e in recent_entropy):
        start = statistics.fmean(entropies[:PATIENCE])
        if all(e < ENTROPY_DROP * start for e in recent_entropy) and not risen:
            found["entropy"] = (
                f"policy entropy {recent_entropy[-1]:.3g} is under {ENTROPY_DROP:.0%} of its start "
                f"({start:.3g}) for {PATIENCE} iterations"
            )
    tied = [_value(h, "tied_group_fraction") for h in recent]
    if all(t >= TIED_LIMIT for t in tied) and not recent_success >= SOLVED:  # NaN compares False
        found["tied"] = f"{_at_least(min(tied))} of task groups tied (all rewards equal) for {PATIENCE} iterations"
    earlier = successes[:-PATIENCE]
    windows = [statistics.fmean(earlier[i : i + PATIENCE]) for i in range(len(earlier) - PATIENCE + 1)]
    best = max((w for w in windows if not math.isnan(w)), default=0.0)
    if best >= SUCCESS_SEEN and all(s == 0.0 for s in successes[-PATIENCE:]):
        found["success"] = f"success rate 0 for {PATIENCE} iterations after averaging {best:.2f}"
    truncated = [_value(h, "truncated_fraction") for h in history]
    start = statistics.fmean(truncated[:PATIENCE])
    if start <= TRUNCATED_START and all(t >= TRUNCATED_LIMIT for t in truncated[-PATIENCE:]):
        found["ending"] = (
            f"{_at_least(min(truncated[-PATIENCE:]))} of episodes ended by a limit (max_turns, the trajectory budget) "
            f"for {PATIENCE} iterations, {start:.0%} at the start"
        )
    return found


def collapse_warning(history: Sequence[Mapping[str, Any]]) -> str | None:
    """The warning to log after the last record of ``history``: the signatures that hold now and did
    not one iteration earlier, with the keys to try; None if there are none."""
    now, before = collapse_signatures(history), collapse_signatures(history[:-1])
    new = [kind for kind in now if kind not in before]
    if not new:
        return None
    advice = "; ".join(dict.fromkeys(clause for kind in new for clause in ADVICE[kind]))
    iteration = history[-1].get("iteration", len(history))
    signs = "; ".join(now[kind] for kind in new)
    advice = advice[0].upper() + advice[1:]
    return f"iteration {iteration}: learning may be collapsing: {signs}. {advice} (docs/stabilisers.md)"
