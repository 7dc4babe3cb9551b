"""Evaluate a base model or a trained adapter on a split -- the ``loop-eval`` command.

    loop-eval --model_name_or_path Qwen/Qwen2.5-7B-Instruct [--adapter outputs/run] \\
        --environment appworld --split test_normal [--rollouts_per_task 1 --temperature 0]

Runs :class:`~loop_trainer.evaluation.Evaluator` (the trainer's evaluation pipeline) and writes
``results.jsonl`` (one row per rollout), ``metrics.json`` (the environment's summary,
``Environment.summarize``: success rate and mean reward; AppWorld adds TGC / SGC overall and per
difficulty, computed as ``appworld evaluate`` computes them) and ``viewer.html`` (every rollout,
turn by turn) to ``output_dir``. With AppWorld, rollout k's world states are saved under the
experiment ``<experiment_name>`` (k = 0) or ``<experiment_name>_rollout<k>``, so
``appworld evaluate <experiment> <split>`` can grade them too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
from argparse import ArgumentTypeError
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase
from transformers.hf_argparser import string_to_bool
from trl import ModelConfig

from ..chat import ChatFormatter, stop_token_ids
from ..config import EpisodeSettings, LOOPConfig, check_ranges, mapping_setting, output_dir_problem, range_of
from ..config.ranges import annotation_text, setting
from ..envs import Environment, EnvironmentSetupError, make_environment
from ..evaluation import Evaluator, GreedySuccessOnTrainingTasks, format_metrics, write_evaluation_viewer
from ..models.packaged import PackagedModelError, resolve_model_path
from ..models.tiny import INSTRUCT_PREFIX, build_tiny_from_spec, build_word_tokenizer, is_tiny_spec, load_tokenizer
from ..publishing.model_card import RECIPE_FILE
from ..rollout import GenerationBackend, TransformersBackend
from ..rollout.backend import build_transformers_backend
from ..rollout.sampling_parts import COMPILE_NEEDS_STATIC, SamplingPartsError, TransformersSamplingSettings
from ..training.activation_checkpointing import peft_wrapping
from ..training.checkpoints import LOOP_STATE_FILE, CheckpointError, is_complete, read_loop_state
from ..training.settings import episode_settings
from .recipe import RecipeError, ScriptArguments, given_mapping, parse_recipe

__all__ = ["EvalArguments", "cli", "evaluate"]
logger = logging.getLogger("loop_trainer")


@dataclass
class EvalArguments(ScriptArguments, EpisodeSettings):
    """What to evaluate on and how (the model is TRL's ModelConfig: model_name_or_path, dtype, ...).
    Episode limits and concurrency are :class:`EpisodeSettings`, so their defaults are training's."""

    environment: str = field(default="appworld", metadata={"help": "Environment name (as in loop-train)."})
    split: str | None = field(
        default=None,
        metadata={
            "help": "Split to evaluate. Default: the evaluated run's eval_split, else the environment's own "
            "(the built-in worlds: test; AppWorld: dev; the verifiers, OpenEnv and TRL adapters: eval)."
        },
    )
    adapter: str | None = field(default=None, metadata={"help": "A PEFT adapter directory to load on the model."})
    # loop-eval's ranges are training's: those of LOOPConfig's evaluation keys (and the episode settings').
    rollouts_per_task: int = setting(
        1, "Independent rollouts of every task.", range_of(LOOPConfig, "eval_rollouts_per_task")
    )
    temperature: float = setting(0.0, "Sampling temperature; 0 is greedy.", range_of(LOOPConfig, "eval_temperature"))
    max_tasks: int | None = setting(
        None, "Evaluate only the first N tasks of the split.", range_of(LOOPConfig, "eval_max_tasks")
    )
    output_dir: str = field(default="eval", metadata={"help": "Where results, metrics and the viewer go."})
    experiment_name: str | None = field(
        default=None, metadata={"help": "AppWorld experiment name for the saved outputs (default: output_dir's name)."}
    )
    seed: int = setting(
        0, "Sampling seed (and a tiny model's, unless model_seed is given).", range_of(LOOPConfig, "seed")
    )
    model_seed: int | None = setting(
        None,
        "tiny:<env> / tiny-instruct:<env> models: the seed they are built with, as loop-train's seed builds them (a "
        "tiny LoRA run followed: the run's, so that its adapter goes on the base it trained); none: seed.",
        dataclasses.replace(range_of(LOOPConfig, "seed"), none=True),
    )
    tiny_instruct_steps: int | None = setting(
        None,
        "tiny-instruct:<env> models: the warm-up's supervised steps, as loop-train's key (the run's, to evaluate the "
        "policy it started from); none: until held-out demonstrations are fitted.",
        range_of(LOOPConfig, "tiny_instruct_steps"),
    )

    model_environment_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "tiny:<env> / tiny-instruct:<env> models: the environment_kwargs of the world they are built from "
            "(its warm-up demonstrations and depth come from the environment), as loop-train's run's (a tiny LoRA run "
            "followed with other environment_kwargs given: the run's); unset: environment_kwargs. The evaluation "
            "runs under environment_kwargs."
        },
    )
    model_episode_settings: dict | str | None = field(
        default=None,
        metadata={
            "help": "tiny-instruct:<env> models whose warm-up a greedy probe ends (tiny_instruct_steps none, an "
            "environment naming a warm_up_success): the episode settings the probe runs under (a mapping of "
            "max_turns, ...; JSON on the CLI), as loop-train's run's (a tiny LoRA run followed: the run's, these "
            "over them); unset ones: this evaluation's."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # checks every field's range
        if problem := output_dir_problem(self.output_dir):
            raise RecipeError(problem)
        self.model_episode_settings = given_mapping(
            self.model_episode_settings, "model_episode_settings", " of episode settings (max_turns, ...)"
        )
        self.warm_up_probe_settings()  # each an episode setting in its range
        self.model_environment_kwargs = given_mapping(
            self.model_environment_kwargs,
            "model_environment_kwargs",
            " (the environment_kwargs a tiny model is built from)",
        )
        static = self.static_decode if self.static_decode is not None else torch.cuda.is_available()  # unset: by device
        if self.compile_decode_step is True and not static:
            raise RecipeError(COMPILE_NEEDS_STATIC)

    def other_model_world(self) -> dict[str, Any] | None:
        """``model_environment_kwargs`` where they name another world than ``environment_kwargs``, else None."""
        kwargs = self.model_environment_kwargs
        if kwargs is None or kwargs == (self.environment_kwargs or {}):
            return None
        return mapping_setting(kwargs, "model_environment_kwargs")

    def warm_up_probe_settings(self) -> EpisodeSettings:
        """The episode settings a tiny-instruct model's warm-up probe runs under: ``model_episode_settings`` over this
        evaluation's."""
        given = self.model_episode_settings
        if given is not None and not isinstance(given, dict):
            raise RecipeError("model_episode_settings must be a mapping of episode settings (max_turns, ...)")
        names = [f.name for f in dataclasses.fields(EpisodeSettings)]
        if unknown := sorted(set(given or {}) - set(names)):
            listed = ", ".join(names)
            raise RecipeError(f"model_episode_settings: {', '.join(unknown)} is not an episode setting ({listed})")
        try:
            settings = dataclasses.replace(episode_settings(self), **(given or {}))
            check_ranges(settings)
            return settings
        except (TypeError, ValueError) as error:
            raise RecipeError(f"model_episode_settings: {str(error).splitlines()[0]}") from None


def _resolve(model_args: ModelConfig, name: str) -> str:
    """A ``packaged:<model>`` spec's directory (converted on first use), or the name itself; also
    ``model_args.model_name_or_path`` from now on (``name`` is its value)."""
    try:
        model_args.model_name_or_path = resolved = resolve_model_path(name)
    except PackagedModelError as error:
        raise RecipeError(str(error)) from None
    return resolved


@contextlib.contextmanager
def tiny_model_world(env: Environment, eval_args: EvalArguments) -> Iterator[Environment]:
    """The environment a tiny model is built from: the evaluated ``env``, or, where ``model_environment_kwargs``
    names other kwargs than ``environment_kwargs``, the environment built from them (closed after), whose words the
    evaluated one must not outgrow (the model's word tokenizer holds the building world's)."""
    kwargs = eval_args.other_model_world()
    if kwargs is None:
        yield env
        return
    try:
        world = make_environment(eval_args.environment, **kwargs)
    except (ValueError, EnvironmentSetupError) as error:
        raise RecipeError(f"model_environment_kwargs: {error}") from None
    try:
        unknown = set()
        if hasattr(world, "vocabulary") and hasattr(env, "vocabulary"):  # else building a tiny model is refused
            unknown = set(env.vocabulary()) - set(world.vocabulary())
        if missing := sorted(unknown):
            raise RecipeError(
                f"the evaluated environment (environment_kwargs {json.dumps(eval_args.environment_kwargs)}) uses "
                f"words that a tiny model built from model_environment_kwargs {json.dumps(kwargs)} has no token "
                f"for ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): evaluate it under "
                f"environment_kwargs {json.dumps(kwargs)}"
            )
        yield world
    finally:
        world.close()


def load_policy(model_args: ModelConfig, eval_args: EvalArguments, env: Environment) -> tuple[Any, Any]:
    name = model_args.model_name_or_path
    if not name:
        raise RecipeError("model_name_or_path is not set (a model id or a local directory)")
    model: Any  # a PreTrainedModel, or the PeftModel around it
    tokenizer: PreTrainedTokenizerBase
    if is_tiny_spec(name):
        try:
            with tiny_model_world(env, eval_args) as world:
                model, tokenizer = build_tiny_from_spec(
                    name,
                    world,
                    seed=eval_args.seed if eval_args.model_seed is None else eval_args.model_seed,
                    env_timeout=eval_args.env_timeout,
                    warm_up_steps=eval_args.tiny_instruct_steps,
                    greedy_success=GreedySuccessOnTrainingTasks(world, eval_args.warm_up_probe_settings()),
                )
        except ValueError as error:
            raise RecipeError(str(error)) from None
    else:
        name = _resolve(model_args, name)
        kwargs: dict[str, Any] = {
            "revision": model_args.model_revision,
            "trust_remote_code": getattr(model_args, "trust_remote_code", False),
        }
        try:
            tokenizer = load_tokenizer(eval_args.adapter or name, **kwargs)
        except (OSError, ValueError):
            try:
                tokenizer = load_tokenizer(name, **kwargs)
            except (OSError, ValueError) as error:
                raise RecipeError(f"cannot load a tokenizer from '{name}': {str(error).splitlines()[0]}") from None
        dtype = model_args.dtype if model_args.dtype not in (None, "auto") else "auto"
        try:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
        except (OSError, ValueError) as error:
            raise RecipeError(f"cannot load model '{name}': {str(error).splitlines()[0]}") from None
    if eval_args.adapter:
        from peft import PeftModel

        try:
            with peft_wrapping():  # no FutureWarning from PEFT reading transformers' old checkpointing name
                model = PeftModel.from_pretrained(model, eval_args.adapter)
        except (OSError, ValueError, RuntimeError, KeyError) as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            reason = next((line for line in lines if "size mismatch" in line), lines[0] if lines else repr(error))
            raise RecipeError(
                f"cannot load adapter '{eval_args.adapter}' on '{name}' (is it this model's adapter?): {reason}"
            ) from None
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    return model, tokenizer


def load_tokenizer_only(model_args: ModelConfig, eval_args: EvalArguments, env: Environment) -> Any:
    """The policy's tokenizer without its weights (a generation backend was given)."""
    name = model_args.model_name_or_path
    if not name:
        raise RecipeError("model_name_or_path is not set (a model id or a local directory)")
    if is_tiny_spec(name):
        label = name.split(":", 1)[1]
        if label != env.name or not hasattr(env, "vocabulary"):
            raise RecipeError(
                f"'{name}' is a tiny model for the '{label}' environment; the environment is '{env.name}'"
            )
        with tiny_model_world(env, eval_args) as world:  # the model's words: those of the world it is built from
            return build_word_tokenizer(world.vocabulary() if hasattr(world, "vocabulary") else env.vocabulary())
    name = _resolve(model_args, name)
    kwargs: dict[str, Any] = {
        "revision": model_args.model_revision,
        "trust_remote_code": getattr(model_args, "trust_remote_code", False),
    }
    for source in dict.fromkeys(filter(None, (eval_args.adapter, name))):
        try:
            return load_tokenizer(source, **kwargs)
        except (OSError, ValueError) as error:
            reason = str(error).splitlines()[0]
    raise RecipeError(f"cannot load a tokenizer from '{name}': {reason}")


@contextlib.contextmanager
def experiment_per_rollout(env: Environment, experiment: str) -> Iterator[Callable[[int], None] | None]:
    """For environments that save their outputs under an experiment name (AppWorld), a
    ``before_rollout`` hook naming rollout k's ``<experiment>`` (k = 0) or ``<experiment>_rollout<k>``;
    the env's own name is put back afterwards (an env we were given leaves as it came)."""
    if not hasattr(env, "experiment_name"):
        yield None
        return
    original = env.experiment_name

    def name_rollout(k: int) -> None:
        env.experiment_name = experiment if k == 0 else f"{experiment}_rollout{k}"

    try:
        yield name_rollout
    finally:
        env.experiment_name = original


def sampling_backend(
    model: Any, tokenizer: Any, settings: EpisodeSettings, temperature: float = 1.0
) -> TransformersBackend:
    """The transformers backend evaluation samples ``model`` with, built as training builds it (its fast parts
    on with CUDA unless a key turns them off). ``merge_adapter_for_sampling`` applies to a policy with a LoRA
    adapter; a policy without one samples as it is. A part that cannot apply is a recipe error."""
    merge = settings.merge_adapter_for_sampling if getattr(model, "peft_config", None) else False
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        return build_transformers_backend(
            model,
            TransformersSamplingSettings(
                temperature=temperature,
                max_batch_size=settings.generation_batch_limit,
                static_decode=settings.static_decode,
                compile_decode_step=settings.compile_decode_step,
                merge_adapter=merge,
            ),
            stop_token_ids=stop_token_ids(model, tokenizer),
            pad_token_id=pad_token_id,
        )
    except SamplingPartsError as error:
        raise RecipeError(str(error)) from None


def evaluate(
    eval_args: EvalArguments,
    model_args: ModelConfig,
    *,
    env: Environment | None = None,
    generation_backend: GenerationBackend | None = None,
) -> dict[str, Any]:
    """Run the evaluation; return the metrics (also written to ``output_dir/metrics.json``).

    An ``env`` given here is used as it is and left open (its creator closes it): it is prepared
    (a no-op if it already is) but gets no tokenizer; one built from ``eval_args`` is closed at
    the end. With a ``generation_backend`` only the tokenizer is loaded, never the model."""
    torch.manual_seed(eval_args.seed)
    owns_env = env is None
    other_world = eval_args.other_model_world() is not None
    if not owns_env and other_world and is_tiny_spec(str(model_args.model_name_or_path or "")):
        raise RecipeError(
            "model_environment_kwargs builds the tiny model's world from environment, which an env given to "
            "evaluate() replaces: build the model yourself, or let loop-eval build the environment"
        )
    if env is None:
        try:
            env = make_environment(
                eval_args.environment, **mapping_setting(eval_args.environment_kwargs, "environment_kwargs")
            )
        except (ValueError, EnvironmentSetupError) as error:
            raise RecipeError(str(error)) from None
    try:
        split = eval_args.split or env.default_eval_split
        if split is None:  # before any loading
            raise RecipeError(f"environment {env.name!r} names no default split to evaluate: set --split")
        if generation_backend is None:
            model, tokenizer = load_policy(model_args, eval_args, env)
            generation_backend = sampling_backend(model, tokenizer, eval_args, eval_args.temperature)
        else:
            tokenizer = load_tokenizer_only(model_args, eval_args, env)
            # The temperature is honoured (the backend samples at it) or refused, never recorded but ignored.
            if not hasattr(generation_backend, "with_temperature"):
                raise RecipeError(
                    f"generation_backend {type(generation_backend).__name__} has no "
                    "with_temperature(temperature) method, so temperature cannot be honoured"
                )
            generation_backend = generation_backend.with_temperature(eval_args.temperature)
        if owns_env:
            env.set_tokenizer(tokenizer)
        env.prepare()
        output_dir = Path(eval_args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        experiment = eval_args.experiment_name or output_dir.resolve().name
        evaluator = Evaluator(env, generation_backend, ChatFormatter(tokenizer), eval_args, show_progress=True)
        try:
            with experiment_per_rollout(env, experiment) as before_rollout:
                result = evaluator.run(
                    split,
                    rollouts_per_task=eval_args.rollouts_per_task,
                    seed=eval_args.seed,
                    max_tasks=eval_args.max_tasks,
                    before_rollout=before_rollout,
                )
        finally:
            evaluator.close()
    finally:
        if owns_env:
            env.close()
    metrics: dict[str, Any] = {
        **result.metrics,
        "split": split,
        "model": model_args.model_name_or_path,
        "adapter": eval_args.adapter,
        "temperature": eval_args.temperature,
    }
    if hasattr(env, "experiment_name"):  # where each rollout's saved world states are
        metrics["experiment_name"] = experiment
        for row in result.rows:
            row["experiment_name"] = experiment if row["rollout"] == 0 else f"{experiment}_rollout{row['rollout']}"
    with open(output_dir / "results.jsonl", "w") as handle:
        for row in result.rows:
            handle.write(json.dumps(row, default=str) + "\n")
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    write_evaluation_viewer(
        result.rows, output_dir / "viewer.html", title=f"{env.name} · {split} · {model_args.model_name_or_path}"
    )
    return metrics


EPISODE_KEYS = (
    "max_turns",
    "max_new_tokens_per_turn",
    "max_trajectory_tokens",
    "max_completion_tokens",
    "context_keep_observations",
    "context_observation_budget",
    "context_strip_thinking",
)
"""What ``loop-eval`` takes from the run it evaluates, unless a flag or ``--config`` sets it: the episode limits
and the context policy the policy was trained under (a policy trained on 6 turns of 4 tokens is not evaluated on
40 of 1,500). How it samples (static_decode, batch limits, concurrency) is this machine's, not the run's."""

NULL_IS_A_VALUE = frozenset({"environment_kwargs", *EPISODE_KEYS})
"""The keys :func:`follow_run` takes from the run whose null in ``--config`` is a value, not "unset": no kwargs, no
budget, no context policy. (A null ``split``, ``model_seed`` or ``tiny_instruct_steps`` there still follows the run.)"""


def _run_of(directory: Path) -> tuple[Path, Path] | None:
    """The run ``directory`` belongs to, as (the folder holding its ``recipe.yaml``, the folder holding the weights
    to evaluate): a run's ``output_dir`` is both; one of its ``checkpoint-N`` folders (complete: it holds
    ``loop_state.json``) has its weights and the run's recipe one level up. None: not a run's."""
    if (directory / RECIPE_FILE).is_file():
        return directory, directory
    if is_complete(directory) and (directory.parent / RECIPE_FILE).is_file():
        return directory.parent, directory
    return None


def _checkpoint_settings(checkpoint: Path) -> dict[str, Any]:
    """The recipe keys ``checkpoint`` recorded (``loop_state.json``'s settings: the values it was trained under,
    which the run's ``recipe.yaml`` does not show where a resume changed them since)."""
    try:
        state = read_loop_state(checkpoint)
    except CheckpointError as error:
        raise RecipeError(str(error)) from None
    recorded = state.get("settings") if isinstance(state, dict) else None
    if not isinstance(recorded, dict):  # an older loop_trainer's (no settings), or not a LOOP checkpoint's
        if isinstance(state, dict) and recorded is None:
            return {}
        raise RecipeError(f"{checkpoint / LOOP_STATE_FILE} is not a LOOP checkpoint's state (a JSON object)")
    keys = {f.name for f in dataclasses.fields(LOOPConfig)} | {"environment_kwargs"}
    # a tiny LoRA run's base as built (resume.TINY_BASE: its seed, warm-up steps and probe's episode settings)
    return {key: value for key, value in {**recorded, **(recorded.get("tiny_base") or {})}.items() if key in keys}


_PARSERS: dict[str, Callable[[str], Any]] = {"bool": string_to_bool, "int": int, "float": float}


def _as_parsed(settings: dict[str, Any]) -> dict[str, Any]:
    """Episode settings read from a run's recipe file, a value written as text (``"true"``, ``"8"``: a recipe file
    given to the Python API as ``recipe_path`` is kept as written, or one edited by hand) parsed as loop-train's
    parser reads it, by the key's type; text that parses to nothing is left for the range check to refuse."""
    parsed = dict(settings)
    for spec in dataclasses.fields(EpisodeSettings):
        value = settings.get(spec.name)
        parse = _PARSERS.get(annotation_text(spec.type).removesuffix("|None"))
        if isinstance(value, str) and parse is not None:
            with contextlib.suppress(ArgumentTypeError, ValueError):
                parsed[spec.name] = parse(value)
    return parsed


def follow_run(eval_args: EvalArguments, model_args: ModelConfig) -> tuple[EvalArguments, dict[str, Any]]:
    """Where ``--model_name_or_path`` (or ``--adapter``) is a run's ``output_dir`` (it holds the ``recipe.yaml``
    loop-train writes), take the run's environment (loop-train's default where its recipe names none) with its
    kwargs and ``eval_split``, and its :data:`EPISODE_KEYS`, each unless given here (kwargs and split only with
    the run's environment); a LoRA run's ``output_dir`` holds its adapter, evaluated on the run's base model. One
    of the run's checkpoints (``output_dir/checkpoint-N``) is followed the same way, with the settings it recorded
    in place of the recipe's. Returns the arguments (checked again, as parsed ones are) and what was taken (empty:
    no run to follow)."""
    candidates = (eval_args.adapter, model_args.model_name_or_path)
    followed_dirs = next((dirs for d in candidates if d and (dirs := _run_of(Path(d))) is not None), None)
    if followed_dirs is None:
        return eval_args, {}
    run_dir, weights_dir = followed_dirs
    try:
        recipe = yaml.safe_load((run_dir / RECIPE_FILE).read_text()) or {}
    except yaml.YAMLError as error:
        raise RecipeError(f"{run_dir / RECIPE_FILE} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(recipe, dict):
        raise RecipeError(f"{run_dir / RECIPE_FILE} is not a run's recipe (a YAML mapping of keys to values)")
    if weights_dir != run_dir:  # a checkpoint: the settings it was trained under (a resume may have changed some)
        recipe = {**recipe, **_checkpoint_settings(weights_dir)}
    given = set(getattr(eval_args, "effective_recipe", None) or {})
    given |= NULL_IS_A_VALUE & set(getattr(eval_args, "nulls_given", None) or ())
    taken: dict[str, Any] = {}
    environment = recipe.get("environment", ScriptArguments.environment)  # loop-train's default, if unnamed
    if "environment" not in given:
        taken["environment"] = environment
    if "environment" not in given or eval_args.environment == environment:  # the run's world: its kwargs, split
        if "environment_kwargs" not in given and recipe.get("environment_kwargs") is not None:
            taken["environment_kwargs"] = recipe["environment_kwargs"]
        if "split" not in given and recipe.get("eval_split"):
            taken["split"] = recipe["eval_split"]
    taken.update(_as_parsed({key: recipe[key] for key in EPISODE_KEYS if key in recipe and key not in given}))
    base = recipe.get("model_name_or_path")
    lora = bool(recipe.get("use_peft")) and (weights_dir / "adapter_config.json").is_file()
    if lora and base and is_tiny_spec(str(base)):
        # The base is rebuilt as the run built it: its seed and warm-up (loop-train's defaults where unnamed), read
        # back from the warm-up cache where this machine built it before (elsewhere warmed up again: equal up to
        # the machine's rounding); sampled with loop-eval's own seed.
        named = model_args.model_name_or_path
        if eval_args.adapter and named and named != base:  # --adapter with another base named
            raise RecipeError(
                f"{weights_dir} holds a LoRA adapter on '{base}', not on '{named}': evaluate it with "
                f"--model_name_or_path {base} (or without one)"
            )
        # Its world too (its demonstrations and depth come from the environment), where other environment_kwargs are
        # given to evaluate under: the run's build the base. (Another environment: the spec names the run's.)
        run_kwargs = recipe.get("environment_kwargs") or {}
        with contextlib.suppress(RecipeError):  # JSON text compared as its mapping; one that is none is refused below
            run_kwargs = given_mapping(run_kwargs, "environment_kwargs") or {}
        if (
            "environment_kwargs" in given
            and "model_environment_kwargs" not in given
            and ("environment" not in given or eval_args.environment == environment)
            and (eval_args.environment_kwargs or {}) != run_kwargs
        ):
            taken["model_environment_kwargs"] = run_kwargs
        model_args.model_name_or_path = base
        for key, run_key in (("model_seed", "seed"), ("tiny_instruct_steps", "tiny_instruct_steps")):
            if key not in given:
                taken[key] = recipe.get(run_key, LOOPConfig.__dataclass_fields__[run_key].default)
        steps = eval_args.tiny_instruct_steps if "tiny_instruct_steps" in given else taken["tiny_instruct_steps"]
        if steps is None and str(base).startswith(INSTRUCT_PREFIX):  # a greedy probe may end the warm-up: its
            # readings depend on the episode settings it runs under, the run's (what loop-eval runs under is its own);
            # those given here go over them
            probed = (f.name for f in dataclasses.fields(EpisodeSettings))
            defaults = LOOPConfig.__dataclass_fields__
            run = _as_parsed({key: recipe.get(key, defaults[key].default) for key in probed})
            given_probe = eval_args.model_episode_settings if "model_episode_settings" in given else None
            taken["model_episode_settings"] = {**run, **(given_probe if isinstance(given_probe, dict) else {})}
    if lora and not eval_args.adapter and base:
        taken["adapter"], model_args.model_name_or_path = str(weights_dir), base
    state = "" if weights_dir == run_dir else f" and {weights_dir / LOOP_STATE_FILE}"  # where taken values come from
    try:
        followed = dataclasses.replace(eval_args, **taken)  # __post_init__ checks the run's values as given ones
    except (TypeError, ValueError) as error:
        raise RecipeError(f"{run_dir / RECIPE_FILE}{state}: {str(error).splitlines()[0]}") from None
    followed.effective_recipe = getattr(eval_args, "effective_recipe", {})  # type: ignore[attr-defined]
    followed.nulls_given = getattr(eval_args, "nulls_given", [])  # type: ignore[attr-defined]
    if taken:
        listed = ", ".join(f"{key} {value}" for key, value in taken.items())
        logger.info(f"loop-eval: following the run in {run_dir} ({RECIPE_FILE}{state}): {listed}; a flag overrides any")
    return followed, taken


def cli(argv: Sequence[str] | None = None) -> int:
    """Entry point: one actionable line on user errors, exit status 2."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        eval_args, model_args = parse_recipe(argv, (EvalArguments, ModelConfig))
        eval_args, _ = follow_run(eval_args, model_args)
        metrics = evaluate(eval_args, model_args)
    except (RecipeError, EnvironmentSetupError) as error:
        # the environments' advice names training's keys; here the split is --split
        print(f"loop-eval: error: {str(error).replace('train_split / eval_split', '--split')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loop-eval: interrupted; nothing was written for the unfinished evaluation", file=sys.stderr)
        return 130
    print(format_metrics(metrics))
    print(f"results, metrics and viewer.html in {eval_args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
