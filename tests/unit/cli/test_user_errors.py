"""User errors found by an independent probe after issues 11 and 12: each is one line, or honoured."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from datasets import Dataset

from loop_trainer.cli.train import cli
from loop_trainer.envs import EnvironmentSetupError, VaultEnv, load_tasks

TINY = [
    "--model_name_or_path",
    "tiny:vault",
    "--environment_kwargs",
    '{"num_tasks": 8}',
    "--iterations",
    "1",
    "--tasks_per_iteration",
    "2",
    "--rollouts_per_task",
    "2",
    "--minibatch_size",
    "4",
    "--max_turns",
    "3",
    "--max_new_tokens_per_turn",
    "4",
    "--max_trajectory_tokens",
    "200",
    "--disable_tqdm",
    "true",
]


@pytest.mark.parametrize(
    "flags", [["--load_in_4bit", "true"], ["--load_in_8bit", "true"], ["--bnb_4bit_quant_type", "fp4"]]
)
def test_quantisation_keys_of_trls_model_config_are_refused_not_ignored(tmp_path, capsys, flags):
    for extra in ([], ["--dry-run"]):
        assert cli([*TINY, "--output_dir", str(tmp_path / "q"), *flags, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"loop-train: error: {flags[0][2:]}=") and "use_peft" in err[0]


def test_help_lists_what_loop_uses_and_marks_the_model_keys_it_refuses(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    # TrainingArguments and GRPOConfig settings LOOP does not use are no options at all
    assert "--learning_rate" in text and "--iterations" in text
    assert "--loss_type" not in text and "--eval_steps" not in text and "--num_train_epochs" not in text
    assert "REFUSED by LOOP" in text.rsplit("--load_in_4bit", 1)[1][:300]
    assert "REFUSED" not in text.rsplit("--learning_rate", 1)[1][:200]


def test_an_output_dir_that_cannot_be_created_is_one_line(capsys):
    assert cli([*TINY, "--output_dir", "/proc/loop-trainer-cannot-be-here"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loop-train: error: output_dir '/proc/loop-trainer-cannot-be-here'")


@pytest.mark.parametrize("every", ["0", "1.5", '"two"'])
def test_a_checkpointing_every_n_layers_that_is_not_a_whole_number_is_one_line(tmp_path, capsys, every):
    kwargs = f'{{"every_n_layers": {every}}}'
    flags = ["--activation_checkpointing", "true", "--activation_checkpointing_kwargs", kwargs]
    for extra in ([], ["--dry-run"]):
        assert cli([*TINY, "--output_dir", str(tmp_path / "c"), *flags, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "every_n_layers must be a whole number >= 1" in err[0], err


class SplitByKeyEnv(VaultEnv):
    """Answers an unknown split the way many environments do: a KeyError from a dict lookup."""

    def tasks(self, split: str = "train") -> Dataset:
        return {"train": super().tasks("train")}[split]

    def episode(self, task: Mapping[str, Any]):
        return super().episode(task)


def test_an_environments_own_error_for_an_unknown_split_is_one_line():
    env = SplitByKeyEnv(num_tasks=4)
    assert len(load_tasks(env, "train")) == 4
    with pytest.raises(
        EnvironmentSetupError, match=r"^environment 'vault' cannot list the tasks of split 'nope': 'nope'$"
    ):
        load_tasks(env, "nope")


def test_trainer_evaluate_runs_episodes_on_the_eval_split(tmp_path, vault_tiny):
    from loop_trainer import LOOPConfig, LOOPTrainer

    env, model, tok = vault_tiny
    args = LOOPConfig(
        output_dir=str(tmp_path / "run"),
        iterations=1,
        tasks_per_iteration=2,
        rollouts_per_task=2,
        minibatch_size=4,
        max_turns=3,
        max_new_tokens_per_turn=4,
        max_trajectory_tokens=200,
        activation_checkpointing=False,
        disable_tqdm=True,
        eval_split="test",
        eval_max_tasks=2,
        report_to=[],
    )
    with LOOPTrainer(model, env, args, processing_class=tok) as trainer:
        metrics = trainer.evaluate()
        assert metrics["eval_num_rollouts"] == 2 and "eval_success_rate" in metrics
        with pytest.raises(ValueError, match="evaluate_policy"):
            trainer.evaluate(eval_dataset=Dataset.from_list([{"x": 1}]))


def test_more_tasks_per_iteration_than_the_split_has_is_said(tmp_path, vault_tiny, caplog):
    from loop_trainer import LOOPConfig, LOOPTrainer

    env, model, tok = vault_tiny  # 16 tasks
    args = LOOPConfig(
        output_dir=str(tmp_path / "run"),
        iterations=1,
        tasks_per_iteration=20,
        rollouts_per_task=2,
        activation_checkpointing=False,
        disable_tqdm=True,
        report_to=[],
    )
    with caplog.at_level("WARNING"):
        LOOPTrainer(model, env, args, processing_class=tok).close()
    assert "tasks_per_iteration (20) exceeds the 16 tasks of split 'train'" in caplog.text
