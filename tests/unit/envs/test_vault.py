"""The built-in `vault` environment: rewards, state, demonstrations, and the tiny models for it."""

from __future__ import annotations

import pytest

from loop_trainer.envs import VaultEnv, make_environment
from loop_trainer.envs.vault import solve
from loop_trainer.models.tiny import build_tiny_from_spec


def play(env, task, replies):
    episode = env.episode(task)
    messages = episode.start()
    for reply in replies:
        step = episode.step(reply)
        messages.extend(step.messages)
        if step.done:
            break
    return episode.score(), messages


@pytest.fixture()
def env():
    return VaultEnv(num_tasks=20, seed=3)


def test_a_perfect_agent_passes_every_check(env):
    for task in env.tasks("train"):
        score, _ = play(env, task, solve(task))
        assert score.reward == 1.0 and score.success


def test_rewards_are_the_fraction_of_checks_passed(env):
    task = env.tasks("train")[0]
    other = next(p for p in task["people"] if p != task["person"])
    assert play(env, task, [])[0].reward == 0.0
    assert play(env, task, ["hello"])[0].reward == 0.0
    assert play(env, task, [f"find {other}", "open", "submit x"])[0].reward == 0.25
    right = solve(task)
    assert play(env, task, [right[0], "submit x"])[0].reward == 0.5
    assert play(env, task, right[:2] + ["submit x"])[0].reward == 0.75
    # the account opened is the one selected by the *last* find (session state)
    assert play(env, task, [right[0], f"find {other}", "open", right[2]])[0].info["checks"] == {
        "used_directory": True,
        "found_person": True,
        "opened_account": False,
        "submitted_code": True,
    }


def test_one_command_per_turn_and_observations(env):
    task = env.tasks("train")[0]
    _, messages = play(env, task, ["no tools here", f"blah find {task['person']} open", "open"])
    observations = [m["content"] for m in messages if m["role"] == "user"][1:]
    assert observations[0] == "no command"
    assert observations[1].startswith(f"{task['person']} id k")  # only the first command ran
    assert observations[2].split()[1] == "code"


def test_splits_are_seeded_and_distinct(env):
    assert env.tasks("train")[:] == VaultEnv(num_tasks=20, seed=3).tasks("train")[:]
    assert env.tasks("train")["task_id"] != env.tasks("test")["task_id"]
    with pytest.raises(ValueError, match="splits"):
        env.tasks("dev")


def test_demonstrations_are_real_episodes_with_the_requested_accuracy(env):
    perfect = env.demonstrations(20, accuracy=1.0)
    tasks = env.tasks("train")
    for index, conversation in enumerate(perfect):
        replies = [m["content"] for m in conversation if m["role"] == "assistant"]
        assert replies == solve(tasks[index])
    noisy = env.demonstrations(400, accuracy=0.5, seed=1)
    right = sum(c[2]["content"] == f"find {tasks[i % 20]['person']}" for i, c in enumerate(noisy))
    assert 150 < right < 250


def test_tiny_specs(env):
    model, tok = build_tiny_from_spec("tiny:vault", make_environment("vault"))
    assert model.config.hidden_size // model.config.num_attention_heads == 32 and len(tok) == model.config.vocab_size
    with pytest.raises(ValueError, match="for the 'other' environment"):
        build_tiny_from_spec("tiny:other", env)
