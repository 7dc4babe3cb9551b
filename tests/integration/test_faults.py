"""Faulty environments inside real LOOP runs: each fault costs only its rollout, counted and
logged; too many faults stop the run with one clear line."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

import support.helpers
from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.cli.train import cli
from loop_trainer.models.tiny import build_tiny_for_environment
from loop_trainer.rollout import RolloutFailureBudgetExceeded
from support.helpers import FaultyEnv


def raised_in_helpers(statement: str) -> str:
    """``support/helpers.py:<line>`` of the one line holding ``statement``: where a failure's traceback points."""
    lines = Path(support.helpers.__file__).read_text().splitlines()
    (line,) = [number for number, text in enumerate(lines, start=1) if statement in text]
    return f"support/helpers.py:{line}"


FAILING = {"raises", "hangs", "dies"}
# The hung task never answers, so it times out whatever the timeout; every other environment call
# answers at once, far inside it. Exact counts then hold however loaded the machine is.
ENV_TIMEOUT = 5.0
RELEASED = threading.Event()


class NeverAnsweringEnv(FaultyEnv):
    """FaultyEnv whose ``hangs`` task does not answer its first step until the test has ended."""

    def episode(self, task):
        episode = super().episode(task)
        if task["kind"] == "hangs":
            episode.step = hang_until_released
        return episode


def hang_until_released(reply: str):
    RELEASED.wait(timeout=600)
    raise RuntimeError("answered only after the test ended")


@pytest.fixture(autouse=True)
def release_hung_steps():
    RELEASED.clear()
    yield
    RELEASED.set()  # the hung steps return and their episodes are closed (their daemon threads never
    # held up the process's exit: tests/unit/envs/test_env_contract.py checks that)


def fault_args(tmp_path, **overrides) -> LOOPConfig:
    base = {
        "output_dir": str(tmp_path / "run"),
        "iterations": 2,
        "tasks_per_iteration": len(FaultyEnv.KINDS),
        "rollouts_per_task": 2,
        "minibatch_size": 4,
        "max_turns": 3,
        "max_new_tokens_per_turn": 4,
        "max_trajectory_tokens": 256,
        "env_timeout": ENV_TIMEOUT,
        "max_failed_fraction": 0.5,
        "learning_rate": 1e-3,
        "activation_checkpointing": False,
        "per_device_train_batch_size": 4,
        "disable_tqdm": True,
        "seed": 0,
        "report_to": [],
    }
    base.update(overrides)
    return LOOPConfig(**base)


def test_each_fault_costs_only_its_rollout(tmp_path, caplog):
    env = NeverAnsweringEnv()
    model, tokenizer = build_tiny_for_environment(env.vocabulary(), seed=0)
    trainer = LOOPTrainer(model, env, fault_args(tmp_path), processing_class=tokenizer)
    with caplog.at_level(logging.DEBUG, logger="loop_trainer"):
        trainer.train()
    assert len(trainer.history) == 2
    for record in trainer.history:
        assert record["num_failed"] == 2 * len(FAILING)  # both rollouts of each failing task
        assert record["num_rollouts"] == 2 * (len(FaultyEnv.KINDS) - len(FAILING))
        assert record["repaired_messages"] == 4  # bytes and surrogates, 2 rollouts each
        assert record["cut_messages"] == 2 and record["ended_trajectory_budget"] == 2  # enormous, cut then ended
    failed = [record for record in caplog.records if "rollout of task" in record.getMessage()]
    failures = [record.getMessage() for record in failed]
    shown = [record.getMessage() for record in failed if record.levelno == logging.WARNING]
    for kind, message, raised_at in (
        ("raises", "the tool crashed", raised_in_helpers('raise RuntimeError("the tool crashed")')),
        ("hangs", "TimeoutError", "loop_trainer/rollout/engine.py"),
        ("dies", "environment server went away", raised_in_helpers("raise ConnectionResetError(")),
    ):
        # Each failing task fails for its own reason (the hung one by its timeout), and only those fail.
        assert sum(f"rollout of task {kind}-" in line and message in line for line in failures) == 2 * 2
        # the first failure of each kind is shown with its traceback, down to the environment's line; the
        # other three only at debug level (the iteration line counts them)
        (first,) = [line for line in shown if f"rollout of task {kind}-" in line]
        assert "Traceback (most recent call last)" in first and raised_at in first
    assert len(failures) == 2 * 2 * len(FAILING) and len(shown) == len(FAILING)


def test_too_many_faults_stop_the_run_with_one_error(tmp_path):
    env = NeverAnsweringEnv()
    model, tokenizer = build_tiny_for_environment(env.vocabulary(), seed=0)
    trainer = LOOPTrainer(model, env, fault_args(tmp_path, max_failed_fraction=0.25), processing_class=tokenizer)
    with pytest.raises(
        RolloutFailureBudgetExceeded, match=r"6 of 16 rollouts failed \(budget 25%\); most common error"
    ):
        trainer.train()


def test_the_cli_reports_a_failure_budget_stop_in_one_line(tmp_path, capsys):
    status = cli(
        [
            "--model_name_or_path",
            "tiny:faulty",
            "--environment",
            "test_faults:NeverAnsweringEnv",
            "--output_dir",
            str(tmp_path),
            "--iterations",
            "1",
            "--tasks_per_iteration",
            "8",
            "--rollouts_per_task",
            "2",
            "--max_turns",
            "2",
            "--max_new_tokens_per_turn",
            "3",
            "--env_timeout",
            str(ENV_TIMEOUT),
            "--max_failed_fraction",
            "0.1",
            "--activation_checkpointing",
            "false",
            "--memory_stress_test",  # at the default 32,000 tokens: half a minute
            "false",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1
    assert err[0].startswith("loop-train: error: 6 of 16 rollouts failed")
    # it stopped in iteration 1, before any checkpoint: nothing to resume, so no advice to resume
    assert err[0].endswith("Fix the environment, then run it again from the start (no checkpoint was saved)")
