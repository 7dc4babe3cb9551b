"""loop-train: recipes, overrides, and one actionable line for every user mistake."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loop_trainer.recipe import RecipeError, parse_recipe
from loop_trainer.scripts.train import cli

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_yaml_sets_defaults_and_flags_override(tmp_path):
    recipe = write(tmp_path, """
        model_name_or_path: tiny:vault
        environment: vault
        environment_kwargs: {num_tasks: 8}
        output_dir: out
        learning_rate: 0.001
        iterations: 7
        lora_target_modules: [q_proj, v_proj]
        max_training_tokens: null
        env:
          LOOP_TEST_EXPORTED: "yes"
    """)
    script, args, model = parse_recipe(["--config", recipe, "--iterations", "3"])
    assert (args.learning_rate, args.iterations, args.max_steps) == (0.001, 3, 3)
    assert script.environment_kwargs == {"num_tasks": 8}
    assert model.model_name_or_path == "tiny:vault" and model.lora_target_modules == ["q_proj", "v_proj"]
    import os

    assert os.environ["LOOP_TEST_EXPORTED"] == "yes"


@pytest.mark.parametrize(
    ("recipe", "flags", "message"),
    [
        ("lerning_rate: 0.1\n", [], "unknown key 'lerning_rate' in .* \\(did you mean 'learning_rate'\\?\\)"),
        ("learning_rate: fast\n", [], "learning_rate.*invalid float value: 'fast'"),
        ("iterations: 0\n", [], "iterations must be >= 1"),
        ("beta: 0.04\n", [], "beta=0.04 is not supported by LOOP"),
        ("", ["--rollouts_per_tsk", "4"], "unknown option '--rollouts_per_tsk' \\(did you mean '--rollouts_per_task'|rollouts_per_task"),
        ("- a list\n", [], "must contain a YAML mapping"),
        ("environment_kwargs: '{bad json'\n", [], "environment_kwargs is not valid JSON"),
    ],
)
def test_recipe_mistakes_are_one_line(tmp_path, recipe, flags, message):
    path = write(tmp_path, "output_dir: out\n" + recipe if not recipe.startswith("-") else recipe)
    with pytest.raises(RecipeError, match=message):
        parse_recipe(["--config", path, *flags])


def test_missing_recipe_file():
    with pytest.raises(RecipeError, match="recipe file not found: nope.yaml"):
        parse_recipe(["--config", "nope.yaml"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model_name_or_path", "/no/such/model"], "cannot load model_name_or_path '/no/such/model'"),
        (["--model_name_or_path", "tiny:vault", "--environment", "appwrld"], "unknown environment 'appwrld'"),
        (["--model_name_or_path", "tiny:vault", "--environment_kwargs", '{"num_tsks": 3}'], "bad arguments for environment 'vault'"),
        ([], "model_name_or_path is not set"),
    ],
)
def test_cli_user_errors_exit_2_with_one_line(tmp_path, capsys, flags, message):
    code = cli(["--output_dir", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("loop-train: error: ") and "\n" not in err
    assert __import__("re").search(message, err), err


def test_console_script_prints_no_traceback(tmp_path):
    bin_dir = Path(sys.executable).parent
    exe = bin_dir / "loop-train"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "loop_trainer.scripts.train"]
    result = subprocess.run([*command, "--config", write(tmp_path, "output_dir: o\nlerning_rate: 1\n")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"loop-train: error: unknown key 'lerning_rate' in {tmp_path / 'recipe.yaml'} (did you mean 'learning_rate'?)"
    )


def test_cli_trains_from_a_recipe(tmp_path, capsys):
    recipe = write(tmp_path, f"""
        model_name_or_path: tiny:vault
        environment: vault
        output_dir: {tmp_path / 'run'}
        iterations: 2
        tasks_per_iteration: 2
        rollouts_per_task: 3
        max_turns: 3
        max_new_tokens_per_turn: 4
        max_trajectory_tokens: 256
        activation_checkpointing: false
        disable_tqdm: true
    """)
    assert cli(["--config", recipe]) == 0
    out = capsys.readouterr().out
    assert "LOOP: 2 iterations on 'vault'" in out and "metrics.jsonl" in out
    assert (tmp_path / "run" / "metrics.jsonl").exists() and (tmp_path / "run" / "model.safetensors").exists()
