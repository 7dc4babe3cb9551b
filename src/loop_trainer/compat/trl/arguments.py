"""GRPOTrainer's agent-training arguments on LOOPTrainer: which environment a call describes.

``LOOPTrainer`` takes either a LOOP :class:`~loop_trainer.envs.Environment` or what a TRL 1.16
multi-turn script hands ``GRPOTrainer``: ``reward_funcs``, ``train_dataset`` / ``eval_dataset``,
``tools`` and ``environment_factory``. The second route builds a
:class:`~loop_trainer.compat.trl.environment.TRLAgentEnvironment` from them (TRL's semantics, run through
LOOP's concurrent rollout engine); the config keys only that route reads (``reward_weights``,
``max_tool_calling_iterations``) are refused on the first, so neither route ignores a setting. A
``GRPOConfig`` given as ``args`` is translated (:mod:`.grpo_config`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig

from ...config import LOOPConfig
from ...envs.base import Environment
from .environment import TrainerStateForRewards, TRLAgentEnvironment
from .grpo_config import loop_config_from_grpo

logger = logging.getLogger(__name__)

# LOOPConfig keys read only when the trainer is given TRL's agent arguments -> what they do.
TRL_ROUTE_KEYS = {
    "reward_weights": "weights of reward_funcs in the episode reward",
    "max_tool_calling_iterations": "rounds of tool calls per episode",
    "malformed_tool_call": "what a tool call that does not parse does",
}


def loop_config_for(args: Any, train_dataset: Dataset | None) -> LOOPConfig:
    """``args`` as a LOOPConfig: itself, or a GRPOConfig translated (the one-word switch from
    GRPOTrainer), what the translation set and replaced logged."""
    if isinstance(args, GRPOConfig) and not isinstance(args, LOOPConfig):
        args, translated, replaced = loop_config_from_grpo(args, None if train_dataset is None else len(train_dataset))
        logger.warning(
            "GRPOConfig as LOOPConfig: %s. GRPO defaults LOOP replaces: %s",
            ", ".join(f"{k}={v!r}" for k, v in translated.items()),
            "; ".join(replaced) or "none",
        )
    if not isinstance(args, LOOPConfig):
        raise TypeError(f"args must be a LOOPConfig (or a GRPOConfig, translated), got {type(args).__name__}")
    return args


def _is_reward_funcs(value: Any) -> bool:
    return callable(value) or (isinstance(value, (list, tuple)) and all(callable(f) for f in value) and bool(value))


def environment_for(
    env: Any,
    args: LOOPConfig,
    *,
    reward_funcs: Any = None,
    train_dataset: Dataset | None = None,
    eval_dataset: Dataset | None = None,
    tools: Sequence[Callable] | None = None,
    environment_factory: Callable | Mapping[str, Callable] | None = None,
    reward_processing_classes: Any = None,
    rollout_func: Any = None,
) -> tuple[Environment, bool, list[TrainerCallback]]:
    """The environment a ``LOOPTrainer(...)`` call trains on, whether it came from TRL's arguments, and the
    callbacks that route needs (the trainer's state for TRL's reward functions).

    ``env`` is the trainer's second positional argument: an Environment, or (GRPOTrainer's order)
    the reward functions."""
    if env is not None and not isinstance(env, Environment):
        if not _is_reward_funcs(env):
            raise TypeError(
                f"LOOPTrainer's second argument is an Environment or, as for GRPOTrainer, reward_funcs "
                f"(callables); got {type(env).__name__}"
            )
        if reward_funcs is not None:
            raise TypeError("LOOPTrainer got reward_funcs twice (as its second argument and by keyword)")
        env, reward_funcs = None, env
    if rollout_func is not None:
        raise ValueError(
            "LOOPTrainer runs episodes itself and takes no rollout_func: give the multi-turn logic as an "
            "environment_factory (or a loop_trainer Environment)"
        )
    if reward_processing_classes is not None:
        raise ValueError(
            "LOOPTrainer takes reward functions only (callables), so reward_processing_classes has "
            "nothing to apply to: wrap a reward model in a function"
        )
    trl_arguments = {
        "reward_funcs": reward_funcs,
        "train_dataset": train_dataset,
        "eval_dataset": eval_dataset,
        "tools": tools,
        "environment_factory": environment_factory,
    }
    given = [name for name, value in trl_arguments.items() if value is not None]
    if env is not None:
        if given:
            raise ValueError(
                f"LOOPTrainer got an Environment and {', '.join(given)}: give either a loop_trainer "
                "Environment, or GRPOTrainer's agent arguments (train_dataset, reward_funcs, tools, "
                "environment_factory), not both"
            )
        defaults = {spec.name: spec.default for spec in dataclasses.fields(LOOPConfig)}
        for key, meaning in TRL_ROUTE_KEYS.items():
            if getattr(args, key) != defaults[key]:
                raise ValueError(
                    f"LOOPConfig: {key}={getattr(args, key)!r} is used only with GRPOTrainer's agent "
                    f"arguments ({meaning}); this run's rewards and turns come from the environment "
                    f"{env.name!r} (its episodes; max_turns)"
                )
        return env, False, []
    if not given:
        raise TypeError(
            "LOOPTrainer needs an environment: a loop_trainer Environment as its second argument, or "
            "GRPOTrainer's agent arguments (train_dataset with a 'prompt' column, reward_funcs, tools, "
            "environment_factory)"
        )
    if train_dataset is None:
        if environment_factory is None or isinstance(environment_factory, Mapping):
            raise ValueError(
                "train_dataset is required unless a single environment_factory builds every prompt "
                "(reset() returns it), as in GRPOTrainer"
            )
        # TRL's stand-in: empty user messages that reset()'s returned text fills in, one per task
        train_dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * args.tasks_per_iteration})
    if eval_dataset is not None and not (args.eval_split and args.eval_every):
        logger.warning(
            "eval_dataset is not evaluated during training: set eval_split='eval' and eval_every (or, "
            "in a GRPOConfig, eval_strategy='steps'); trainer.evaluate_policy('eval') runs it"
        )
    agent = TRLAgentEnvironment(
        train_dataset,
        reward_funcs or (),
        tools=tools or (),
        environment_factory=environment_factory,
        reward_weights=args.reward_weights,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        answer_malformed_calls=args.malformed_tool_call == "answer",
        eval_dataset=eval_dataset,
    )
    return agent, True, [TrainerStateForRewards(agent)]
