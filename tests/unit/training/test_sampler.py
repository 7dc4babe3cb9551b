"""TaskSampler: which tasks each iteration trains on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from loop_trainer.training.sampler import TaskSampler


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
