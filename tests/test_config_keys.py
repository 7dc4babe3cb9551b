"""Every LOOPConfig key is honoured or refused: the inherited-key tables, their one-line refusals
through ``loop-train`` (training and ``--dry-run``), their documentation, and the keys advice names.

``python tests/test_config_keys.py`` prints the table of docs/recipes.md "Inherited keys LOOP refuses".
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from trl import ModelConfig

from loop_trainer.cli.recipe import ScriptArguments
from loop_trainer.cli.train import cli
from loop_trainer.config import (
    HONOURED_INHERITED_KEYS,
    LOOP_OWN_KEYS,
    REFUSED_INHERITED_KEYS,
    LOOPConfig,
    refused_key_message,
)

ROOT = Path(__file__).resolve().parents[1]
ALL_KEYS = {f.name for cls in (ScriptArguments, LOOPConfig, ModelConfig) for f in dataclasses.fields(cls)}
SNAKE_CASE = r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+"

# The keys issue 11 names as accepted-and-ignored, plus the ones LOOPConfig.__post_init__ overwrites
# (a value the user set must be refused before it is overwritten), each with a value as a recipe writes it.
NAMED_KEYS = {
    "loss_type": "dapo",  # TRL's default: written in a recipe it still asks for a loss LOOP never computes
    "epsilon_high": 0.28,
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


def test_every_field_is_loops_own_honoured_or_refused():
    """A TRL/transformers upgrade that adds a field fails here until the field is classified."""
    fields = {f.name for f in dataclasses.fields(LOOPConfig)}
    unclassified = fields - LOOP_OWN_KEYS - HONOURED_INHERITED_KEYS - set(REFUSED_INHERITED_KEYS)
    assert not unclassified, f"classify in loop_trainer/config.py: {sorted(unclassified)}"
    stale = (HONOURED_INHERITED_KEYS | set(REFUSED_INHERITED_KEYS)) - fields
    assert not stale, f"no longer fields of GRPOConfig: {sorted(stale)}"
    assert not LOOP_OWN_KEYS & HONOURED_INHERITED_KEYS
    assert not LOOP_OWN_KEYS & set(REFUSED_INHERITED_KEYS)
    assert not HONOURED_INHERITED_KEYS & set(REFUSED_INHERITED_KEYS)


def test_every_equivalent_named_is_a_key_loop_honours():
    for key, (equivalent, _) in REFUSED_INHERITED_KEYS.items():
        assert equivalent is None or equivalent in LOOP_OWN_KEYS | HONOURED_INHERITED_KEYS, (key, equivalent)


def test_defaults_refuse_nothing():
    LOOPConfig(output_dir="x")


@pytest.mark.parametrize("key", ["num_generations", "steps_per_generation", "max_steps", "max_completion_length",
                                 "gradient_accumulation_steps", "epsilon_high", "eval_steps", "generation_kwargs"])
def test_constructing_with_a_refused_key_is_one_line(key):
    with pytest.raises(ValueError) as caught:
        LOOPConfig(output_dir="x", **{key: NAMED_KEYS[key]})
    assert str(caught.value) == refused_key_message(key, NAMED_KEYS[key])
    assert "\n" not in str(caught.value)


def test_refusal_names_loops_equivalent():
    assert refused_key_message("eval_steps", 10) == (
        "LOOPConfig: eval_steps=10 is not used by LOOP; use eval_every "
        "(LOOP evaluates by running episodes on eval_split every eval_every iterations)")
    assert refused_key_message("loss_type", "dapo").startswith("LOOPConfig: loss_type='dapo' is not used by LOOP (")


@pytest.mark.parametrize("dry_run", [False, True], ids=["train", "dry-run"])
@pytest.mark.parametrize("key", list(NAMED_KEYS))
def test_a_recipe_setting_an_unused_inherited_key_stops_with_one_line(tmp_path, capsys, key, dry_run):
    import yaml

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": "tiny:vault", "output_dir": str(tmp_path / "o"),
                                      key: NAMED_KEYS[key]}))
    assert cli(["--config", str(recipe), *(["--dry-run"] if dry_run else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"loop-train: error: {refused_key_message(key, NAMED_KEYS[key])}"
    assert not (tmp_path / "o").exists()  # stopped before any work


@pytest.mark.parametrize("flag", ["--gradient_accumulation_steps=4", "--gradient_accumulation_steps 4"])
def test_a_flag_setting_an_unused_inherited_key_stops_with_one_line(tmp_path, capsys, flag):
    assert cli(["--output_dir", str(tmp_path / "o"), "--model_name_or_path", "tiny:vault", *flag.split()]) == 2
    assert capsys.readouterr().err.strip() == f"loop-train: error: {refused_key_message('gradient_accumulation_steps', 4)}"


# --- documentation ---------------------------------------------------------------------------------------------
def render_refused_table() -> str:
    rows = ["| key | LOOP's equivalent | why LOOP does not use it |", "| --- | --- | --- |"]
    for key, (equivalent, why) in sorted(REFUSED_INHERITED_KEYS.items()):
        rows.append(f"| `{key}` | {f'`{equivalent}`' if equivalent else '-'} | {why.replace('|', '/')} |")
    return "\n".join(rows)


def test_recipes_doc_lists_the_refused_keys_of_the_code():
    doc = (ROOT / "docs" / "recipes.md").read_text()
    assert render_refused_table() in doc, "regenerate the table: python tests/test_config_keys.py"


def test_loop_trainer_doc_does_not_say_use_vllm_is_rejected_or_eval_steps_counts_iterations():
    doc = (ROOT / "docs" / "loop_trainer.md").read_text()
    assert "(for now) `use_vllm`" not in doc
    assert not re.search(r"`eval_steps` (are|is) in iterations", doc)


# --- every key named in advice is a real key -------------------------------------------------------------------
def _string_constants(path: Path) -> list[str]:
    return [node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


@pytest.mark.parametrize("module", ["cli/dry_run.py", "config.py", "cli/recipe.py"])
def test_keys_named_in_messages_are_real(module):
    """``key: value`` and ``key=`` in a message name a recipe key (``set vllm_sleep_mode: true`` did not)."""
    named = set()
    for text in _string_constants(ROOT / "src" / "loop_trainer" / module):
        named |= set(re.findall(rf"\b({SNAKE_CASE}): (?=\S)", text)) | set(re.findall(rf"\b({SNAKE_CASE})=", text))
    assert named <= ALL_KEYS, sorted(named - ALL_KEYS)


R7B, R32B = "recipes/appworld/qwen2.5-7b-instruct.yaml", "recipes/appworld/qwen2.5-32b-instruct.yaml"


@pytest.mark.parametrize("flags", [
    ["--config", R32B, "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.9",
     "--vllm_tensor_parallel_size", "1"],  # colocated vLLM without sleep mode
    ["--config", R7B, "--use_vllm", "false"],  # the transformers backend's generation batch
    ["--config", R32B, "--use_peft", "false", "--plan_gpus", "1", "--vllm_tensor_parallel_size", "1",
     "--activation_checkpointing", "false", "--per_device_train_batch_size", "2"],
    ["--config", R7B, "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.1"],
], ids=["vllm-awake", "generation-batch", "full-fine-tuning", "vllm-too-small"])
def test_every_identifier_in_the_dry_runs_advice_is_a_real_key(flags, capsys):
    assert cli([*flags, "--dry-run"]) == 3
    advice = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  - ")]
    assert advice
    named = {word for line in advice for word in re.findall(rf"\b{SNAKE_CASE}\b", line)}
    assert named <= ALL_KEYS, (sorted(named - ALL_KEYS), advice)


def test_the_sleep_mode_advice_names_vllm_enable_sleep_mode(capsys):
    flags = ["--config", R32B, "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.9",
             "--vllm_tensor_parallel_size", "1", "--dry-run"]
    assert cli(flags) == 3
    assert "set vllm_enable_sleep_mode: true" in capsys.readouterr().out


if __name__ == "__main__":
    print(render_refused_table())
