"""An environment that says in ``metrics()`` which modules of the training stack its process has imported: a
collection child's copy must import none (tests/unit/rollout/test_collection_process.py). In a module of its own,
which imports nothing heavy, because the child imports the module that defines the environment's class."""

from __future__ import annotations

import sys

from loop_trainer.envs.errands import ErrandsEnv

# torch alone is 610 MiB and about 5 s of a child's start.
TRAINING_STACK = ("torch", "transformers.trainer", "transformers.modeling_utils", "peft", "trl", "accelerate")


class StackWatchingEnv(ErrandsEnv):
    def metrics(self) -> dict[str, float]:
        return {module: float(module in sys.modules) for module in TRAINING_STACK}
