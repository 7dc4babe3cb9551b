"""The built-in long-horizon `errands` environment: levels, dependent calls, state-based checks, the
two forms, demonstrations and the tiny model's vocabulary."""

from __future__ import annotations

import pytest

from loop_trainer.envs import ErrandsEnv, make_environment
from loop_trainer.envs.base import UnknownSplitError, check_tasks
from loop_trainer.envs.errands import LEVELS, solution, solve


def play(env, task, replies):
    episode = env.episode(task)
    messages = episode.start()
    for reply in replies:
        messages.append({"role": "assistant", "content": reply})
        step = episode.step(reply)
        if step.done:
            break
        messages.extend(step.messages)
    return episode.score(), messages


@pytest.fixture(scope="module")
def env():
    return ErrandsEnv(num_tasks=30, seed=3)


def test_every_level_needs_its_number_of_dependent_calls_and_a_perfect_agent_passes(env):
    tasks = env.tasks("train")
    check_tasks(tasks, environment="errands", split="train")
    assert sorted(set(tasks["level"])) == [1, 2, 3]
    for task in tasks:
        low, high = LEVELS[task["level"]]
        replies = solve(task)
        assert low <= len(replies) <= high
        score, _ = play(env, task, replies)
        assert score.success and score.reward == 1.0
        assert score.info["calls"] == len(replies)
        payees = [errand[1] for errand in task["errands"] if errand[0] in ("pay", "refund")]
        assert len(payees) == len(set(payees))  # one payment per person: its amount follows from whom


def test_train_and_test_draw_different_tasks_and_levels_filter():
    env = ErrandsEnv(num_tasks=20, levels=[2])
    train, test = env.tasks("train"), env.tasks("test")
    assert set(train["level"]) == set(test["level"]) == {2}
    assert train["errands"] != test["errands"] and train["names"] != test["names"]
    with pytest.raises(UnknownSplitError, match="'train' and 'test'"):
        env.tasks("dev")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"levels": [4]}, "levels"),
        ({"form": "verbose"}, "form"),
        ({"num_tasks": 0}, "num_tasks"),
        ({"people_per_task": 1}, "people_per_task"),
    ],
)
def test_bad_kwargs_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_environment("errands", **kwargs)


def first_task(env, kind):
    return next(task for task in env.tasks("train") if task["errands"][0][0] == kind)


def test_later_calls_need_values_only_results_reveal(env):
    task = first_task(env, "send")
    calls = solution(task)[:4]
    assert [call.command for call in calls] == ["item", "buy", "find", "ship"]
    _, messages = play(env, task, solve(task)[:4])
    results = [m["content"] for m in messages if m["role"] == "user"][1:]
    item, sku, price = results[0].split()[0], results[0].split()[2], results[0].split()[4]
    assert results[0] == f"{item} sku {sku} price {price}"
    order = results[1].split()[1]
    assert calls[1].arguments == (sku,) and calls[3].arguments[0] == order  # the order comes from buy, 2 calls back
    assert results[3] == f"shipped {order} to {calls[3].arguments[1]}"


def test_checks_are_on_the_worlds_final_state_and_doing_nothing_earns_nothing(env):
    task = first_task(env, "pay")
    replies = solve(task)
    n = len(task["errands"])
    # nothing done, then `done`: no errand, no stray effect, finished -- and no reward
    score, _ = play(env, task, ["done"])
    assert score.reward == 0.0 and not score.success
    assert score.info["checks"]["no_stray_effects"] and score.info["checks"]["finished"]
    # everything but `done`: the errands pass, the reward is halved, no success
    score, _ = play(env, task, replies[:-1])
    assert score.reward == 0.5 and not score.success and not score.info["checks"]["finished"]
    # paying the wrong amount fails the errand and is a stray effect, a quarter errand off
    assert [reply.split()[0] for reply in replies[:3]] == ["find", "bill", "pay"]
    account, amount = replies[2].split()[1:]
    wrong = str(int(amount) % 9 + 1)
    score, _ = play(env, task, [*replies[:2], f"pay {account} {wrong}", *replies[3:]])
    checks = score.info["checks"]
    assert not checks["0_pay"] and not checks["no_stray_effects"] and checks["finished"]
    assert score.info["stray_effects"] == 1
    assert score.reward == pytest.approx((n - 1 - 0.25) / n)
    # put right afterwards: the errand passes, the stray payment still costs its quarter
    score, _ = play(env, task, [*replies[:2], f"pay {account} {wrong}", *replies[2:]])
    assert score.reward == pytest.approx((n - 0.25) / n) and not score.success


def test_malformed_replies_get_an_observation_and_unknown_values_change_nothing(env):
    task = first_task(env, "text")
    account = task["accounts"][0]
    _, messages = play(env, task, ["hello", "find zed", "phone k99", "text p99", f"pay {account} x", "doc nope"])
    results = [m["content"] for m in messages if m["role"] == "user"][1:]
    assert results == ["no command", "no such person", "bad account", "bad phone", "bad n", "no such app"]
    # only the first call of a reply runs
    name = task["errands"][0][1]
    score, messages = play(env, task, [f"blah find {name} done"])
    assert messages[-1]["content"] == f"{name} id {task['accounts'][task['names'].index(name)]}"
    assert not score.info["checks"]["finished"]


def test_the_english_form_is_the_same_world_in_plain_english():
    env = ErrandsEnv(num_tasks=4, form="english")
    for task in env.tasks("test"):
        replies = solve(task, "english")
        assert replies[-1] == "done()" and '("' in replies[0]
        score, messages = play(env, task, [f"Next I will call {reply}. Thanks!" for reply in replies])
        assert score.success
        assert "find(" in messages[0]["content"] and "Account id: AC-" in "\n".join(m["content"] for m in messages)
    score, messages = play(env, env.tasks("test")[0], ["I think I am done"])
    assert messages[-1]["content"].startswith("No function call found")


def test_demonstrations_replay_real_episodes_in_the_compact_vocabulary(env):
    vocabulary = set(env.vocabulary())
    tasks = env.demonstration_tasks(40, seed=1)
    # a world of its own for each conversation, none of the splits' (a warm-up must not memorise them)
    seen = {str(task["errands"]) + str(task["accounts"]) for split in ("train", "test") for task in env.tasks(split)}
    assert len({str(task["errands"]) + str(task["accounts"]) for task in tasks} - seen) == 40
    assert env.demonstration_tasks(3, seed=2) != env.demonstration_tasks(3, seed=1)
    mean_reward = {}
    for accuracy in (0.5, 0.8, 1.0):
        rewards = []
        for index, conversation in enumerate(env.demonstrations(40, accuracy=accuracy, seed=1)):
            assert {word for message in conversation for word in message["content"].split()} <= vocabulary
            replies = [m["content"] for m in conversation if m["role"] == "assistant"]
            assert replies[-1] == "done"
            score, replayed = play(env, tasks[index], replies)
            assert [m["content"] for m in replayed] == [m["content"] for m in conversation]
            rewards.append(score.reward)
        mean_reward[accuracy] = sum(rewards) / len(rewards)
    assert 0 < mean_reward[0.5] < mean_reward[0.8] < mean_reward[1.0] == 1.0
    # the mistakes are plausible ones: a value of the right kind that this world has
    for conversation in env.demonstrations(20, accuracy=0.5, seed=2):
        results = [m["content"] for m in conversation[2:] if m["role"] == "user"]
        assert not any(result.startswith(("bad", "no such")) for result in results)


def test_summary_reports_levels_check_kinds_and_calls(env):
    tasks = env.tasks("test")
    rows = []
    for index, task in enumerate(tasks.select(range(6))):
        score, _ = play(env, task, solve(task) if index % 2 else [])
        rows.append(
            {
                "task_id": task["task_id"],
                "status": "completed",
                "reward": score.reward,
                "success": score.success,
                "info": score.info,
            }
        )
    summary = env.summarize(rows)
    assert summary["success_rate"] == 0.5
    assert {f"success_rate_level_{level}" for level in (1, 2, 3)} <= set(summary)
    assert summary["passed_finished"] == 0.5 and summary["passed_no_stray_effects"] == 1.0
    assert summary["calls_mean"] > 5


def test_demonstrations_read_the_task_line_right_unless_told_otherwise(env):
    """The errand to do next (the person or item the task line names) is read right by default, however
    unreliable the copying of results; `reading_accuracy` makes it unreliable too."""
    tasks = env.demonstration_tasks(30, seed=3)

    def looked_up(replies):
        return [reply for reply in replies if reply.split()[0] in ("find", "item")]

    def read_wrong(**noise):
        wrong = 0
        for task, conversation in zip(tasks, env.demonstrations(30, seed=3, **noise), strict=True):
            replies = [m["content"] for m in conversation if m["role"] == "assistant"]
            wrong += looked_up(replies) != looked_up(solve(task))
        return wrong

    assert read_wrong(accuracy=0.5) == 0
    assert read_wrong(accuracy=0.5, reading_accuracy=0.5) > 20
