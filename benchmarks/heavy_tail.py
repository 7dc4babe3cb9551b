"""``vault`` with a heavy tail of slow episodes, as AppWorld's lengths have one (most episodes short, a few 5-10x
longer): each episode draws whether it is slow, and each of its environment steps then sleeps ``step_seconds``
or ``step_seconds`` times a factor drawn in ``tail_factor``. The tasks, the checks and the rewards are vault's, so
the tiny vault models learn it; only the time an episode takes changes. The draw does not depend on what the agent
does, so the straggler cut throws away slow episodes, not failing ones.

    loop-train --config recipes/demo.yaml --environment benchmarks.heavy_tail:HeavyTailedVault \\
        --environment_kwargs '{"num_tasks": 64, "tail_fraction": 0.1}'
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

from loop_trainer.envs.base import Step
from loop_trainer.envs.vault import VaultEnv, VaultEpisode


class SlowVaultEpisode(VaultEpisode):
    def __init__(self, task: Mapping[str, Any], step_seconds: float):
        super().__init__(task)
        self.step_seconds = step_seconds

    def step(self, reply: str) -> Step:
        time.sleep(self.step_seconds)  # a synchronous step: on the engine's environment threads
        return super().step(reply)


class HeavyTailedVault(VaultEnv):
    """``vault`` whose episodes are slow with probability ``tail_fraction`` (each step ``tail_factor`` times
    ``step_seconds``), drawn from ``draw_seed`` in the order episodes are opened."""

    def __init__(
        self,
        num_tasks: int = 64,
        people_per_task: int = 4,
        seed: int = 0,
        step_seconds: float = 0.05,
        tail_fraction: float = 0.1,
        tail_factor: tuple[float, float] = (5.0, 10.0),
        draw_seed: int = 0,
    ):
        super().__init__(num_tasks, people_per_task, seed)
        self.step_seconds, self.tail_fraction, self.tail_factor = step_seconds, tail_fraction, tuple(tail_factor)
        self._draws = itertools.count()
        self._lock = threading.Lock()
        self.draw_seed = draw_seed

    def episode(self, task: Mapping[str, Any]) -> SlowVaultEpisode:
        with self._lock:
            draw = random.Random(f"{self.draw_seed}-{next(self._draws)}")
        slow = draw.random() < self.tail_fraction
        factor = draw.uniform(*self.tail_factor) if slow else 1.0
        return SlowVaultEpisode(task, self.step_seconds * factor)
