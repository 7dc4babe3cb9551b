"""GRPOTrainer compatibility: ``LOOPTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset, tools=,
environment_factory=)`` trains with LOOP.

* :mod:`.arguments`: which environment a trainer call describes, and the refusals of that route;
* :mod:`.grpo_config`: a ``GRPOConfig`` translated to a :class:`~loop_trainer.LOOPConfig`;
* :mod:`.environment`: TRL's prompt dataset, reward functions, tools and environment_factory as an Environment;
* :mod:`.tool_calls`: tool calls parsed and run as GRPOTrainer does (shared by the verifiers and OpenEnv adapters).
"""

from typing import TYPE_CHECKING

from ...lazy_exports import lazy_exports

# On first use: the environment imports transformers' TrainerCallback (and with it torch and accelerate), which the
# verifiers and OpenEnv adapters, importing .tool_calls in a collection child, do not need (lazy_exports.py).
if TYPE_CHECKING:
    from .environment import TRLAgentEnvironment
else:  # not for mypy, which would take any name imported from here as Any (lazy_exports.py)
    __getattr__, __dir__ = lazy_exports(__name__, {".environment": ("TRLAgentEnvironment",)})

__all__ = ["TRLAgentEnvironment"]
