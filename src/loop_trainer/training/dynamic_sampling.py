"""An iteration's rollouts, scored: collected in one round (LOOP), or in up to ``1 + dynamic_sampling_rounds``
rounds until ``tasks_per_iteration`` task groups have rewards that are not all equal (DAPO's dynamic
sampling, Yu et al. 2025, arXiv 2503.14476, with rounds sized to what is missing).

A tied group's leave-one-out advantages are all 0: it costs its rollouts and teaches nothing. Once a
policy settles on a rule, most groups tie and an iteration may keep nothing at all. Dynamic sampling
spends more rollouts on new tasks, drawn from the task sampler (the order of tasks stays one stream),
and trains on the first ``tasks_per_iteration`` groups that are not tied, in collection order; groups
beyond those are dropped and counted, so the number of trajectories an update sees stays what the
recipe sets. Where DAPO draws a whole batch per round, a round here draws the tasks still missing
divided by the fraction of groups that were not tied so far (at most ``tasks_per_iteration``, all of
them while none was informative): one missing group costs about one task, not a whole batch.

Round ``r`` samples with seed ``mix_seed(seed, iteration)`` for ``r = 0`` (LOOP's seed, unchanged) and
``mix_seed(seed, iteration, r)`` after it: a resumed run collects the same rounds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..objective import advantage_keep_mask, advantages_for
from ..rollout import RolloutBatch
from ..stabilisers import select_informative_groups, tied_groups


@dataclass
class ScoredRollouts:
    batch: RolloutBatch
    """Every round's rollouts; a round's groups numbered after the previous rounds' tasks."""
    advantages: Tensor
    """``[len(batch.trajectories)]`` each trajectory's advantage within its group."""
    trained: list[bool]
    """Per trajectory: goes to the update (its |advantage| passes the threshold, and with dynamic
    sampling its group is one of the selected)."""
    metrics: dict[str, float]


def score_rollouts(
    batch: RolloutBatch, *, estimator: str, std_normalize: bool, threshold: float
) -> tuple[Tensor, Tensor]:
    """Each trajectory's advantage within its task group (``advantage_estimator``), and which pass the
    ``advantage_threshold``."""
    rewards = torch.tensor([t.reward for t in batch.trajectories], dtype=torch.float32)
    advantages = advantages_for(estimator, rewards, [t.group for t in batch.trajectories], std_normalize)
    return advantages, advantage_keep_mask(advantages, threshold)


def merge_rounds(batches: list[RolloutBatch], tasks_per_round: list[int]) -> RolloutBatch:
    """One batch of several rounds' batches: a round's group ``g`` becomes ``g`` plus the number of
    tasks of the rounds before it."""
    if len(batches) == 1:
        return batches[0]
    trajectories, failed, offset = [], [], 0
    for batch, num_tasks in zip(batches, tasks_per_round, strict=True):
        trajectories += [dataclasses.replace(t, group=t.group + offset) for t in batch.trajectories]
        failed += [dataclasses.replace(t, group=t.group + offset) for t in batch.failed]
        offset += num_tasks
    return RolloutBatch(
        trajectories=trajectories,
        failed=failed,
        num_cancelled=sum(b.num_cancelled for b in batches),
        seconds=sum(b.seconds for b in batches),
    )


def next_round_size(groups_wanted: int, informative: int, collected: int) -> int:
    """Tasks for the next round: the groups still missing over the fraction of groups so far that were
    not tied, rounded up, at most ``groups_wanted`` (all of them while none was informative)."""
    missing = groups_wanted - informative
    if informative == 0:
        return groups_wanted
    return min(groups_wanted, math.ceil(missing * collected / informative))


def collect_scored(
    collect_round: Callable[[int, int], RolloutBatch],
    score: Callable[[RolloutBatch], tuple[Tensor, Tensor]],
    *,
    groups_wanted: int,
    extra_rounds: int,
) -> ScoredRollouts:
    """``collect_round(r, n)`` draws ``n`` tasks and returns their rollouts (groups ``0 .. n - 1``);
    ``score(batch)`` returns ``(advantages, keep mask)``. With ``extra_rounds`` 0 this is one round of
    ``groups_wanted`` tasks, every kept trajectory trained (LOOP). Otherwise rounds run until
    ``groups_wanted`` groups are not tied or ``extra_rounds`` extra rounds have run."""
    sizes = [groups_wanted]
    rounds = [collect_round(0, groups_wanted)]
    informative = sum(not is_tied for is_tied in _tied(rounds[0]).values())
    while extra_rounds and informative < groups_wanted and len(rounds) <= extra_rounds:
        sizes.append(next_round_size(groups_wanted, informative, sum(sizes)))
        rounds.append(collect_round(len(rounds), sizes[-1]))
        informative += sum(not is_tied for is_tied in _tied(rounds[-1]).values())
    batch = merge_rounds(rounds, sizes)
    advantages, keep = score(batch)
    trained = keep.tolist()
    metrics: dict[str, float] = {}
    if extra_rounds:
        selected, surplus = select_informative_groups(_tied(batch), groups_wanted)
        chosen = set(selected)
        trained = [k and t.group in chosen for k, t in zip(trained, batch.trajectories, strict=True)]
        metrics = {
            "dynamic_sampling_rounds": float(len(rounds) - 1),
            "dynamic_sampling_extra_rollouts": float(sum(len(b.trajectories) + len(b.failed) for b in rounds[1:])),
            "informative_groups": float(len(selected)),
            "dynamic_sampling_surplus_groups": float(surplus),
        }
    return ScoredRollouts(batch, advantages, trained, metrics)


def _tied(batch: RolloutBatch) -> dict[object, bool]:
    return tied_groups([t.reward for t in batch.trajectories], [t.group for t in batch.trajectories])
