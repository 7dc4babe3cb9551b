"""Which tasks each iteration trains on: shuffled passes over the task list."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..rollout.records import stream_seed


@dataclass
class TaskSampler:
    """Walks seeded random permutations of ``range(num_tasks)``, ``n`` tasks at a time.

    Every task is used once per pass before any is reused. The state (pass, position) is two
    integers, so a resumed run draws exactly the tasks it would have drawn.

    A draw that runs off the end of one pass continues into the next pass's permutation, skipping
    the tasks it already holds: one draw never repeats a task while ``n <= num_tasks``. A skipped
    task counts as used in the new pass too (the position moves past it), so the state stays two
    integers, and draws that meet no repeat are exactly the plain walk over the permutations.
    """

    num_tasks: int
    seed: int = 0
    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        if self.num_tasks < 1:
            raise ValueError("the environment has no tasks in this split")

    def _permutation(self) -> list[int]:
        generator = torch.Generator().manual_seed(stream_seed(self.seed, self.epoch))
        return torch.randperm(self.num_tasks, generator=generator).tolist()

    def next(self, n: int) -> list[int]:
        picked: list[int] = []
        held: set[int] = set()
        order = self._permutation()
        while len(picked) < n:
            if self.position == self.num_tasks:
                self.epoch, self.position = self.epoch + 1, 0
                order = self._permutation()
            task = order[self.position]
            self.position += 1
            # Once every task is held (n > num_tasks), repeats cannot be avoided.
            if task in held and len(held) < self.num_tasks:
                continue
            picked.append(task)
            held.add(task)
        return picked

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
