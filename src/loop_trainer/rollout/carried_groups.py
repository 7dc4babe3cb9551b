"""A run's carried groups (partial rollouts, :mod:`.partial`) in a checkpoint and across processes: written beside
the weights before a checkpoint, read back by the resumed run (each process its own tasks' share), and gathered from
every process for the checkpoint.

Apart from :mod:`.partial` because these need torch and accelerate, and a collection child, which holds a run's
partial rollouts, needs neither (:mod:`loop_trainer.lazy_exports`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate.utils import gather_object

from .partial import CarriedGroup

CARRIED_FILE = "carried_episodes.pt"


def gather_carried(groups: list[CarriedGroup], num_processes: int) -> list[CarriedGroup]:
    """Every process's carried groups, on every process (a collective)."""
    if num_processes == 1:
        return groups
    return [group for part in gather_object([groups]) for group in part]


def save_carried(groups: Sequence[CarriedGroup], directory: Path) -> None:
    """Write the carried groups into a checkpoint ``directory`` (nothing if none)."""
    if groups:
        saved = [
            {"iteration": g.iteration, "task_index": g.task_index, "size": g.size, "ended": g.ended} for g in groups
        ]
        torch.save({"groups": saved}, directory / CARRIED_FILE)


def load_carried(checkpoint: str | Path, num_processes: int = 1, process_index: int = 0) -> list[CarriedGroup]:
    """This process's carried groups in a checkpoint (its tasks' share, as :func:`.sharding.collect_share`
    deals them: task index modulo the process count); none if it holds none."""
    path = Path(checkpoint) / CARRIED_FILE
    if not path.is_file():
        return []
    saved = torch.load(path, weights_only=False)  # our own checkpoint: trajectories, not tensors only
    groups = [
        CarriedGroup(int(g["iteration"]), int(g["task_index"]), int(g["size"]), dict(g["ended"]))
        for g in saved["groups"]
    ]
    return [g for g in groups if g.task_index % num_processes == process_index]
