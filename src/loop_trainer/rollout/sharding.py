"""Collecting one batch of rollouts with several processes: each runs the episodes of its share
of the tasks (round-robin), then every process sees every result.

The two halves are apart: :func:`collect_share` runs no collective (an overlapped collection runs it on a
thread of its own while the update's collectives run on the main thread), :func:`gather_shares` is the one
collective, run on the main thread at the iteration boundary.

Seeds depend on the task's position in the whole list, not on the process, so the trajectories
are the same whatever the number of processes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from accelerate.utils import gather_object

from ..trajectory import Trajectory
from .engine import RolloutBatch
from .records import GenerationBackend


class Collector(Protocol):
    """What collects a batch: the rollout engine, or a collection process (:mod:`.collection_process`)."""

    def collect(self, tasks: Sequence[Mapping[str, Any]], rollouts_per_task: int, **kwargs: Any) -> RolloutBatch: ...


def collect_share(
    engine: Collector,
    tasks: Sequence[Mapping[str, Any]],
    rollouts_per_task: int,
    *,
    num_processes: int,
    process_index: int,
    seed: int | None,
    description: str,
    max_failed_fraction: float = 1.0,
    backend: GenerationBackend | None = None,
    done_fraction: float = 1.0,
    task_fraction: float = 1.0,
) -> RolloutBatch:
    """This process's share of the batch (its tasks' episodes, each trajectory's ``group`` its task's index
    in ``tasks``), sampled by ``backend`` (default: the engine's). No collective: safe on any thread."""
    mine = task_share(len(tasks), num_processes, process_index)
    batch = engine.collect(
        [tasks[i] for i in mine],
        rollouts_per_task,
        seed=seed,
        group_ids=mine,
        max_failed_fraction=max_failed_fraction,
        description=description,
        backend=backend,
        done_fraction=done_fraction,
        task_fraction=task_fraction,
    )
    for trajectory in (*batch.trajectories, *batch.failed):
        trajectory.group = mine[trajectory.group]
    return batch


def task_share(num_tasks: int, num_processes: int, process_index: int) -> list[int]:
    """The indices of the tasks whose episodes this process runs (round-robin)."""
    return list(range(process_index, num_tasks, num_processes))


def gather_shares(batch: RolloutBatch, num_processes: int) -> RolloutBatch:
    """Every process's share of one batch, on every process (a collective: every process calls it, on the
    thread that runs the others)."""
    if num_processes == 1:
        return batch
    parts = gather_object([batch])
    return RolloutBatch(
        trajectories=_in_task_order([t for part in parts for t in part.trajectories]),
        failed=_in_task_order([t for part in parts for t in part.failed]),
        num_cancelled=sum(part.num_cancelled for part in parts),
        seconds=max(part.seconds for part in parts),
        num_carried=sum(part.num_carried for part in parts),
        num_dropped_stale=sum(part.num_dropped_stale for part in parts),
    )


def _in_task_order(trajectories: list[Trajectory]) -> list[Trajectory]:
    """In (task, rollout) order, as one process collects them: the update's shuffled minibatches index this list,
    so the processes' shares one after another would make other minibatches than one process makes."""
    return sorted(trajectories, key=lambda t: (t.group, t.rollout))
