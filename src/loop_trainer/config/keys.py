"""Which ``TrainingArguments`` fields LOOP honours, and LOOP's key for settings of other trainers.

``LOOPConfig`` keeps exactly the ``TrainingArguments`` fields in :data:`HONOURED_TRAINING_ARGUMENTS` (read
by LOOP's own code or by the parts of transformers' ``Trainer`` it keeps: optimizer and scheduler,
accelerate/DDP/DeepSpeed set-up, callbacks and trackers, checkpoint saving and rotation, the Hub). Every
other ``TrainingArguments`` field, including any a future transformers adds, stays an attribute with its
default (the ``Trainer`` reads them) but is no constructor argument, recipe key or flag: set, it stops
with one line (:func:`unknown_key_message`) naming LOOP's equivalent from :data:`LOOP_EQUIVALENTS`.
:func:`only_the_training_arguments_loop_honours` and :func:`refusing_unknown_keys` make ``LOOPConfig`` so.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from transformers import TrainingArguments

HONOURED_TRAINING_ARGUMENTS = frozenset(
    {
        # run identity, seeding, resuming
        "output_dir",
        "seed",
        "full_determinism",
        "resume_from_checkpoint",
        "restore_callback_states_from_checkpoint",
        # optimizer and schedule
        "learning_rate",
        "lr_scheduler_type",
        "lr_scheduler_kwargs",
        "warmup_steps",
        "weight_decay",
        "max_grad_norm",
        "optim",
        "optim_args",
        "optim_target_modules",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        # the micro-batch and activation checkpointing
        "per_device_train_batch_size",
        "activation_checkpointing",
        "activation_checkpointing_kwargs",
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
        # precision and devices
        "bf16",
        "fp16",
        "tf32",
        "use_cpu",
        "debug",
        # distribution (accelerate, DDP, DeepSpeed)
        "accelerator_config",
        "deepspeed",
        "local_rank",
        "ddp_backend",
        "ddp_timeout",
        "ddp_find_unused_parameters",
        "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers",
        "ddp_static_graph",
        # logging, progress, trackers (in iterations)
        "logging_strategy",
        "logging_steps",
        "logging_first_step",
        "log_level",
        "log_level_replica",
        "log_on_each_node",
        "disable_tqdm",
        "report_to",
        "run_name",
        "project",
        "trackio_space_id",
        "trackio_bucket_id",
        "trackio_static_space_id",
        # checkpoints and the Hub
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "save_on_each_node",
        "push_to_hub",
        "hub_model_id",
        "hub_strategy",
        "hub_token",
        "hub_private_repo",
        "hub_always_push",
        "hub_revision",
    }
)

# Settings of TrainingArguments or TRL's GRPOConfig that LOOPConfig does not have -> LOOP's key for
# the same intent (None: LOOP has nothing like it; its objective is the paper's, see docs/loop_trainer.md).
LOOP_EQUIVALENTS: dict[str, str | None] = {
    # the length of the run and the batch
    "max_steps": "iterations",
    "num_train_epochs": "iterations",
    "num_iterations": "ppo_epochs",
    "gradient_accumulation_steps": "minibatch_size",
    "steps_per_generation": "minibatch_size",
    "auto_find_batch_size": "per_device_train_batch_size",
    "group_by_length": "train_sampling_strategy",
    "num_generations": "rollouts_per_task",
    "generation_batch_size": "tasks_per_iteration",
    # the loss and the advantages
    "delta": "epsilon",
    "importance_sampling_level": "ratio_level",
    "scale_rewards": "std_normalize_advantages",
    "mask_truncated_completions": "max_training_tokens",
    "loss_type": None,
    "label_smoothing_factor": None,
    "entropy_coef": None,
    "top_entropy_quantile": None,
    "sync_ref_model": "beta",
    "ref_model_sync_steps": "beta",
    "ref_model_mixup_alpha": "beta",
    # generation
    "max_completion_length": "max_completion_tokens",
    "max_prompt_length": "max_trajectory_tokens",
    "top_p": "temperature",
    "top_k": "temperature",
    "min_p": "temperature",
    "repetition_penalty": "temperature",
    "generation_kwargs": "temperature",
    "use_transformers_paged": "generation_batch_limit",
    "use_transformers_continuous_batching": "generation_batch_limit",
    "vllm_group_port": "vllm_sync_dir",
    "vllm_importance_sampling_correction": "sampler_importance_cap",
    "vllm_importance_sampling_cap": "sampler_importance_cap",
    "vllm_importance_sampling_clip_max": "sampler_importance_cap",
    "vllm_importance_sampling_clip_min": "sampler_importance_floor",
    "vllm_importance_sampling_mode": "sampler_correction",
    # evaluation
    "eval_strategy": "eval_every",
    "eval_steps": "eval_every",
    "eval_delay": "eval_every",
    "eval_on_start": "eval_every",
    "do_eval": "eval_every",
    "num_generations_eval": "eval_rollouts_per_task",
    "per_device_eval_batch_size": "max_concurrent_episodes",
    # data, distribution, checkpoints, logging of completions
    "data_seed": "seed",
    "shuffle_dataset": "seed",
    "fsdp": "deepspeed",
    "fsdp_config": "deepspeed",
    "parallelism_config": "deepspeed",
    "save_only_model": "save_strategy",
    "enable_jit_checkpoint": "save_steps",
    "log_completions": "save_rollouts",
    "num_completions_to_print": "viewer_rollouts_per_iteration",
}


def unknown_key_message(key: str, owner: str = "LOOPConfig") -> str:
    """Why ``key`` (a setting of another trainer, or a typo) is not a LOOP setting, with LOOP's equivalent."""
    if key not in LOOP_EQUIVALENTS:
        return f"{owner} has no setting {key!r} (LOOP does not use it; see docs/recipes.md for every key)"
    equivalent = LOOP_EQUIVALENTS[key]
    instead = (
        f"; LOOP's equivalent is {equivalent}"
        if equivalent
        else " (LOOP's objective is the paper's: see docs/loop_trainer.md)"
    )
    return f"{owner} has no setting {key!r}{instead}"


def only_the_training_arguments_loop_honours(cls: type) -> type:
    """Turn every ``TrainingArguments`` field LOOP does not honour into a non-init field with its default:
    the Trainer still reads it, but no constructor, recipe or flag can set it (nor does ``--help`` list it)."""
    annotations = cls.__dict__["__annotations__"]  # the class's own (the body declares fields)
    for spec in dataclasses.fields(TrainingArguments):
        if spec.name in HONOURED_TRAINING_ARGUMENTS or spec.name in annotations or not spec.init:
            continue
        annotations[spec.name] = spec.type
        setattr(
            cls,
            spec.name,
            dataclasses.field(
                default=spec.default,
                default_factory=spec.default_factory,
                init=False,
                repr=False,
                metadata=spec.metadata,
            ),
        )
    return cls


def refusing_unknown_keys(cls: type, init: Callable[..., None]) -> Callable[..., None]:
    """``init`` (``cls.__init__``), refusing a keyword that is no init field of ``cls`` with one line naming
    LOOP's equivalent (:func:`unknown_key_message`); a subclass's instances (which may add keys) pass through."""
    init_keys = frozenset(f.name for f in dataclasses.fields(cls) if f.init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in init_keys and type(self) is cls:
                raise TypeError(unknown_key_message(key))
        init(self, *args, **kwargs)

    return __init__
