"""Resuming a run with the settings it was started with, or with changed ones applied and recorded.

Every checkpoint's ``loop_state.json`` records the settings an exact resume depends on
(:func:`resume_settings`). On resume they are compared with the run's (:func:`compare_settings`): a
change is refused with one line naming it, unless ``resume_with_changed_settings``, in which case it
is applied where the checkpoint's state would restore the old value (:func:`apply_setting_changes`:
the optimizer's hyperparameters, the scheduler's base rates, the task sampler) and recorded in the
log, ``loop_state.json``, ``recipe.yaml`` and the model card (:func:`record_setting_changes`). Never
recorded but ignored.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from ..config.resume_policy import FIXED_KEYS
from .checkpoints import (
    CheckpointError,
    check_fresh_output_dir,
    check_matches,
    clear_previous_run,
    read_loop_state,
    resolve,
)
from .repartition import repartitions
from .sampler import BalancedTaskSampler, TaskSampler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartSettings:
    """What deciding how a run starts needs: where it writes, and what a fresh run or a resume may do."""

    output_dir: str
    overwrite_output_dir: bool = False
    overwrite_interrupted_run: bool = False
    resume_with_changed_settings: bool = False
    should_save: bool = True
    """False on the processes that write nothing (all but the main one, unless save_on_each_node)."""


@dataclass(frozen=True)
class OptimizerHyperparameters:
    """This run's optimizer and schedule settings, written into the restored state on a permitted change."""

    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float


# Recorded besides LOOPConfig's keys (config/resume_policy.py classifies those): the environment (loop-train's
# ScriptArguments, handed to the trainer as LOOPTrainer.run_settings), the size of the training split, the model,
# the adapter, and the transformers sampler's fast parts as resolved (their keys unset are decided by the device).
RUN_SETTINGS = (
    "environment",
    "environment_kwargs",
    "num_train_tasks",
    "model",
    "adapter",
    "sampling_parts",
    "optimizer_state_layout",
    "tiny_base",
)
OPTIMIZER_STATE_LAYOUT = "optimizer_state_layout"
"""The run setting of how the checkpoint holds the optimizer state (``distribution.optimizer_state_layout``): its
ZeRO stage, or none, never changes on resume, since no launch of another can load it; the process count under the
same stage does, through DeepSpeed's universal checkpoint (:mod:`.repartition`)."""
TINY_BASE = "tiny_base"
"""The run setting of what a tiny LoRA run's base weights are built from (``model_loading.tiny_lora_base``): never
changeable on resume, since its checkpoints hold only the adapter, trained on that base."""


_TINY_WORLD = ("environment", "environment_kwargs", "num_train_tasks")
"""The run settings a tiny model's base is built from besides :data:`TINY_BASE`: its world (the warm-up replays its
training tasks; a Python-API run records no ``environment_kwargs``, but the size of the split)."""


def jsonable(value: Any) -> Any:
    """``value`` as it reads back from JSON (enums by value, tuples as lists), for comparison."""
    return json.loads(json.dumps(getattr(value, "value", value), default=lambda v: getattr(v, "value", str(v))))


def compare_settings(
    checkpoint: str | os.PathLike[str],
    current: dict[str, Any],
    allow_changes: bool,
    state: Mapping[str, Any] | None = None,
) -> list[tuple[str, Any, Any]]:
    """The settings that differ between ``checkpoint``'s record and ``current``, as (key, old, new).
    Raises :class:`CheckpointError` naming every change unless ``allow_changes``, and for a change no
    resume can apply (``fixed`` in :mod:`~loop_trainer.config.resume_policy`, the optimizer state's layout but its
    process count under one ZeRO stage, a tiny LoRA run's base: :data:`TINY_BASE`) even then. A checkpoint
    written before settings were recorded is resumed with a warning (its weights, optimizer and sampler
    state are still exact; only the comparison is impossible). ``state``: the checkpoint's ``loop_state.json``
    where the caller has read it already."""
    if state is None:
        state = read_loop_state(checkpoint)
    recorded = state.get("settings")
    if recorded is None:
        logger.warning(
            "resume_from_checkpoint: %s records no settings (written by an older loop_trainer), so this "
            "run's settings cannot be checked against it; resuming with this run's settings",
            checkpoint,
        )
        return []
    current = {key: jsonable(value) for key, value in current.items()}
    changed = [
        (key, recorded[key], current[key]) for key in current if key in recorded and recorded[key] != current[key]
    ]
    if not changed:
        return []
    layout = next(((old, new) for key, old, new in changed if key == OPTIMIZER_STATE_LAYOUT), None)
    if layout is not None and repartitions(*layout):
        # the same ZeRO stage on another number of processes: DeepSpeed repartitions the state as it loads it
        # (.repartition), which is the launch's to choose, like the process count of a run without DeepSpeed
        changed = [change for change in changed if change[0] != OPTIMIZER_STATE_LAYOUT]
        if not changed:
            return []
    elif layout is not None:
        written, launched = layout
        raise CheckpointError(
            f"resume_from_checkpoint: {checkpoint}'s optimizer state is {_describe_layout(written)} and this launch's "
            f"would be {_describe_layout(launched)}, which cannot load it: resume it under a launch like the one that "
            f"wrote it ({_launch_advice(written)}), or {_new_run_advice(checkpoint)}"
        )
    base = next(((old, new) for key, old, new in changed if key == TINY_BASE), None)
    if base is not None and base[0] is not None and base[1] is not None:  # else one side records no tiny LoRA base
        built, building = base
        differ = [
            f"{key} {_show(built[key])} -> {_show(building[key])}"
            for key in sorted(built.keys() & building.keys())
            if built[key] != building[key]
        ]
        if built.keys() != building.keys():  # the episode settings are recorded where a greedy probe ends the warm-up
            probed = "would no longer" if len(built) > len(building) else "would now"
            differ.append(f"a greedy probe {probed} end the warm-up")
        raise CheckpointError(
            f"resume_from_checkpoint: {checkpoint} holds a LoRA adapter trained on a tiny model's base that this "
            f"launch would build otherwise ({', '.join(differ)}); the adapter needs its own base: resume with the "
            "checkpoint's values, or start a fresh run (another output_dir, or overwrite_output_dir: true)"
        )
    world = [f"{key} {_show(old)} -> {_show(new)}" for key, old, new in changed if key in _TINY_WORLD]
    # The base is built from the environment too; where the launch builds none, the model's change says why not.
    if world and isinstance(recorded.get(TINY_BASE), dict) and isinstance(current.get(TINY_BASE), dict):
        raise CheckpointError(
            f"resume_from_checkpoint: {checkpoint} holds a LoRA adapter trained on a tiny model's base, which is built "
            f"from the run's environment (its demonstrations), and this launch would build it from another "
            f"({', '.join(world)}); the adapter needs its own base: resume with the checkpoint's values, or start a "
            "fresh run (another output_dir, or overwrite_output_dir: true)"
        )
    listed = ", ".join(f"{key} {_show(old)} -> {_show(new)}" for key, old, new in changed)
    fixed = [key for key, _, _ in changed if key in FIXED_KEYS]
    if fixed:
        raise CheckpointError(
            f"resume_from_checkpoint: {', '.join(fixed)} cannot change on resume (the optimizer state "
            f"in {checkpoint} belongs to the old optimizer); changed: {listed}"
        )
    if not allow_changes:
        raise CheckpointError(
            f"resume_from_checkpoint: settings differ from {checkpoint}'s ({listed}); an exact resume needs the "
            "checkpoint's settings: drop the changes, or pass --resume_with_changed_settings true to apply them "
            f"from iteration {int(state.get('iteration', 0)) + 1} on"
        )
    return changed


def _describe_layout(layout: Mapping[str, int] | None) -> str:
    if layout is None:
        return "whole (no DeepSpeed)"
    stage = layout["deepspeed_zero_stage"]
    if not stage:
        return "DeepSpeed's, without ZeRO"
    processes = layout["processes"]
    return f"DeepSpeed ZeRO-{stage}'s, partitioned over {processes} process{'es' if processes != 1 else ''}"


def _launch_advice(layout: Mapping[str, int] | None) -> str:
    if layout is None:
        return "without DeepSpeed, on any number of processes"
    stage = layout["deepspeed_zero_stage"]
    config = f"a DeepSpeed config of zero_stage {stage} (zero_optimization.stage in a DeepSpeed JSON)"
    if not stage:
        return f"accelerate launch with {config}"
    return f"accelerate launch with {config}, on any number of processes"


def _new_run_advice(checkpoint: str | os.PathLike[str]) -> str:
    """How to go on from ``checkpoint`` on another launch: a new run from its weights, which is not the same run
    (a fresh optimizer and schedule, the tasks from the start). Under ZeRO-3 the checkpoint holds the whole weights
    only where the launch gathered them on save (stage3_gather_16bit_weights_on_model_save); else DeepSpeed's
    zero_to_fp32.py, which it writes beside them, rebuilds them."""
    directory = Path(checkpoint)
    weights = [*directory.glob("*.safetensors"), *directory.glob("pytorch_model*.bin")]
    start = "start a new run from its weights (not an exact continuation: a fresh optimizer and schedule)"
    if weights:
        return f"{start}: --model_name_or_path {checkpoint} and another output_dir"
    return f"{start}: write them with the zero_to_fp32.py in {checkpoint} and pass that folder as --model_name_or_path"


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list, str)) or value is None else str(value)


# The adapter settings recorded for resume (checkpoints.check_matches refuses a different shape outright).
ADAPTER_SETTINGS = (
    "peft_type",
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "use_rslora",
    "use_dora",
    "modules_to_save",
)
CHANGED_MARK = "# LOOP resumed with a changed setting:"


def resume_settings(
    recorded_keys: Mapping[str, Any],
    *,
    env_name: str,
    num_train_tasks: int,
    model: torch.nn.Module,
    run_settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings an exact resume depends on: ``recorded_keys``, LOOPConfig's recorded keys with their values
    (``RECORDED_KEYS`` of :mod:`~loop_trainer.config.resume_policy`), the
    environment and the size of its training split, the model and the adapter, and
    ``run_settings`` (what ``loop-train`` knows beyond LOOPConfig: ``environment_kwargs``)."""
    peft_config = getattr(model, "peft_config", None)
    adapter = None
    if peft_config:
        lora = next(iter(peft_config.values())).to_dict()
        adapter = {
            key: sorted(map(str, value)) if isinstance(value, (list, set, tuple)) else value
            for key, value in lora.items()
            if key in ADAPTER_SETTINGS
        }
    settings = dict(recorded_keys)
    settings.update(
        environment=env_name,
        num_train_tasks=num_train_tasks,
        model=getattr(model.config, "_name_or_path", None) or None,
        adapter=adapter,
    )
    settings.update(run_settings or {})
    return {key: jsonable(value) for key, value in settings.items()}


def record_setting_changes(
    checkpoint: str | os.PathLike[str],
    changes: Sequence[tuple[str, Any, Any]],
    *,
    recipe: str | Mapping[str, Any] | None,
    output_dir: str,
    write: bool,
) -> tuple[list[dict[str, Any]], str | Mapping[str, Any] | None]:
    """Every setting change so far (the checkpoint's and these), oldest first, as
    ``{"setting", "old", "new", "from_iteration"}``; each new one is logged, and with ``write``
    recipe.yaml in ``output_dir`` is rewritten with a comment line per change. Returns the changes
    and the recipe to publish (that file once written)."""
    state = read_loop_state(checkpoint)
    iteration = int(state.get("iteration", 0)) + 1
    recorded = list(state.get("setting_changes", [])) + [
        {"setting": key, "old": old, "new": new, "from_iteration": iteration} for key, old, new in changes
    ]
    for key, old, new in changes:
        logger.warning(
            "resume_with_changed_settings: %s changed %s -> %s from iteration %d on (applied, and recorded "
            "in loop_state.json, recipe.yaml and the model card)",
            key,
            old,
            new,
            iteration,
        )
    if not recorded or recipe is None or not write:
        return recorded, recipe
    text = (
        yaml.safe_dump(dict(recipe), sort_keys=False)
        if isinstance(recipe, Mapping)
        else Path(recipe).read_text(encoding="utf-8")
    )
    text = "".join(line for line in text.splitlines(keepends=True) if not line.startswith(CHANGED_MARK))
    notes = "".join(
        f"{CHANGED_MARK} {c['setting']} was {c['old']} before iteration {c['from_iteration']}, "
        f"{c['new']} from iteration {c['from_iteration']} on (resume_with_changed_settings)\n"
        for c in recorded
    )
    path = Path(output_dir) / "recipe.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(notes + text, encoding="utf-8")
    return recorded, str(path)


# What apply_setting_changes writes into restored state, by where: together the ``applied`` keys of the resume policy.
SCHEDULE_KEYS = frozenset({"learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps"})
OPTIMIZER_GROUP_KEYS = frozenset({"weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon"})
TASK_ORDER_KEYS = frozenset({"seed", "balance_tasks_by"})


def apply_setting_changes(
    changes: Sequence[tuple[str, Any, Any]],
    new: OptimizerHyperparameters,
    optimizer: Any,
    lr_scheduler: Any,
    task_sampler: TaskSampler | BalancedTaskSampler,
    *,
    decay_parameters: set[str],
    named_parameters: Mapping[str, torch.nn.Parameter],
    num_train_tasks: int,
) -> None:
    """Make changed settings take effect where the checkpoint's state would restore the old ones:
    the optimizer's hyperparameters and the scheduler's base learning rates, and the task sampler's
    position when the seed or the training split's size changed. Everything else LOOP reads afresh
    each iteration."""
    changed = {key: old for key, old, _ in changes}
    if not changed:
        return
    groups = optimizer.param_groups
    scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate's wrapper
    if changed.keys() & SCHEDULE_KEYS:
        old_lr = changed.get("learning_rate", new.learning_rate)
        base_lrs = [base * new.learning_rate / old_lr if old_lr else new.learning_rate for base in scheduler.base_lrs]
        scheduler.base_lrs = base_lrs
        lambdas = getattr(scheduler, "lr_lambdas", None)  # the new schedule's (LambdaLR does not save them)
        for index, group in enumerate(groups):
            group["initial_lr"] = base_lrs[index]
            group["lr"] = base_lrs[index] * lambdas[index](scheduler.last_epoch) if lambdas else base_lrs[index]
        scheduler._last_lr = [group["lr"] for group in groups]
    if "weight_decay" in changed:
        names = {id(parameter): name for name, parameter in named_parameters.items()}
        for group in groups:
            if any(names.get(id(parameter)) in decay_parameters for parameter in group["params"]):
                group["weight_decay"] = new.weight_decay
    for group in groups:
        if changed.keys() & {"adam_beta1", "adam_beta2"} and "betas" in group:
            group["betas"] = (new.adam_beta1, new.adam_beta2)
        if "adam_epsilon" in changed and "eps" in group:
            group["eps"] = new.adam_epsilon
    if changed.keys() & {"num_train_tasks", *TASK_ORDER_KEYS}:  # a new order: the old position means nothing
        task_sampler.start_new_pass(num_train_tasks)


def check_resume_before_loading(
    settings: StartSettings,
    resume_from_checkpoint: str | bool | None,
    known: Mapping[str, Any],
    tiny_lora_args: Any = None,
) -> str | None:
    """What a resume can check before any model is loaded: that the checkpoint is there (``last``: the newest
    complete one, which is returned) and that the settings in ``known`` (those a run knows before its model: most of
    LOOPConfig's, the environment, the launch's optimizer state layout) are the ones it records, or may change
    (``resume_with_changed_settings``). ``tiny_lora_args``: the run's LOOPConfig where it trains an adapter on a tiny
    model, whose base (:data:`TINY_BASE`) is then checked too, by the keys the checkpoint recorded (whether a greedy
    probe ends the warm-up is the environment's to say, which is not built yet). ``loop-train`` runs it first, so a
    resume that cannot go on stops in seconds rather than after the model is built or loaded and vLLM started;
    :func:`plan_start` then checks everything again. None for a fresh run."""
    checkpoint = resolve(resume_from_checkpoint, settings.output_dir)
    if checkpoint is None:
        return None
    state = read_loop_state(checkpoint)
    recorded = state.get("settings")
    if recorded is not None:  # else plan_start warns, once
        base = recorded.get(TINY_BASE)
        if tiny_lora_args is not None and isinstance(base, dict):
            known = {**known, TINY_BASE: {key: jsonable(getattr(tiny_lora_args, key)) for key in base}}
        compare_settings(checkpoint, dict(known), settings.resume_with_changed_settings, state)
    return checkpoint


def plan_start(
    settings: StartSettings,
    resume_from_checkpoint: str | bool | None,
    model: torch.nn.Module,
    current_settings: Callable[[], dict[str, Any]],
    *,
    recipe: str | Mapping[str, Any] | None,
    is_main_process: bool,
    barrier: Callable[[], None],
) -> tuple[str | None, list, list, Any]:
    """Before a run starts: a fresh run refuses an ``output_dir`` holding another run's checkpoints
    unless ``overwrite_output_dir`` (then that run is deleted); a resume checks the checkpoint fits
    the model and compares settings. Returns (checkpoint or None, the changes to apply, every change
    recorded so far, the recipe to publish)."""
    checkpoint = resolve(resume_from_checkpoint, settings.output_dir)
    if checkpoint is None:
        previous = check_fresh_output_dir(
            settings.output_dir, settings.overwrite_output_dir, settings.overwrite_interrupted_run
        )
        barrier()
        if is_main_process and settings.should_save:
            clear_previous_run(settings.output_dir, previous)
        barrier()
        return None, [], [], recipe
    check_matches(checkpoint, model)
    changes = compare_settings(checkpoint, current_settings(), settings.resume_with_changed_settings)
    recorded, recipe = record_setting_changes(
        checkpoint, changes, recipe=recipe, output_dir=settings.output_dir, write=is_main_process
    )
    return checkpoint, changes, recorded, recipe
