"""The stabilisers (clip-higher, truncated importance weights toward the sampler, tied groups and
dynamic sampling's selection) against brute-force loops written from their definitions."""

from __future__ import annotations

import math
import random

import pytest
import torch

from loop_trainer.objective import loop_policy_loss
from loop_trainer.rollout import RolloutBatch
from loop_trainer.stabilisers import TIE_TOLERANCE, select_informative_groups, tied_groups, truncated_importance_weights
from loop_trainer.training.dynamic_sampling import collect_scored, next_round_size, score_rollouts
from loop_trainer.trajectory import Trajectory


def brute_force_loss(logp, old, adv, mask, eps, divisor, eps_high=None, weights=None):
    """-(1/D) sum_i mean_t w_t min(rho A, clip(rho, 1/(1+eps), 1+eps_high) A), one token at a time."""
    high = 1 + (eps if eps_high is None else eps_high)
    total = 0.0
    for i in range(len(logp)):
        terms = []
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(ratio, 1 / (1 + eps)), high)
            w = 1.0 if weights is None else weights[i][t]
            terms.append(w * min(ratio * adv[i], clipped * adv[i]))
        if terms:
            total += sum(terms) / len(terms)
    return -total / divisor


def random_batch(seed: int, batch: int = 6, length: int = 11):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    # ratios from ~0.55 to ~1.8: inside, between and beyond both upper bounds, and below the lower one
    logp = (old + (torch.rand(batch, length, generator=g, dtype=torch.float64) - 0.4) * 1.5).requires_grad_(True)
    mask = (torch.rand(batch, length, generator=g) > 0.25).long()
    mask[0] = 0
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("eps_high", [None, 0.1, 0.28, 0.5])
def test_clip_higher_matches_brute_force_and_its_gradient(seed, eps_high):
    eps, divisor = 0.2, 32
    logp, old, adv, mask = random_batch(seed)
    out = loop_policy_loss(logp, old, adv, mask, epsilon=eps, divisor=divisor, epsilon_high=eps_high)
    expected = brute_force_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), eps, divisor, eps_high)
    assert out.loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    out.loss.backward()
    ratio = torch.exp(logp.detach() - old)
    low, high = 1 / (1 + eps), 1 + (eps if eps_high is None else eps_high)
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        for t in range(logp.shape[1]):
            a = adv[i].item()
            clipped = (a > 0 and ratio[i, t] > high) or (a < 0 and ratio[i, t] < low)
            want = 0.0 if (not mask[i, t] or clipped) else -ratio[i, t].item() * a / (n * divisor)
            assert logp.grad[i, t].item() == pytest.approx(want, abs=1e-12)


def test_clip_higher_keeps_the_gradient_of_a_token_between_the_two_upper_bounds():
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(1.2), requires_grad=True)  # ratio 1.2: above 1.1, below 1.28
    for eps_high, moves in ((None, False), (0.28, True)):
        logp.grad = None
        loop_policy_loss(logp, old, torch.ones(1), torch.ones(1, 1), epsilon=0.1, epsilon_high=eps_high).loss.backward()
        assert (logp.grad.abs().item() > 0) is moves


def test_epsilon_high_none_is_bit_identical_to_loop():
    logp, old, adv, mask = random_batch(3)
    plain = loop_policy_loss(logp.float(), old.float(), adv.float(), mask, epsilon=0.1)
    same = loop_policy_loss(logp.float(), old.float(), adv.float(), mask, epsilon=0.1, epsilon_high=None)
    assert torch.equal(plain.loss, same.loss)
    with pytest.raises(ValueError, match="epsilon_high"):
        loop_policy_loss(logp, old, adv, mask, epsilon=0.1, epsilon_high=-0.5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap", [0.5, 1.0, 2.0, 1e6])
def test_truncated_importance_weights_match_brute_force(seed, cap):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 9, generator=g, dtype=torch.float64) * 4
    sampler = old + torch.randn(4, 9, generator=g, dtype=torch.float64)  # the sampler above and below pi_old
    mask = (torch.rand(4, 9, generator=g) > 0.3).long()
    old[mask == 0] = math.inf  # never read where not sampled
    weights, capped = truncated_importance_weights(old, sampler, mask, cap)
    count = capped_count = 0
    for i in range(4):
        for t in range(9):
            if not mask[i, t]:
                assert weights[i, t].item() == 1.0
                continue
            raw = math.exp(old[i, t].item() - sampler[i, t].item())
            assert weights[i, t].item() == pytest.approx(min(raw, cap), rel=1e-6)
            count += 1
            capped_count += raw > cap
    assert capped.item() == pytest.approx(capped_count / count)
    assert not weights.requires_grad


def test_truncated_importance_weights_cap_on_both_sides_and_nothing_sampled():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    sampler = torch.tensor([[-3.0, 0.0, 3.0]])  # pi_old/pi_sampler = e^3, 1, e^-3
    weights, capped = truncated_importance_weights(old, sampler, torch.ones(1, 3), cap=2.0)
    assert weights.tolist()[0] == pytest.approx([2.0, 1.0, math.exp(-3.0)])  # only the top is capped
    assert capped.item() == pytest.approx(1 / 3)
    weights, capped = truncated_importance_weights(old, sampler, torch.zeros(1, 3), cap=2.0)
    assert weights.tolist() == [[1.0, 1.0, 1.0]] and capped.item() == 0.0
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(old, sampler, torch.ones(1, 3), cap=0.0)


@pytest.mark.parametrize("seed", range(4))
def test_weighted_loss_matches_brute_force_at_every_ratio_level_for_tokens(seed):
    eps, divisor = 0.1, 8
    logp, old, adv, mask = random_batch(seed)
    sampler = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.5
    weights, _ = truncated_importance_weights(old, sampler, mask, cap=1.5)
    out = loop_policy_loss(logp, old, adv, mask, epsilon=eps, divisor=divisor, token_weights=weights)
    expected = brute_force_loss(
        logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), eps, divisor, weights=weights.tolist()
    )
    assert out.loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    # weights of 1 are LOOP's loss exactly
    ones = loop_policy_loss(logp, old, adv, mask, epsilon=eps, divisor=divisor, token_weights=torch.ones_like(old))
    plain = loop_policy_loss(logp, old, adv, mask, epsilon=eps, divisor=divisor)
    assert ones.loss.item() == pytest.approx(plain.loss.item(), rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("level", ["turn", "trajectory"])
def test_clip_higher_and_weights_match_brute_force_at_the_turn_and_trajectory_levels(seed, level):
    """Every token carries its segment's ratio (its turn's, or its trajectory's sampled tokens'), clipped to
    [1/(1+eps), 1+eps_high], weighted by its own truncated importance weight."""
    eps, eps_high, divisor = 0.1, 0.3, 8
    logp, old, adv, mask = random_batch(seed)
    logp = (old + (logp.detach() - old) * 0.3).requires_grad_(True)  # segment sums stay near the bounds
    g = torch.Generator().manual_seed(100 + seed)
    turn_ids = torch.where(mask.bool(), torch.randint(0, 3, mask.shape, generator=g), -1)
    sampler = old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.5
    weights, _ = truncated_importance_weights(old, sampler, mask, cap=1.5)
    out = loop_policy_loss(
        logp,
        old,
        adv,
        mask,
        epsilon=eps,
        divisor=divisor,
        ratio_level=level,
        turn_ids=turn_ids,
        epsilon_high=eps_high,
        token_weights=weights,
    )
    total = 0.0
    for i in range(logp.shape[0]):
        terms = []
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            segment = [
                u
                for u in range(logp.shape[1])
                if mask[i, u] and (level == "trajectory" or turn_ids[i, u] == turn_ids[i, t])
            ]
            ratio = math.exp(sum(logp[i, u].item() - old[i, u].item() for u in segment))
            clipped = min(max(ratio, 1 / (1 + eps)), 1 + eps_high)
            a = adv[i].item()
            terms.append(weights[i, t].item() * min(ratio * a, clipped * a))
        if terms:
            total += sum(terms) / len(terms)
    assert out.loss.item() == pytest.approx(-total / divisor, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_tied_groups_match_brute_force(seed):
    rng = random.Random(seed)
    groups = [g for g in range(8) for _ in range(rng.randint(1, 5))]
    rng.shuffle(groups)
    rewards = [rng.choice([0.0, 0.25, 1.0]) if rng.random() < 0.5 else 0.5 for _ in groups]
    got = tied_groups(rewards, groups)
    for g in set(groups):
        members = [r for r, h in zip(rewards, groups, strict=True) if h == g]
        assert got[g] == (max(members) - min(members) < TIE_TOLERANCE)
    assert list(got) == list(dict.fromkeys(groups))  # first-seen order


def test_tied_groups_all_tied_nothing_tied_and_rounding():
    assert all(tied_groups([1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1]).values())
    assert not any(tied_groups([1.0, 0.0, 0.25, 0.5], [0, 0, 1, 1]).values())
    assert tied_groups([0.1 + 0.2, 0.3], ["a", "a"]) == {"a": True}  # float rounding is a tie
    assert tied_groups([0.7], [5]) == {5: True}  # one rollout: no baseline
    assert select_informative_groups({0: True, 1: False, 2: False, 3: True, 4: False}, 2) == ([1, 2], 1)
    assert select_informative_groups({0: True}, 3) == ([], 0)


# --- dynamic sampling ---------------------------------------------------------------------------------------
def round_batch(rewards_per_group: list[list[float]]) -> RolloutBatch:
    return RolloutBatch(
        trajectories=[
            Trajectory(task_id=f"t{g}", group=g, rollout=k, reward=r)
            for g, rewards in enumerate(rewards_per_group)
            for k, r in enumerate(rewards)
        ],
        seconds=1.0,
    )


def scorer(batch):
    return score_rollouts(batch, estimator="leave_one_out", std_normalize=False, threshold=0.01)


def test_next_round_size():
    assert next_round_size(16, 15, 16) == 2  # one group missing at 15/16 informative: ceil(16/15)
    assert next_round_size(4, 0, 4) == 4  # nothing informative yet: a whole round
    assert next_round_size(4, 1, 4) == 4  # 3 missing at 1/4: 12, capped at a whole round
    assert next_round_size(8, 6, 8) == 3


def test_dynamic_sampling_collects_until_enough_groups_are_not_tied():
    rounds = [
        [[1, 1], [0, 1], [0, 0]],  # 1 informative of 3: 2 missing -> ceil(2 * 3 / 1) = 6, capped at 3 tasks
        [[1, 0], [1, 1], [1, 1]],  # 2 of 6 so far: 1 missing -> ceil(1 * 6 / 2) = 3 tasks
        [[0, 0], [0.5, 1], [1, 0.25]],  # 4 of 9: enough, one surplus
    ]
    calls = []

    def collect(round_index: int, num_tasks: int) -> RolloutBatch:
        calls.append((round_index, num_tasks))
        return round_batch(rounds[round_index][:num_tasks])

    scored = collect_scored(collect, scorer, groups_wanted=3, extra_rounds=5)
    assert calls == [(0, 3), (1, 3), (2, 3)]
    assert scored.metrics == {
        "dynamic_sampling_rounds": 2.0,
        "dynamic_sampling_extra_rollouts": 12.0,
        "informative_groups": 3.0,
        "dynamic_sampling_surplus_groups": 1.0,
    }
    # groups renumbered after the earlier rounds' tasks; the first three informative ones are trained
    assert [t.group for t in scored.batch.trajectories] == [g for g in range(9) for _ in range(2)]
    trained_groups = sorted({t.group for t, k in zip(scored.batch.trajectories, scored.trained, strict=True) if k})
    assert trained_groups == [1, 3, 7]
    assert scored.batch.seconds == 3.0


def test_dynamic_sampling_stops_at_its_budget_and_is_off_by_default():
    tied = [[1, 1], [0, 0]]
    calls = []

    def collect(round_index: int, num_tasks: int) -> RolloutBatch:
        calls.append(round_index)
        return round_batch(tied[:num_tasks])

    scored = collect_scored(collect, scorer, groups_wanted=2, extra_rounds=2)
    assert calls == [0, 1, 2] and not any(scored.trained)
    assert scored.metrics["dynamic_sampling_rounds"] == 2.0 and scored.metrics["informative_groups"] == 0.0

    calls.clear()
    mixed = [[1, 0], [0, 0]]
    off = collect_scored(lambda r, n: round_batch(mixed[:n]), scorer, groups_wanted=2, extra_rounds=0)
    advantages, keep = scorer(round_batch(mixed))
    assert off.metrics == {} and off.trained == keep.tolist() and torch.equal(off.advantages, advantages)


def test_dynamic_sampling_with_no_tied_group_collects_no_extra_round():
    calls = []

    def collect(round_index: int, num_tasks: int) -> RolloutBatch:
        calls.append((round_index, num_tasks))
        return round_batch([[1, 0], [0.25, 1], [0, 0.5]][:num_tasks])

    scored = collect_scored(collect, scorer, groups_wanted=3, extra_rounds=4)
    assert calls == [(0, 3)]  # every group informative: the first round is the iteration
    assert scored.metrics["dynamic_sampling_rounds"] == 0.0
    assert scored.metrics["dynamic_sampling_extra_rollouts"] == 0.0
    assert scored.metrics["informative_groups"] == 3.0 and all(scored.trained)
