"""Which tasks each iteration trains on: shuffled passes over the task list, or passes balanced
across the values of one column (``balance_tasks_by``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset

from ..rollout.records import mix_seed, stream_seed


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

    def start_new_pass(self, num_tasks: int) -> None:
        """After a resume that changed the seed or the split's size: the old position means nothing in
        the new order, so walking starts over in the next pass."""
        self.num_tasks, self.epoch, self.position = num_tasks, self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class BalancedTaskSampler:
    """``balance_tasks_by``: draws that take the kinds of task in turn (the values of one column of
    the training split, e.g. ``contacts``' ``field``), so an iteration of n tasks holds n/k of each of
    the k kinds (the remainder rotates from draw to draw).

    Why: a draw of shuffled tasks is often lopsided (4 tasks of 2 kinds: all of one kind 1 time in 8),
    and a policy that cannot yet tell the kinds apart learns "do what that kind needs" for every task
    from such an iteration: on ``contacts`` one draw of four city questions tipped SmolLM2 into
    answering the city everywhere (docs/stabilisers.md). Each kind is walked in its own seeded
    shuffled passes (a :class:`TaskSampler` over its tasks); the state is those samplers' plus the
    count of tasks drawn, so a resumed run draws exactly what it would have."""

    def __init__(self, kinds: Sequence[str], seed: int = 0):
        if not kinds:
            raise ValueError("the environment has no tasks in this split")
        self.num_tasks = len(kinds)
        self.members = [[i for i, kind in enumerate(kinds) if kind == value] for value in sorted(set(kinds))]
        # 31-bit seeds: TaskSampler's stream_seed scales its seed by ~1e6 into torch's 64-bit range
        self.samplers = [
            TaskSampler(len(group), seed=mix_seed(seed, k) % 2**31) for k, group in enumerate(self.members)
        ]
        self.drawn = 0

    @property
    def epoch(self) -> int:
        return self.drawn // self.num_tasks

    @property
    def position(self) -> int:
        return self.drawn % self.num_tasks

    def next(self, n: int) -> list[int]:
        turns = [(self.drawn + i) % len(self.members) for i in range(n)]  # the kind of each task drawn
        taken = {k: iter(self.samplers[k].next(turns.count(k))) for k in set(turns)}
        self.drawn += n
        return [self.members[k][next(taken[k])] for k in turns]

    def start_new_pass(self, num_tasks: int) -> None:
        """After a resume that changed the seed or the split: every kind starts a fresh pass."""
        for sampler in self.samplers:
            sampler.start_new_pass(sampler.num_tasks)

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "kinds": [sampler.state_dict() for sampler in self.samplers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["kinds"]) != len(self.samplers):
            raise ValueError(
                f"the checkpoint's task sampler walked {len(state['kinds'])} kinds of task, this split has "
                f"{len(self.samplers)}"
            )
        self.drawn = int(state["drawn"])
        for sampler, kind_state in zip(self.samplers, state["kinds"], strict=True):
            sampler.load_state_dict(kind_state)


def task_sampler_for(tasks: Dataset, seed: int, balance_by: str | None) -> TaskSampler | BalancedTaskSampler:
    """The training split's sampler: shuffled passes, or with ``balance_by`` (a column of the split)
    draws balanced across that column's values. A missing column is one line naming the columns."""
    if balance_by is None:
        return TaskSampler(len(tasks), seed=seed)
    if balance_by not in tasks.column_names:
        raise ValueError(
            f"balance_tasks_by: the training split has no column {balance_by!r}; its columns are "
            f"{', '.join(tasks.column_names)}"
        )
    return BalancedTaskSampler([str(value) for value in tasks[balance_by]], seed=seed)
