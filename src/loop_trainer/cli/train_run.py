"""What ``loop-train`` runs (its entry point is :mod:`.train`, which imports this module when it starts): a recipe
parsed, the run's model, environment and trainer built, the run trained and closed, and every error a user can cause
as one line.

Like TRL's own scripts: ``make_parser()`` builds the TrlParser over (ScriptArguments, LOOPConfig,
ModelConfig) and ``main(script_args, training_args, model_args)`` runs the job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from trl import ModelConfig, get_peft_config

from ..config import LOOPConfig, mapping_setting
from ..config.combinations import ConfigCombinationError, Generator, Launch, check_combinations
from ..envs import Environment, EnvironmentSetupError, make_environment
from ..models.packaged import PackagedModelError, resolve_model_path
from ..models.tiny import INSTRUCT_PREFIX, is_tiny_spec, load_tokenizer
from ..rollout import RolloutFailureBudgetExceeded
from ..rollout.collection_protocol import CollectionProcessError
from ..rollout.generator import GeneratorConfigError, VLLMNotInstalledError
from ..rollout.weight_sync import WeightSyncError
from ..training.checkpoints import CheckpointError, check_fresh_output_dir, is_fresh, last_complete_checkpoint
from ..training.console import (
    StartupLog,
    is_main_launch_process,
    progress_bars_visible,
    progress_description,
    quiet_transformers_bars,
)
from ..training.distribution import DistributedSetupError, end_distributed_run, optimizer_state_layout
from ..training.model_loading import build_tiny_model, tiny_lora_base
from ..training.resume import OPTIMIZER_STATE_LAYOUT, TINY_BASE, check_resume_before_loading
from ..training.settings import recorded_keys, start_settings
from ..training.stress import MemoryStressTestFailed
from ..training.trainer import LOOPTrainer
from .dry_run import dry_run
from .recipe import RecipeError, ScriptArguments, make_parser, parse_recipe

__all__ = ["main", "make_parser", "run"]
logger = logging.getLogger("loop_trainer")


def load_model_and_tokenizer(
    model_args: ModelConfig, training_args: LOOPConfig, env: Environment, report: Callable[[str], None] | None = None
):
    """A model id/path (loaded by the trainer, like TRL) or a ``tiny:<env>`` /
    ``tiny-instruct:<env>`` spec (see :mod:`loop_trainer.models.tiny`), whose warm-up reports its progress
    to ``report``."""
    name = model_args.model_name_or_path
    if not name:
        raise RecipeError(
            "model_name_or_path is not set (a model id, a local directory, 'tiny:<env>' or "
            "'packaged:smollm2-135m-instruct')"
        )
    if is_tiny_spec(name):
        try:
            return build_tiny_model(name, env, training_args, report)
        except ValueError as error:
            raise RecipeError(str(error)) from None
    try:  # packaged:<model> -> its converted directory (loop_trainer.models.packaged)
        name = model_args.model_name_or_path = resolve_model_path(name)
    except PackagedModelError as error:
        raise RecipeError(str(error)) from None
    kwargs = {"revision": model_args.model_revision, "trust_remote_code": training_args.trust_remote_code}
    try:
        tokenizer = load_tokenizer(name, padding_side="left", **kwargs)
    except (OSError, ValueError) as error:
        where = "local directory" if os.path.isdir(name) else "model id (no local directory of that name)"
        raise RecipeError(
            f"cannot load model_name_or_path '{name}' as a {where}: {str(error).splitlines()[0]}"
        ) from None
    init = mapping_setting(training_args.model_init_kwargs, "model_init_kwargs")
    init.update(kwargs, attn_implementation=model_args.attn_implementation)
    if model_args.dtype not in (None, "auto"):
        init["dtype"] = model_args.dtype
    training_args.model_init_kwargs = {k: v for k, v in init.items() if v is not None}
    return name, tokenizer


def main(script_args: ScriptArguments, training_args: LOOPConfig, model_args: ModelConfig) -> LOOPTrainer | None:
    try:  # LOOPConfig checked what it could; loop-train samples with the built-in generator, so now all of it
        launch = dataclasses.replace(training_args.launch(Generator.BUILT_IN), lora=bool(model_args.use_peft))
        check_combinations(training_args, launch)
    except ConfigCombinationError as error:
        raise RecipeError(str(error)) from None
    if script_args.dry_run:  # run() turns the plan's verdict into the exit status
        dry_run(script_args, training_args, model_args)
        return None
    assert training_args.output_dir is not None  # TrainingArguments.__post_init__ gives it a default
    try:  # LOOPTrainer.train() checks these too (a resume: all its settings); here before minutes of loading
        if is_fresh(training_args.resume_from_checkpoint):
            check_fresh_output_dir(
                training_args.output_dir, training_args.overwrite_output_dir, training_args.overwrite_interrupted_run
            )
        else:  # "last" becomes the checkpoint it names, which the banner then shows
            tiny_lora = is_tiny_spec(str(model_args.model_name_or_path)) and model_args.use_peft
            training_args.resume_from_checkpoint = check_resume_before_loading(
                start_settings(training_args),
                training_args.resume_from_checkpoint,
                settings_before_loading(script_args, training_args, launch),
                tiny_lora_args=training_args if tiny_lora else None,
            )
    except CheckpointError as error:
        raise RecipeError(str(error)) from None
    try:  # e.g. a read-only file system, which os.access cannot see for root
        os.makedirs(training_args.output_dir, exist_ok=True)
    except OSError as error:
        raise RecipeError(
            f"output_dir {training_args.output_dir!r} cannot be created: {error.strerror or error}"
        ) from None
    startup = StartupLog(enabled=is_main_launch_process())
    print_banner(startup, script_args, training_args, model_args)
    try:
        env = make_environment(
            script_args.environment, **mapping_setting(script_args.environment_kwargs, "environment_kwargs")
        )
    except (ValueError, EnvironmentSetupError) as error:
        raise RecipeError(str(error)) from None
    try:  # loop-train created the environment, so it closes it, on every path
        startup.stage("loading the model", loading_detail(model_args, training_args))
        # No bars of transformers' model loading (or a packaged model's conversion) in a log file, or with
        # disable_tqdm.
        quiet = training_args.disable_tqdm or not progress_bars_visible()
        with quiet_transformers_bars() if quiet else contextlib.nullcontext():
            model, tokenizer = load_model_and_tokenizer(
                model_args, training_args, env, report=lambda line: startup.print(f"  {line}")
            )
            peft_config = get_peft_config(model_args)
            try:
                trainer = LOOPTrainer(
                    model=model,
                    env=env,
                    args=training_args,
                    processing_class=tokenizer,
                    peft_config=peft_config,
                    callbacks=[startup],
                )
            except (
                VLLMNotInstalledError,
                GeneratorConfigError,
                WeightSyncError,
                DistributedSetupError,
                EnvironmentSetupError,
                ConfigCombinationError,
                CollectionProcessError,
            ) as error:
                raise RecipeError(str(error)) from None
        trainer.recipe_path = getattr(script_args, "effective_recipe", None)
        # the model came built: what a tiny LoRA run's base is built from is loop-train's to say
        trainer.run_settings = environment_settings(script_args)
        tiny_base = tiny_lora_base(str(model_args.model_name_or_path), env, training_args, peft_config)
        if tiny_base is not None:
            trainer.run_settings[TINY_BASE] = tiny_base
        with trainer:
            startup.stage("warming up", warm_up_detail(training_args))  # startup's on_train_begin ends it
            try:
                trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
            except (
                EnvironmentSetupError,
                CheckpointError,
                WeightSyncError,
                DistributedSetupError,
                GeneratorConfigError,
                CollectionProcessError,
            ) as error:
                raise RecipeError(str(error)) from None
            with quiet_transformers_bars():  # no "Writing model shards" bar
                trainer.save_model(training_args.output_dir, _internal_call=True)  # the push is the next line's
                # the model card and recipe.yaml beside the weights, as in every checkpoint: loop-eval pointed at
                # output_dir follows the run's environment and episode limits from it
                trainer.create_model_card()
                if training_args.push_to_hub:
                    trainer.push_to_hub()
    finally:
        close_environment(env)
    if trainer.is_world_process_zero():
        print(summary(trainer))
    return trainer


def environment_settings(script_args: ScriptArguments) -> dict[str, Any]:
    """The environment loop-train builds, as the trainer records it in each checkpoint and compares on resume
    (``LOOPTrainer.run_settings``), like LOOPConfig's settings."""
    return {"environment": script_args.environment, "environment_kwargs": script_args.environment_kwargs or {}}


def settings_before_loading(script_args: ScriptArguments, training_args: LOOPConfig, launch: Launch) -> dict[str, Any]:
    """The settings a checkpoint records that loop-train knows before it loads a model: LOOPConfig's (but
    ``model_init_kwargs``, which loading completes), the environment and how the launch holds the optimizer state
    (as LOOPTrainer.resume_settings has them)."""
    known = recorded_keys(training_args)
    del known["model_init_kwargs"]
    layout = optimizer_state_layout(launch.zero_stage, launch.num_processes)
    return {**known, **environment_settings(script_args), OPTIMIZER_STATE_LAYOUT: layout}


def print_banner(
    startup: StartupLog, script_args: ScriptArguments, training_args: LOOPConfig, model_args: ModelConfig
) -> None:
    """The run in four lines, before anything is loaded: what trains on what, how long, where it writes,
    and what the console shows while it goes."""
    resume = training_args.resume_from_checkpoint  # a checkpoint directory by now ("last" resolved), or fresh
    startup.banner(
        model=model_args.model_name_or_path,
        environment=script_args.environment,
        iterations=training_args.iterations,
        rollouts=f"{training_args.tasks_per_iteration} tasks x {training_args.rollouts_per_task} rollouts",
        output_dir=str(training_args.output_dir),
        resume=None if is_fresh(resume) else str(resume),
        progress=progress_description(training_args.disable_tqdm),
    )


def loading_detail(model_args: ModelConfig, training_args: LOOPConfig) -> str:
    """What loading the model involves, where it is more than reading weights (the loading stage's line)."""
    parts = []
    if (model_args.model_name_or_path or "").startswith(INSTRUCT_PREFIX):
        parts.append("a tiny model, warmed up on the environment's demonstrations")
    if training_args.use_vllm:
        parts.append("and starting vLLM")
    return "; ".join(parts)


def warm_up_detail(training_args: LOOPConfig) -> str:
    """What happens between the model load and iteration 1 (the warm-up stage's line)."""
    parts = ["optimizer"]
    if not is_fresh(training_args.resume_from_checkpoint):
        parts.append("checkpoint")
    if training_args.memory_stress_test:
        parts.append(f"memory stress test at {training_args.max_training_tokens} tokens")
    return ", ".join(parts)


def close_environment(env: Environment) -> None:
    """Close what loop-train opened; a failure to close is one warning line, never an error that
    turns a saved run into a failed one (nor hides the error that ended a failed one)."""
    try:
        env.close()
    except Exception as error:  # noqa: BLE001 - any failure of a plugin's close() is reported the same way
        warn_failure(f"closing the environment '{getattr(env, 'name', type(env).__name__)}'", error)


def warn_failure(action: str, error: Exception) -> None:
    """``loop-train: warning: <action> failed (<error type>: <its first line>)`` on stderr."""
    detail = str(error).splitlines()[0] if str(error) else ""
    print(
        f"loop-train: warning: {action} failed ({type(error).__name__}{': ' + detail if detail else ''})",
        file=sys.stderr,
    )


def summary(trainer: LOOPTrainer, window: int = 5) -> str:
    """The closing lines: where the outputs are (the trackers' runs too), and how reward and success moved from
    the first ``window`` iterations to the last (success when the environment reports it)."""
    history = trainer.history
    k = max(1, min(window, len(history) // 2))

    def moved(key: str) -> tuple[float, float] | None:
        values = [h.get(key, math.nan) for h in history]
        first, last = sum(values[:k]) / k, sum(values[-k:]) / k
        return None if math.isnan(first) or math.isnan(last) else (first, last)

    lines = [f"LOOP: {len(history)} iterations on '{trainer.env.name}'."]
    for key, label in (("reward_mean", "mean reward"), ("success_rate", "success rate")):
        if (values := moved(key)) is not None:
            lines.append(
                f"  {label + ',':14} first {k} iterations: {values[0]:.3f}   last {k} iterations: "
                f"{values[1]:.3f}   ({values[1] - values[0]:+.3f})"
            )
    return "\n".join(
        [
            *lines,
            f"  metrics:        {trainer.metrics_path}",
            f"  learning curve: {trainer.curve_path}",
            f"  model:          {trainer.args.output_dir}",
            *(f"  {tracker + ':':15} {where}" for tracker, where in trainer.tracker_locations.items()),
        ]
    )


def resume_advice(output_dir: str | None) -> str:
    """How to go on after a stopped run: resume only if there is a checkpoint to resume from."""
    checkpoint = last_complete_checkpoint(output_dir) if output_dir else None
    if checkpoint is None:
        return "run it again from the start (no checkpoint was saved)"
    return f"continue with --resume_from_checkpoint last (from {checkpoint.name})"


def end_process_group() -> None:
    """After a finished run, this process's part in the process group ends before the interpreter does (it may be
    one the caller set up: loop-train is the process's last act); a failure to end it is one warning line, never an
    error that turns a saved run into a failed one."""
    try:
        end_distributed_run()
    except Exception as error:  # noqa: BLE001 - whatever the backend raises, the run is saved
        warn_failure("ending the process group", error)


def run(argv: Sequence[str] | None = None) -> int:
    """loop-train with ``argv``: one actionable line on user errors, exit status 2; Ctrl-C exits 130. After a
    finished run it ends the process group, the launch's or one the caller set up (:func:`end_process_group`)."""
    training_args = None
    try:
        script_args, training_args, model_args = parse_recipe(argv)
        if script_args.dry_run:
            return dry_run(script_args, training_args, model_args)
        main(script_args, training_args, model_args)
        end_process_group()
    except RecipeError as error:
        print(f"loop-train: error: {error}", file=sys.stderr)
        return 2
    except MemoryStressTestFailed as error:
        print(f"loop-train: error: {error}", file=sys.stderr)
        return 1
    except RolloutFailureBudgetExceeded as error:
        output_dir = training_args.output_dir if training_args else None
        print(f"loop-train: error: {error}. Fix the environment, then {resume_advice(output_dir)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a checkpoint being written is completed first (interrupts.deferred_interrupt)
        checkpoint = last_complete_checkpoint(training_args.output_dir) if training_args else None
        if checkpoint is None:
            print("loop-train: interrupted before the first checkpoint; nothing to resume", file=sys.stderr)
        else:
            iteration = checkpoint.name.rsplit("-", 1)[1]
            print(
                f"loop-train: interrupted; the newest checkpoint is from iteration {iteration}: resume with "
                "--resume_from_checkpoint last (later iterations are redone)",
                file=sys.stderr,
            )
        return 130
    return 0
