"""report_to's trackers, offline: wandb (WANDB_MODE=offline) and tensorboard runs of a few iterations are read
back from what they wrote -- each iteration's metrics at the iteration as the step, the config, the tables of
sampled trajectories, the learning curve image, the collapse alert -- and report_to naming a tracker whose
package is missing stops when the configuration is built, in one line naming the install command."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.cli.train import cli
from loop_trainer.cli.train_run import summary
from loop_trainer.training.trackers import TABLE_COLUMNS, TrackerLog, TrackerSettings
from support.helpers import PreferFindEnv, ScriptedBackend

ITERATIONS = 4
ROLLOUTS = 2 * 4  # tasks_per_iteration x rollouts_per_task
PER_TABLE = 3


def scripted_run(tmp_path, vault_tiny, **overrides) -> LOOPTrainer:
    """ITERATIONS iterations of 2 tasks x 4 rollouts: the first iteration's replies alternate "find ann" (reward 1)
    and "open k3" (0), so it trains on all 8 with advantages +-2/3; every later reply is "open k3": every group
    ties, and the third tied iteration (the last) sets off the collapse warning."""
    _, model, tok = vault_tiny
    calls = itertools.count()
    backend = ScriptedBackend(
        tok, lambda prompt: "find ann" if (n := next(calls)) < ROLLOUTS and n % 2 == 0 else "open k3"
    )
    settings = {
        "output_dir": str(tmp_path / "run"),
        "iterations": ITERATIONS,
        "tasks_per_iteration": 2,
        "rollouts_per_task": 4,
        "minibatch_size": 4,
        "max_turns": 2,
        "max_new_tokens_per_turn": 4,
        "max_trajectory_tokens": 256,
        "learning_rate": 3e-3,
        "activation_checkpointing": False,
        "per_device_train_batch_size": 4,
        "disable_tqdm": True,
        "seed": 0,
        "save_strategy": "no",
        "num_trajectories_to_log": PER_TABLE,
        **overrides,
    }
    trainer = LOOPTrainer(
        model, PreferFindEnv(), LOOPConfig(**settings), processing_class=tok, generation_backend=backend
    )
    trainer.run_settings = {"environment": "support.helpers:PreferFindEnv", "environment_kwargs": {}}
    trainer.train()
    return trainer


def check_first_table(rows: list[list[Any]], iteration: int = 1) -> None:
    """Iteration 1's table: the best, the worst and the best again of its 8 rollouts, all trained."""
    by = [dict(zip(TABLE_COLUMNS, row, strict=True)) for row in rows]
    assert [r["reward"] for r in by] == [1.0, 0.0, 1.0]
    assert [r["advantage"] for r in by] == pytest.approx([2 / 3, -2 / 3, 2 / 3])
    assert all(r["kept"] is True and r["iteration"] == iteration and r["task_id"] in ("t0", "t1") for r in by)
    assert by[0]["transcript"].startswith("[user] fetch code of ann\n\n[assistant] find ann")
    assert by[1]["transcript"].endswith("[assistant] open k3")


# --- wandb -----------------------------------------------------------------------------------------------------
@pytest.fixture()
def wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "loop-test")
    yield wandb
    wandb.finish()  # a run left open would receive the next test's logs


def offline_run_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of an offline run's transaction log (run-<id>.wandb), as wandb's own reader prints them
    (``wandb leet inspect --json``: one JSON object per record, nested keys joined by dots)."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_wandb_offline_run_logs_iterations_config_tables_curve_and_alert(tmp_path, vault_tiny, wandb_offline):
    trainer = scripted_run(tmp_path, vault_tiny, report_to="wandb")
    where = trainer.tracker_locations["wandb"]
    wandb_offline.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert where == f"{run_dir} (offline: upload with `wandb sync {run_dir}`)"
    assert f"  wandb:          {where}" in summary(trainer).splitlines()
    records = offline_run_records(run_dir)

    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    metrics = [h for h in history if "train/reward_mean" in h]
    assert [h["train/global_step"] for h in metrics] == [1, 2, 3, 4]  # one per iteration, the iteration its step
    assert [h["train/reward_mean"] for h in metrics] == [0.5, 0.0, 0.0, 0.0]
    tables = [h for h in history if h.get("trajectories._type") == "table-file"]
    assert [h["train/global_step"] for h in tables] == [1, 2, 3, 4]  # log_trajectories_every: 1 (the default)
    curves = [h for h in history if h.get("learning_curve._type") == "image-file"]
    assert [h["train/global_step"] for h in curves] == [ITERATIONS]
    assert (run_dir / "files" / curves[0]["learning_curve.path"]).stat().st_size > 0

    first = json.loads((run_dir / "files" / tables[0]["trajectories.path"]).read_text())
    assert first["columns"] == list(TABLE_COLUMNS)
    check_first_table(first["data"])
    last = json.loads((run_dir / "files" / tables[-1]["trajectories.path"]).read_text())
    assert [(row[6], row[8], row[9]) for row in last["data"]] == [(0.0, 0.0, False)] * PER_TABLE  # tied: none kept

    config: dict[str, Any] = {}
    for record in records:
        if record["type"] == "config":
            config.update(record["config"]["update"])
    assert config["tasks_per_iteration"] == 2 and config["num_trajectories_to_log"] == PER_TABLE  # LOOPConfig
    assert config["loop_run"] == {
        "environment_name": "prefer-find",
        "num_train_tasks": 2,
        "environment": "support.helpers:PreferFindEnv",
        "environment_kwargs": {},
    }

    [alert] = [r["alert"] for r in records if r["type"] == "alert"]  # at the one iteration the warning fired
    assert alert["title"] == "LOOP: learning may be collapsing" and alert["level"] == "WARN"
    assert alert["text"].startswith(f"iteration {ITERATIONS}: learning may be collapsing") and "tied" in alert["text"]


# --- tensorboard -----------------------------------------------------------------------------------------------
def test_tensorboard_run_logs_iterations_config_tables_curve_and_warning(tmp_path, vault_tiny, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    trainer = scripted_run(tmp_path, vault_tiny, report_to="tensorboard", log_trajectories_every=2)
    (logdir,) = (tmp_path / "run" / "runs").iterdir()  # transformers' default: output_dir/runs/<date>_<host>
    assert trainer.tracker_locations == {"tensorboard": f"{logdir} (view: tensorboard --logdir {logdir})"}
    events = EventAccumulator(str(logdir), size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    events.Reload()

    reward = events.Scalars("train/reward_mean")
    assert [(e.step, e.value) for e in reward] == [(1, 0.5), (2, 0.0), (3, 0.0), (4, 0.0)]

    def texts(tag: str) -> list[tuple[int, str]]:
        return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(f"{tag}/text_summary")]

    [(_, args)] = texts("args")  # LOOPConfig, by transformers' callback
    assert json.loads(args)["tasks_per_iteration"] == 2
    [(_, run_settings)] = texts("loop_run")
    assert '"environment": "support.helpers:PreferFindEnv"' in run_settings
    tables = texts("trajectories")
    assert [step for step, _ in tables] == [2, 4]  # log_trajectories_every: 2
    assert tables[0][1].startswith(f"iteration 2: {PER_TABLE} of {ROLLOUTS} trajectories\n\n| iteration | task_id |")
    assert "[user] fetch code of ann\n\n[assistant] open k3" in tables[0][1]
    [(step, warning)] = texts("warnings")
    assert step == ITERATIONS and warning.startswith(f"iteration {ITERATIONS}: learning may be collapsing")
    [curve] = events.Images("learning_curve")
    assert curve.step == ITERATIONS and curve.width > 100 and curve.height > 100


# --- TrackerLog alone ------------------------------------------------------------------------------------------
class RecordingWriter:
    def __init__(self):
        self.texts: list[tuple[str, int | None]] = []

    def add_text(self, tag, text, global_step=None):
        self.texts.append((tag, global_step))

    def flush(self):
        pass


def test_tables_follow_log_trajectories_every_and_only_the_main_process_writes(vault_tiny):
    from transformers.integrations import TensorBoardCallback

    from loop_trainer.rollout import RolloutBatch
    from loop_trainer.trajectory import Trajectory

    batch = RolloutBatch(trajectories=[Trajectory(task_id="t0", group=0, rollout=r, reward=r) for r in range(3)])
    for every, writes, logged in ((2, True, [2, 4]), (0, True, []), (1, False, [])):
        writer = RecordingWriter()
        log = TrackerLog(TrackerSettings(every, None), [TensorBoardCallback(tb_writer=writer)], writes=writes)
        for iteration in range(1, 5):
            log.trajectories(iteration, batch, {}, set())
        assert [step for tag, step in writer.texts if tag == "trajectories"] == logged, (every, writes)


def test_with_no_tracker_nothing_is_logged_or_located(tmp_path, vault_tiny):
    trainer = scripted_run(tmp_path, vault_tiny, report_to="none", iterations=1)
    assert not trainer.trackers.active and trainer.tracker_locations == {}
    assert not any(line.lstrip().startswith(("wandb:", "tensorboard:")) for line in summary(trainer).splitlines())


# --- report_to naming a missing package -------------------------------------------------------------------------
def hide(monkeypatch, *modules: str) -> None:
    """As if ``modules`` were not installed (find_spec is how the check, and transformers, look)."""
    real = importlib.util.find_spec

    def find_spec(name, package=None):
        return None if name.split(".")[0] in modules else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize(
    ("tracker", "modules", "install"),
    [
        ("wandb", ("wandb",), "pip install 'loop-trainer[wandb]'"),
        ("tensorboard", ("tensorboard", "tensorboardX"), "pip install 'loop-trainer[tensorboard]'"),
        ("trackio", ("trackio",), "pip install trackio"),
    ],
)
def test_report_to_a_missing_tracker_stops_at_config_time_in_one_line(
    tmp_path, capsys, monkeypatch, tracker, modules, install
):
    hide(monkeypatch, *modules)
    message = (
        f"LOOPConfig: report_to: {tracker} needs the {modules[0]} package, which is not installed: {install} "
        "(or report_to: none)"
    )
    with pytest.raises(ValueError) as caught:
        LOOPConfig(output_dir=str(tmp_path / "o"), report_to=tracker)
    assert str(caught.value) == message
    # loop-train: before the model, the environment or the output_dir (the warm-up never starts)
    out = tmp_path / "o"
    assert cli(["--output_dir", str(out), "--model_name_or_path", "tiny-instruct:vault", "--report_to", tracker]) == 2
    assert capsys.readouterr().err == f"loop-train: error: {message}\n"
    assert not out.exists()


def test_a_tracker_with_either_tensorboard_writer_is_accepted(tmp_path, monkeypatch):
    hide(monkeypatch, "tensorboardX")
    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard is not installed")
    assert LOOPConfig(output_dir=str(tmp_path), report_to="tensorboard").report_to == ["tensorboard"]


def test_report_to_a_name_that_is_no_tracker_says_which_it_resembles(tmp_path):
    with pytest.raises(
        ValueError, match=r"^LOOPConfig: report_to: 'wandbb' is no tracker \(did you mean 'wandb'\?\); "
    ):
        LOOPConfig(output_dir=str(tmp_path), report_to="wandbb")


def test_report_to_null_means_none(tmp_path):
    """A recipe's ``report_to: null``: no tracker (transformers' Trainer would refuse the [None] it made of it)."""
    assert LOOPConfig(output_dir=str(tmp_path), report_to=None).report_to == []


def test_report_to_takes_several_trackers_as_one_comma_separated_value_or_a_yaml_list(tmp_path):
    """``--report_to wandb,tensorboard``: the parser gives report_to one string; a recipe's YAML list
    (``report_to: [wandb, tensorboard]``) reaches it as that string, not as two flags it would refuse."""
    from loop_trainer.cli.recipe import parse_recipe

    assert LOOPConfig(output_dir=str(tmp_path), report_to="wandb, tensorboard").report_to == ["wandb", "tensorboard"]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'o'}\nreport_to: [wandb, tensorboard]\n")
    _, config, _ = parse_recipe(["--config", str(recipe)])
    assert config.report_to == ["wandb", "tensorboard"]
