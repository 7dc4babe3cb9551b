"""LOOPConfig takes what LOOP uses and nothing else: every other setting of TrainingArguments or GRPOConfig
stops with one line naming LOOP's equivalent, in Python, in a recipe and as a flag (training and
``--dry-run``); the keys documentation and advice name are real.

``python tests/unit/config/test_keys.py`` prints the table of docs/recipes.md "Settings of other trainers".
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from transformers import HfArgumentParser, TrainingArguments
from trl import ModelConfig

from loop_trainer.cli.recipe import ScriptArguments
from loop_trainer.cli.train import cli
from loop_trainer.config import (
    HONOURED_TRAINING_ARGUMENTS,
    LOOP_EQUIVALENTS,
    LOOP_OWN_KEYS,
    LOOPConfig,
    unknown_key_message,
)

ROOT = Path(__file__).resolve().parents[3]
INIT_KEYS = {f.name for f in dataclasses.fields(LOOPConfig) if f.init}
ALL_KEYS = {f.name for cls in (ScriptArguments, LOOPConfig, ModelConfig) for f in dataclasses.fields(cls) if f.init}
TRAINING_ARGUMENTS = {f.name for f in dataclasses.fields(TrainingArguments)}
SNAKE_CASE = r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+"

# Settings of GRPOConfig / TrainingArguments that LOOP does not take, each with a value as a recipe writes it.
NAMED_KEYS = {
    "loss_type": "dapo",  # TRL's default: written in a recipe it still asks for a loss LOOP never computes
    "top_entropy_quantile": 0.2,
    "delta": 2.0,
    "scale_rewards": "batch",
    "importance_sampling_level": "sequence",
    "repetition_penalty": 1.1,
    "generation_kwargs": {"max_tokens": 5},
    "gradient_accumulation_steps": 4,
    "eval_steps": 10,
    "num_generations": 4,
    "steps_per_generation": 2,
    "generation_batch_size": 8,
    "max_steps": 5,
    "max_completion_length": 64,
    "sync_ref_model": True,
}


def test_loop_config_takes_loops_keys_and_the_training_arguments_it_honours():
    assert INIT_KEYS == LOOP_OWN_KEYS | (HONOURED_TRAINING_ARGUMENTS & TRAINING_ARGUMENTS)
    assert HONOURED_TRAINING_ARGUMENTS <= TRAINING_ARGUMENTS, "no longer TrainingArguments fields: " + str(
        sorted(HONOURED_TRAINING_ARGUMENTS - TRAINING_ARGUMENTS)
    )
    # every other TrainingArguments field (a new transformers' too) keeps its default for the Trainer,
    # but is no argument
    hidden = TRAINING_ARGUMENTS - INIT_KEYS
    assert {"eval_steps", "max_steps", "gradient_accumulation_steps", "fsdp", "torch_compile"} <= hidden
    args = LOOPConfig(output_dir="x")
    defaults = TrainingArguments(output_dir="x")
    assert all(getattr(args, key) == getattr(defaults, key) for key in hidden - {"logging_dir"})


def test_every_equivalent_named_is_a_loop_key():
    for key, equivalent in LOOP_EQUIVALENTS.items():
        assert key not in INIT_KEYS, key
        assert equivalent is None or equivalent in INIT_KEYS, (key, equivalent)


def test_defaults_refuse_nothing():
    LOOPConfig(output_dir="x")


@pytest.mark.parametrize("key", list(NAMED_KEYS))
def test_constructing_with_another_trainers_key_is_one_line(key):
    with pytest.raises(TypeError) as caught:
        LOOPConfig(output_dir="x", **{key: NAMED_KEYS[key]})
    assert str(caught.value) == unknown_key_message(key)
    assert "\n" not in str(caught.value)


def test_the_message_names_loops_equivalent():
    assert (
        unknown_key_message("eval_steps") == "LOOPConfig has no setting 'eval_steps'; LOOP's equivalent is eval_every"
    )
    assert unknown_key_message("loss_type").startswith("LOOPConfig has no setting 'loss_type' (LOOP's objective")


def test_transformers_argument_parser_takes_loop_config():
    """A user's own script parsing LOOPConfig with HfArgumentParser/TrlParser (every field's metadata is argparse's)."""
    [args] = HfArgumentParser(LOOPConfig).parse_args_into_dataclasses(
        ["--output_dir", "x", "--iterations", "2", "--max_turns", "3"]
    )
    assert (args.iterations, args.max_turns) == (2, 3)


@pytest.mark.parametrize("dry_run", [False, True], ids=["train", "dry-run"])
@pytest.mark.parametrize("key", list(NAMED_KEYS))
def test_a_recipe_setting_another_trainers_key_stops_with_one_line(tmp_path, capsys, key, dry_run):
    import yaml

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump({"model_name_or_path": "tiny:vault", "output_dir": str(tmp_path / "o"), key: NAMED_KEYS[key]})
    )
    assert cli(["--config", str(recipe), *(["--dry-run"] if dry_run else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"loop-train: error: unknown key '{key}' in {recipe}: {unknown_key_message(key)}"
    assert not (tmp_path / "o").exists()  # stopped before any work


@pytest.mark.parametrize("flag", ["--gradient_accumulation_steps=4", "--gradient_accumulation_steps 4"])
def test_a_flag_setting_another_trainers_key_stops_with_one_line(tmp_path, capsys, flag):
    assert cli(["--output_dir", str(tmp_path / "o"), "--model_name_or_path", "tiny:vault", *flag.split()]) == 2
    assert capsys.readouterr().err.strip() == (
        "loop-train: error: unknown option '--gradient_accumulation_steps': "
        f"{unknown_key_message('gradient_accumulation_steps')}"
    )


# --- documentation ---------------------------------------------------------------------------------------------
def render_equivalents_table() -> str:
    rows = ["| setting of another trainer | LOOP's equivalent |", "| --- | --- |"]
    for key, equivalent in sorted(LOOP_EQUIVALENTS.items()):
        rows.append(f"| `{key}` | {f'`{equivalent}`' if equivalent else '- (not part of LOOP)'} |")
    return "\n".join(rows)


def test_recipes_doc_lists_the_equivalents_of_the_code():
    doc = (ROOT / "docs" / "recipes.md").read_text()
    assert render_equivalents_table() in doc, "regenerate the table: python tests/unit/config/test_keys.py"


def test_loop_trainer_doc_does_not_say_use_vllm_is_rejected_or_eval_steps_counts_iterations():
    doc = (ROOT / "docs" / "loop_trainer.md").read_text()
    assert "(for now) `use_vllm`" not in doc
    assert not re.search(r"`eval_steps` (are|is) in iterations", doc)


# --- every key named in advice is a real key -------------------------------------------------------------------
def _string_constants(path: Path) -> list[str]:
    return [
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


@pytest.mark.parametrize("module", ["cli/dry_run.py", "config/loop_config.py", "config/keys.py", "cli/recipe.py"])
def test_keys_named_in_messages_are_real(module):
    """``key: value`` and ``key=`` in a message name a recipe key (``set vllm_sleep_mode: true`` did not)."""
    named = set()
    for text in _string_constants(ROOT / "src" / "loop_trainer" / module):
        named |= set(re.findall(rf"\b({SNAKE_CASE}): (?=\S)", text)) | set(re.findall(rf"\b({SNAKE_CASE})=", text))
    assert named <= ALL_KEYS, sorted(named - ALL_KEYS)


R7B, R32B = "recipes/appworld/qwen2.5-7b-instruct.yaml", "recipes/appworld/qwen2.5-32b-instruct.yaml"


@pytest.mark.parametrize(
    "flags",
    [
        [
            "--config",
            R32B,
            "--vllm_mode",
            "colocate",
            "--vllm_gpu_memory_utilization",
            "0.9",
            "--vllm_tensor_parallel_size",
            "1",
        ],  # colocated vLLM without sleep mode
        ["--config", R7B, "--use_vllm", "false"],  # the transformers backend's generation batch
        [
            "--config",
            R32B,
            "--use_peft",
            "false",
            "--plan_gpus",
            "1",
            "--vllm_tensor_parallel_size",
            "1",
            "--activation_checkpointing",
            "false",
            "--per_device_train_batch_size",
            "2",
        ],
        ["--config", R7B, "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.1"],
    ],
    ids=["vllm-awake", "generation-batch", "full-fine-tuning", "vllm-too-small"],
)
def test_every_identifier_in_the_dry_runs_advice_is_a_real_key(flags, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli([*flags, "--dry-run"]) == 3
    out = capsys.readouterr().out
    advice = out[out.index("DOES NOT FIT") :].splitlines()[1:]  # the reasons and the fix
    assert any(line.startswith("  fits with these together: ") for line in advice)
    named = {word for line in advice for word in re.findall(rf"\b{SNAKE_CASE}\b", line)}
    assert named <= ALL_KEYS, (sorted(named - ALL_KEYS), advice)


def test_the_sleep_mode_advice_names_vllm_enable_sleep_mode(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli(["--config", R7B, "--plan_gpu_memory_gib", "40", "--dry-run"]) == 3
    out = capsys.readouterr().out
    assert "vllm_enable_sleep_mode: true" in out and "--vllm_enable_sleep_mode true" in out
    assert "vllm_sleep_mode" not in out  # the planner's own name for it


if __name__ == "__main__":
    print(render_equivalents_table())
