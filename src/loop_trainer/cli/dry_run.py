"""``loop-train --config RECIPE --dry-run``: check a recipe and plan its GPU memory, without a GPU.

Prints a one-line summary of the run, warnings about its launch (a server address that cannot be reached
from where the processes run), and the per-GPU memory plan of :mod:`loop_trainer.models.memory_plan` with
its verdict; exits 0 if it fits, 3 if it does not. A plan that does not fit names the settings that together
make it fit, re-planned from the recipe with them applied, or says that none the planner knows does.
``--dry_run_show_config true`` also prints every resolved setting first.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shlex
from typing import Any
from urllib.parse import urlsplit

from transformers import TrainingArguments
from trl import ModelConfig

from ..config import LOOPConfig, mapping_setting
from ..config.combinations import ConfigCombinationError, Generator, check_combinations
from ..config.loop_config import checkpointing_kwargs, checkpointing_kwargs_key
from ..envs import available_environments
from ..models.memory_plan import MemoryPlan, plan_memory
from ..models.model_shape import ModelShape, load_model_shape
from ..models.packaged import resolve_model_path
from ..models.tiny import is_tiny_spec, tiny_config
from .recipe import RecipeError, ScriptArguments, launch_deepspeed_config

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


@dataclasses.dataclass(frozen=True)
class DeepSpeedLaunch:
    """What the `accelerate launch` running this process set for DeepSpeed."""

    zero_stage: int
    offload_optimizer: bool  # optimizer state off the GPU (offload_optimizer_device cpu or nvme)
    offload_param: bool  # ZeRO-3's weight partitions off the GPU (offload_param_device)

    @property
    def offload_planned(self) -> bool:
        """Whether the plan keeps the optimizer state off the GPU: where the launch offloads it at ZeRO-2, the stage
        the plan models it for (at another stage a note says the plan counts it on the GPU)."""
        return self.offload_optimizer and self.zero_stage == 2


def deepspeed_launch() -> DeepSpeedLaunch | None:
    """The launch's DeepSpeed settings (None without DeepSpeed): from its DeepSpeed JSON where the accelerate config
    names one (``deepspeed_config_file``: accelerate then passes no stage or offload variables), else from the
    variables accelerate sets from the accelerate config's ``deepspeed_config``."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true"):
        return None
    settings = launch_deepspeed_config()
    if settings is not None:
        zero = settings.get("zero_optimization", {})

        def device(key: str) -> str:
            return str((zero.get(key) or {}).get("device", "none")).lower()

        stage, optimizer, param = zero.get("stage", 0), device("offload_optimizer"), device("offload_param")
    else:
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 3)
        optimizer = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none").lower()
        param = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none").lower()
    return DeepSpeedLaunch(int(stage), optimizer not in ("", "none"), param not in ("", "none"))


def planned_zero_stage(world: int, kl_reference_copy: bool, launch: DeepSpeedLaunch | None) -> int:
    """The ZeRO stage the plan assumes: the DeepSpeed ``launch``'s stage where there is one, else
    ZeRO-3 on several GPUs (the documented setup; ZeRO-2 where the KL reference is a frozen copy of the
    weights, which ZeRO-3 refuses) and none on one GPU (measured there, no DeepSpeed)."""
    if launch is not None:
        return launch.zero_stage
    return (2 if kl_reference_copy else 3) if world > 1 else 0


def keeps_kl_reference_copy(args: LOOPConfig, model_args: ModelConfig) -> bool:
    """Whether the run keeps a frozen copy of the weights as the KL reference (beta > 0, no adapter)."""
    return args.beta > 0 and not model_args.use_peft


def planned_world(script_args: ScriptArguments) -> int:
    return script_args.plan_gpus or int(os.environ.get("WORLD_SIZE", 8))


def plan_for(
    script_args: ScriptArguments, args: LOOPConfig, model_args: ModelConfig, suggest: bool = True
) -> tuple[MemoryPlan, int]:
    world = planned_world(script_args)
    adapter = {
        "r": model_args.lora_r,
        "alpha": model_args.lora_alpha,
        "target_modules": model_args.lora_target_modules or "all-linear",
        "dropout": model_args.lora_dropout,
    }
    lora = adapter if model_args.use_peft else None
    reference_copy = keeps_kl_reference_copy(args, model_args)
    deepspeed = deepspeed_launch()  # the launch's DeepSpeed stage and offload, read once
    # A vLLM server generates on GPUs of its own: only a colocated engine shares the trainer's.
    colocated = args.use_vllm and args.vllm_mode == "colocate"
    try:  # the combined-key checks on the launch being planned: GPUs, whatever machine runs the dry run
        launch = dataclasses.replace(args.launch(Generator.BUILT_IN, world), cuda=not args.use_cpu)
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
            zero_stage=planned_zero_stage(world, reference_copy, deepspeed),
            offload_optimizer=deepspeed is not None and deepspeed.offload_planned,
            lora=lora,
            bf16=model_args.dtype in (None, "auto", "bfloat16", "float16"),
            activation_checkpointing=bool(args.activation_checkpointing),
            checkpoint_every_n_layers=checkpointing_kwargs(args).get("every_n_layers", 1),
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
            kl_reference_copy=reference_copy,
            suggested_lora=adapter,
            _suggest=suggest,
        )
    except ValueError as error:
        raise RecipeError(in_recipe_keys(str(error))) from None
    plan.reasons = [in_recipe_keys(reason) for reason in plan.reasons]
    plan.notes = [in_recipe_keys(note) for note in plan.notes]
    if deepspeed is not None and deepspeed.offload_optimizer and not deepspeed.offload_planned:
        plan.notes.append(
            f"offload_optimizer_device at ZeRO-{deepspeed.zero_stage}: the plan counts the optimizer state on the GPU "
            "(an overestimate by the 'trainable state' row; it models the offload at ZeRO-2)"
        )
    if deepspeed is not None and deepspeed.offload_param:
        plan.notes.append(
            "the launch's offload_param_device keeps ZeRO-3's weight partitions off the GPU; the plan counts them "
            "on it (an overestimate by the 'model weights' row)"
        )
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
    if script_args.dry_run_show_config:
        print(effective_configuration(script_args, args, model_args) + "\n")
    print(summary(script_args, args, model_args, world))
    for warning in launch_warnings(script_args, args, world):
        print(f"warning: {warning}")
    launch = deepspeed_launch()
    stage = planned_zero_stage(world, keeps_kl_reference_copy(args, model_args), launch)
    deepspeed = f"ZeRO-{stage}" + (", optimizer state on the CPU" if launch and launch.offload_planned else "")
    print(
        f"\nMemory plan per GPU: {world} GPUs x {script_args.plan_gpu_memory_gib:g} GiB, "
        f"{deepspeed if stage else 'no DeepSpeed'} (estimates; see docs/recipes.md)"
    )
    if args.use_vllm and args.vllm_mode == "server":
        plan.notes.append("generation runs on the vLLM server's own GPUs (vllm_mode: server), not planned here")
    if args.max_staleness:
        plan.notes.append(overlap_note(args))
    print(plan.format(fix_line(plan, script_args, args, model_args)))
    return 0 if plan.fits else EXIT_DOES_NOT_FIT


def summary(script_args: ScriptArguments, args: LOOPConfig, model_args: ModelConfig, world: int) -> str:
    """What is planned, in one line, and how to see the rest of the configuration."""
    training = f"LoRA r {model_args.lora_r}" if model_args.use_peft else "full fine-tuning"
    if not args.use_vllm:
        generation = "the transformers backend"
    elif args.vllm_mode == "server":
        generation = f"a vLLM server at {server_url(args)}"
    else:
        generation = f"vLLM colocated ({args.vllm_gpu_memory_utilization:g} of each GPU)"
    hint = "" if script_args.dry_run_show_config else "\n(every resolved setting: add --dry_run_show_config true)"
    return (
        f"Dry run: {model_args.model_name_or_path} ({training}) on {script_args.environment}, {world} training "
        f"process{'es' if world > 1 else ''}, generation by {generation}{hint}"
    )


# --- launch warnings: server addresses the processes cannot reach ----------------------------------------------
DEFAULT_GPUS_PER_MACHINE = 8


def server_url(args: LOOPConfig) -> str:
    """The vLLM server's address as the trainer builds it (training/settings.py)."""
    return args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"


def is_this_machine(url: str) -> bool:
    """Whether ``url`` (or a bare host) names the machine it is used on: localhost, 127.x, 0.0.0.0 or ::1."""
    host = urlsplit(url if "//" in url else f"//{url}").hostname or ""
    return host in ("localhost", "0.0.0.0", "::1") or host.startswith("127.")


def gpus_per_machine(script_args: ScriptArguments) -> int:
    """``plan_gpus_per_machine``, else the launcher's ``LOCAL_WORLD_SIZE``, else a node of 8 GPUs (the recipes')."""
    return script_args.plan_gpus_per_machine or int(os.environ.get("LOCAL_WORLD_SIZE") or DEFAULT_GPUS_PER_MACHINE)


def launch_warnings(script_args: ScriptArguments, args: LOOPConfig, world: int) -> list[str]:
    """One line for each server address that points at the machine it is read on, where that cannot be the server:
    the training processes span several machines (each would look on itself), or, for a vLLM server, they take
    every GPU of their machine (the server needs GPUs of its own, so it runs on another)."""
    per_machine = gpus_per_machine(script_args)
    machines = -(-world // per_machine)
    spread = (
        f"the {world} training processes span {machines} machines of {per_machine} GPUs (plan_gpus, "
        "plan_gpus_per_machine), and on each this address is the machine itself"
    )
    warnings = []
    if args.use_vllm and args.vllm_mode == "server" and is_this_machine(server_url(args)):
        key = "vllm_server_base_url" if args.vllm_server_base_url else "vllm_server_host"
        where = f"{key} {args.vllm_server_base_url or args.vllm_server_host} points at the training machine"
        fix = f"set vllm_server_base_url to the server's address, e.g. http://<server-host>:{args.vllm_server_port}"
        if machines > 1:
            warnings.append(f"{where}, but {spread}: {fix}")
        elif world >= per_machine:
            warnings.append(
                f"{where}, but the {world} training processes take all {per_machine} of its GPUs (plan_gpus, "
                f"plan_gpus_per_machine) and the vLLM server needs GPUs of its own, on another machine: {fix}"
            )
    if machines > 1:
        for key, value in mapping_setting(script_args.environment_kwargs, "environment_kwargs").items():
            urls = [value] if isinstance(value, str) else value if isinstance(value, list) else []
            local = [url for url in urls if isinstance(url, str) and "://" in url and is_this_machine(url)]
            if local:
                warnings.append(
                    f"environment_kwargs {key} names {local[0]}, but {spread}: give addresses every machine "
                    "reaches, or make sure each runs its own"
                )
    return warnings


# --- the fix, in recipe keys, re-planned from the recipe --------------------------------------------------------
def recipe_settings(changes: dict[str, Any], args: LOOPConfig) -> list[tuple[str, Any]]:
    """The memory plan's changes (its parameters) as recipe keys and values."""
    settings: list[tuple[str, Any]] = []
    for name, value in changes.items():
        if name == "vllm_server":
            settings += [("use_vllm", True)] if not args.use_vllm else []
            settings.append(("vllm_mode", "server"))
        elif name == "use_vllm":
            if value and "vllm_server" not in changes:  # a colocated engine, from the transformers backend
                settings += [("use_vllm", True), ("vllm_mode", "colocate")]
        elif name == "lora":
            settings.append(("use_peft", True))
        elif name == "checkpoint_every_n_layers":  # a key inside the checkpointing kwargs
            kwargs = {**checkpointing_kwargs(args), "every_n_layers": value}
            settings.append((checkpointing_kwargs_key(args), kwargs))
        else:
            settings.append((RECIPE_KEY_OF_PLAN_PARAMETER.get(name, name), value))
    return [setting for index, setting in enumerate(settings) if setting not in settings[:index]]  # each once


def with_settings(
    settings: list[tuple[str, Any]], script_args: ScriptArguments, args: LOOPConfig, model_args: ModelConfig
) -> tuple[ScriptArguments, LOOPConfig, ModelConfig]:
    """Copies of the three configurations with ``settings`` applied, each key on the one that owns it."""
    copies = (copy.copy(script_args), copy.copy(args), copy.copy(model_args))
    for key, value in settings:
        owner = next(config for config in copies if key in {f.name for f in dataclasses.fields(config)})
        setattr(owner, key, value)
    return copies


def fix_line(plan: MemoryPlan, script_args: ScriptArguments, args: LOOPConfig, model_args: ModelConfig) -> str | None:
    """The plan's fix in recipe keys, as the recipe re-planned with them applied says (or None if it fits)."""
    if plan.fix is None:
        return None
    settings = recipe_settings(plan.fix.changes, args)
    listed = ", ".join(f"{key}: {shown(value)}" for key, value in settings)
    flags = " ".join(f"--{key} {shlex.quote(shown(value))}" for key, value in settings)
    try:
        replanned, _ = plan_for(*with_settings(settings, script_args, args, model_args), suggest=False)
    except RecipeError as error:  # a combination the recipe's other keys refuse
        return f"the planner's fix, {listed}, is refused with the recipe's other keys ({error}); no verified fix"
    if replanned.fits != plan.fix.plan.fits:
        return f"the planner's fix, {listed}, did not re-plan the same from the recipe; no verified fix"
    peak, budget = replanned.peak_gib, replanned.budget_gib
    if replanned.fits:
        return (
            f"fits with these together: {listed} (the recipe re-planned with them: peak {peak:.1f} GiB <= budget "
            f"{budget:.1f} GiB)\n    as flags: {flags}"
        )
    return (
        f"no combination of the settings the planner can change fits; the nearest, {listed}, peaks at "
        f"{peak:.1f} GiB > budget {budget:.1f} GiB"
    )


def shown(value: Any) -> str:
    """A value as a recipe or flag spells it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):  # a mapping-valued key: JSON, as a flag takes it and a recipe reads it
        return json.dumps(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


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
    if args.collection_process:
        note += "; collection_process: each training process collects the queued batches in a child process"
    if args.partial_rollouts:
        note += (
            "; partial_rollouts: the groups running at each cut continue into the next batch, every turn sampled "
            "by the newest policy, and a saving iteration first runs them to their end (carried_episodes.pt)"
        )
    return note
