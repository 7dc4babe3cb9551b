"""Recipes: YAML + command-line flags -> (ScriptArguments, LOOPConfig, ModelConfig), TRL-style.

``--config recipe.yaml`` sets values, flags override them, a top-level ``env:`` mapping is exported
as environment variables (TrlParser's conventions). Unlike a bare TrlParser, every YAML value goes
through the same type checks as a flag, and a mistake -- an unknown key, a bad value, a missing
file -- becomes one :class:`RecipeError` line with a did-you-mean, not a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import enum
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import yaml
from transformers import TrainingArguments
from transformers.hf_argparser import DataClassType
from trl import GRPOConfig, ModelConfig, TrlParser

from ..config import LOOP_EQUIVALENTS, LOOPConfig, check_ranges, unknown_key_message
from ..config.combinations import planning_a_gpu_launch
from ..config.ranges import above, at_least, setting


class RecipeError(ValueError):
    """A mistake in a recipe or on the command line, explained in one line."""


@dataclass
class ScriptArguments:
    """What to train on (the rest of a recipe is LOOPConfig and TRL's ModelConfig)."""

    environment: str = field(
        default="vault", metadata={"help": "Environment: a built-in name, an entry point, or 'package.module:Class'."}
    )
    environment_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Keyword arguments for the environment (a mapping, or JSON on the CLI)."}
    )
    dry_run: bool = field(
        default=False,
        metadata={
            "help": "Check the recipe and print its per-GPU memory plan, its verdict and, if it does not fit, the "
            "settings that together would; train nothing (no GPU needed). Exit status 3 if the plan does not fit."
        },
    )
    dry_run_show_config: bool = field(
        default=False,
        metadata={
            "help": "With --dry-run: also print every resolved setting (the full configuration) before the plan."
        },
    )
    plan_gpus: int | None = setting(
        None,
        "GPUs the memory plan assumes (default: $WORLD_SIZE, else 8).",
        at_least(1, "GPUs the dry run's memory plan assumes; None: $WORLD_SIZE, else 8", none=True),
    )
    plan_gpu_memory_gib: float = setting(
        80.0, "Memory of one GPU for the memory plan.", above(0, "the memory of one GPU in the dry run's memory plan")
    )
    plan_gpus_per_machine: int | None = setting(
        None,
        "GPUs of one machine, for the dry run's check of server addresses (default: $LOCAL_WORLD_SIZE, else 8).",
        at_least(1, "GPUs of one machine in the dry run; None: $LOCAL_WORLD_SIZE, else 8", none=True),
    )

    def __post_init__(self) -> None:
        try:
            check_ranges(self)
        except ValueError as error:
            raise RecipeError(str(error)) from None
        if self.dry_run_show_config and not self.dry_run:
            raise RecipeError("dry_run_show_config prints the configuration of a dry run: add --dry-run, or remove it")
        self.environment_kwargs = given_mapping(self.environment_kwargs, "environment_kwargs")


def given_mapping(value: Any, key: str, what: str = "") -> Any:
    """A mapping-valued key as given: a mapping, the JSON text of one (the command line's) parsed, or None;
    anything else refused in one line (``what``: what the mapping holds, for that line)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise RecipeError(f"{key} is not valid JSON: {error}") from None
    if value is not None and not isinstance(value, dict):
        raise RecipeError(f"{key} must be a mapping{what}")
    return value


# Options parse_recipe itself reads, besides the dataclasses' keys.
OWN_OPTIONS = ("config", "help")


class _Parser(TrlParser):
    def error(self, message: str) -> NoReturn:  # argparse would print usage and exit
        raise RecipeError(message.replace("the following arguments are required", "missing required arguments"))


DATACLASSES = (ScriptArguments, LOOPConfig, ModelConfig)


# TRL ModelConfig keys loop-train and loop-eval do not honour: key -> why (one line if set).
REFUSED_MODEL_KEYS: dict[str, str] = dict.fromkeys(
    ("load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage"),
    "quantised (bitsandbytes) loading is not supported by LOOP; train a LoRA adapter on bf16 weights "
    "(use_peft: true, dtype: bfloat16)",
)


def make_parser(classes: Sequence[type] = DATACLASSES) -> TrlParser:
    parser = _Parser(tuple(DataClassType(c) for c in classes))
    # --help lists every field of the dataclasses; say which ModelConfig ones LOOP refuses rather than advertise them.
    for action in parser._actions:
        if action.dest in REFUSED_MODEL_KEYS and ModelConfig in classes:
            action.help = f"REFUSED by LOOP: {REFUSED_MODEL_KEYS[action.dest]}."
    return parser


def refuse_unused_model_keys(model_args: ModelConfig) -> None:
    """One line for a ModelConfig key set away from its default that LOOP does not honour."""
    defaults = {spec.name: spec.default for spec in dataclasses.fields(ModelConfig)}
    for key, why in REFUSED_MODEL_KEYS.items():
        value = getattr(model_args, key)
        if value != defaults[key]:
            raise RecipeError(f"{key}={value!r} is not used by LOOP: {why}")


def _known_keys(classes: Sequence[type]) -> set[str]:
    return {f.name for cls in classes for f in dataclasses.fields(cls) if f.init}


# Settings of other trainers: a recipe naming one gets LOOP's equivalent, not a spelling suggestion.
OTHER_TRAINERS_KEYS = frozenset(LOOP_EQUIVALENTS) | {
    f.name for cls in (TrainingArguments, GRPOConfig) for f in dataclasses.fields(cls)
}


def _did_you_mean(key: str, classes: Sequence[type], prefix: str = "") -> str:
    """A hint spelled as the user spelled the mistake: ``prefix`` is ``--`` for a flag, empty for a YAML key.
    For another trainer's setting, LOOP's equivalent."""
    if key in OTHER_TRAINERS_KEYS and LOOPConfig in classes:
        return f": {unknown_key_message(key)}"
    candidates = sorted(_known_keys(classes) | (set(OWN_OPTIONS) if prefix else set()))
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.7)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


COMMA_SEPARATED = ("report_to",)
"""Keys whose YAML list is one comma-separated flag (``report_to: [wandb, tensorboard]``): TrainingArguments
parses them as one string, so the list's items as separate flags would be refused as unused arguments."""


def _as_flags(config: dict[str, Any], source: str, classes: Sequence[type]) -> tuple[list[str], dict[str, Any]]:
    """YAML values as command-line flags, so argparse type-checks them like flags; ``None``
    values (which flags cannot spell) are returned separately as parser defaults."""
    known = _known_keys(classes)
    flags: list[str] = []
    nulls: dict[str, Any] = {}
    for key, value in config.items():
        if key not in known:
            raise RecipeError(f"unknown key '{key}' in {source}{_did_you_mean(key, classes)}")
        if value is None:
            nulls[key] = None
        elif isinstance(value, bool):
            flags += [f"--{key}", str(value).lower()]
        elif isinstance(value, list) and key in COMMA_SEPARATED:
            flags += [f"--{key}", ",".join(map(str, value))]
        elif isinstance(value, list):
            flags += [f"--{key}", *map(str, value)]
        elif isinstance(value, dict):
            flags += [f"--{key}", json.dumps(value)]
        else:
            flags += [f"--{key}", str(value)]
    return flags, nulls


def launch_deepspeed_config() -> dict[str, Any] | None:
    """The DeepSpeed settings an ``accelerate launch`` passes as JSON (its config's ``deepspeed_config_file``, or the
    JSON text itself), read and checked: the training arguments read the file too, and JSON's own error would not
    say which file it is about. None where the launch names none (no DeepSpeed, or the settings in accelerate's own
    variables from its config's ``deepspeed_config``)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true"):
        return None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path:
        return None
    named = f"the DeepSpeed config file {path} (deepspeed_config_file in the accelerate config)"
    try:
        if path.lstrip().startswith("{"):  # the settings themselves (DeepSpeed accepts JSON text)
            settings = json.loads(path)
        elif not os.path.isfile(path):
            raise RecipeError(f"{named} is not found")
        else:
            with open(path) as handle:
                settings = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RecipeError(f"{named} is not valid JSON: {error}") from None
    if not isinstance(settings, dict):
        raise RecipeError(f"the DeepSpeed config file {path} must hold a JSON object of DeepSpeed's settings")
    return settings


def as_written(value: Any) -> Any:
    """``value`` as a recipe writes it (``yaml.safe_dump`` writes nothing else): a settings object (transformers'
    ``AcceleratorConfig``) as its mapping, an enum (``DebugOption``, ``IntervalStrategy``) as its value, tuples as
    lists, at any depth."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, enum.Enum):
        return as_written(value.value)
    if isinstance(value, dict):
        return {str(key): as_written(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [as_written(item) for item in value]
    return value


def parse_recipe(argv: Sequence[str] | None = None, classes: Sequence[type] = DATACLASSES) -> tuple[Any, ...]:
    """Parse ``[--config recipe.yaml] [--key value ...]`` into one instance of each of ``classes``
    (by default ScriptArguments, LOOPConfig, ModelConfig); raise :class:`RecipeError` on mistakes."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser(classes)
    config_flags: list[str] = []
    nulls: dict[str, Any] = {}
    config: dict[str, Any] = {}
    index = next((i for i, token in enumerate(argv) if token == "--config" or token.startswith("--config=")), None)
    if index is not None:
        if argv[index] == "--config":
            if index + 1 >= len(argv):
                raise RecipeError("--config needs a path to a YAML recipe")
            path = argv.pop(index + 1)
        else:
            path = argv[index].split("=", 1)[1]
            if not path:
                raise RecipeError("--config needs a path to a YAML recipe")
        del argv[index]
        if not os.path.isfile(path):
            raise RecipeError(f"recipe file not found: {path}")
        try:
            with open(path) as handle:
                config = yaml.safe_load(handle) or {}
        except yaml.YAMLError as error:
            raise RecipeError(f"{path} is not valid YAML: {str(error).splitlines()[0]}") from None
        if not isinstance(config, dict):
            raise RecipeError(f"{path} must contain a YAML mapping of keys to values")
        exported = config.pop("env", None) or {}
        if not isinstance(exported, dict):
            raise RecipeError(f"'env' in {path} must be a mapping of environment variables")
        os.environ.update({str(k): str(v) for k, v in exported.items()})
        config_flags, nulls = _as_flags(config, path, classes)
        parser.set_defaults(**nulls)
    for token in argv:
        if token == "--help":  # argparse prints the help and exits 0, as for -h
            continue
        if token.startswith("--") and token[2:].split("=", 1)[0].replace("-", "_") not in _known_keys(classes):
            key = token[2:].split("=", 1)[0]
            raise RecipeError(f"unknown option '--{key}'{_did_you_mean(key, classes, prefix='--')}")
    launch_deepspeed_config()  # checked before the training arguments read it
    try:
        # A dry run checks the recipe for the GPU launch it plans, not for this machine (maybe without a GPU).
        dry_run = getattr(parser.parse_known_args(args=config_flags + argv)[0], "dry_run", False)
        with planning_a_gpu_launch() if dry_run else contextlib.nullcontext():
            parsed = tuple(parser.parse_args_into_dataclasses(args=config_flags + argv))
    except RecipeError:
        raise
    except (ValueError, TypeError, argparse.ArgumentError) as error:
        raise RecipeError(str(error).splitlines()[0]) from None
    # The recipe as run (YAML keys and flags, after overrides), for the model card and the Hub.
    given = [t[2:].split("=", 1)[0].replace("-", "_") for t in config_flags + argv if t.startswith("--")]
    effective = {}
    for key in dict.fromkeys(given):
        value = next(getattr(obj, key) for obj in parsed if hasattr(obj, key))
        effective[key] = as_written(value)
    for obj in parsed:
        if isinstance(obj, ModelConfig):
            refuse_unused_model_keys(obj)
    parsed[0].effective_recipe = effective
    # The keys the YAML sets to null (none of them a flag): a parser default, left out of the recipe as run (which
    # would record their value as resolved), but set: loop-eval keeps those whose None is a value of its own.
    parsed[0].nulls_given = [key for key in nulls if key not in effective]
    return parsed
