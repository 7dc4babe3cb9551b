"""``loop-train --config RECIPE --dry-run``: check a recipe and plan its GPU memory, without a GPU.

Prints the effective configuration (every LOOP key, the model and environment settings) and the
per-GPU memory plan of :mod:`loop_trainer.models.memory_plan`, and exits 0 if it fits, 3 if it does not
(with the reasons and the knobs to turn).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from transformers import TrainingArguments
from trl import ModelConfig

from ..config import LOOPConfig
from ..config.combinations import ConfigCombinationError, Generator, check_combinations
from ..envs import available_environments
from ..models.memory_plan import MemoryPlan, plan_memory
from ..models.model_shape import ModelShape, load_model_shape
from ..models.packaged import resolve_model_path
from ..models.tiny import is_tiny_spec, tiny_config
from .recipe import RecipeError, ScriptArguments

EXIT_DOES_NOT_FIT = 3
MODEL_KEYS = (
    "model_name_or_path",
    "dtype",
    "attn_implementation",
    "use_peft",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
)
# plan_memory's advice names its own parameters; a recipe sets them through these keys (see plan_for).
RECIPE_KEY_OF_PLAN_PARAMETER = {
    "vllm_sleep_mode": "vllm_enable_sleep_mode",
    "generation_batch": "generation_batch_limit",
    "world_size": "plan_gpus",
    "lora": "use_peft: true",
}
GENERATION_KEYS = (
    "use_vllm",
    "vllm_mode",
    "vllm_gpu_memory_utilization",
    "vllm_tensor_parallel_size",
    "vllm_enable_sleep_mode",
    "generation_batch_limit",
)


def model_shape(model_args: ModelConfig) -> ModelShape:
    name = model_args.model_name_or_path
    if not name:
        raise RecipeError("model_name_or_path is not set")
    if is_tiny_spec(name):
        return ModelShape.from_config(tiny_config(vocab_size=1024).to_dict(), name)
    try:
        return load_model_shape(resolve_model_path(name))
    except ValueError as error:  # PackagedModelError included
        raise RecipeError(str(error)) from None


def planned_zero_stage(world: int) -> int:
    """The ZeRO stage the plan assumes: accelerate's DeepSpeed stage where a launch sets one, else
    ZeRO-3 on several GPUs (the documented setup) and none on one GPU (measured there, no DeepSpeed)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        return int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 3))
    return 3 if world > 1 else 0


def plan_for(script_args: ScriptArguments, args: LOOPConfig, model_args: ModelConfig) -> tuple[MemoryPlan, int]:
    world = script_args.plan_gpus or int(os.environ.get("WORLD_SIZE", 8))
    lora = None
    if model_args.use_peft:
        lora = {
            "r": model_args.lora_r,
            "alpha": model_args.lora_alpha,
            "target_modules": model_args.lora_target_modules or "all-linear",
            "dropout": model_args.lora_dropout,
        }
    # A vLLM server generates on GPUs of its own: only a colocated engine shares the trainer's.
    colocated = args.use_vllm and args.vllm_mode == "colocate"
    try:  # the combined-key checks on the launch being planned
        launch = args.launch(Generator.BUILT_IN, world)
        check_combinations(args, dataclasses.replace(launch, lora=bool(model_args.use_peft)))
    except ConfigCombinationError as error:
        raise RecipeError(str(error)) from None
    # Episodes a process runs at once bound the transformers backend's generation batch.
    episodes = -(-args.tasks_per_iteration * args.rollouts_per_task // world)
    assert args.max_training_tokens is not None  # LOOPConfig.__post_init__ sets it
    try:
        plan = plan_memory(
            model_shape(model_args),
            world_size=world,
            gpu_memory_gib=script_args.plan_gpu_memory_gib,
            zero_stage=planned_zero_stage(world),
            lora=lora,
            bf16=model_args.dtype in (None, "auto", "bfloat16", "float16"),
            activation_checkpointing=bool(args.activation_checkpointing),
            activation_offloading=args.activation_offloading,
            max_training_tokens=args.max_training_tokens,
            per_device_train_batch_size=args.per_device_train_batch_size,
            use_vllm=colocated,
            vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            vllm_tensor_parallel_size=args.vllm_tensor_parallel_size,
            vllm_sleep_mode=args.vllm_enable_sleep_mode,
            generation_batch=min(args.generation_batch_limit, args.max_concurrent_episodes, episodes),
            max_trajectory_tokens=args.max_trajectory_tokens,
            vllm_server=args.use_vllm and args.vllm_mode == "server",
        )
    except ValueError as error:
        raise RecipeError(in_recipe_keys(str(error))) from None
    plan.reasons = [in_recipe_keys(reason) for reason in plan.reasons]
    plan.notes = [in_recipe_keys(note) for note in plan.notes]
    return plan, world


def in_recipe_keys(advice: str) -> str:
    """``advice`` from the memory plan with each plan parameter named by the recipe key that sets it."""
    pattern = r"\b(" + "|".join(RECIPE_KEY_OF_PLAN_PARAMETER) + r")\b"
    return re.sub(pattern, lambda match: RECIPE_KEY_OF_PLAN_PARAMETER[match.group(1)], advice)


def effective_configuration(script_args: ScriptArguments, args: LOOPConfig, model_args: ModelConfig) -> str:
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    loop_keys = [f.name for f in dataclasses.fields(LOOPConfig) if f.init and f.name not in inherited]
    training_keys = (
        "learning_rate",
        "lr_scheduler_type",
        "weight_decay",
        "max_grad_norm",
        "epsilon",
        "temperature",
        "per_device_train_batch_size",
        "activation_checkpointing",
        "bf16",
        "seed",
        "output_dir",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "report_to",
        "push_to_hub",
        "hub_model_id",
    )
    sections: list[tuple[str, list[tuple[str, Any]]]] = [
        ("environment", [(k, getattr(script_args, k)) for k in ("environment", "environment_kwargs")]),
        ("model", [(k, getattr(model_args, k)) for k in MODEL_KEYS]),
        ("LOOP", [(k, getattr(args, k)) for k in loop_keys if k not in GENERATION_KEYS]),
        ("generation", [(k, getattr(args, k)) for k in GENERATION_KEYS]),
        ("training", [(k, getattr(args, k)) for k in training_keys if k not in loop_keys]),
    ]
    lines = []
    for title, items in sections:
        lines.append(f"[{title}]")
        lines += [f"  {key}: {getattr(value, 'value', value)}" for key, value in items]
    return "\n".join(lines)


def dry_run(script_args: ScriptArguments, args: LOOPConfig, model_args: ModelConfig) -> int:
    name = script_args.environment
    if ":" not in name and name not in available_environments():
        raise RecipeError(f"unknown environment {name!r}; available: {', '.join(available_environments())}")
    plan, world = plan_for(script_args, args, model_args)
    print(effective_configuration(script_args, args, model_args))
    stage = planned_zero_stage(world)
    print(
        f"\nMemory plan per GPU: {world} GPUs x {script_args.plan_gpu_memory_gib:g} GiB, "
        f"{f'ZeRO-{stage}' if stage else 'no DeepSpeed'} (estimates; see docs/recipes.md)"
    )
    if args.use_vllm and args.vllm_mode == "server":
        plan.notes.append("generation runs on the vLLM server's own GPUs (vllm_mode: server), not planned here")
    if args.max_staleness:
        plan.notes.append(overlap_note(args))
    print(plan.format())
    return 0 if plan.fits else EXIT_DOES_NOT_FIT


def overlap_note(args: LOOPConfig) -> str:
    """What ``max_staleness`` asks of the launch (docs/overlap.md)."""
    k = args.max_staleness
    batches = "the batch" if k == 1 else f"the {k} batches"
    note = (
        f"max_staleness {k}: iteration j's rollouts are sampled by policy j-{k} while the update runs here; "
        f"every checkpoint also holds {batches} in flight (next_rollouts.pt)"
    )
    if k > 1 and args.use_vllm and args.vllm_mode == "server":
        note += f"; the server holds up to {k + 1} LoRA adapters at once: start it with --max-loras {k + 1}"
    if args.partial_rollouts:
        note += (
            "; partial_rollouts: the groups running at each cut continue into the next batch, every turn sampled "
            "by the newest policy, and a saving iteration first runs them to their end (carried_episodes.pt)"
        )
    return note
