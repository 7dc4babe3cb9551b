"""AppWorldRolloutEnv and loop-eval on a synthetic world run by AppWorld's real engine.

The world (a few tasks, several scenarios and difficulties) is built on first use with
appworld's own code in AppWorld's virtualenv and cached; see tests/support/appworld_world.py.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trl import ModelConfig

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.chat import ChatFormatter
from loop_trainer.cli.evaluate import EvalArguments, evaluate
from loop_trainer.cli.evaluate import cli as eval_cli
from loop_trainer.envs import EnvironmentSetupError
from loop_trainer.envs.appworld import AppWorldCallError, AppWorldRolloutEnv
from loop_trainer.envs.appworld.agent import DEFAULT_PROMPT_DIR
from loop_trainer.rollout import EpisodeLimits, RolloutEngine
from support.appworld_world import appworld_python, build_synthetic_world
from support.helpers import AnyTemperature, ScriptedBackend, tiny_qwen

pytestmark = pytest.mark.appworld
ALL_SPLITS = "train_and_dev_and_test_normal_and_test_challenge"


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    # A fresh root per session whose data/ is the cached world: worlds write experiments/ next to it.
    cached = build_synthetic_world()
    root = tmp_path_factory.mktemp("appworld-root")
    (root / "data").symlink_to(cached / "data", target_is_directory=True)
    return root, json.loads((cached / "synthetic_solutions.json").read_text())


@pytest.fixture(scope="module")
def env(world, tmp_path_factory):
    root, _ = world
    env = AppWorldRolloutEnv(
        root=root, num_servers=2, python=str(appworld_python()), log_dir=str(tmp_path_factory.mktemp("servers"))
    )
    yield env
    env.close()


def code(text: str) -> str:
    return f"I will run this.\n```python\n{text}\n```"


class Policy:
    """A scripted agent: ``plan(task_id, turn) -> reply``, reading the task from the prompt."""

    def __init__(self, tokenizer, tasks, plan):
        self.tokenizer, self.plan = tokenizer, plan
        self.by_instruction = {row["instruction"]: row["task_id"] for row in tasks}

    def __call__(self, prompt_ids):
        text = self.tokenizer.decode(prompt_ids)
        after_task = text[text.rindex("\nTask: ") + len("\nTask: ") :]
        instruction = after_task.split("<|im_end|>")[0].strip()
        turn = after_task.count("<|im_start|>assistant") - 1
        return self.plan(self.by_instruction[instruction], turn)

    def backend(self):
        return ScriptedBackend(self.tokenizer, self)


def run(env, tokenizer, tasks, plan, max_turns=3, rollouts=1):
    engine = RolloutEngine(
        env,
        Policy(tokenizer, tasks, plan).backend(),
        ChatFormatter(tokenizer),
        EpisodeLimits(max_turns, 2000, 30000),
        max_concurrent_episodes=env.max_concurrent_episodes,
        show_progress=False,
    )
    try:
        return engine.collect(list(tasks), rollouts)
    finally:
        engine.close()


def test_scripted_agent_solves_every_task(env, world, qwen_tokenizer):
    _, solutions = world
    tasks = env.tasks(ALL_SPLITS)
    assert len({row["difficulty"] for row in tasks}) >= 2 and len({row["scenario_id"] for row in tasks}) >= 2
    batch = run(env, qwen_tokenizer, tasks, lambda task_id, turn: code(solutions[task_id]["solution_code"]))
    assert not batch.failed and len(batch.trajectories) == len(tasks)
    for trajectory in batch.trajectories:
        assert (trajectory.reward, trajectory.success, trajectory.ending) == (1.0, True, "done"), trajectory.info
        assert trajectory.num_turns == 1 and trajectory.info["infra_retries"] == 0


def test_do_nothing_agent_gets_the_partial_reward_the_tests_imply(env, world, qwen_tokenizer):
    _, solutions = world
    tasks = env.tasks(ALL_SPLITS)
    batch = run(env, qwen_tokenizer, tasks, lambda task_id, turn: "I am not sure what to do.", max_turns=2)
    assert not batch.failed
    for trajectory in batch.trajectories:
        expected = solutions[trajectory.task_id]["noop_pass_fraction"]
        assert 0 < expected < 1
        assert trajectory.reward == pytest.approx(expected) and trajectory.success is False
        assert trajectory.ending == "turn_limit" and trajectory.num_turns == 2
        reply, answer = trajectory.messages[trajectory.num_opening_messages :][:2]
        assert reply == {"role": "assistant", "content": "I am not sure what to do."}
        assert "no ```python code block" in answer["content"]


def test_observations_are_the_worlds_output_with_a_reminder(env, world, qwen_tokenizer):
    tasks = env.tasks("train").select([0])
    plan = {0: code("print('hello from the world')"), 1: code("print('\\n'.join(str(i) for i in range(5000)))")}
    batch = run(env, qwen_tokenizer, tasks, lambda task_id, turn: plan.get(turn, "done"), max_turns=3)
    messages = batch.trajectories[0].messages[batch.trajectories[0].num_opening_messages :]
    assert "hello from the world" in messages[1]["content"] and "Reminder, the task is:" in messages[1]["content"]
    long_observation = messages[3]["content"]
    assert "The output was too long" in long_observation
    shown = long_observation.split("```")[1].strip().splitlines()
    assert shown == [str(i) for i in range(len(shown))] and 100 < len(shown) < 5000  # whole lines, a prefix


def test_servers_listen_on_loopback_only(env):
    env.prepare()
    listening = {}
    for line in (
        Path("/proc/net/tcp").read_text().splitlines()[1:] + Path("/proc/net/tcp6").read_text().splitlines()[1:]
    ):
        local, state = line.split()[1], line.split()[3]
        if state == "0A":
            address, port = local.rsplit(":", 1)
            listening.setdefault(int(port, 16), []).append(address)
    for server in env.pool.servers:
        port = int(server.url.rsplit(":", 1)[1])
        assert server.url.startswith("http://127.0.0.1:")
        assert listening[port] == ["0100007F"], listening[port]


def solve_in_two_steps(solutions):
    # Step 1 keeps the solution in a REPL variable; step 2 runs it. A world rebuilt without
    # replaying step 1 would fail step 2 with a NameError.
    def plan(task_id, turn):
        if turn == 0:
            return code(f"solution = {solutions[task_id]['solution_code']!r}\nprint('stored')")
        return code("exec(solution)")

    return plan


def interrupt_mid_episode(world, log_dir, interrupt, **env_kwargs):
    """Run a task in two steps on a one-server pool, calling ``interrupt(server_process)`` between
    them; return the episode's score and the pool's stats."""
    root, solutions = world
    env = AppWorldRolloutEnv(
        root=root, num_servers=1, python=str(appworld_python()), log_dir=str(log_dir), **env_kwargs
    )
    try:
        task = env.tasks("train")[0]
        episode = env.episode(task)
        episode.start()
        plan = solve_in_two_steps(solutions)
        assert "stored" in episode.step(plan(task["task_id"], 0)).messages[0]["content"]
        process = env.pool.servers[0].process
        interrupt(process)
        assert episode.step(plan(task["task_id"], 1)).done
        score = episode.score()
        episode.close()
        assert env.pool.servers[0].process.pid != process.pid
        return score, env.pool.stats
    finally:
        env.close()


def test_server_killed_mid_episode_is_restarted_and_the_episode_retried(world, tmp_path):
    def kill(process):
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    score, stats = interrupt_mid_episode(world, tmp_path, kill)
    assert (score.reward, score.success) == (1.0, True)
    assert score.info["infra_retries"] == 1 and score.info["replay_mismatches"] == 0
    assert stats["restarts"] == 1 and stats["connection_errors"] >= 1


def test_hung_server_times_out_and_is_replaced(world, tmp_path):
    def hang(process):  # alive, but silent
        os.killpg(process.pid, signal.SIGSTOP)

    score, stats = interrupt_mid_episode(world, tmp_path, hang, execution_timeout=3, request_timeout=6)
    # What happened, not how fast: the call to the stopped server timed out, the server was replaced
    # (a loaded machine may time out a fresh one too, and replace it again), and the episode's world
    # was rebuilt on the new one: step 2 ran the solution that step 1 stored, replayed exactly.
    assert stats["timeouts"] >= 1 and stats["restarts"] >= 1
    assert 1 <= score.info["infra_retries"] <= stats["restarts"] and score.info["replay_mismatches"] == 0
    assert (score.reward, score.success) == (1.0, True)


def test_code_that_runs_too_long_is_the_agents_problem_not_a_server_failure(world, tmp_path):
    root, _ = world
    env = AppWorldRolloutEnv(
        root=root,
        num_servers=1,
        python=str(appworld_python()),
        log_dir=str(tmp_path),
        execution_timeout=2,
        request_timeout=30,
    )
    try:
        episode = env.episode(env.tasks("train")[0])
        episode.start()
        step = episode.step(code("while True:\n    pass"))
        assert not step.done and "timed out" in step.messages[0]["content"]
        assert episode.step(code("print(1 + 1)")).messages[0]["content"].split("```")[1].strip() == "2"
        episode.close()
        assert env.pool.stats["restarts"] == 0
    finally:
        env.close()


def appworld_evaluate(root, experiment, split):
    """What `appworld evaluate` reports: aggregate and per-difficulty TGC/SGC."""
    python = appworld_python()
    env = {**os.environ, "APPWORLD_ROOT": str(root)}
    subprocess.run(
        [str(python.parent / "appworld"), "evaluate", experiment, split],
        cwd=root,
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    script = (
        "import json,sys; from appworld.evaluator import Metric; "
        "d=json.load(open(sys.argv[1])); print(json.dumps(Metric.build_report(d)))"
    )
    path = root / "experiments" / "outputs" / experiment / "evaluations" / f"{split}.json"
    out = subprocess.run([str(python), "-c", script, str(path)], env=env, check=True, capture_output=True, text=True)
    table = json.loads(out.stdout)
    return {
        kind: {"tgc": tgc, "sgc": sgc}
        for kind, tgc, sgc in zip(
            table["type"], table["task_goal_completion"], table["scenario_goal_completion"], strict=True
        )
    }


def test_loop_eval_goal_completion_equals_appworld_evaluate(world, qwen_tokenizer, tmp_path):
    root, solutions = world
    model_dir = tmp_path / "model"
    tiny_qwen(qwen_tokenizer).save_pretrained(model_dir)
    qwen_tokenizer.save_pretrained(model_dir)
    env = AppWorldRolloutEnv(root=root, num_servers=2, python=str(appworld_python()), log_dir=str(tmp_path / "s"))
    split = "train"
    tasks = env.tasks(split)
    scenarios = sorted(set(tasks["scenario_id"]))
    assert len(scenarios) >= 2
    # All of one scenario and one task of another: TGC and SGC then differ, and neither is 0 or 100.
    solved = sorted(
        [t for t in tasks["task_id"] if t.startswith(scenarios[0])]
        + [t for t in tasks["task_id"] if t.startswith(scenarios[1])][:1]
    )
    policy = Policy(
        qwen_tokenizer,
        tasks,
        lambda task_id, turn: code(
            solutions[task_id]["solution_code"] if task_id in solved else "apis.supervisor.complete_task()"
        ),
    )
    experiment = f"loop_eval_test_{os.getpid()}"
    eval_args = EvalArguments(
        environment="appworld", split=split, output_dir=str(tmp_path / "eval"), experiment_name=experiment, max_turns=2
    )
    try:
        metrics = evaluate(
            eval_args,
            ModelConfig(model_name_or_path=str(model_dir)),
            env=env,
            generation_backend=AnyTemperature(policy.backend()),
        )
        # The env was ours: loop-eval left it open and put its experiment name back.
        assert env.experiment_name is None and env.pool.servers and env.tasks(split)
        episode = env.episode(tasks[0])
        episode.start()
        episode.close()
    finally:
        env.close()
    ours = {"aggregate": {"tgc": metrics["tgc"], "sgc": metrics["sgc"]}}
    for level in (1, 2, 3):
        ours[f"difficulty_{level}"] = {
            "tgc": metrics[f"tgc_difficulty_{level}"],
            "sgc": metrics[f"sgc_difficulty_{level}"],
        }
    assert ours == appworld_evaluate(root, experiment, split)
    assert 0 < ours["aggregate"]["sgc"] < ours["aggregate"]["tgc"] < 100
    rows = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").read_text().splitlines()]
    assert sorted(r["task_id"] for r in rows if r["success"]) == solved
    assert "FAIL" in (tmp_path / "eval" / "viewer.html").read_text()


def test_loop_eval_cli_runs_a_real_model(world, qwen_tokenizer, tmp_path, capsys):
    root, _ = world
    model_dir = tmp_path / "model"
    tiny_qwen(qwen_tokenizer).save_pretrained(model_dir)
    qwen_tokenizer.save_pretrained(model_dir)
    kwargs = json.dumps({"root": str(root), "num_servers": 2, "python": str(appworld_python())})
    status = eval_cli(
        [
            "--model_name_or_path",
            str(model_dir),
            "--split",
            "dev",
            "--environment_kwargs",
            kwargs,
            "--max_turns",
            "2",
            "--max_new_tokens_per_turn",
            "6",
            "--rollouts_per_task",
            "2",
            "--temperature",
            "1.0",
            "--output_dir",
            str(tmp_path / "eval"),
        ]
    )
    assert status == 0, capsys.readouterr().err
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    dev = [t for t in (root / "data" / "datasets" / "dev.txt").read_text().split() if t != "3ab5b8b_3"]
    assert metrics["num_rollouts"] == 2 * len(dev) and metrics["num_failed_to_run"] == 0
    assert {"tgc", "sgc", *(f"{m}_difficulty_{level}" for m in ("tgc", "sgc") for level in (1, 2, 3))} <= set(metrics)
    assert "3ab5b8b_3" not in (tmp_path / "eval" / "results.jsonl").read_text()


def test_loop_eval_reports_missing_data_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("APPWORLD_ROOT", raising=False)
    assert eval_cli(["--model_name_or_path", "x", "--environment", "appworld"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loop-eval: error: APPWORLD_ROOT is not set") and "\n" not in err


def short_prompts(directory: Path) -> Path:
    """The built-in templates with a one-line intro and no worked example (shorter sequences)."""
    shutil.copytree(DEFAULT_PROMPT_DIR, directory)
    (directory / "intro.md").write_text("Solve my task with `apis`, {{ supervisor.first_name }}'s assistant.")
    (directory / "example.yaml").write_text("[]\n")
    return directory


def test_two_loop_iterations_on_the_synthetic_world(world, qwen_tokenizer, tmp_path):
    root, solutions = world
    env = AppWorldRolloutEnv(
        root=root,
        num_servers=2,
        python=str(appworld_python()),
        log_dir=str(tmp_path / "s"),
        prompt_dir=str(short_prompts(tmp_path / "prompts")),
    )
    rng = random.Random(0)
    policy = Policy(
        qwen_tokenizer,
        env.tasks("train"),
        lambda task_id, turn: code(solutions[task_id]["solution_code"] if rng.random() < 0.5 else "print('thinking')"),
    )
    args = LOOPConfig(
        output_dir=str(tmp_path / "run"),
        iterations=2,
        tasks_per_iteration=2,
        rollouts_per_task=3,
        minibatch_size=3,
        max_turns=2,
        max_new_tokens_per_turn=2000,
        max_trajectory_tokens=3000,
        per_device_train_batch_size=1,
        activation_checkpointing=False,
        disable_tqdm=True,
        seed=0,
        learning_rate=1e-3,
        report_to=[],
    )
    model = tiny_qwen(qwen_tokenizer)
    trainer = LOOPTrainer(model, env, args, processing_class=qwen_tokenizer, generation_backend=policy.backend())
    try:
        trainer.train()
    finally:
        env.close()
    assert len(trainer.history) == 2
    assert all(h["num_failed"] == 0 and h["num_rollouts"] == 6 for h in trainer.history)
    assert trainer.history[-1]["env_appworld_restarts"] == 0.0
    assert sum(h["optimizer_steps"] for h in trainer.history) > 0  # rewards differed, so LOOP updated
    assert all(h["tokens"] < 6 * 1000 for h in trainer.history)  # the short prompts were used
    assert sorted(p.name for p in (tmp_path / "run" / "viewer").iterdir()) == [
        "iteration-00001.html",
        "iteration-00002.html",
    ]


def test_a_task_the_server_refuses_fails_that_rollout_without_restarts(env):
    episode = env.episode({"task_id": "fffffff_9", "instruction": "?"})
    with pytest.raises(AppWorldCallError, match="/initialize"):
        episode.start()
    episode.close()
    assert env.pool.stats["restarts"] == 0
    assert env.tasks("train")  # the server it had is free again and still works
    good = env.episode(env.tasks("train")[0])
    good.start()
    good.close()


def test_unreachable_remote_servers_fail_at_prepare_with_one_line(world):
    root, _ = world
    env = AppWorldRolloutEnv(root=root, server_urls=["http://127.0.0.1:9"], startup_timeout=1)
    with pytest.raises(EnvironmentSetupError, match=r"^AppWorld server http://127.0.0.1:9 did not answer within 1s$"):
        env.prepare()
    assert env.max_concurrent_episodes == 1


def test_servers_do_not_outlive_a_killed_trainer(world, tmp_path):
    root, _ = world
    script = (
        f"from loop_trainer.envs.appworld import AppWorldRolloutEnv\n"
        f"env = AppWorldRolloutEnv(root={str(root)!r}, num_servers=2, python={str(appworld_python())!r})\n"
        "env.prepare()\n"
        "print('PIDS', *(s.process.pid for s in env.pool.servers), flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    line = next(line for line in trainer.stdout if line.startswith("PIDS"))  # imports may print first
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == 2 and all(Path(f"/proc/{pid}").exists() for pid in pids)
    trainer.kill()  # SIGKILL: no atexit, no finally, nothing of the trainer's runs
    trainer.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.2)
    alive = [
        pid
        for pid in pids
        if Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    ]
    assert not alive, alive
