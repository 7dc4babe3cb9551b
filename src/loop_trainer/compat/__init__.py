"""Adapters from other ecosystems: TRL's GRPOTrainer route (:mod:`.trl`: the one-word switch, a
``GRPOConfig`` translated, TRL's tool calling), verifiers environments (:mod:`.verifiers`) and OpenEnv
environments (:mod:`.openenv`). Each becomes a LOOP :class:`~loop_trainer.envs.Environment`; the core
never imports these modules."""
