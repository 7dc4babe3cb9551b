"""An output_dir holds one run: a fresh run refuses another run's checkpoints (or, asked to, deletes
that run first); a resume uses the newest complete checkpoint and the checkpoint's settings (or,
asked to, applies and records changed ones); a stopped or interrupted run says how to go on, in
one line, and only advises resuming when there is a checkpoint (issue 12, defects 1, 4 and 5)."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from loop_trainer.envs import VaultEnv
from loop_trainer.training.checkpoints import CheckpointError, CheckpointStager, read_loop_state
from support.in_process import loop_train_in_process
from support.tiny_run import TINY_VAULT_RUN

HERE = Path(__file__).resolve().parent  # loop-train imports this module's environments by name
TESTS = Path(__file__).resolve().parents[2]
TINY = [*TINY_VAULT_RUN, "--plot_curves", "false", "--seed", "0"]


class FailingVault(VaultEnv):
    """Every episode fails to start: the run stops in iteration 1, before any checkpoint."""

    def episode(self, task):
        raise RuntimeError("the tool server is down")


class UncloseableVault(VaultEnv):
    """Trains normally; closing it fails."""

    def close(self):
        raise RuntimeError("the tool server went away first")


def loop_train(output_dir: Path, *flags: str, **popen: object) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "loop_trainer.cli.train", *TINY, "--output_dir", str(output_dir), *flags],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )


def refused_here(capsys: pytest.CaptureFixture[str], output_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """:func:`loop_train` for a launch it refuses, in this process."""
    refused = loop_train_in_process(capsys, [*TINY, "--output_dir", str(output_dir), *flags])
    assert refused.returncode == 2, refused.stderr[-3000:]
    return refused


def checkpoints(output_dir: Path) -> list[str]:
    return sorted((p.name for p in output_dir.glob("checkpoint-*")), key=lambda name: int(name.split("-")[1]))


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("loop-train: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 3-iteration run (checkpoint-2 and checkpoint-3 kept), to copy."""
    output = tmp_path_factory.mktemp("finished") / "run"
    result = loop_train(output, "--iterations", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoints(output) == ["checkpoint-2", "checkpoint-3"]
    return output


def copy_of(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "X"
    shutil.copytree(run, target)
    return target


# --- defect 1: a fresh run in another run's output_dir -------------------------------------------------------
def test_a_fresh_run_into_another_runs_output_dir_is_refused_or_replaces_it_when_asked(finished_run, tmp_path, capsys):
    x = copy_of(finished_run, tmp_path)
    before = {p.relative_to(x): p.stat().st_mtime_ns for p in x.rglob("*")}
    refused = refused_here(capsys, x, "--iterations", "2", "--seed", "1")
    assert refused.returncode == 2
    line = error_line(refused)
    assert line.startswith(
        f"loop-train: error: output_dir {x} already holds another run's checkpoints (checkpoint-2, checkpoint-3)"
    )
    for advice in (
        "--resume_from_checkpoint last",
        "another output_dir",
        "--overwrite_output_dir true",
        "metrics.jsonl",
        "viewer/",
    ):
        assert advice in line
    assert {p.relative_to(x): p.stat().st_mtime_ns for p in x.rglob("*")} == before  # nothing touched

    fresh = loop_train(x, "--iterations", "2", "--seed", "1", "--overwrite_output_dir", "true")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert (
        f"overwrite_output_dir: deleting the previous run in {x}: checkpoint-2/, checkpoint-3/, metrics.jsonl"
        in fresh.stderr
    )
    # The new run's checkpoints survived rotation (the old checkpoint-3 would have outranked them) ...
    assert checkpoints(x) == ["checkpoint-1", "checkpoint-2"]
    assert read_loop_state(x / "checkpoint-2")["settings"]["seed"] == 1
    assert [m["iteration"] for m in metrics(x)] == [1, 2]
    # ... so resuming continues the new run, not the old one.
    resumed = loop_train(x, "--iterations", "3", "--seed", "1", "--resume_from_checkpoint", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["iteration"] for m in metrics(x)] == [1, 2, 3] and checkpoints(x) == ["checkpoint-2", "checkpoint-3"]


def test_overwrite_output_dir_keeps_a_run_that_stopped_before_its_last_iteration(finished_run, tmp_path, capsys):
    """A recipe copied from the demo sets overwrite_output_dir: the second start after a crash must not delete
    the crashed run. A finished run says so (run_finished.json); one without it stopped early."""
    assert json.loads((finished_run / "run_finished.json").read_text()) == {"iteration": 3}
    x = copy_of(finished_run, tmp_path)
    (x / "run_finished.json").unlink()  # as if the machine was lost after checkpoint-3
    before = {p.relative_to(x): p.stat().st_mtime_ns for p in x.rglob("*")}
    refused = refused_here(capsys, x, "--iterations", "2", "--overwrite_output_dir", "true")
    assert refused.returncode == 2
    assert error_line(refused) == (
        f"loop-train: error: output_dir {x} holds a run that stopped before its last iteration (newest checkpoint "
        "checkpoint-3), which overwrite_output_dir does not delete: continue it with --resume_from_checkpoint last, "
        "choose another output_dir, or pass --overwrite_interrupted_run true to delete it and start over"
    )
    assert {p.relative_to(x): p.stat().st_mtime_ns for p in x.rglob("*")} == before  # nothing touched
    fresh = loop_train(x, "--iterations", "2", "--overwrite_output_dir", "true", "--overwrite_interrupted_run", "true")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert checkpoints(x) == ["checkpoint-1", "checkpoint-2"] and [m["iteration"] for m in metrics(x)] == [1, 2]
    assert json.loads((x / "run_finished.json").read_text()) == {"iteration": 2}


def test_looptrainer_train_refuses_another_runs_output_dir_too(tmp_path, vault_tiny):
    from loop_trainer import LOOPConfig, LOOPTrainer

    env, model, tokenizer = vault_tiny
    (tmp_path / "checkpoint-12").mkdir()
    args = LOOPConfig(
        output_dir=str(tmp_path),
        iterations=1,
        tasks_per_iteration=2,
        rollouts_per_task=2,
        max_turns=2,
        max_new_tokens_per_turn=3,
        max_trajectory_tokens=128,
        activation_checkpointing=False,
        disable_tqdm=True,
        report_to=[],
        memory_stress_test=False,
    )
    with (
        LOOPTrainer(model, env, args, processing_class=tokenizer) as trainer,
        pytest.raises(CheckpointError, match="already holds another run's checkpoints \\(checkpoint-12\\)"),
    ):
        trainer.train()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-12"]


# --- defect 5: `last` is the newest complete checkpoint ------------------------------------------------------
def test_resume_last_skips_incomplete_checkpoints_and_says_so(finished_run, tmp_path):
    x = copy_of(finished_run, tmp_path)
    (x / "checkpoint-9").mkdir()  # e.g. a copy that was cut short: no loop_state.json
    (x / "checkpoint-9" / "model.safetensors").write_bytes(b"")
    resumed = loop_train(x, "--iterations", "4", "--resume_from_checkpoint", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "resume_from_checkpoint last: skipping checkpoint-9 (no loop_state.json: incomplete); resuming from "
        "checkpoint-3" in resumed.stderr
    )
    assert [m["iteration"] for m in metrics(x)] == [1, 2, 3, 4]
    # The incomplete directory neither counts nor is deleted by rotation: the complete ones stay.
    assert checkpoints(x) == ["checkpoint-3", "checkpoint-4", "checkpoint-9"]

    for name in ("checkpoint-3", "checkpoint-4"):
        (x / name / "loop_state.json").unlink()
    none = loop_train(x, "--iterations", "5", "--resume_from_checkpoint", "last")
    assert none.returncode == 2
    assert error_line(none) == (
        f"loop-train: error: resume_from_checkpoint: no complete checkpoint in {x} (checkpoint-3, checkpoint-4, "
        "checkpoint-9 have no loop_state.json): nothing to resume; start over with --overwrite_output_dir true, "
        "or choose another output_dir"
    )


# --- defect 4: changed settings on resume ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, named",
    [
        (["--learning_rate", "0.1"], "learning_rate 0.0006 -> 0.1"),
        (["--seed", "1"], "seed 0 -> 1"),
        (["--tasks_per_iteration", "3"], "tasks_per_iteration 2 -> 3"),
        (["--rollouts_per_task", "3"], "rollouts_per_task 2 -> 3"),
        (["--environment_kwargs", '{"num_tasks": 6}'], 'environment_kwargs {"num_tasks": 8} -> {"num_tasks": 6}'),
        (["--epsilon", "0.2", "--ppo_epochs", "1"], "ppo_epochs 2 -> 1, epsilon 0.1 -> 0.2"),
    ],
    ids=["learning_rate", "seed", "tasks_per_iteration", "rollouts_per_task", "environment_kwargs", "two"],
)
def test_a_changed_setting_on_resume_is_refused_naming_it(finished_run, tmp_path, flags, named, capsys):
    x = copy_of(finished_run, tmp_path)
    refused = refused_here(capsys, x, "--iterations", "4", "--resume_from_checkpoint", "last", *flags)
    assert refused.returncode == 2
    line = error_line(refused)
    assert line.startswith(f"loop-train: error: resume_from_checkpoint: settings differ from {x / 'checkpoint-3'}'s (")
    assert named in line and "--resume_with_changed_settings true" in line and "from iteration 4 on" in line
    assert checkpoints(x) == ["checkpoint-2", "checkpoint-3"] and len(metrics(x)) == 3  # untouched


def test_a_changed_setting_allowed_on_resume_is_applied_and_recorded(finished_run, tmp_path):
    x = copy_of(finished_run, tmp_path)
    resumed = loop_train(
        x,
        "--iterations",
        "5",
        "--resume_from_checkpoint",
        "last",
        "--learning_rate",
        "0.1",
        "--resume_with_changed_settings",
        "true",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "resume_with_changed_settings: learning_rate changed 0.0006 -> 0.1 from iteration 4 on (applied"
        in resumed.stderr
    )
    # applied: the optimizer's learning rate (not only the config's) is the new one, also after scheduler steps
    assert [m["learning_rate"] for m in metrics(x)] == [0.0006] * 3 + [0.1] * 2
    # recorded: in the checkpoint, recipe.yaml and the model card
    changes = read_loop_state(x / "checkpoint-5")["setting_changes"]
    assert changes == [{"setting": "learning_rate", "old": 0.0006, "new": 0.1, "from_iteration": 4}]
    assert read_loop_state(x / "checkpoint-5")["settings"]["learning_rate"] == 0.1
    recipe = (x / "recipe.yaml").read_text()
    assert "learning_rate was 0.0006 before iteration 4, 0.1 from iteration 4 on" in recipe.splitlines()[0]
    assert yaml.safe_load(recipe)["learning_rate"] == 0.1
    card = (x / "README.md").read_text()
    assert "| `learning_rate` | 0.1 |" in card
    assert "- `learning_rate`: 0.0006 before iteration 4, 0.1 from iteration 4 on" in card
    # the next resume compares against the new value, and keeps the history of changes
    again = loop_train(x, "--iterations", "6", "--resume_from_checkpoint", "last", "--learning_rate", "0.1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_loop_state(x / "checkpoint-6")["setting_changes"] == changes


def test_turning_balanced_draws_on_at_a_resume_starts_a_new_order(finished_run, tmp_path):
    x = copy_of(finished_run, tmp_path)
    flags = (
        "--resume_from_checkpoint",
        "last",
        "--balance_tasks_by",
        "person",
        "--resume_with_changed_settings",
        "true",
    )
    resumed = loop_train(x, "--iterations", "5", *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "balance_tasks_by changed None -> person from iteration 4 on" in resumed.stderr
    assert [m["iteration"] for m in metrics(x)] == [1, 2, 3, 4, 5]
    sampler = read_loop_state(x / "checkpoint-5")["task_sampler"]
    assert sampler["drawn"] == 2 * 2 and len(sampler["kinds"]) > 1  # iterations 4 and 5, 2 tasks each


def test_the_base_of_a_tiny_lora_run_cannot_change_on_resume(tmp_path, capsys):
    """A tiny LoRA run's checkpoints hold only the adapter, and a resume builds the base again: a seed or
    tiny_instruct_steps that would build another one is refused, even with changes allowed. A full-weight tiny
    run's checkpoints hold every weight: its tiny_instruct_steps only named how it started."""
    lora = ("--model_name_or_path", "tiny-instruct:vault", "--tiny_instruct_steps", "3", "--use_peft", "true")
    x = tmp_path / "lora"
    assert loop_train(x, *lora, "--iterations", "1").returncode == 0
    assert read_loop_state(x / "checkpoint-1")["settings"]["tiny_base"] == {"seed": 0, "tiny_instruct_steps": 3}
    for change, says in (
        (("--seed", "1"), "seed 0 -> 1"),
        (("--tiny_instruct_steps", "4"), "tiny_instruct_steps 3 -> 4"),
    ):
        resumed = (*lora, "--iterations", "2", "--resume_from_checkpoint", "last", *change)
        for allowed in ((), ("--resume_with_changed_settings", "true")):
            refused = refused_here(capsys, x, *resumed, *allowed)
            line = error_line(refused)
            assert line.startswith(
                f"loop-train: error: resume_from_checkpoint: {x / 'checkpoint-1'} holds a LoRA adapter"
            )
            assert f"a tiny model's base that this launch would build otherwise ({says})" in line
            assert "replaying" not in refused.stdout + refused.stderr  # refused before the base is built
    # its world too: the warm-up replays the environment's training tasks
    resumed = (
        *lora,
        "--iterations",
        "2",
        "--resume_from_checkpoint",
        "last",
        "--environment_kwargs",
        '{"num_tasks": 6}',
    )
    refused = refused_here(capsys, x, *resumed, "--resume_with_changed_settings", "true")
    line = error_line(refused)
    assert "a tiny model's base, which is built from the run's environment" in line, line
    assert "would build it from another (environment_kwargs" in line and '"num_tasks": 6' in line
    assert "replaying" not in refused.stdout + refused.stderr
    full = tmp_path / "full"
    assert loop_train(full, "--iterations", "1", "--tiny_instruct_steps", "3").returncode == 0
    assert read_loop_state(full / "checkpoint-1")["settings"]["tiny_base"] is None
    resumed = loop_train(full, "--iterations", "2", "--resume_from_checkpoint", "last", "--tiny_instruct_steps", "4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]


# --- defect 5: how a stopped run says how to go on -------------------------------------------------------------
def test_a_run_that_fails_before_its_first_checkpoint_does_not_advise_resuming(tmp_path):
    result = loop_train(tmp_path / "run", "--iterations", "2", "--environment", "test_output_dir:FailingVault")
    assert result.returncode == 1
    # the environment's failure is shown once with its traceback, down to its own line; the run's error is one line
    raised_at = inspect.getsourcelines(FailingVault.episode)[1] + 1  # the line of its raise
    assert result.stderr.count("Traceback") == 1
    assert f'{Path(__file__).name}", line {raised_at}, in episode' in result.stderr
    line = [line for line in result.stderr.splitlines() if line.startswith("loop-train: ")][-1]
    assert line.startswith("loop-train: error: 4 of 4 rollouts failed")
    assert "resume_from_checkpoint" not in line and line.endswith(
        "run it again from the start (no checkpoint was saved)"
    )
    assert checkpoints(tmp_path / "run") == []


def test_ctrl_c_prints_one_line_and_exits_130_with_the_checkpoints_complete(tmp_path):
    output = tmp_path / "run"
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "loop_trainer.cli.train", *TINY, "--output_dir", str(output), "--iterations", "200"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )
    deadline = time.monotonic() + 300

    def past_iteration_one() -> bool:  # any complete checkpoint after the first (checkpoint-2 may be rotated away)
        states = output.glob("checkpoint-*/loop_state.json")
        return any(int(state.parent.name.split("-")[1]) >= 2 for state in states)

    while not past_iteration_one() and time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    last = checkpoints(output)[-1]
    assert stderr.strip().splitlines()[-1] == (
        f"loop-train: interrupted; the newest checkpoint is from iteration {last.split('-')[1]}: resume with "
        "--resume_from_checkpoint last (later iterations are redone)"
    ), stderr[-3000:]  # the last line: nothing after it (a warning Python prints at exit would be)
    assert all((output / name / "loop_state.json").is_file() for name in checkpoints(output))


def test_ctrl_c_while_a_checkpoint_is_published_completes_it_first(tmp_path, python_sigint):
    stager = CheckpointStager(is_main_process=True, barrier=lambda: None, save_total_limit=2)

    def loop_state():  # Ctrl-C arrives after the Trainer wrote the checkpoint, while it is being published
        os.kill(os.getpid(), signal.SIGINT)
        return {"iteration": 1, "task_sampler": {"epoch": 0, "position": 2}, "history": []}

    with pytest.raises(KeyboardInterrupt), stager.staged(tmp_path, 1, loop_state) as staging:
        (staging / "checkpoint-1").mkdir(parents=True)
        (staging / "checkpoint-1" / "model.safetensors").write_bytes(b"weights")
    assert read_loop_state(tmp_path / "checkpoint-1")["iteration"] == 1
    assert (tmp_path / "checkpoint-1" / "model.safetensors").read_bytes() == b"weights"
    assert not (tmp_path / ".staging-checkpoint").exists()


def test_an_environment_that_fails_to_close_after_a_finished_run_is_a_warning(tmp_path):
    result = loop_train(tmp_path / "run", "--iterations", "1", "--environment", "test_output_dir:UncloseableVault")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("loop-train: ")]
    assert warnings == [
        "loop-train: warning: closing the environment 'vault' failed (RuntimeError: the tool server went away first)"
    ]
    assert "LOOP: 1 iterations on 'vault'." in result.stdout
    assert (tmp_path / "run" / "model.safetensors").is_file()
