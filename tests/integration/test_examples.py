"""The example scripts build what they train: the TRL script its trainer, from its GRPOConfig (a tiny
model stands in for the real one), and the verifiers script its environment. Nothing trains here:
each route's training is tested in its own test file. examples/openenv_env.py needs a running
OpenEnv server (tests/unit/compat/test_openenv_env.py trains against one)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from loop_trainer import LOOPConfig
from support.helpers import tiny_qwen

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_model_dir(tokenizer, path: Path) -> str:
    tiny_qwen(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_the_trl_example_builds_its_trainer_from_a_grpo_config(qwen_tokenizer, tmp_path):
    example = load_example("trl_environment_factory")
    model = tiny_model_dir(qwen_tokenizer, tmp_path / "model")
    with example.build_trainer(model, str(tmp_path / "out"), use_cpu=True, bf16=False) as trainer:
        args = trainer.args
        assert isinstance(args, LOOPConfig) and trainer.trl_route
        assert (args.tasks_per_iteration, args.rollouts_per_task, args.iterations, args.max_turns) == (2, 6, 50, 7)
        assert sorted(trainer.env.tasks()["target"]) == sorted([10, 25, 42] * 7)
        assert hasattr(trainer.model, "peft_config")


def test_the_verifiers_example_builds_its_environment():
    from loop_trainer.envs import from_verifiers

    env = from_verifiers(load_example("verifiers_env").build_env())
    tasks = env.tasks()
    assert len(tasks) == 200 and tasks[0]["prompt"][-1]["content"].startswith("What is ")
