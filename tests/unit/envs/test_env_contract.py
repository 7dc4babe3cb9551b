"""The environment contract, enforced: a hung synchronous call cannot keep the process alive, and
what an environment hands the trainer (tasks, messages, scores) is checked, with one clear line
for each violation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset

from loop_trainer.chat import ChatFormatter
from loop_trainer.envs import VaultEnv, make_environment
from loop_trainer.envs.base import (
    Environment,
    EnvironmentSetupError,
    Episode,
    EpisodeContractError,
    Score,
    Step,
    UnknownSplitError,
    as_score,
    check_tasks,
    load_tasks,
)
from loop_trainer.envs.vault import VaultEpisode
from loop_trainer.rollout import EpisodeLimits, RolloutEngine
from support.helpers import ScriptedBackend
from support.tiny_run import TINY_VAULT_RUN

HERE = Path(__file__).resolve().parent  # loop-train imports this module's environments by name
TESTS = Path(__file__).resolve().parents[2]


# -- a synchronous step that never returns ------------------------------------------------------


class HangingVaultEnv(VaultEnv):
    """``vault`` whose first task's episodes block forever in a synchronous ``step`` (nothing will
    ever release them). Every episode call is appended to ``events`` (a JSON-lines file), with
    whether another call of the same episode was still running at the time."""

    def __init__(self, events: str, hang_task: str = "train-0000", **kwargs):
        super().__init__(**kwargs)
        self.events, self.hang_task = events, hang_task
        self.lock = threading.Lock()

    def record(self, **event) -> None:
        with self.lock, open(self.events, "a") as file:
            file.write(json.dumps(event) + "\n")

    def episode(self, task):
        return HangingVaultEpisode(self, task)


class HangingVaultEpisode(VaultEpisode):
    def __init__(self, env: HangingVaultEnv, task):
        super().__init__(task)
        self.env, self.task_id, self.running = env, task["task_id"], 0

    def _enter(self, name: str) -> None:
        self.env.record(event=name, task=self.task_id, concurrent=self.running > 0)
        self.running += 1

    def step(self, reply):
        self._enter("step")
        try:
            if self.task_id == self.env.hang_task:
                threading.Event().wait()  # never set: Python cannot interrupt this thread
            return super().step(reply)
        finally:
            self.running -= 1

    def close(self):
        self._enter("close")
        self.running -= 1


def test_a_hung_synchronous_step_fails_its_rollout_and_the_process_still_exits(tmp_path):
    events = tmp_path / "events.jsonl"
    command = [
        sys.executable,
        "-m",
        "loop_trainer.cli.train",
        "--model_name_or_path",
        "tiny:vault",
        "--environment",
        "test_env_contract:HangingVaultEnv",
        "--environment_kwargs",
        json.dumps({"events": str(events), "num_tasks": 4}),
        "--output_dir",
        str(tmp_path / "run"),
        "--iterations",
        "2",
        "--tasks_per_iteration",
        "4",
        "--rollouts_per_task",
        "2",
        "--max_turns",
        "3",
        "--max_new_tokens_per_turn",
        "3",
        "--max_trajectory_tokens",
        "256",
        "--env_timeout",
        "5",  # the hung call waits it out; every other call answers at once, far inside it, however loaded
        "--max_failed_fraction",
        "0.5",
        "--activation_checkpointing",
        "false",
        "--disable_tqdm",
        "true",
        "--plot_curves",
        "false",
        "--report_to",
        "none",
        "--viewer_rollouts_per_iteration",
        "0",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    # A hang detector, not a speed assertion: the run takes seconds; before the fix it never exited.
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "num_failed" in r]
    assert [r["num_failed"] for r in records] == [2.0, 2.0]  # both rollouts of the hung task, each iteration
    assert [r["env_abandoned_calls"] for r in records] == [2.0, 4.0]  # counted, cumulative
    calls = [json.loads(line) for line in events.read_text().splitlines()]
    assert not [c for c in calls if c["concurrent"]], "an episode method ran while another was still running"
    hung = [c for c in calls if c["task"] == "train-0000"]
    # Each hung episode entered step once and was never closed: its step never returned.
    assert [c["event"] for c in hung] == ["step"] * 4
    assert sum(c["event"] == "close" for c in calls) == 2 * 3 * 2  # every other episode, once


# -- what episodes return: messages and scores -----------------------------------------------------


class ContractEpisode(Episode):
    """Opens with ``task["opening"]``, answers the first reply with ``task["answer"]`` (a Step,
    or anything), scores ``task["score"]``."""

    def __init__(self, task):
        self.task = task

    def start(self):
        return self.task.get("opening", [{"role": "user", "content": "go"}])

    def step(self, reply):
        return self.task.get("answer", Step(done=True))

    def score(self):
        return self.task.get("score", 1.0)


class ContractEnv(Environment):
    name = "contract"

    def __init__(self, rows):
        self.rows = rows

    def tasks(self, split="train"):
        return Dataset.from_list([{"task_id": row["task_id"]} for row in self.rows])

    def episode(self, task):
        return ContractEpisode(next(row for row in self.rows if row["task_id"] == task["task_id"]))


def rollout_errors(tokenizer, rows) -> dict[str, str | None]:
    """Each task's rollout error (None when it completed)."""
    backend = ScriptedBackend(tokenizer, lambda prompt: "ok")
    with RolloutEngine(
        ContractEnv(rows),
        backend,
        ChatFormatter(tokenizer),
        EpisodeLimits(max_turns=2),
        show_progress=False,
        env_timeout=120.0,
    ) as engine:
        batch = engine.collect(rows, 1)
    return {t.task_id: t.error for t in (*batch.trajectories, *batch.failed)}


def test_messages_without_a_known_role_fail_their_rollout_with_the_message_named(qwen_tokenizer):
    rows = [
        {"task_id": "good", "answer": Step([{"role": "tool", "content": "fine"}])},
        {"task_id": "no-role", "answer": Step([{"content": "hello"}])},
        {"task_id": "bot-role", "answer": Step([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}])},
        {"task_id": "opening", "opening": [{"role": "System", "content": "sys"}]},
        {"task_id": "a-string", "opening": "fetch code of ann"},
        {"task_id": "not-a-dict", "answer": Step(["hello"])},
        {"task_id": "not-a-step", "answer": {"messages": [], "done": True}},
    ]
    errors = rollout_errors(qwen_tokenizer, rows)
    assert errors["good"] is None
    assert errors["no-role"] == (
        "EpisodeContractError: Episode.step() message 0 has no 'role' "
        "(roles: system, user, assistant, tool): {'content': 'hello'}"
    )
    assert errors["bot-role"] == (
        "EpisodeContractError: Episode.step() message 1 has the unknown role 'bot' "
        "(roles: system, user, assistant, tool): {'role': 'bot', 'content': 'b'}"
    )
    assert errors["opening"].startswith("EpisodeContractError: Episode.start() message 0 has the unknown role 'System'")
    assert errors["a-string"] == (
        "EpisodeContractError: Episode.start() must return a list of messages, got str: 'fetch code of ann'"
    )
    assert errors["not-a-dict"].startswith("EpisodeContractError: Episode.step() message 0 is a str, not a dict")
    assert errors["not-a-step"] == "EpisodeContractError: Episode.step() must return a Step, got dict"


def test_a_reward_that_is_not_a_number_fails_its_rollout_naming_its_type(qwen_tokenizer):
    rows = [
        {"task_id": "string", "score": "0.5"},
        {"task_id": "score-string", "score": Score(reward="0.5")},
        {"task_id": "none", "score": None},
        {"task_id": "number", "score": 0.5},
    ]
    errors = rollout_errors(qwen_tokenizer, rows)
    assert errors["string"] == (
        "EpisodeContractError: Episode.score() must return a number in [0, 1] or a Score, got str: '0.5'"
    )
    assert (
        errors["score-string"]
        == "EpisodeContractError: Score.reward must be a number in [0, 1] (int or float), got str: '0.5'"
    )
    assert errors["none"].endswith("got NoneType: None") and errors["number"] is None


def test_as_score_takes_numbers_only():
    # bool is an int: a 0/1 reward loses nothing, so it is taken (as 0.0 / 1.0)
    for value, reward in (
        (True, 1.0),
        (0, 0.0),
        (np.float32(0.25), 0.25),
        (Fraction(1, 2), 0.5),
        (Score(reward=np.bool_(True), success=True), 1.0),
    ):
        score = as_score(value)
        assert score.reward == reward and type(score.reward) is float
    for value, kind in (
        ("0.5", "str"),
        (b"1", "bytes"),
        (Decimal("0.5"), "Decimal"),
        ([0.5], "list"),
        (torch.tensor(0.5), "Tensor"),
        (Score(reward=None), "NoneType"),
    ):
        with pytest.raises(EpisodeContractError, match=f"got {kind}: "):
            as_score(value)
    for value in (1.5, -0.1, float("nan"), Score(reward=2)):
        with pytest.raises(EpisodeContractError, match=r"episode reward must be a finite number in \[0, 1\]"):
            as_score(value)
    # an environment with another range (TRL reward functions: any finite number)
    assert as_score(-3.5, (-float("inf"), float("inf"))).reward == -3.5
    for value in (float("inf"), float("nan")):
        with pytest.raises(EpisodeContractError, match=r"finite number in \[-inf, inf\]"):
            as_score(value, (-float("inf"), float("inf")))


# -- what environments list: tasks ------------------------------------------------------------------


def test_check_tasks_accepts_a_dataset_with_distinct_task_ids():
    tasks = Dataset.from_list([{"task_id": f"t{i}", "x": i} for i in range(3)])
    assert check_tasks(tasks, environment="mine", split="train") is tasks


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        (
            [{"task_id": "a"}],
            "environment 'mine', split 'train': tasks() returned a list, not a datasets.Dataset "
            "(wrap rows with datasets.Dataset.from_list(rows))",
        ),
        ({"task_id": ["a"]}, "environment 'mine', split 'train': tasks() returned a dict, not a datasets.Dataset"),
        (
            Dataset.from_list([{"id": "a", "prompt": "p"}]),
            "environment 'mine', split 'train': the tasks have no 'task_id' column (columns: id, prompt)",
        ),
        (
            Dataset.from_list([]),
            "environment 'mine', split 'train': the split has no tasks (check the environment's data, or the "
            "environment_kwargs that set its size)",
        ),
        (
            Dataset.from_dict({"task_id": []}),
            "environment 'mine', split 'train': the split has no tasks (check the environment's data, or the "
            "environment_kwargs that set its size)",
        ),
        (
            Dataset.from_dict({"task_id": ["a", None, "b"]}),
            "environment 'mine', split 'train': 1 of 3 tasks have no task_id",
        ),
        (
            Dataset.from_dict({"task_id": ["a", "b", "a", "c", "b", "a", "d", "d", "e", "e"]}),
            "environment 'mine', split 'train': 4 task ids occur more than once: "
            "'a' (3x), 'b' (2x), 'd' (2x) and 1 more; every task needs its own task_id",
        ),
        (Dataset.from_dict({"task_id": [1, 2, 1]}), "1 task ids occur more than once: '1' (2x)"),
    ],
)
def test_check_tasks_refuses_with_one_line(tasks, message):
    with pytest.raises(EnvironmentSetupError) as error:
        check_tasks(tasks, environment="mine", split="train")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_vault_refuses_no_tasks_and_unknown_splits():
    for num_tasks in (0, -3, "8"):
        with pytest.raises(
            ValueError,
            match=r"^vault: num_tasks \(environment_kwargs\) is the number of tasks per "
            r"split and must be an integer >= 1, got",
        ):
            make_environment("vault", num_tasks=num_tasks)
    with pytest.raises(UnknownSplitError) as error:
        VaultEnv(num_tasks=2).tasks("dev")
    assert isinstance(error.value, EnvironmentSetupError) and isinstance(error.value, ValueError)
    assert str(error.value) == (
        "vault has no split 'dev'; its splits are 'train' and 'test' (set train_split / eval_split to one of them)"
    )
    assert len(load_tasks(VaultEnv(num_tasks=2), "test")) == 2


class ListTasksVault(VaultEnv):
    def tasks(self, split="train"):
        return list(super().tasks(split))


class NoTaskIdVault(VaultEnv):
    def tasks(self, split="train"):
        return super().tasks(split).rename_column("task_id", "id")


class DuplicateIdsVault(VaultEnv):
    def tasks(self, split="train"):
        return Dataset.from_list([{**row, "task_id": f"{split}-{i % 2}"} for i, row in enumerate(super().tasks(split))])


TINY_RUN = [*TINY_VAULT_RUN, "--iterations", "1", "--report_to", "none"]  # flags later on a line win
BROKEN_TASK_LISTS = {  # flags, and the line loop-train refuses them with
    "no-tasks": (
        ["--environment_kwargs", '{"num_tasks": 0}'],
        "vault: num_tasks (environment_kwargs) is the number of tasks per split and must be an integer >= 1, got 0",
    ),
    "unknown-split": (
        ["--environment_kwargs", '{"num_tasks": 8}', "--train_split", "dev"],
        "vault has no split 'dev'; its splits are 'train' and 'test' (set train_split / eval_split to one of them)",
    ),
    "list": (
        ["--environment", "test_env_contract:ListTasksVault"],
        "environment 'vault', split 'train': tasks() returned a list, not a datasets.Dataset",
    ),
    "no-task-id": (
        ["--environment", "test_env_contract:NoTaskIdVault"],
        "environment 'vault', split 'train': the tasks have no 'task_id' column (columns: id, person, people,",
    ),
    "duplicate-ids": (
        ["--environment", "test_env_contract:DuplicateIdsVault", "--environment_kwargs", '{"num_tasks": 8}'],
        "environment 'vault', split 'train': 2 task ids occur more than once: 'train-0' (4x), 'train-1' (4x);",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN_TASK_LISTS))
def test_loop_train_refuses_a_broken_task_list_with_one_line(tmp_path, capsys, case):
    from loop_trainer.cli.train import cli

    flags, message = BROKEN_TASK_LISTS[case]
    assert cli([*TINY_RUN, "--output_dir", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"loop-train: error: {message}") and err.count("\n") == 1, err


def test_the_loop_train_command_refuses_a_broken_task_list_with_one_line_and_nothing_else(tmp_path):
    """As the command, in a process of its own: the one line is all it writes. The in-process test above cannot see
    a line before it: pytest keeps Python's warnings and log records for itself, and capsys misses writes to fd 2."""
    flags, message = BROKEN_TASK_LISTS["list"]
    command = [sys.executable, "-m", "loop_trainer.cli.train", *TINY_RUN, "--output_dir", str(tmp_path / "run"), *flags]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(f"loop-train: error: {message}") and result.stderr.count("\n") == 1, result.stderr


def test_an_environment_module_in_the_working_directory_imports_as_python_m_would(tmp_path, monkeypatch):
    """``loop-train --environment my_env:MyEnv`` beside ``my_env.py``: a console script's sys.path does not
    start at the working directory, so the module is looked for there; a module found nowhere names the fix."""
    import sys

    (tmp_path / "beside_the_recipe.py").write_text(
        "from loop_trainer.envs import VaultEnv\n\nclass MyVault(VaultEnv):\n    name = 'my-vault'\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    env = make_environment("beside_the_recipe:MyVault", num_tasks=3)
    assert env.name == "my-vault" and len(env.tasks("train")) == 3
    with pytest.raises(ValueError) as caught:
        make_environment("nowhere_to_be_found:Env")
    message = str(caught.value)
    assert "\n" not in message and "No module named 'nowhere_to_be_found'" in message
    assert "run from the directory that holds nowhere_to_be_found.py, or add that directory to PYTHONPATH" in message
    with pytest.raises(ValueError, match="has no attribute 'Missing'$"):
        make_environment("beside_the_recipe:Missing")
