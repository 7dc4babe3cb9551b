"""OpenEnv environments through from_openenv, against OpenEnv's real server on 127.0.0.1 (a guessing
game and an MCP calculator, tests/support/openenv_guess.py), driven by a scripted model that emits
Qwen2.5 tool calls: the rollout engine, LOOPTrainer, text mode, MCP, setup errors."""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import time

import pytest
from openenv.core import GenericEnvClient  # the project's venv has OpenEnv (requirements/integrations*.lock)
from openenv.core.mcp_client import MCPToolClient

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.chat import ChatFormatter
from loop_trainer.compat.openenv.environment import from_openenv
from loop_trainer.envs import EnvironmentSetupError
from loop_trainer.rollout import EpisodeLimits, RolloutEngine
from support.helpers import ScriptedBackend, tiny_qwen
from support.openenv_guess import GuessAction, GuessClient, GuessEnvironment, calculator_app, guess_app, serve


@pytest.fixture(scope="module")
def guess_server():
    with serve(guess_app(max_sessions=4)) as url:
        yield url


@pytest.fixture(autouse=True)
def fresh_records():
    GuessEnvironment.forget()
    yield
    GuessEnvironment.forget()


def sessions_closed(within: float = 10.0) -> bool:
    """Whether the server has closed every session by now: it closes one once it has read the client's close of
    its connection, which may come just after the client's call returns (a bounded wait, not a timing)."""
    deadline = time.monotonic() + within
    while GuessEnvironment.open_sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    return GuessEnvironment.open_sessions == 0


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def turn_and_game(text: str) -> tuple[int, int]:
    """Which reply the model is writing (0, 1, ...) and the game's number, from the prompt."""
    return text.count("<|im_start|>assistant") - 1, int(re.search(r"\(game (\d+)\)", text).group(1))


def by_game(script):
    return lambda text: script(*turn_and_game(text))


def collect(tokenizer, env, script, k=1, max_turns=10):
    """Roll out every task with a model that replies ``script(prompt text)``: the trajectories, failed
    ones included, in task order."""
    env.set_tokenizer(tokenizer)
    backend = ScriptedBackend(tokenizer, lambda prompt: script(tokenizer.decode(prompt)))
    limits = EpisodeLimits(max_turns=max_turns, max_new_tokens_per_turn=96)
    with RolloutEngine(env, backend, ChatFormatter(tokenizer), limits, show_progress=False) as engine:
        batch = engine.collect(env.tasks(), rollouts_per_task=k)
    order = {task_id: index for index, task_id in enumerate(env.tasks()["task_id"])}
    return sorted(batch.trajectories + batch.failed, key=lambda t: order[t.task_id])


GAME_13 = [
    call("guess", '{"number": 2, "comment": "low"}'),
    call("guess", '{"numbr": 4}'),
    call("guess", '{"number": 4,, }'),
    call("guess", '{"number": 12}'),
    call("nope", "{}"),
    call("guess", '{"number": 5}'),
    call("guess", '{"number": 3}'),
    "unreachable",
]


def test_tool_calls_reach_the_server_and_its_rewards_score_the_episode(qwen_tokenizer, guess_server):
    env = from_openenv(GuessClient, base_url=guess_server, tasks=[{"seed": 13}], instructions="Find my number.")
    [trajectory] = collect(qwen_tokenizer, env, by_game(lambda turn, game: GAME_13[turn]))
    assert trajectory.status == "completed", trajectory.error
    # the server received exactly the valid actions, with their arguments
    assert GuessEnvironment.actions == [(13, 2, "low"), (13, 12, ""), (13, 5, ""), (13, 3, "")]
    # one tool, built from GuessAction's fields (metadata left out), shown in the opening with the reset observation
    opening = qwen_tokenizer.decode(trajectory.token_ids[: trajectory.prompt_length])
    assert '"name": "guess"' in opening and '"number": {"description": "Your guess, from 0 to 9"' in opening
    assert "metadata" not in opening and '"description": "Guess the secret number."' in opening
    assert "Find my number.\n\nI am thinking of a number from 0 to 9 (game 13).<|im_end|>" in opening
    tool_messages = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert tool_messages[0] == "higher"
    assert tool_messages[1] == (
        "{'error': 'invalid arguments for guess: number: Field required; numbr: Extra inputs are not permitted'}"
    )
    assert tool_messages[2].startswith("{'error': 'malformed tool call: its JSON does not parse")
    assert tool_messages[3:] == ["{'error': '12 is not between 0 and 9'}", "{'error': 'Tool nope not found.'}", "lower"]
    # the server's done ended the episode at the right guess; its rewards summed: -0.25 - 0.25 + 1
    assert trajectory.ending == "done" and trajectory.num_turns == 7
    assert trajectory.reward == 0.5 and trajectory.info["rewards"] == [-0.25, -0.25, 1.0]
    assert trajectory.info["action_errors"] == 4 and trajectory.info["last_observation"] == "correct"
    assert env.metrics()["action_errors"] == 4.0
    # token-exact: the whole conversation rendered at once by the template gives the same ids
    full = qwen_tokenizer.apply_chat_template(trajectory.messages, tools=[env.tool], tokenize=False)
    assert trajectory.token_ids + qwen_tokenizer.encode("\n") == qwen_tokenizer.encode(full)
    # tool messages are masked out of the loss; every reply is in it
    sampled = qwen_tokenizer.decode([t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m])
    assert "<tool_response>" not in sampled and "higher" not in sampled and sampled.count("<tool_call>") == 7
    assert sessions_closed()  # the episode closed its session


def test_episodes_run_concurrently_one_session_each(qwen_tokenizer, guess_server):
    # each session's first step waits on the server until all three sessions have reached it
    GuessEnvironment.barrier = threading.Barrier(3)
    env = from_openenv(GuessClient, base_url=guess_server, tasks=3, max_concurrent_episodes=4)
    trajectories = collect(qwen_tokenizer, env, by_game(lambda turn, game: call("guess", f'{{"number": {game % 10}}}')))
    assert [t.status for t in trajectories] == ["completed"] * 3, [t.error for t in trajectories]
    assert GuessEnvironment.peak_sessions == 3 and not GuessEnvironment.barrier.broken
    assert sorted(GuessEnvironment.actions) == [(0, 0, ""), (1, 1, ""), (2, 2, "")]
    assert [t.reward for t in trajectories] == [1.0] * 3 and env.max_concurrent_episodes == 4
    assert env.tasks()["task_id"] == ["seed-0", "seed-1", "seed-2"]


def test_a_full_server_says_how_to_fix_it(guess_server):
    with serve(guess_app(max_sessions=1)) as url:
        env = from_openenv(GuessClient, base_url=url, tasks=2, capacity_wait=0)

        async def two_sessions():
            first, second = env.episode(env.tasks()[0]), env.episode(env.tasks()[1])
            await first.start()
            try:
                with pytest.raises(
                    RuntimeError,
                    match=r"refused a session \(Server at capacity: 1/1 sessions"
                    r".*max_concurrent_envs.*max_concurrent_episodes=1\)",
                ):
                    await second.start()
            finally:
                await first.close()
                await second.close()

        asyncio.run(two_sessions())


def test_two_loop_iterations_against_the_live_server(qwen_tokenizer, guess_server, tmp_path):
    attempts: dict[int, int] = {}

    def policy(prompt_ids):  # every other attempt at a game guesses right at once; the others miss, then give up
        turn, game = turn_and_game(qwen_tokenizer.decode(prompt_ids))
        if turn > 0:
            return "I give up."
        attempts[game] = attempts.get(game, 0) + 1
        return call("guess", f'{{"number": {game % 10 if attempts[game] % 2 else (game + 1) % 10}}}')

    env = from_openenv(GuessClient, base_url=guess_server, tasks=4, max_concurrent_episodes=4)
    # one task of three rollouts per iteration: the smallest run whose groups differ (the 151k-token vocabulary
    # makes every trained token cost)
    args = LOOPConfig(
        output_dir=str(tmp_path / "run"),
        iterations=2,
        tasks_per_iteration=1,
        rollouts_per_task=3,
        minibatch_size=3,
        max_turns=3,
        max_new_tokens_per_turn=64,
        max_trajectory_tokens=800,
        per_device_train_batch_size=3,
        activation_checkpointing=False,
        disable_tqdm=True,
        seed=0,
        learning_rate=1e-3,
        report_to=[],
        memory_stress_test=False,
    )
    trainer = LOOPTrainer(
        tiny_qwen(qwen_tokenizer),
        env,
        args,
        processing_class=qwen_tokenizer,
        generation_backend=ScriptedBackend(qwen_tokenizer, policy),
    )
    trainer.train()
    assert len(trainer.history) == 2
    assert all(h["num_failed"] == 0 and h["num_rollouts"] == 3 for h in trainer.history)
    # the rewards are the server's: +1 for a right guess, -0.25 for a wrong one
    guesses = GuessEnvironment.actions
    assert len(guesses) == 6
    right = sum(number == seed % 10 for seed, number, _ in guesses)
    assert 0 < right < 6
    mean = sum(h["reward_mean"] for h in trainer.history) / 2
    assert mean == pytest.approx((right * 1.0 - (6 - right) * 0.25) / 6)
    assert all(h["optimizer_steps"] > 0 for h in trainer.history)  # rewards differed within each group: LOOP updated
    assert sessions_closed()


def test_text_mode_turns_each_reply_into_an_action(qwen_tokenizer, guess_server):
    replies = {0: "five", 1: "2", 2: "3"}
    env = from_openenv(
        GuessClient,
        base_url=guess_server,
        tasks=[{"seed": 3, "prompt": "Reply with a digit."}],
        action_from_text=lambda text: GuessAction(number=int(text.strip())),
        system_prompt="Be brief.",
    )
    [trajectory] = collect(qwen_tokenizer, env, by_game(lambda turn, game: replies[turn]))
    assert trajectory.status == "completed", trajectory.error
    assert [m["role"] for m in trajectory.messages] == ["system", "user"] + ["assistant", "user"] * 2 + ["assistant"]
    assert trajectory.messages[1]["content"] == "Reply with a digit.\n\nI am thinking of a number from 0 to 9 (game 3)."
    assert [m["content"] for m in trajectory.messages[3::2]] == [
        "{'error': \"no action in this reply: invalid literal for int() with base 10: 'five'\"}",
        "higher",
    ]
    assert GuessEnvironment.actions == [(3, 2, ""), (3, 3, "")]
    assert trajectory.reward == 0.75 and trajectory.ending == "done"
    opening = qwen_tokenizer.decode(trajectory.token_ids[: trajectory.prompt_length])
    assert "<tools>" not in opening and "Be brief." in opening


def test_mcp_tools_come_from_the_server_and_no_reward_at_all_fails_the_rollout(qwen_tokenizer):
    def script(prompt):
        turn = prompt.count("<|im_start|>assistant") - 1
        a = int(re.search(r"What is (\d+) \+ 3", prompt).group(1))
        if turn == 0:
            return call("add", f'{{"a": {a}, "b": 3}}')
        return "It is 5." if a == 2 else call("submit", f'{{"answer": {a + 3}}}')

    with serve(calculator_app()) as url:
        env = from_openenv(MCPToolClient, base_url=url, tasks=2)
        first, second = collect(qwen_tokenizer, env, script)
    opening = qwen_tokenizer.decode(second.token_ids[: second.prompt_length])
    assert '"name": "add"' in opening and '"name": "submit"' in opening and "What is 3 + 3?" in opening
    assert second.status == "completed" and second.reward == 1.0
    assert [m["content"] for m in second.messages if m["role"] == "tool"] == ["6"]
    # seed 0 only added: the server gave no reward in any step, which is the environment's problem, not 0
    assert first.status == "failed" and "gave no reward in any of this episode's 1 steps" in first.error


def test_an_instance_or_an_untyped_client_works_and_setup_errors_are_one_line(qwen_tokenizer, guess_server):
    parent = GuessClient(base_url=guess_server)
    env = from_openenv(parent, tasks=2)
    env.prepare()  # a probe session: the server answers
    assert GuessEnvironment.peak_sessions == 1 and sessions_closed()
    trajectories = collect(qwen_tokenizer, env, by_game(lambda turn, game: call("guess", f'{{"number": {game}}}')))
    assert [t.reward for t in trajectories] == [1.0, 1.0] and not parent._child_clients
    env.close()
    # GenericEnvClient sends dicts: the tool is built from the server's /schema, the server validates
    generic = from_openenv(GenericEnvClient, base_url=guess_server, tasks=[{"seed": 4}])
    script = [call("guess", '{"number": "many"}'), call("guess", '{"number": 4}')]
    [trajectory] = collect(qwen_tokenizer, generic, by_game(lambda turn, game: script[turn]))
    assert generic.tool["function"]["name"] == "guess" and trajectory.reward == 1.0
    assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["{'error': 'Invalid message'}"]
    with pytest.raises(EnvironmentSetupError, match=r"^OpenEnv environment 'openenv': Failed to connect") as error:
        from_openenv(GuessClient, base_url="http://127.0.0.1:9", tasks=1).prepare()
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="needs base_url="):
        from_openenv(GuessClient, tasks=1)
    with pytest.raises(ValueError, match=r"drop|without \.sync\(\)"):
        from_openenv(GuessClient(base_url=guess_server).sync(), tasks=1)
    with pytest.raises(ValueError, match="tasks must be an int"):
        from_openenv(GuessClient, base_url=guess_server, tasks="seed")
    with pytest.raises(ValueError, match="client_kwargs are for a client class"):
        from_openenv(lambda: GuessClient(base_url=guess_server), client_kwargs={"message_timeout_s": 5})
    with pytest.raises(ValueError, match="action_class and tool_name are for tool mode"):
        from_openenv(GuessClient, base_url=guess_server, action_from_text=str, tool_name="guess")


def test_without_openenv_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(EnvironmentSetupError, match=r"pip install 'loop-trainer\[openenv\]'.*--no-deps"):
        from_openenv(GuessClient, base_url="http://127.0.0.1:9")
