"""An environment that says in ``metrics()`` which modules of the training stack its process has imported: a
collection child's copy must import none (tests/unit/rollout/test_collection_process.py). In a module of its own,
which imports nothing heavy, because the child imports the module that defines the environment's class."""

from __future__ import annotations

import sys

from loop_trainer.envs.errands import ErrandsEnv

# With them a child held 610 MiB and took about 7 s to start; 328 MiB and about 2 s without
# (benchmarks/collection_child.py).
TRAINING_STACK = ("torch", "transformers.trainer", "transformers.modeling_utils", "peft", "trl", "accelerate")


class StackWatchingEnv(ErrandsEnv):
    def metrics(self) -> dict[str, float]:
        return {module: float(module in sys.modules) for module in TRAINING_STACK}
