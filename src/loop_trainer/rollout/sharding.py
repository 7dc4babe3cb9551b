"""Collecting one batch of rollouts with several processes: each runs the episodes of its share
of the tasks (round-robin), then every process sees every result.

Seeds depend on the task's position in the whole list, not on the process, so the trajectories
are the same whatever the number of processes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from accelerate.utils import gather_object

from .engine import RolloutBatch, RolloutEngine


def collect_across_processes(
    engine: RolloutEngine,
    tasks: Sequence[Mapping[str, Any]],
    rollouts_per_task: int,
    *,
    num_processes: int,
    process_index: int,
    seed: int | None,
    description: str,
    max_failed_fraction: float = 1.0,
    **early_stop: float,
) -> RolloutBatch:
    """Run ``rollouts_per_task`` episodes of this process's tasks; return everyone's, with each
    trajectory's ``group`` set to its task's index in ``tasks``."""
    mine = list(range(process_index, len(tasks), num_processes))
    batch = engine.collect(
        [tasks[i] for i in mine],
        rollouts_per_task,
        seed=seed,
        group_ids=mine,
        max_failed_fraction=max_failed_fraction,
        description=description,
        **early_stop,
    )
    for trajectory in (*batch.trajectories, *batch.failed):
        trajectory.group = mine[trajectory.group]
    if num_processes == 1:
        return batch
    parts = gather_object([batch])
    return RolloutBatch(
        trajectories=[t for part in parts for t in part.trajectories],
        failed=[t for part in parts for t in part.failed],
        num_cancelled=sum(part.num_cancelled for part in parts),
        seconds=max(part.seconds for part in parts),
    )
