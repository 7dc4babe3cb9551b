"""One evaluation pipeline (Evaluator), the environment's own summary, loop-eval's lifecycle, and
AppWorld as a plugin the core never imports."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from trl import ModelConfig

from loop_trainer import LOOPConfig
from loop_trainer.chat import ChatFormatter
from loop_trainer.cli import evaluate as loop_eval
from loop_trainer.cli.evaluate import EvalArguments, evaluate
from loop_trainer.cli.recipe import RecipeError
from loop_trainer.config import EpisodeSettings
from loop_trainer.envs import BUILTIN, ENTRY_POINT_GROUP, VaultEnv, make_environment
from loop_trainer.evaluation import Evaluator
from loop_trainer.models.tiny import build_word_tokenizer
from support.helpers import AnyTemperature, ScriptedBackend


def test_importing_the_core_does_not_import_appworld():
    script = (
        "import sys, loop_trainer, loop_trainer.cli.train_run, loop_trainer.cli.evaluate, loop_trainer.evaluation\n"
        "from loop_trainer import *  # every name loop_trainer exports on first use (the trainer among them)\n"
        "from loop_trainer.envs import *\n"
        "print(sorted(m for m in sys.modules if m.startswith('loop_trainer.envs.appworld')))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"  # after anything the imports print


def test_appworld_is_an_entry_point_not_a_builtin(monkeypatch):
    from importlib.metadata import entry_points

    assert "appworld" not in BUILTIN
    (entry,) = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == "appworld"]
    assert entry.value == "loop_trainer.envs.appworld:AppWorldRolloutEnv"
    monkeypatch.delenv("APPWORLD_ROOT", raising=False)
    from loop_trainer.envs.appworld import AppWorldDataError

    with pytest.raises(AppWorldDataError, match="APPWORLD_ROOT is not set"):  # resolved, then asked for its data
        make_environment("appworld")


class VaultAgent:
    """Plays vault's protocol from the last message of the prompt (word tokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, prompt_ids):
        words = self.tokenizer.decode(prompt_ids).split("<|im_start|>")[-2].split()
        if "fetch" in words:  # "user fetch code of ann <|im_end|>"
            return f"find {words[words.index('of') + 1]}"
        if "id" in words:  # "user ann id k3 <|im_end|>"
            return "open"
        return f"submit {words[words.index('code') + 1]}"  # "user k3 code 7 <|im_end|>"


class RecordingVault(VaultEnv):
    """A vault whose first task cannot start, that records experiment names and close() calls."""

    def __init__(self):
        super().__init__(num_tasks=6)
        self.experiment_name = "the caller's"
        self.experiments_seen: list[str] = []
        self.closed = 0

    def episode(self, task):
        self.experiments_seen.append(self.experiment_name)
        if task["task_id"].endswith("0000"):
            raise RuntimeError("this world is broken")
        return super().episode(task)

    def close(self):
        self.closed += 1


def test_vault_summary_counts_failures_and_reports_no_goal_completion():
    env = RecordingVault()
    tokenizer = build_word_tokenizer(env.vocabulary())
    evaluator = Evaluator(
        env,
        ScriptedBackend(tokenizer, VaultAgent(tokenizer)),
        ChatFormatter(tokenizer),
        EpisodeSettings(max_turns=4, max_new_tokens_per_turn=4, max_trajectory_tokens=256),
    )
    result = evaluator.run("test", rollouts_per_task=2, seed=0)
    evaluator.close()
    assert env.closed == 0
    assert [(row["rollout"], row["task_id"]) for row in result.rows] == [
        (k, f"test-{i:04d}") for k in range(2) for i in range(6)
    ]
    assert [row["status"] for row in result.rows].count("failed") == 2
    assert result.metrics == {
        "success_rate": 10 / 12,
        "reward_mean": 10 / 12,
        "passed_used_directory": 10 / 12,
        "passed_found_person": 10 / 12,
        "passed_opened_account": 10 / 12,
        "passed_submitted_code": 10 / 12,
        "num_rollouts": 12.0,
        "num_failed_to_run": 2.0,
    }
    assert all("token_ids" not in row and isinstance(row["success"], bool) for row in result.rows)


def test_loop_eval_defaults_are_the_trainers():
    for setting in dataclasses.fields(EpisodeSettings):
        assert (
            getattr(EvalArguments(), setting.name)
            == getattr(LOOPConfig(output_dir="x"), setting.name)
            == setting.default
        ), setting.name


def test_loop_eval_leaves_a_given_env_open_and_as_it_was(tmp_path):
    env = RecordingVault()
    tokenizer = build_word_tokenizer(env.vocabulary())
    tokenizer.save_pretrained(tmp_path / "tokenizer-only")
    eval_args = EvalArguments(
        environment="vault",
        split="test",
        rollouts_per_task=2,
        output_dir=str(tmp_path / "eval"),
        experiment_name="exp",
        max_turns=4,
        max_new_tokens_per_turn=4,
    )
    metrics = evaluate(
        eval_args,
        ModelConfig(model_name_or_path=str(tmp_path / "tokenizer-only")),
        env=env,
        generation_backend=AnyTemperature(ScriptedBackend(tokenizer, VaultAgent(tokenizer))),
    )
    assert env.closed == 0 and env.experiment_name == "the caller's"
    assert env.experiments_seen == ["exp"] * 6 + ["exp_rollout1"] * 6  # rollout k under its own experiment
    assert metrics["success_rate"] == 10 / 12 and metrics["num_failed_to_run"] == 2
    written = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert written["passed_submitted_code"] == 10 / 12 and not any("tgc" in key for key in written)
    rows = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").read_text().splitlines()]
    assert [row["experiment_name"] for row in rows] == ["exp"] * 6 + ["exp_rollout1"] * 6


def test_loop_eval_with_a_generation_backend_loads_no_model(tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("loop-eval loaded a model although a generation backend was given")

    monkeypatch.setattr(loop_eval, "build_tiny_from_spec", no_model)
    monkeypatch.setattr(loop_eval.AutoModelForCausalLM, "from_pretrained", no_model)
    env = VaultEnv(num_tasks=3)
    tokenizer = build_word_tokenizer(env.vocabulary())
    eval_args = EvalArguments(environment="vault", split="test", output_dir=str(tmp_path), max_turns=4)
    metrics = evaluate(
        eval_args,
        ModelConfig(model_name_or_path="tiny:vault"),
        env=env,
        generation_backend=AnyTemperature(ScriptedBackend(tokenizer, VaultAgent(tokenizer))),
    )
    assert metrics["success_rate"] == 1.0 and metrics["num_rollouts"] == 3


def test_loop_eval_builds_a_tiny_model_with_the_warm_up_steps_and_seed_it_is_given(tmp_path, monkeypatch):
    """tiny_instruct_steps and seed reach the build, as loop-train's reach it: the starting policy of a run that
    pinned its warm-up is that warm-up, not one until fitted."""
    import torch

    built, model, tokenizer = [], torch.nn.Linear(1, 1), object()
    monkeypatch.setattr(
        loop_eval, "build_tiny_from_spec", lambda name, env, **kwargs: built.append(kwargs) or (model, tokenizer)
    )
    env = VaultEnv(num_tasks=3)
    for steps in (7, None):
        eval_args = EvalArguments(environment="vault", output_dir=str(tmp_path), seed=3, tiny_instruct_steps=steps)
        loaded = loop_eval.load_policy(ModelConfig(model_name_or_path="tiny-instruct:vault"), eval_args, env)
        assert loaded == (model, tokenizer)
    assert [(kwargs["warm_up_steps"], kwargs["seed"]) for kwargs in built] == [(7, 3), (None, 3)]


def test_loop_eval_refuses_a_temperature_a_given_backend_cannot_honour(tmp_path):
    env = VaultEnv(num_tasks=3)
    tokenizer = build_word_tokenizer(env.vocabulary())
    eval_args = EvalArguments(environment="vault", split="test", output_dir=str(tmp_path), max_turns=4, temperature=0.7)
    with pytest.raises(RecipeError, match="temperature cannot be honoured"):
        evaluate(
            eval_args,
            ModelConfig(model_name_or_path="tiny:vault"),
            env=env,
            generation_backend=ScriptedBackend(tokenizer, VaultAgent(tokenizer)),
        )
