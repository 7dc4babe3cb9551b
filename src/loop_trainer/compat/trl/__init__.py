"""GRPOTrainer compatibility: ``LOOPTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset, tools=,
environment_factory=)`` trains with LOOP.

* :mod:`.arguments`: which environment a trainer call describes, and the refusals of that route;
* :mod:`.grpo_config`: a ``GRPOConfig`` translated to a :class:`~loop_trainer.LOOPConfig`;
* :mod:`.environment`: TRL's prompt dataset, reward functions, tools and environment_factory as an Environment;
* :mod:`.tool_calls`: tool calls parsed and run as GRPOTrainer does (shared by the verifiers and OpenEnv adapters).
"""

from .environment import TRLAgentEnvironment

__all__ = ["TRLAgentEnvironment"]
