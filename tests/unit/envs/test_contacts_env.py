"""The built-in `contacts` environment: the protocol, the partial credit, and what a confused model is told."""

from __future__ import annotations

import pytest

from loop_trainer.envs import ContactsEnv, UnknownSplitError, make_environment
from loop_trainer.envs.contacts import CALL, SYSTEM_PROMPT, question, solve


@pytest.fixture
def env():
    return ContactsEnv(num_tasks=16)


def play(env, task, replies):
    episode = env.episode(task)
    messages = episode.start()
    for reply in replies:
        step = episode.step(reply)
        messages += step.messages
        if step.done:
            break
    return episode.score(), messages


def target_card(task):
    return next(card for card in task["contacts"] if card["name"] == task["person"])


def test_a_scripted_agent_that_follows_the_protocol_solves_every_task(env):
    for split in ("train", "test"):
        for task in env.tasks(split):
            score, _ = play(env, task, solve(task))
            assert score.reward == 1.0 and score.success is True


def test_partial_credit_is_the_fraction_of_checks_passed(env):
    task = env.tasks("train")[0]
    card = target_card(task)
    first_name = task["person"].split()[0]
    namesake = next(c for c in task["contacts"] if c["name"].startswith(first_name + " ") and c is not card)
    cases = {
        # answers at once, without looking anything up: nothing passed
        (f'answer("{card["phone"]}x")',): 0.0,
        # searches for the person, then stops (the turn limit ends the episode): searched, found
        (f'search("{task["person"]}")',): 0.5,
        # a first-name search lists the namesakes too; opening the wrong one and answering with its field
        (f'search("{first_name}")', f"get({namesake['id']})", f'answer("{namesake[task["field"]]}")'): 0.5,
        # the right card, the wrong field
        (f'search("{first_name}")', f"get({card['id']})", 'answer("nobody")'): 0.75,
    }
    for replies, reward in cases.items():
        score, _ = play(env, task, list(replies))
        assert score.reward == reward, replies
        assert score.success is (reward == 1.0)


def test_a_first_name_search_returns_the_namesakes_with_their_ids(env):
    task = env.tasks("train")[3]
    first_name = task["person"].split()[0]
    _, messages = play(env, task, [f'search("{first_name}")'])
    listing = messages[-1]["content"]
    namesakes = [c for c in task["contacts"] if c["name"].split()[0] == first_name]
    assert len(namesakes) == 3 and listing.startswith("3 contacts: ")
    for card in namesakes:
        assert f"{card['name']} (id {card['id']})" in listing


@pytest.mark.parametrize(
    ("reply", "told"),
    [
        ("I will look it up.", "No tool call found"),
        ("get(abc)", "get needs a contact id"),
        ("search()", "search needs a name"),
        ('search("Nobody Atall")', "No contacts match"),
    ],
)
def test_malformed_or_unproductive_actions_get_an_observation_saying_what_is_wrong(env, reply, told):
    task = env.tasks("train")[0]
    episode = env.episode(task)
    episode.start()
    step = episode.step(reply)
    assert not step.done and told in step.messages[0]["content"]


def test_get_only_opens_ids_a_search_returned_in_this_episode(env):
    task = env.tasks("train")[0]
    card = target_card(task)
    score, messages = play(env, task, [f"get({card['id']})"])
    assert "Search first" in messages[-1]["content"] and not score.info["checks"]["opened_card"]


def test_calls_are_read_leniently(env):
    task = env.tasks("train")[1]
    card = target_card(task)
    replies = [
        f"Let me search. SEARCH( {task['person'].lower()} )",
        f"get(id {card['id']}).",
        f"The answer is: Answer('{card[task['field']]}.')",
    ]
    score, _ = play(env, task, replies)
    assert score.success is True


def test_the_opening_shows_one_solved_example_of_another_person():
    task = ContactsEnv(num_tasks=4).tasks("train")[0]
    messages = ContactsEnv(num_tasks=4).episode(task).start()
    assert messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert [m["role"] for m in messages[1:]] == ["user", "assistant", "user", "assistant", "user", "assistant", "user"]
    assert all(CALL.search(m["content"]) for m in messages if m["role"] == "assistant")
    assert task["person"] in messages[-1]["content"] and task["examples"][0]["person"] in messages[1]["content"]
    bare = ContactsEnv(num_tasks=4, examples=0)
    assert [m["role"] for m in bare.episode(bare.tasks("train")[0]).start()] == ["system", "user"]


def test_two_examples_answer_different_fields_so_the_question_decides():
    env = ContactsEnv(num_tasks=16, examples=2)
    orders = set()
    for task in env.tasks("train"):
        fields = [example["field"] for example in task["examples"]]
        assert sorted(fields) == ["city", "phone"]
        orders.add(tuple(fields))
        messages = env.episode(task).start()
        questions = [m["content"] for m in messages if m["role"] == "user" and m["content"].startswith("What is")]
        assert questions == [question(task["examples"][0]), question(task["examples"][1]), question(task)]
    assert len(orders) == 2  # the order is random, so neither field is always the last one shown
    with pytest.raises(ValueError, match="examples"):
        ContactsEnv(examples=True)


def test_splits_are_reproducible_distinct_and_checked():
    env = make_environment("contacts", num_tasks=8, seed=3)
    assert env.tasks("train")["person"] == ContactsEnv(num_tasks=8, seed=3).tasks("train")["person"]
    assert env.tasks("train")["contacts"] != env.tasks("test")["contacts"]
    with pytest.raises(UnknownSplitError, match="'train' and 'test'"):
        env.tasks("dev")
    with pytest.raises(ValueError, match="namesakes"):
        ContactsEnv(contacts_per_task=3, namesakes=3)


def test_summary_reports_how_often_each_check_passed(env):
    task = env.tasks("train")[0]
    rows = []
    for replies in (solve(task), solve(task)[:1]):
        score, _ = play(env, task, replies)
        rows.append({"status": "completed", "reward": score.reward, "success": score.success, "info": score.info})
    rows.append({"status": "failed", "reward": 0.0, "success": False, "info": {}})
    summary = env.summarize(rows)
    assert summary["success_rate"] == pytest.approx(1 / 3) and summary["passed_searched"] == pytest.approx(2 / 3)
    assert summary["passed_answered"] == pytest.approx(1 / 3)


def test_summary_counts_answers_that_give_the_other_field(env):
    task = env.tasks("train")[0]
    card = next(card for card in task["contacts"] if card["name"] == task["person"])
    other = "city" if task["field"] == "phone" else "phone"
    *lookups, _ = solve(task)
    rows = []
    for final in (f'answer("{card[task["field"]]}")', f'answer("{card[other]}")', 'answer("no idea")'):
        score, _ = play(env, task, [*lookups, final])
        rows.append({"status": "completed", "reward": score.reward, "success": score.success, "info": score.info})
    assert [row["info"]["answered_other_field"] for row in rows] == [False, True, False]
    assert [row["reward"] for row in rows] == [1.0, 0.75, 0.75]
    assert env.summarize(rows)["answered_other_field"] == pytest.approx(1 / 3)


def test_field_check_credits_the_asked_field_even_miscopied_and_only_that():
    env = ContactsEnv(num_tasks=16, field_check=True)
    rewards = {}
    for task in env.tasks("train"):
        card = target_card(task)
        other = "city" if task["field"] == "phone" else "phone"
        asked = card[task["field"]]
        miscopied = asked[:-2] if task["field"] == "city" else "484" + asked[3:]
        *lookups, _ = solve(task)
        for kind, final in (("right", asked), ("miscopied", miscopied), ("other", card[other]), ("empty", "")):
            score, _ = play(env, task, [*lookups, f'answer("{final}")'])
            assert list(score.info["checks"]) == [
                "searched", "found_person", "opened_card", "answered_field", "answered"
            ]  # fmt: skip
            rewards.setdefault((task["field"], kind), set()).add(score.reward)
            assert score.success is (kind == "right")
    # five checks: the field's kind earns a fifth of the reward apart from copying it exactly
    for field in ("phone", "city"):
        assert rewards[(field, "right")] == {1.0}
        assert rewards[(field, "miscopied")] == {0.8}
        assert rewards[(field, "other")] == rewards[(field, "empty")] == {0.6}
    rows = [{"status": "completed", "reward": 0.8, "success": False, "info": score.info}]
    assert "passed_answered_field" in env.summarize(rows)
    assert "passed_answered_field" not in ContactsEnv(num_tasks=2).summarize(rows)


def test_field_check_must_be_a_boolean():
    with pytest.raises(ValueError, match="field_check"):
        ContactsEnv(field_check="yes")


def test_remind_question_repeats_it_under_every_card_the_examples_included():
    env = ContactsEnv(num_tasks=4, examples=2, remind_question=True)
    task = env.tasks("test")[0]
    score, messages = play(env, task, solve(task))
    cards = [m["content"] for m in messages if m["role"] == "user" and "): phone " in m["content"]]
    # the two examples' cards (their own questions) and the task's
    assert len(cards) == 3 and score.success
    assert cards[-1].endswith(f"\nThe question was: {question(task)}")
    assert [card.split("\nThe question was: ")[1] for card in cards[:2]] == [question(e) for e in task["examples"]]
    plain = ContactsEnv(num_tasks=4, examples=2).episode(task).start()
    assert all("The question was" not in m["content"] for m in plain)
    with pytest.raises(ValueError, match="remind_question"):
        ContactsEnv(remind_question=1)
