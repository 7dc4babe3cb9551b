"""The example scripts build what they train: the TRL script its trainer, from its GRPOConfig (the tiny
tool-calling model stands in for the real one), and the verifiers script its environment; the custom
environment example trains, through the Python API and through loop-train run beside it. Nothing trains here:
each route's training is tested in its own test file. examples/openenv_env.py needs a running
OpenEnv server (tests/unit/compat/test_openenv_env.py trains against one)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from loop_trainer import LOOPConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_trl_example_builds_its_trainer_from_a_grpo_config(tmp_path):
    """With ``tiny-chat:qwen2.5``, the offline tool-calling model its docstring names for a smoke run."""
    example = load_example("trl_environment_factory")
    with example.build_trainer("tiny-chat:qwen2.5", str(tmp_path / "out"), use_cpu=True, bf16=False) as trainer:
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


def test_the_custom_environment_example_keeps_the_contract_and_its_demonstrations_are_an_unreliable_courier():
    example = load_example("custom_env")
    env = example.CourierEnv(num_tasks=8)
    tasks = env.tasks("train")
    assert len(tasks) == 8 and tasks["task_id"] != env.tasks("test")["task_id"]
    for task in tasks:  # a perfect courier: where the person lives, that street's code
        episode = env.episode(task)
        street = episode.street_of[task["name"]]
        replies = [f"where {task['name']}", f"go {street}", f"deliver {episode.code_of[street]}"]
        episode.start()
        assert [episode.step(reply).done for reply in replies] == [False, False, True]
        assert episode.score().success and episode.score().reward == 1.0
    conversations = env.demonstrations(400, seed=0)
    words = set(env.vocabulary())
    assert all(set(m["content"].split()) <= words for c in conversations for m in c)  # the tiny model reads all
    successes = 0
    for world, conversation in zip(env.worlds("demonstrations-0", 400), conversations, strict=True):
        episode = env.episode(world)  # replayed: every observation is what the world answers
        replayed = episode.start()
        for reply in [m["content"] for m in conversation if m["role"] == "assistant"]:
            replayed += [{"role": "assistant", "content": reply}, *episode.step(reply).messages]
        assert replayed == conversation
        successes += episode.score().success
    assert 0.06 < successes / 400 < 0.2  # three values, each copied right half the time: 1/8


def test_the_custom_environment_example_trains_through_the_python_api_and_loop_train_from_its_directory(tmp_path):
    """The example's own route (``LOOPTrainer("tiny-instruct:courier", env, args)``) and the CLI run beside
    ``custom_env.py`` (``--environment custom_env:CourierEnv``, found in the working directory)."""
    import subprocess
    import sys

    from loop_trainer import LOOPTrainer
    from loop_trainer.training.run_log import read_metrics

    example = load_example("custom_env")
    small = {
        "iterations": 1,
        "tasks_per_iteration": 2,
        "rollouts_per_task": 2,
        "minibatch_size": 4,
        "max_trajectory_tokens": 512,  # as the example sets it: the default 32,000 sizes a minute's stress test on CPU
    }
    args = LOOPConfig(output_dir=str(tmp_path / "api"), tiny_instruct_steps=3, max_turns=4, disable_tqdm=True, **small)
    LOOPTrainer("tiny-instruct:courier", example.CourierEnv(num_tasks=4), args).train()
    assert read_metrics(args.output_dir)[-1]["iteration"] == 1

    exe = Path(sys.executable).parent / "loop-train"
    flags = [f"--{key}={value}" for key, value in {**small, "tiny_instruct_steps": 3, "max_turns": 4}.items()]
    result = subprocess.run(
        [
            str(exe),
            "--environment",
            "custom_env:CourierEnv",
            "--model_name_or_path",
            "tiny-instruct:courier",
            "--output_dir",
            str(tmp_path / "cli"),
            "--disable_tqdm",
            "true",
            "--report_to",
            "none",
            *flags,
        ],
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=900,  # seconds on a crowded machine; a hang, not slowness, is what it catches
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert read_metrics(str(tmp_path / "cli"))[-1]["iteration"] == 1
