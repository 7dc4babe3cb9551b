"""Every numeric LOOP key declares its range on its field, checked at configuration time, and the
configuration mistakes of defect 5 are one line: through Python (ValueError), ``loop-train`` and
``loop-train --dry-run`` (exit 2, no traceback), and ``loop-eval`` (the same rules).

``python tests/unit/config/test_ranges.py`` prints the table of docs/recipes.md "Allowed values".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loop_trainer.cli.evaluate import EvalArguments
from loop_trainer.cli.recipe import RecipeError, parse_recipe
from loop_trainer.cli.train import cli
from loop_trainer.config import EpisodeSettings, LOOPConfig, range_of
from loop_trainer.config.ranges import Interval, Range, at_least, steps_or_fraction
from support.in_process import loop_train_in_process

ROOT = Path(__file__).resolve().parents[3]
FIELDS = {spec.name: spec for spec in dataclasses.fields(LOOPConfig) if spec.init}


def range_message(key: str, value, rule: Range) -> str:
    return rule.message(key, value)


def allowed(key: str) -> str:
    return range_of(LOOPConfig, key).allowed


# A run that would train in seconds were its configuration accepted.
TINY = [
    "--model_name_or_path",
    "tiny:vault",
    "--environment_kwargs",
    json.dumps({"num_tasks": 8}),
    "--iterations",
    "1",
    "--tasks_per_iteration",
    "2",
    "--rollouts_per_task",
    "2",
    "--max_turns",
    "2",
    "--max_new_tokens_per_turn",
    "3",
    "--max_trajectory_tokens",
    "64",
    "--activation_checkpointing",
    "false",
    "--memory_stress_test",
    "false",
    "--disable_tqdm",
    "true",
    "--plot_curves",
    "false",
]


def loop_train(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "loop_trainer.cli.train", *flags], capture_output=True, text=True, timeout=300, env=env
    )


def loop_train_here(capsys: pytest.CaptureFixture[str], *flags: str) -> subprocess.CompletedProcess:
    """:func:`loop_train` in this process. The refusals below run here;
    test_the_loop_train_command_refuses_a_nonsense_value_with_one_line runs the command itself."""
    return loop_train_in_process(capsys, flags)


def assert_one_line_refusal(result: subprocess.CompletedProcess, message: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert result.stderr.strip().splitlines()[-1] == f"loop-train: error: {message}"


def is_numeric(spec: dataclasses.Field) -> bool:
    annotation = spec.type if isinstance(spec.type, str) else getattr(spec.type, "__name__", str(spec.type))
    default = spec.default if spec.default is not dataclasses.MISSING else None
    return bool(re.search(r"\b(int|float)\b", str(annotation))) or (
        isinstance(default, (int, float)) and not isinstance(default, bool)
    )


# --- every numeric key declares a range ---------------------------------------------------------------------
def test_every_numeric_key_declares_a_range_or_why_not():
    """A numeric key added to LOOPConfig (or EpisodeSettings) fails here until its field declares a range."""
    numeric = {name for name, spec in FIELDS.items() if is_numeric(spec)}
    assert {
        "max_grad_norm",
        "epsilon",
        "save_steps",
        "env_timeout",
        "eval_max_tasks",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "warmup_steps",
        "seed",
    } <= numeric  # the detection works
    missing = {
        name
        for name in numeric
        if getattr(FIELDS[name], "range", None) is None and not getattr(FIELDS[name], "unranged", None)
    }
    assert not missing, f"declare a range on these fields (config.ranges.setting): {sorted(missing)}"
    assert getattr(FIELDS["local_rank"], "unranged", None)


def test_every_range_accepts_its_default():
    defaults = LOOPConfig(output_dir="x")
    for key, spec in FIELDS.items():
        rule = getattr(spec, "range", None)
        if rule is None:
            continue
        value = getattr(defaults, key) if key == "max_training_tokens" else spec.default  # its default is filled in
        assert rule.allows(value), (key, value, rule.allowed)
        assert rule.when is None or rule.when[0] in FIELDS


def test_the_ranges():
    positive, positive_or_inf = (
        Range((Interval(0, low_open=True),), ""),
        Range((Interval(0, low_open=True),), "", inf=True),
    )
    assert positive.allows(1e-9) and not positive.allows(0) and not positive.allows(math.nan)
    assert not positive.allows(math.inf) and positive_or_inf.allows(math.inf) and not positive_or_inf.allows(-math.inf)
    half_open = Range((Interval(0, 1, high_open=True),), "")
    assert half_open.allows(0) and not half_open.allows(1) and half_open.allowed == "in [0, 1)"
    assert at_least(1, "", none=True).allows(None) and not at_least(1, "").allows(None)
    assert not at_least(1, "").allows("2") and not at_least(1, "").allows(True)
    assert at_least(1, "", none=True).allowed == ">= 1 or None"
    whole_or_fraction = steps_or_fraction("", when=("save_strategy", "steps"))
    assert whole_or_fraction.allowed == "a whole number >= 1 or in (0, 1)"
    assert whole_or_fraction.allows(3) and whole_or_fraction.allows(3.0) and whole_or_fraction.allows(0.25)
    assert not whole_or_fraction.allows(1.5) and not whole_or_fraction.allows(0)
    anything = Range((Interval(),), "", none=True)
    assert anything.allowed == "a number or None" and anything.allows(-1) and not anything.allows(math.nan)
    assert range_of(LOOPConfig, "seed").allowed == "in [0, 4294967295]"


# --- values outside their range: LOOPConfig -------------------------------------------------------------------
# key -> (values refused, values accepted). The issue's probes first.
CASES = {
    "max_grad_norm": ([-1.0, 0.0, math.nan], [1e-3, math.inf]),  # -1 flipped every gradient
    "kl_abort_threshold": ([-1.0, 0.0], [1e-6, math.inf]),  # -1: no optimizer step ever
    "epsilon": ([0.0, -1.0, math.inf], [0.2]),  # 0 froze the policy; -1 divided by zero in the stress test
    "save_steps": ([0, -1, 1.5], [1, 3, 0.5]),  # 0 saved no checkpoint
    "learning_rate": ([-1.0, 0.0, math.nan], [1e-6]),
    "per_device_train_batch_size": ([0], [1]),
    "weight_decay": ([-0.01], [0.0]),
    "advantage_threshold": ([-0.01], [0.0]),
    "temperature": ([0.0], [0.7]),
    "eval_temperature": ([-0.5], [0.0]),
    "eval_every": ([-1], [0]),
    "eval_rollouts_per_task": ([0], [1]),
    "eval_max_tasks": ([0], [None, 1]),
    "max_training_tokens": ([0], [None, 1]),
    "viewer_rollouts_per_iteration": ([-1], [0]),
    "vllm_probe_tokens": ([1], [2]),
    "vllm_gpu_memory_utilization": ([0.0, 1.5], [1.0]),
    "save_total_limit": ([0], [None, 1]),
    "logging_steps": ([0, -1], [1, 0.5]),
    "env_timeout": ([0.0, -1.0], [0.5]),
    "iterations": ([0], [1]),
    "rollouts_per_task": ([1], [2]),
    "early_stop_done_fraction": ([1.1], [0.0]),
    "adam_beta1": ([1.0, -0.1], [0.0]),
    "adam_beta2": ([1.0], [0.5]),
    "adam_epsilon": ([0.0], [1e-12]),
    "warmup_steps": ([-1], [0.1, 10]),
    "seed": ([-1, 2**32], [0, 2**32 - 1]),
    "vllm_sync_tolerance": ([math.nan], [None, -1.0, 0.0]),
}


@pytest.mark.parametrize("key", list(CASES))
def test_a_value_outside_its_range_is_one_line_naming_key_value_and_range(key, tmp_path):
    refused, accepted = CASES[key]
    for value in refused:
        with pytest.raises(ValueError) as caught:
            LOOPConfig(output_dir=str(tmp_path / "o"), **{key: value})
        message = str(caught.value)
        assert message == f"LOOPConfig: {range_message(key, value, range_of(LOOPConfig, key))}"
        assert "\n" not in message and message.startswith(f"LOOPConfig: {key} must be {allowed(key)}")
        assert f"got {value!r}" in message
    for value in accepted:
        LOOPConfig(output_dir=str(tmp_path / "o"), **{key: value})


def test_a_flag_given_something_else_than_a_bool_is_refused_in_one_line(tmp_path):
    """Parsers type a flag; the Python API and loop-eval's model_episode_settings (a JSON mapping) do not, and
    "false" is true."""
    for key, value, allowed in (
        ("context_strip_thinking", "false", "true or false"),
        ("gradient_checkpointing", 0, "true, false or None"),
        ("static_decode", "no", "true, false or None"),
    ):
        with pytest.raises(ValueError) as caught:
            LOOPConfig(output_dir=str(tmp_path / "o"), **{key: value})
        assert str(caught.value) == f"LOOPConfig: {key} must be {allowed}, got {value!r}"
    LOOPConfig(output_dir=str(tmp_path / "o"), static_decode=None, context_strip_thinking=True)
    # transformers' argument parser replaces the fields' annotations with the types they name: the same check
    from loop_trainer.config.ranges import _flag_allows

    assert _flag_allows("bool | None") == _flag_allows(bool | None) == "true, false or None"
    assert _flag_allows("bool") == _flag_allows(bool) == "true or false"
    assert _flag_allows("int | None") is _flag_allows(int | None) is _flag_allows("bool | str") is None
    assert _flag_allows("Optional[bool]") == _flag_allows("None | bool") == "true, false or None"


def test_every_flag_declared_with_setting_is_checked_as_one():
    """A flag annotated in a way the check does not read would be left unchecked: none is."""
    from loop_trainer.cli.evaluate import EvalArguments
    from loop_trainer.config.ranges import SettingField, _flag_allows

    flags = [
        (cls.__name__, spec.name, spec.type)
        for cls in (LOOPConfig, EvalArguments, EpisodeSettings)
        for spec in dataclasses.fields(cls)
        if isinstance(spec, SettingField) and "bool" in str(spec.type)
    ]
    assert len(flags) > 10 and [flag for flag in flags if _flag_allows(flag[2]) is None] == []


def test_save_steps_is_checked_only_when_checkpoints_are_saved(tmp_path):
    LOOPConfig(output_dir=str(tmp_path / "o"), save_strategy="no", save_steps=0)
    with pytest.raises(ValueError, match=r"^LOOPConfig: save_steps must be .* with save_strategy: steps, got 0 "):
        LOOPConfig(output_dir=str(tmp_path / "o"), save_steps=0)


# --- through loop-train (train and --dry-run) -------------------------------------------------------------------
ISSUE_PROBES = [
    ("max_grad_norm", "-1", -1.0),
    ("kl_abort_threshold", "-1", -1.0),
    ("epsilon", "0", 0.0),
    ("save_steps", "0", 0.0),
    ("learning_rate", "-1", -1.0),
    ("epsilon", "-1", -1.0),
    ("per_device_train_batch_size", "0", 0),
    ("env_timeout", "0", 0.0),
    ("seed", "-1", -1),
]


@pytest.mark.parametrize(("key", "flag", "value"), ISSUE_PROBES, ids=[f"{k}={f}" for k, f, _ in ISSUE_PROBES])
def test_loop_train_refuses_a_nonsense_value_with_one_line(key, flag, value, tmp_path, capsys):
    """Before the fix these trained (max_grad_norm: -1 flipping every gradient, ...) or died with a traceback
    (learning_rate: -1 in the optimizer, epsilon: -1 a ZeroDivisionError, per_device_train_batch_size: 0)."""
    result = loop_train_here(capsys, "--output_dir", str(tmp_path / "o"), *TINY, f"--{key}", flag)
    assert_one_line_refusal(result, f"LOOPConfig: {range_message(key, value, range_of(LOOPConfig, key))}")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("dry_run", [False, True], ids=["train", "dry-run"])
def test_the_loop_train_command_refuses_a_nonsense_value_with_one_line(tmp_path, dry_run):
    """The refusals above, from the command itself: exit status 2, one line, no traceback."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'o'}\nmodel_name_or_path: tiny:vault\nmax_grad_norm: -1\n")
    result = loop_train("--config", str(recipe), *(["--dry-run"] if dry_run else TINY[2:]))
    rule = range_of(LOOPConfig, "max_grad_norm")
    assert_one_line_refusal(result, f"LOOPConfig: {range_message('max_grad_norm', -1.0, rule)}")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("key", "flag", "value"), [("max_grad_norm", "-1", -1.0), ("save_steps", "0", 0.0)])
def test_dry_run_refuses_a_nonsense_value_with_one_line(key, flag, value, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'o'}\nmodel_name_or_path: tiny:vault\n{key}: {flag}\n")
    result = loop_train_here(capsys, "--config", str(recipe), "--dry-run")
    assert_one_line_refusal(result, f"LOOPConfig: {range_message(key, value, range_of(LOOPConfig, key))}")


# --- output_dir ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dry_run", [False, True], ids=["train", "dry-run"])
@pytest.mark.parametrize("case", ["a file", "under a file"])
def test_an_output_dir_that_cannot_be_a_directory_is_one_line(tmp_path, case, dry_run, capsys):
    (tmp_path / "taken").write_text("not a directory")
    output_dir = str(tmp_path / "taken") if case == "a file" else str(tmp_path / "taken" / "run")
    message = (
        f"output_dir {output_dir!r} is a file, not a directory (choose a directory path)"
        if case == "a file"
        else f"output_dir {output_dir!r} cannot be created: {str(tmp_path / 'taken')!r} is a file, not a directory"
    )
    result = loop_train_here(capsys, "--output_dir", output_dir, *TINY, *(["--dry-run"] if dry_run else []))
    assert_one_line_refusal(result, f"LOOPConfig: {message}")


def test_an_output_dir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys):
    """In-process, with os.access answering as it does for a user without write permission (root may write anywhere)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode, **kw: False if Path(path) == locked else real_access(path, mode, **kw)
    )
    for output_dir, problem in [
        (locked, "is not writable (choose a directory you can write to)"),
        (locked / "run" / "deeper", f"cannot be created: {str(locked)!r} is not writable"),
    ]:
        assert cli(["--output_dir", str(output_dir), *TINY]) == 2
        shown = f"{str(locked)!r} {problem}" if output_dir == locked else f"{str(output_dir)!r} {problem}"
        assert capsys.readouterr().err.strip() == f"loop-train: error: LOOPConfig: output_dir {shown}"


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="root writes into a read-only (chmod 555) directory anyway; the in-process test above "
    "checks the refusal with os.access patched",
)
def test_a_read_only_output_dir_is_one_line_through_loop_train(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        result = loop_train("--output_dir", str(locked / "run"), *TINY)
    finally:
        locked.chmod(0o755)
    assert_one_line_refusal(
        result, f"LOOPConfig: output_dir {str(locked / 'run')!r} cannot be created: {str(locked)!r} is not writable"
    )


def test_an_output_dir_that_does_not_exist_yet_is_fine(tmp_path):
    LOOPConfig(output_dir=str(tmp_path / "a" / "b" / "c"))
    assert not (tmp_path / "a").exists()  # checking creates nothing


# --- --help, --config ---------------------------------------------------------------------------------------------
def test_help_prints_the_help_and_exits_0():
    result = loop_train("--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"^usage: ", result.stdout, re.MULTILINE) and "--max_grad_norm" in result.stdout
    assert "Traceback" not in result.stderr


def test_a_mistyped_config_flag_suggests_config(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # were it not refused, transformers' default output_dir would be made here
    result = loop_train_here(capsys, "--confg=recipe.yaml")
    assert_one_line_refusal(result, "unknown option '--confg' (did you mean '--config'?)")


def test_config_in_the_equals_form_suggests_nothing(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'o'}\nmodel_name_or_path: tiny:vault\n")
    result = loop_train_here(capsys, f"--config={recipe}", "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "fsdp_config" not in result.stderr + result.stdout.split("[training]")[0]


def test_the_dry_run_planning_keys_have_ranges():
    with pytest.raises(RecipeError, match=r"^plan_gpus must be >= 1 or None, got 0 "):
        parse_recipe(["--output_dir", "o", "--plan_gpus", "0"])
    with pytest.raises(RecipeError, match=r"^plan_gpu_memory_gib must be > 0, got -80.0 "):
        parse_recipe(["--output_dir", "o", "--plan_gpu_memory_gib", "-80"])


# --- loop-eval checks the same ranges -------------------------------------------------------------------------
def test_loop_eval_shares_the_episode_and_evaluation_ranges(tmp_path):
    for spec in dataclasses.fields(EpisodeSettings):
        if getattr(spec, "range", None) is None:  # a switch (static_decode) has no range; numbers share theirs
            assert getattr(EvalArguments(output_dir=str(tmp_path / "eval")), spec.name) == spec.default
            continue
        assert range_of(EvalArguments, spec.name) is range_of(LOOPConfig, spec.name)
    assert range_of(EvalArguments, "rollouts_per_task") is range_of(LOOPConfig, "eval_rollouts_per_task")
    assert range_of(EvalArguments, "temperature") is range_of(LOOPConfig, "eval_temperature")
    assert range_of(EvalArguments, "max_tasks") is range_of(LOOPConfig, "eval_max_tasks")
    assert range_of(EvalArguments, "seed") is range_of(LOOPConfig, "seed")
    for key, value, training_key in [
        ("env_timeout", 0.0, "env_timeout"),
        ("max_turns", 0, "max_turns"),
        ("rollouts_per_task", 0, "eval_rollouts_per_task"),
        ("temperature", -1.0, "eval_temperature"),
        ("max_tasks", 0, "eval_max_tasks"),
    ]:
        with pytest.raises(RecipeError) as caught:
            EvalArguments(output_dir=str(tmp_path / "eval"), **{key: value})
        assert str(caught.value) == range_message(key, value, range_of(LOOPConfig, training_key))
    (tmp_path / "taken").write_text("")
    with pytest.raises(RecipeError, match="is a file, not a directory"):
        EvalArguments(output_dir=str(tmp_path / "taken"))


def test_loop_eval_refuses_env_timeout_0_with_one_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "loop_trainer.cli.evaluate",
            "--model_name_or_path",
            "tiny:vault",
            "--environment",
            "vault",
            "--env_timeout",
            "0",
            "--output_dir",
            str(tmp_path / "e"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip().splitlines()[-1]
        == f"loop-eval: error: {range_message('env_timeout', 0.0, range_of(LOOPConfig, 'env_timeout'))}"
    )


# --- documentation ------------------------------------------------------------------------------------------------
def render_ranges_table() -> str:
    rows = ["| key | allowed | meaning |", "| --- | --- | --- |"]
    ranged = {key: spec.range for key, spec in FIELDS.items() if getattr(spec, "range", None) is not None}
    for key, rule in sorted(ranged.items()):
        when = f" (with `{rule.when[0]}: {rule.when[1]}`)" if rule.when else ""
        meaning = rule.meaning.replace("|", "\\|")  # a literal bar inside a Markdown table cell
        rows.append(f"| `{key}` | {rule.allowed}{when} | {meaning} |")
    return "\n".join(rows)


def test_recipes_doc_lists_the_ranges_of_the_code():
    assert render_ranges_table() in (ROOT / "docs" / "recipes.md").read_text(), (
        "regenerate the table: python tests/unit/config/test_ranges.py"
    )


if __name__ == "__main__":
    print(render_ranges_table())
