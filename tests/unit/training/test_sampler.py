"""TaskSampler: which tasks each iteration trains on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from loop_trainer.training.sampler import BalancedTaskSampler, TaskSampler, task_sampler_for


def plain_walk(sampler: TaskSampler, n: int) -> list[int]:
    """The sampler before the fix: a plain walk over the permutations, crossing into the next pass
    mid-draw without looking back (so one draw could hold a task twice)."""
    picked: list[int] = []
    order = sampler._permutation()
    while len(picked) < n:
        if sampler.position == sampler.num_tasks:
            sampler.epoch, sampler.position = sampler.epoch + 1, 0
            order = sampler._permutation()
        take = min(n - len(picked), sampler.num_tasks - sampler.position)
        picked.extend(order[sampler.position : sampler.position + take])
        sampler.position += take
    return picked


@pytest.mark.parametrize("num_tasks,n,seed", [(5, 3, 0), (7, 4, 1), (10, 7, 2), (6, 6, 3), (3, 2, 4), (64, 24, 0)])
def test_one_draw_never_holds_a_task_twice(num_tasks, n, seed):
    sampler, before = TaskSampler(num_tasks, seed=seed), TaskSampler(num_tasks, seed=seed)
    repeats_before = 0
    for _ in range(200):
        draw = sampler.next(n)
        assert len(draw) == n and len(set(draw)) == n, draw
        assert set(draw) <= set(range(num_tasks))
        old = plain_walk(before, n)
        repeats_before += len(set(old)) < n
    # The old walk did repeat tasks on these settings: this test would fail on it.
    assert num_tasks % n == 0 or repeats_before > 0


@pytest.mark.parametrize("num_tasks,n,seed", [(5, 3, 0), (7, 4, 1), (10, 7, 2), (8, 3, 5), (64, 8, 0), (64, 24, 0)])
def test_draws_without_a_repeat_are_those_of_the_plain_walk(num_tasks, n, seed):
    sampler = TaskSampler(num_tasks, seed=seed)
    unchanged = 0
    for _ in range(300):
        reference = TaskSampler(num_tasks, seed=seed)
        reference.load_state_dict(sampler.state_dict())
        expected = plain_walk(reference, n)
        draw = sampler.next(n)
        if len(set(expected)) == n:  # the plain walk had nothing to fix: same tasks, same state after
            assert draw == expected and sampler.state_dict() == reference.state_dict()
            unchanged += 1
    assert unchanged > 0


def test_the_demo_never_crosses_a_pass_mid_draw():
    # recipes/demo.yaml: every pass over vault's tasks ends exactly at the end of a draw, so the fix
    # cannot change the demo's tasks (its numerics stay bit-for-bit the same).
    recipe = yaml.safe_load((Path(__file__).resolve().parents[3] / "recipes" / "demo.yaml").read_text())
    tasks, per_iteration = recipe["environment_kwargs"]["num_tasks"], recipe["tasks_per_iteration"]
    assert tasks % per_iteration == 0
    sampler, before = TaskSampler(tasks, seed=0), TaskSampler(tasks, seed=0)
    for _ in range(1000):
        assert sampler.position % per_iteration == 0
        assert sampler.next(per_iteration) == plain_walk(before, per_iteration)
        assert sampler.state_dict() == before.state_dict()


def test_every_task_once_per_pass_when_draws_divide_the_tasks():
    sampler = TaskSampler(12, seed=3)
    for _ in range(5):
        assert sorted(sampler.next(4) + sampler.next(4) + sampler.next(4)) == list(range(12))


def test_a_skipped_task_is_not_lost_from_the_run():
    # Across many passes every task is drawn about equally often: a task skipped at a pass boundary
    # was drawn in that very draw, so it is at most one draw behind the others per crossing.
    sampler = TaskSampler(7, seed=0)
    counts = torch.zeros(7, dtype=torch.long)
    for _ in range(700):
        for task in sampler.next(4):
            counts[task] += 1
    assert int(counts.min()) > 0.8 * int(counts.max())


def test_more_tasks_than_the_split_repeat_only_once_all_are_held():
    sampler = TaskSampler(3, seed=0)
    sampler.next(2)
    draw = sampler.next(5)  # crosses into the next pass holding one task of the old one
    assert len(draw) == 5 and set(draw[:3]) == {0, 1, 2}


def test_resume_draws_exactly_what_the_uninterrupted_run_draws():
    full = TaskSampler(7, seed=9)
    expected = [full.next(4) for _ in range(20)]
    first = TaskSampler(7, seed=9)
    drawn = [first.next(4) for _ in range(9)]
    state = first.state_dict()
    assert set(state) == {"epoch", "position"} and all(isinstance(v, int) for v in state.values())
    resumed = TaskSampler(7, seed=9)
    resumed.load_state_dict(state)
    drawn += [resumed.next(4) for _ in range(11)]
    assert drawn == expected


def kinds_of(labels: str) -> list[str]:
    return [{"c": "city", "p": "phone", "e": "email"}[ch] for ch in labels]


@pytest.mark.parametrize(
    "labels,n,seed",
    [("ccccccpppp", 4, 0), ("cpcpcpcccccc", 4, 1), ("ccpppe", 3, 2), ("cccppeeee", 5, 3), ("cpcp", 2, 4)],
)
def test_balanced_draws_take_the_kinds_in_turn_and_walk_each_kind_in_full_passes(labels, n, seed):
    kinds = kinds_of(labels)
    sampler = BalancedTaskSampler(kinds, seed=seed)
    values = sorted(set(kinds))
    drawn_kinds: list[str] = []
    per_kind: dict[str, list[int]] = {value: [] for value in values}
    for _ in range(30):
        draw = sampler.next(n)
        counts = [sum(kinds[i] == value for i in draw) for value in values]
        assert max(counts) - min(counts) <= 1  # balanced within a draw, whatever the split's mix
        assert len(set(draw)) == len(draw)  # every kind here has enough tasks for its share
        drawn_kinds += [kinds[i] for i in draw]
        for i in draw:
            per_kind[kinds[i]].append(i)
    assert drawn_kinds == [values[k % len(values)] for k in range(30 * n)]  # the remainder rotates
    # each kind is walked as a TaskSampler over its own tasks walks them (its passes, no repeat in a draw)
    sampler = BalancedTaskSampler(kinds, seed=seed)
    walks = [
        TaskSampler(len(members), seed=own.seed) for members, own in zip(sampler.members, sampler.samplers, strict=True)
    ]
    expected: dict[str, list[int]] = {value: [] for value in values}
    for draw in range(30):
        turns = [(draw * n + i) % len(values) for i in range(n)]
        for k, value in enumerate(values):
            expected[value] += [sampler.members[k][i] for i in walks[k].next(turns.count(k))]
    assert per_kind == expected


def test_a_lopsided_shuffle_is_what_balancing_prevents():
    from loop_trainer.envs.contacts import ContactsEnv

    # the real-model probe of docs/real-model.md: contacts with 3 examples, seed 0, 4 tasks per iteration
    kinds = ContactsEnv(num_tasks=64, examples=3).tasks("train")["field"]
    plain, balanced = TaskSampler(64, seed=0), BalancedTaskSampler(kinds, seed=0)
    plain_cities = [sum(kinds[i] == "city" for i in plain.next(4)) for _ in range(20)]
    assert plain_cities[3] == 4  # iteration 4 asked four city questions
    assert all(sum(kinds[i] == "city" for i in balanced.next(4)) == 2 for _ in range(20))


def test_balanced_resume_draws_exactly_what_the_uninterrupted_run_draws():
    kinds = kinds_of("cccppppe")
    full = BalancedTaskSampler(kinds, seed=5)
    expected = [full.next(3) for _ in range(20)]
    first = BalancedTaskSampler(kinds, seed=5)
    drawn = [first.next(3) for _ in range(7)]
    state = yaml.safe_load(yaml.safe_dump(first.state_dict()))  # plain data, as loop_state.json holds it
    resumed = BalancedTaskSampler(kinds, seed=5)
    resumed.load_state_dict(state)
    drawn += [resumed.next(3) for _ in range(13)]
    assert drawn == expected
    assert (resumed.epoch, resumed.position) == divmod(60, 8)
    with pytest.raises(ValueError, match="walked 3 kinds of task, this split has 2"):
        BalancedTaskSampler(kinds_of("cpcp")).load_state_dict(state)


def test_the_balancing_column_must_exist_in_the_split():
    from datasets import Dataset

    tasks = Dataset.from_list([{"task_id": "a", "field": "city"}, {"task_id": "b", "field": "phone"}])
    assert isinstance(task_sampler_for(tasks, 0, None), TaskSampler)
    assert isinstance(task_sampler_for(tasks, 0, "field"), BalancedTaskSampler)
    with pytest.raises(ValueError, match="no column 'kind'; its columns are task_id, field"):
        task_sampler_for(tasks, 0, "kind")
