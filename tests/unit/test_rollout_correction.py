"""The rollout corrections against brute-force loops written from their definitions: the four ways of bounding
the weights toward the sampler (token/sequence x truncate/mask), the sampler/trainer mismatch sums (k3 KL and
chi-square), and GSPO's geometric-mean sequence ratio (``ratio_level: sequence``), trajectories split over rows
included."""

from __future__ import annotations

import math

import pytest
import torch

from loop_trainer.objective import loop_policy_loss
from loop_trainer.stabilisers import (
    SAMPLER_CORRECTIONS,
    sampler_importance_weights,
    sampler_mismatch_sums,
    truncated_importance_weights,
)


def random_rows(seed: int, rows: int = 7, length: int = 9, spread: float = 0.6, row_shift: float = 0.0):
    """Old and sampler log-probs, a loss mask (row 0 empty), and trajectory labels: rows 1 and 4 are two
    segments of one trajectory, every other row a trajectory of its own. ``spread``: the deviation of a token's
    log-weight log pi_old - log pi_sampler; ``row_shift``: each row's log-weights further sum to about
    ``row_shift`` times a fixed factor from -1 to 1.3 (whole trajectories on both sides of the bounds)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3
    shifts = row_shift * torch.tensor([0.0, -1.0, 0.8, 0.0, 0.3, 1.3, -0.9], dtype=torch.float64)[:rows]
    sampler = old + torch.randn(rows, length, generator=g, dtype=torch.float64) * spread - shifts[:, None] / length
    mask = (torch.rand(rows, length, generator=g) > 0.3).long()
    mask[0] = 0
    old[mask == 0] = math.inf  # never read where not sampled
    trajectory_ids = torch.tensor([0, 1, 2, 3, 1, 4, 5])[:rows]
    return old, sampler, mask, trajectory_ids


def members(trajectory_ids, row):
    """The rows of ``row``'s trajectory."""
    return [r for r in range(len(trajectory_ids)) if trajectory_ids[r] == trajectory_ids[row]]


def brute_force_weights(old, sampler, mask, trajectory_ids, correction, cap, floor):
    """(weight, truncated, masked) of every position, one token at a time."""
    rows, length = mask.shape
    out = {}
    for i in range(rows):
        for t in range(length):
            if not mask[i, t]:
                out[i, t] = (1.0, False, False)
                continue
            if correction.startswith("token"):
                log_w = old[i, t].item() - sampler[i, t].item()
            else:  # the product of the token weights of the whole trajectory (all its rows)
                log_w = sum(
                    old[r, u].item() - sampler[r, u].item()
                    for r in members(trajectory_ids, i)
                    for u in range(length)
                    if mask[r, u]
                )
            high = cap is not None and log_w > math.log(cap)
            low = floor is not None and log_w < math.log(floor)
            if correction.endswith("mask"):
                out[i, t] = (0.0 if high or low else math.exp(log_w), False, high or low)
            else:
                out[i, t] = (cap if high else floor if low else math.exp(log_w), high or low, False)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("correction", SAMPLER_CORRECTIONS)
@pytest.mark.parametrize("bounds", [(2.0, None), (1.5, 0.5), (None, 0.7), (3.0, 0.2)], ids=str)
def test_sampler_weights_match_brute_force(seed, correction, bounds):
    cap, floor = bounds
    # sequence weights multiply a trajectory's token weights: small token deviations, trajectories apart
    token_level = correction.startswith("token")
    old, sampler, mask, trajectory_ids = random_rows(
        seed, spread=0.6 if token_level else 0.05, row_shift=0.0 if token_level else 2.0
    )
    out = sampler_importance_weights(
        old, sampler, mask, correction=correction, cap=cap, floor=floor, trajectory_ids=trajectory_ids
    )
    want = brute_force_weights(old, sampler, mask, trajectory_ids, correction, cap, floor)
    for (i, t), (weight, truncated, masked) in want.items():
        assert out.weights[i, t].item() == pytest.approx(weight, rel=1e-5), (i, t)
        assert (bool(out.truncated[i, t]), bool(out.masked[i, t])) == (truncated, masked), (i, t)
    assert out.weights.dtype == torch.float32 and not out.weights.requires_grad
    touched = out.truncated | out.masked
    assert 0 < int(touched.sum()) < int(mask.sum()), "the case should bound some sampled tokens, not all"


def test_sequence_weights_without_trajectory_ids_take_each_row_whole():
    old, sampler, mask, _ = random_rows(1, spread=0.05, row_shift=2.0)
    out = sampler_importance_weights(old, sampler, mask, correction="sequence_mask", cap=1.2)
    assert 0 < int(out.masked.sum()) < int(mask.sum())
    want = brute_force_weights(old, sampler, mask, torch.arange(mask.shape[0]), "sequence_mask", 1.2, None)
    assert [out.weights[i, t].item() for i, t in want] == pytest.approx([w for w, _, _ in want.values()], rel=1e-5)


def test_a_sequence_weight_beyond_float_range_is_bounded_exactly():
    old = torch.zeros(2, 200)
    sampler = torch.full((2, 200), -1.0)  # pi_old / pi_sampler = e on every token: e^200 per trajectory
    sampler[1] = 1.0  # e^-200
    mask = torch.ones(2, 200, dtype=torch.long)
    truncated = sampler_importance_weights(old, sampler, mask, correction="sequence_truncate", cap=3.0, floor=0.5)
    assert truncated.weights[0].eq(3.0).all() and truncated.weights[1].eq(0.5).all()
    masked = sampler_importance_weights(old, sampler, mask, correction="sequence_mask", cap=3.0, floor=0.5)
    assert masked.weights.eq(0.0).all() and masked.masked.all()


def test_token_truncate_is_todays_truncated_importance_weights_bit_for_bit():
    old, sampler, mask, _ = random_rows(2)
    weights, fraction = truncated_importance_weights(old.float(), sampler.float(), mask, 1.5)
    log_weight = torch.where(mask.bool(), old.float() - sampler.float(), 0.0)
    capped = mask.bool() & (log_weight > math.log(1.5))
    assert torch.equal(weights, torch.where(capped, 1.5, torch.exp(log_weight)))  # the code before the modes
    assert fraction.item() == pytest.approx(float(capped.sum() / mask.sum()))


def test_bad_arguments_are_refused():
    old, sampler, mask, _ = random_rows(0)
    with pytest.raises(ValueError, match="correction must be one of"):
        sampler_importance_weights(old, sampler, mask, correction="sequence_clip", cap=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="floor must be > 0"):
        sampler_importance_weights(old, sampler, mask, cap=2.0, floor=0.0)


@pytest.mark.parametrize("seed", range(4))
def test_mismatch_sums_match_brute_force(seed):
    old, sampler, mask, trajectory_ids = random_rows(seed)
    got = sampler_mismatch_sums(old, sampler, mask, trajectory_ids)
    tokens = kl = chi2 = 0.0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                log_w = old[i, t].item() - sampler[i, t].item()
                tokens += 1
                kl += math.exp(log_w) - 1 - log_w  # k3 of KL(sampler || old), the tokens sampled by the sampler
                chi2 += math.exp(log_w) ** 2 - 1
    chi2_sequence, trajectories = 0.0, 0
    for label in trajectory_ids.unique().tolist():
        rows = [r for r in range(mask.shape[0]) if trajectory_ids[r] == label]
        sampled = [(r, u) for r in rows for u in range(mask.shape[1]) if mask[r, u]]
        if sampled:
            trajectories += 1
            chi2_sequence += math.exp(sum(old[r, u].item() - sampler[r, u].item() for r, u in sampled)) ** 2 - 1
    assert got["tokens"] == tokens and got["trajectories"] == trajectories
    assert got["kl"] == pytest.approx(kl, rel=1e-9) and got["kl"] > 0
    assert got["chi2_token"] == pytest.approx(chi2, rel=1e-9)
    assert got["chi2_sequence"] == pytest.approx(chi2_sequence, rel=1e-9)


def test_the_mismatch_of_a_sampler_that_is_the_old_policy_is_zero():
    old, _, mask, trajectory_ids = random_rows(3)
    got = sampler_mismatch_sums(old, torch.where(mask.bool(), old, 0.0), mask, trajectory_ids)
    assert (got["kl"], got["chi2_token"], got["chi2_sequence"]) == (0.0, 0.0, 0.0)


# --- GSPO's ratio: the geometric mean over the trajectory ------------------------------------------------------------
def brute_force_sequence_loss(logp, old, adv, mask, trajectory_ids, eps, eps_high, divisor, weights=None):
    """-(1/D) sum_i mean_{t in T_i} w_t min(rho_i A_i, clip(rho_i) A_i), rho_i = exp(mean_{t in T_i} log ratio),
    T_i the sampled tokens of all of trajectory i's rows."""
    total = 0.0
    for label in sorted(set(trajectory_ids)):
        tokens = [
            (r, t) for r in range(len(logp)) if trajectory_ids[r] == label for t in range(len(logp[r])) if mask[r][t]
        ]
        if not tokens:
            continue
        a = adv[next(r for r in range(len(logp)) if trajectory_ids[r] == label)]
        rho = math.exp(sum(logp[r][t] - old[r][t] for r, t in tokens) / len(tokens))
        clipped = min(max(rho, 1 / (1 + eps)), 1 + eps_high)
        total += sum((1.0 if weights is None else weights[r][t]) * min(rho * a, clipped * a) for r, t in tokens) / len(
            tokens
        )
    return -total / divisor


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("eps_high", [None, 0.28])
def test_the_sequence_ratio_matches_brute_force_and_its_gradient(seed, eps_high):
    eps, divisor = 0.05, 8
    old, sampler, mask, trajectory_ids = random_rows(seed)
    old = torch.where(mask.bool(), old, 0.0)
    g = torch.Generator().manual_seed(50 + seed)
    # per trajectory, a geometric-mean ratio below, inside or above the clip range, and advantages of both signs
    shifts = torch.tensor([0.0, -0.3, 0.4, 0.0, 0.1, 0.35, -0.25], dtype=torch.float64)[:, None]
    logp = (old + shifts + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.2).requires_grad_(True)
    logp_padded = torch.where(mask.bool(), logp.detach(), math.nan)  # padding is never read
    adv = torch.tensor([0.5, 1.0, 1.0, -1.0, 1.0, -0.7, -1.2], dtype=torch.float64)
    adv = adv * (1 + torch.rand(7, generator=g, dtype=torch.float64))  # rows 1 and 4: one trajectory, one advantage
    adv[4] = adv[1]
    out = loop_policy_loss(
        logp,
        old,
        adv,
        mask,
        epsilon=eps,
        epsilon_high=eps_high,
        divisor=divisor,
        ratio_level="sequence",
        trajectory_ids=trajectory_ids,
    )
    high = eps if eps_high is None else eps_high
    args = (logp_padded.tolist(), old.tolist(), adv.tolist(), mask.tolist(), trajectory_ids.tolist())
    assert out.loss.item() == pytest.approx(brute_force_sequence_loss(*args, eps, high, divisor), rel=1e-10, abs=1e-12)
    # the gradient: rho_i A_i / (|T_i| D) on every sampled token of an unclipped trajectory (GSPO's), 0 elsewhere
    out.loss.backward()
    for label in trajectory_ids.unique().tolist():
        rows = [r for r in range(mask.shape[0]) if trajectory_ids[r] == label]
        tokens = [(r, t) for r in rows for t in range(mask.shape[1]) if mask[r, t]]
        if not tokens:
            continue
        a = adv[rows[0]].item()
        rho = math.exp(sum(logp[r, t].item() - old[r, t].item() for r, t in tokens) / len(tokens))
        clipped = (a > 0 and rho > 1 + high) or (a < 0 and rho < 1 / (1 + eps))
        want = 0.0 if clipped else -rho * a / (len(tokens) * divisor)
        for r in rows:
            for t in range(mask.shape[1]):
                assert logp.grad[r, t].item() == pytest.approx(want if mask[r, t] else 0.0, abs=1e-12), (r, t)
    # some trajectories clipped, some not: both branches checked
    assert 0 < out.clip_frac.item() < 1


@pytest.mark.parametrize("correction", SAMPLER_CORRECTIONS)
def test_the_sequence_ratio_with_sampler_weights_matches_brute_force(correction):
    eps, divisor = 0.1, 5
    old, sampler, mask, trajectory_ids = random_rows(7, spread=0.05, row_shift=1.0)
    old = torch.where(mask.bool(), old, 0.0)
    logp = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 0.3
    adv = torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    adv[4] = adv[1]
    bounded = sampler_importance_weights(
        old, sampler, mask, correction=correction, cap=1.3, floor=0.8, trajectory_ids=trajectory_ids
    )
    out = loop_policy_loss(
        logp,
        old,
        adv,
        mask,
        epsilon=eps,
        divisor=divisor,
        ratio_level="sequence",
        token_weights=bounded.weights,
        trajectory_ids=trajectory_ids,
    )
    want = brute_force_weights(old, sampler, mask, trajectory_ids, correction, 1.3, 0.8)
    weights = [[want[i, t][0] for t in range(mask.shape[1])] for i in range(mask.shape[0])]
    args = (logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), trajectory_ids.tolist())
    expected = brute_force_sequence_loss(*args, eps, eps, divisor, weights=weights)
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)


def test_the_sequence_ratio_of_one_token_trajectories_is_the_token_ratio():
    """With one sampled token per trajectory the geometric mean is that token's ratio: LOOP's token loss."""
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    mask = torch.zeros(5, 3, dtype=torch.long)
    mask[torch.arange(5), torch.tensor([0, 2, 1, 1, 0])] = 1
    adv = torch.randn(5, generator=g)
    token = loop_policy_loss(logp, old, adv, mask, ratio_level="token")
    sequence = loop_policy_loss(logp, old, adv, mask, ratio_level="sequence")
    assert sequence.loss.item() == pytest.approx(token.loss.item(), rel=1e-6)
