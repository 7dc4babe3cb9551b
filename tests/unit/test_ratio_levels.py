"""The paper's Table 1 variants of the objective: per-turn and per-trajectory importance ratios and
GRPO's group-mean advantage, against brute-force loops written straight from the formulas; the
per-token loss (LOOP's) unchanged, bit for bit, and the per-turn and per-trajectory losses
unchanged to float rounding, by the one clipped-loss path that serves all three levels."""

from __future__ import annotations

import math
import random

import pytest
import torch

from loop_trainer.objective import MAX_LOG_RATIO, PolicyLossOutput, group_mean_advantages, loop_policy_loss
from loop_trainer.training.batching import Batch, TrainingSample, collate, turn_ids_from_mask
from loop_trainer.trajectory import Trajectory

EPS = 0.1


# ---------------------------------------------------------------------------------------------
# brute force, one token and one turn at a time


def segment_labels(sampled, turns_row, level):
    """The segment of each sampled token: itself (token), its turn, or the whole trajectory."""
    return {t: t if level == "token" else 0 if level == "trajectory" else turns_row[t] for t in sampled}


def brute_force_sequence_loss(logp, old, adv, mask, turns, level, eps, divisor):
    """``-(1/D) sum_i (1/|T_i|) sum_t min(rho_k A_i, clip(rho_k) A_i)``, ``k`` the token's segment
    (itself, its turn, or the whole trajectory), ``rho_k = prod_{t in k} exp(logp - old)``."""
    total = 0.0
    for i in range(len(logp)):
        sampled = [t for t in range(len(logp[i])) if mask[i][t]]
        if not sampled:
            continue
        label = segment_labels(sampled, turns[i], level)
        ratio = {}
        for k in set(label.values()):
            product = 1.0
            for t in sampled:
                if label[t] == k:
                    product *= math.exp(logp[i][t] - old[i][t])
            ratio[k] = product
        terms = []
        for t in sampled:
            rho = ratio[label[t]]
            clipped = min(max(rho, 1 / (1 + eps)), 1 + eps)
            terms.append(min(rho * adv[i], clipped * adv[i]))
        total += sum(terms) / len(terms)
    return -total / divisor


def brute_force_gradient(logp, old, adv, mask, turns, level, eps, divisor):
    """d loss / d logp_t = -(1/D)(1/|T_i|) n_k rho_k A_i if turn k took the unclipped branch, else 0."""
    grad = [[0.0] * len(row) for row in logp]
    for i in range(len(logp)):
        sampled = [t for t in range(len(logp[i])) if mask[i][t]]
        label = segment_labels(sampled, turns[i], level)
        for t in sampled:
            members = [u for u in sampled if label[u] == label[t]]
            rho = math.exp(sum(logp[i][u] - old[i][u] for u in members))
            a = adv[i]
            clipped = (a > 0 and rho > 1 + eps) or (a < 0 and rho < 1 / (1 + eps))
            if not clipped:
                grad[i][t] = -len(members) * rho * a / (len(sampled) * divisor)
    return grad


def random_case(seed: int, batch: int = 6, length: int = 16, spread: float = 0.12):
    """Rows of unequal length with padding; turns of unequal length (single-token ones included)
    separated by unsampled tokens; a row of one turn; a row with nothing sampled; turn labels
    that need not be contiguous."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length, dtype=torch.long)
    turns = torch.full((batch, length), -1, dtype=torch.long)
    for i in range(batch):
        used = length - rng.randint(0, 5)  # right padding
        t, label = rng.randint(0, 2), rng.choice([0, 0, 3])
        one_turn = i == 1
        while t < used:
            n = 1 if rng.random() < 0.3 else rng.randint(2, 5)
            n = min(n, used - t)
            if one_turn:
                n = used - t
            mask[i, t : t + n] = 1
            turns[i, t : t + n] = label
            label += rng.choice([1, 1, 2])
            t += n + rng.randint(1, 2)  # environment tokens between replies
    mask[batch - 1] = 0
    turns[batch - 1] = -1
    old = -torch.rand(batch, length, generator=g) * 3
    logp = old + (torch.rand(batch, length, generator=g) - 0.5) * 2 * spread
    # Padding and environment tokens may hold garbage: the loss must never read it.
    old = torch.where(mask.bool(), old, torch.tensor(-1e30))
    logp = torch.where(mask.bool(), logp, torch.tensor(float("nan")))
    adv = torch.tensor([rng.choice([-1, 1]) * rng.uniform(0.2, 1.5) for _ in range(batch)])
    return logp, old, adv, mask, turns


LEVELS = ["turn", "trajectory"]  # the levels whose ratio is a product over several tokens
ALL_LEVELS = ["token", *LEVELS]


@pytest.mark.parametrize("level", ALL_LEVELS)
@pytest.mark.parametrize("seed", range(6))
def test_loss_matches_brute_force_and_its_gradient_at_every_level(level, seed):
    logp, old, adv, mask, turns = random_case(seed)
    logp.requires_grad_(True)
    out = loop_policy_loss(logp, old, adv, mask, epsilon=EPS, divisor=32, ratio_level=level, turn_ids=turns)
    args = (logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), turns.tolist(), level, EPS, 32)
    assert out.loss.item() == pytest.approx(brute_force_sequence_loss(*args), rel=1e-5, abs=1e-8)
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()
    want = torch.tensor(brute_force_gradient(*args))
    torch.testing.assert_close(logp.grad, want, rtol=1e-5, atol=1e-8)
    assert (logp.grad[mask == 0] == 0).all()


def test_random_cases_cover_what_they_claim():
    """The brute-force comparison above is only as good as its inputs: clipping on both sides,
    unclipped turns, single-token turns, a one-turn trajectory and padding all occur; at the token
    level too, tokens are clipped on both sides and unclipped."""
    token_counts = {"clipped above": 0, "clipped below": 0, "unclipped": 0}
    for seed in range(6):
        logp, old, adv, mask, _ = random_case(seed)
        sampled = mask.bool()
        rho = torch.exp(torch.where(sampled, logp - old, torch.zeros(())))
        a = adv[:, None].expand_as(rho)
        above, below = sampled & (a > 0) & (rho > 1 + EPS), sampled & (a < 0) & (rho < 1 / (1 + EPS))
        token_counts["clipped above"] += int(above.sum())
        token_counts["clipped below"] += int(below.sum())
        token_counts["unclipped"] += int((sampled & ~above & ~below).sum())
    assert all(token_counts.values()), token_counts
    kinds = set()
    for seed in range(6):
        logp, old, adv, mask, turns = random_case(seed)
        for i in range(mask.shape[0]):
            labels = turns[i][mask[i].bool()].tolist()
            for k in set(labels):
                members = mask[i].bool() & (turns[i] == k)
                rho = math.exp(float((logp[i][members] - old[i][members]).sum()))
                a = float(adv[i])
                kinds.add("single-token turn" if labels.count(k) == 1 else "longer turn")
                if a > 0 and rho > 1 + EPS:
                    kinds.add("clipped above")
                elif a < 0 and rho < 1 / (1 + EPS):
                    kinds.add("clipped below")
                else:
                    kinds.add("unclipped")
            if len(set(labels)) == 1:
                kinds.add("one turn")
            if not mask[i, -1]:
                kinds.add("padding")
    assert kinds == {
        "single-token turn",
        "longer turn",
        "clipped above",
        "clipped below",
        "unclipped",
        "one turn",
        "padding",
    }


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_gradcheck_at_every_level(level):
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 0], [0, 1, 0, 1, 1, 1]])
    turns = torch.tensor([[-1, 0, 0, -1, 1, -1], [0, 0, 0, 0, 0, -1], [-1, 0, -1, 1, 1, 2]])
    old = (-torch.rand(3, 6, generator=g, dtype=torch.float64) * 2).detach()
    logp = (old + (torch.rand(3, 6, generator=g, dtype=torch.float64) - 0.5) * 0.5).requires_grad_(True)
    adv = torch.tensor([0.8, -0.6, 1.1], dtype=torch.float64)

    def loss(x):
        return loop_policy_loss(x, old, adv, mask, epsilon=EPS, divisor=4, ratio_level=level, turn_ids=turns).loss

    assert torch.autograd.gradcheck(loss, (logp,), eps=1e-6, atol=1e-7)
    # not vacuous: some turns clipped, some not
    out = loop_policy_loss(logp, old, adv, mask, epsilon=EPS, ratio_level=level, turn_ids=turns)
    assert 0 < out.clip_frac.item() < 1 or level == "trajectory"


def test_turn_and_trajectory_levels_differ_from_each_other_and_from_token():
    logp, old, adv, mask, turns = random_case(3)
    losses = {
        level: loop_policy_loss(logp, old, adv, mask, ratio_level=level, turn_ids=turns).loss.item()
        for level in ("turn", "trajectory")
    }
    old_token = torch.where(mask.bool(), old, torch.zeros(()))
    logp_token = torch.where(mask.bool(), logp, torch.zeros(()))
    losses["token"] = loop_policy_loss(logp_token, old_token, adv, mask).loss.item()
    assert len({round(v, 6) for v in losses.values()}) == 3


def test_one_token_turns_equal_the_token_level():
    """With every sampled token its own turn, the per-turn loss is the per-token loss."""
    logp, old, adv, mask, _ = random_case(4)
    logp, old = torch.where(mask.bool(), logp, torch.zeros(())), torch.where(mask.bool(), old, torch.zeros(()))
    own = torch.arange(mask.numel()).view_as(mask)
    token = loop_policy_loss(logp, old, adv, mask)
    turn = loop_policy_loss(logp, old, adv, mask, ratio_level="turn", turn_ids=own)
    for field in ("loss", "clip_frac", "kl", "ratio_mean", "ratio_min", "ratio_max", "num_tokens"):
        torch.testing.assert_close(getattr(turn, field), getattr(token, field), rtol=1e-6, atol=1e-7)


def test_sequence_level_statistics():
    # row 0: turns of log-ratio sums log 1.5 (2 tokens) and log 0.5 (1 token), A > 0;
    # row 1: one turn, log-ratio log 0.8, A < 0
    half = math.log(1.5) / 2
    logp = torch.tensor([[half, half, math.log(0.5), 0.0], [math.log(0.8), 0.0, 0.0, 0.0]])
    old = torch.zeros(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    turns = torch.tensor([[0, 0, 1, -1], [0, -1, -1, -1]])
    adv = torch.tensor([1.0, -1.0])
    out = loop_policy_loss(logp, old, adv, mask, ratio_level="turn", turn_ids=turns)
    # clipped: the turn at 1.5 (A > 0, both its tokens) and the turn at 0.8 (A < 0)
    assert out.clip_frac.item() == pytest.approx(3 / 4)
    assert out.ratio_mean.item() == pytest.approx((1.5 + 1.5 + 0.5 + 0.8) / 4)
    assert (out.ratio_min.item(), out.ratio_max.item()) == pytest.approx((0.5, 1.5))
    assert out.kl.item() == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(0.8)) / 4)
    assert out.num_tokens.item() == 4
    expected = -((2 * 1.1 + 0.5) / 3 + (-1 / 1.1)) / 2  # default divisor: the batch size
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    # trajectory level: row 0's ratio is 1.5 * 0.5 = 0.75 (A > 0: unclipped)
    out = loop_policy_loss(logp, old, adv, mask, ratio_level="trajectory")
    assert out.clip_frac.item() == pytest.approx(1 / 4)
    assert out.ratio_mean.item() == pytest.approx((3 * 0.75 + 0.8) / 4)
    assert out.loss.item() == pytest.approx(-(0.75 + (-1 / 1.1)) / 2, rel=1e-6)


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_empty_batch_has_a_zero_loss_that_still_backpropagates(level):
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.long)
    out = loop_policy_loss(
        logp, torch.full((2, 3), float("nan")), torch.ones(2), mask, ratio_level=level, turn_ids=torch.full((2, 3), -1)
    )
    assert out.loss.item() == 0.0 and out.num_tokens.item() == 0 and out.ratio_min.item() == 1.0
    out.loss.backward()  # a stand-in micro-batch: zero gradient, but a graph to the model
    assert torch.equal(logp.grad, torch.zeros(2, 3))


# ---------------------------------------------------------------------------------------------
# overflow: a 30k-token trajectory's summed log-ratio


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("drift", [0.01, -0.01])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_huge_summed_log_ratio_clips_and_keeps_gradients_finite(level, dtype, drift, sign):
    n = 30_000
    old = torch.full((1, n), -2.0)
    logp = (old + drift).to(dtype).requires_grad_(True)  # summed log-ratio about +-300: exp overflows float32
    mask = torch.ones(1, n, dtype=torch.long)
    turns = torch.zeros(1, n, dtype=torch.long)
    out = loop_policy_loss(logp, old, torch.tensor([sign]), mask, ratio_level=level, turn_ids=turns)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()
    # Every token is on the far side of the clip range, so the min picks the clipped branch
    # (or the unclipped one, at the guard) and no gradient flows, exactly as PPO without the guard.
    assert (logp.grad == 0).all()
    if drift > 0 and sign > 0:  # huge ratio, A > 0: clipped at 1 + eps
        assert out.loss.item() == pytest.approx(-1.1) and out.clip_frac.item() == 1.0
    elif drift < 0 and sign < 0:  # tiny ratio, A < 0: clipped at 1 / (1 + eps)
        assert out.loss.item() == pytest.approx(1 / 1.1) and out.clip_frac.item() == 1.0
    elif drift > 0:  # huge ratio, A < 0: the unclipped branch, at the guard e^MAX_LOG_RATIO
        assert out.loss.item() == pytest.approx(math.exp(MAX_LOG_RATIO)) and out.clip_frac.item() == 0.0
    else:  # tiny ratio, A > 0: the unclipped branch, about 0
        assert abs(out.loss.item()) < 1e-8 and out.clip_frac.item() == 0.0
    assert math.isfinite(out.ratio_max.item()) and out.ratio_max.item() <= math.exp(MAX_LOG_RATIO) * 1.0001


def test_large_but_guarded_log_ratio_is_exact_with_negative_advantage():
    """Inside the guard the unclipped branch is exact: a turn at log-ratio 15 with A < 0 gets the
    full PPO gradient n_k rho A / (|T| D)."""
    n = 1500
    old = torch.full((1, n), -3.0)
    logp = (old + 0.01).requires_grad_(True)
    out = loop_policy_loss(
        logp, old, torch.tensor([-0.5]), torch.ones(1, n, dtype=torch.long), ratio_level="trajectory", divisor=1
    )
    rho = math.exp(sum((logp.detach() - old)[0].tolist()))  # the sum in float64
    # (the float32 sum of 1500 log-ratios is good to about 1e-4 absolute, so rho to about 1e-4 relative)
    assert out.loss.item() == pytest.approx(0.5 * rho, rel=1e-3)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, n), 0.5 * rho), rtol=1e-3, atol=0)
    assert 0.5 * math.exp(14) < out.loss.item() < 0.5 * math.exp(16)


def test_non_finite_garbage_in_padding_never_reaches_loss_or_gradient():
    logp = torch.tensor([[-1.0, float("inf"), -0.5, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.1, float("-inf"), -0.4, float("inf")]])
    mask = torch.tensor([[1, 0, 1, 0]])
    for level in ALL_LEVELS:
        logp.grad = None
        out = loop_policy_loss(
            logp, old, torch.tensor([1.0]), mask, ratio_level=level, turn_ids=torch.tensor([[0, -1, 1, -1]])
        )
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
        assert logp.grad[0, 1].item() == 0.0 and logp.grad[0, 3].item() == 0.0


def test_argument_errors():
    logp, old, adv, mask = torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1), torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="turn_ids"):
        loop_policy_loss(logp, old, adv, mask, ratio_level="turn")
    with pytest.raises(ValueError, match="turn_ids"):
        loop_policy_loss(logp, old, adv, mask, ratio_level="turn", turn_ids=torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=">= 0"):
        loop_policy_loss(logp, old, adv, mask, ratio_level="turn", turn_ids=torch.tensor([[0, -1, 0]]))
    with pytest.raises(ValueError, match="ratio_level"):
        loop_policy_loss(logp, old, adv, mask, ratio_level="sentence")
    # "trajectory" needs no turn_ids, and -1 labels on tokens not sampled are fine
    loop_policy_loss(logp, old, adv, mask, ratio_level="trajectory")
    loop_policy_loss(logp, old, adv, torch.tensor([[1, 0, 1]]), ratio_level="turn", turn_ids=torch.tensor([[0, -1, 1]]))


# ---------------------------------------------------------------------------------------------
# the token level: LOOP's loss, unchanged


def reference_token_loss(logprobs, old_logprobs, advantages, loss_mask, *, epsilon=0.1, divisor=None):
    """``loop_policy_loss`` as it was before ratio levels existed (copied verbatim)."""
    logprobs, old_logprobs = logprobs.float(), old_logprobs.detach().float()
    mask = loss_mask.to(torch.float32)
    divisor = float(logprobs.shape[0] if divisor is None else divisor)
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(torch.float32)[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 / (1.0 + epsilon), 1.0 + epsilon) * adv
    objective = torch.minimum(unclipped, clipped)
    tokens_per_trajectory = mask.sum(dim=1)
    trajectory_objective = (objective * mask).sum(dim=1) / tokens_per_trajectory.clamp(min=1)
    loss = -trajectory_objective.sum() / divisor
    with torch.no_grad():
        num_tokens = mask.sum()
        denom = num_tokens.clamp(min=1)
        took_clipped = (clipped < unclipped).to(mask.dtype) * mask
        selected = ratio[mask.bool()]
        empty = selected.numel() == 0
        return PolicyLossOutput(
            loss=loss,
            clip_frac=took_clipped.sum() / denom,
            kl=(-log_ratio * mask).sum() / denom,
            ratio_mean=(ratio * mask).sum() / denom,
            ratio_min=selected.min() if not empty else ratio.new_tensor(1.0),
            ratio_max=selected.max() if not empty else ratio.new_tensor(1.0),
            num_tokens=num_tokens,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_token_level_is_the_old_loss_bit_for_bit(seed, dtype):
    logp, old, adv, mask, turns = random_case(seed)
    logp = torch.where(mask.bool(), logp, torch.zeros(())).to(dtype)
    old = torch.where(mask.bool(), old, torch.full((), -1e9))
    grads, outs = [], []
    for call in ("reference", "default", "token", "token with turn_ids"):
        x = logp.clone().requires_grad_(True)
        if call == "reference":
            out = reference_token_loss(x, old, adv, mask, epsilon=0.2, divisor=7)
        elif call == "default":
            out = loop_policy_loss(x, old, adv, mask, epsilon=0.2, divisor=7)
        elif call == "token":
            out = loop_policy_loss(x, old, adv, mask, epsilon=0.2, divisor=7, ratio_level="token")
        else:
            out = loop_policy_loss(x, old, adv, mask, epsilon=0.2, divisor=7, ratio_level="token", turn_ids=turns)
        out.loss.backward()
        grads.append(x.grad)
        outs.append(out)
    for out, grad in zip(outs[1:], grads[1:], strict=True):
        assert torch.equal(grad, grads[0])
        for field in ("loss", "clip_frac", "kl", "ratio_mean", "ratio_min", "ratio_max", "num_tokens"):
            assert torch.equal(getattr(out, field), getattr(outs[0], field)), field


def reference_sequence_loss(logprobs, old_logprobs, advantages, loss_mask, *, epsilon, divisor, ratio_level, turn_ids):
    """The per-turn / per-trajectory loss as it was, a second implementation beside the token
    level's, before one path served all three levels (copied verbatim, argument checks left out)."""
    batch_size = logprobs.shape[0]
    divisor = float(batch_size if divisor is None else divisor)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    sampled = loss_mask.bool()
    log_ratio = logprobs[sampled].to(dtype) - old_logprobs.detach()[sampled].to(dtype)
    row = torch.arange(batch_size, device=logprobs.device)[:, None].expand_as(sampled)[sampled]
    if ratio_level == "trajectory":
        segment = row
    else:
        turn = turn_ids.to(device=logprobs.device, dtype=torch.long)[sampled]
        width = int(turn.max()) + 1 if turn.numel() else 1
        segment = row * width + turn
    _, inverse = torch.unique(segment, return_inverse=True)
    num_segments = int(inverse.max()) + 1 if inverse.numel() else 0
    segment_log_ratio = log_ratio.new_zeros(num_segments).index_add(0, inverse, log_ratio)
    guarded = segment_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(guarded)[inverse]
    adv = advantages.detach().to(dtype)[row]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 / (1.0 + epsilon), 1.0 + epsilon) * adv
    objective = torch.minimum(unclipped, clipped)
    tokens_per_trajectory = torch.zeros(batch_size, dtype=dtype, device=logprobs.device).index_add_(
        0, row, torch.ones_like(log_ratio.detach())
    )
    loss = -(objective / tokens_per_trajectory[row]).sum() / divisor
    with torch.no_grad():
        num_tokens = sampled.sum().to(torch.float32)
        denom = num_tokens.clamp(min=1)
        empty = ratio.numel() == 0
        return PolicyLossOutput(
            loss=loss,
            clip_frac=(clipped < unclipped).sum().to(torch.float32) / denom,
            kl=(-log_ratio).sum().to(torch.float32) / denom,
            ratio_mean=ratio.sum().to(torch.float32) / denom,
            ratio_min=ratio.min().to(torch.float32) if not empty else ratio.new_tensor(1.0, dtype=torch.float32),
            ratio_max=ratio.max().to(torch.float32) if not empty else ratio.new_tensor(1.0, dtype=torch.float32),
            num_tokens=num_tokens,
        )


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("spread", [0.05, 0.12, 0.5])
@pytest.mark.parametrize("seed", range(8))
def test_turn_and_trajectory_levels_are_the_old_loss_to_float_rounding(level, spread, seed):
    """The one clipped-loss path gives the per-turn and per-trajectory losses of the former second
    implementation: the same values, up to float32 summation order (relative 1e-5, absolute 1e-7 on
    the loss, the statistics and every gradient entry); the clip decisions, the ratio extremes
    and the token count exactly. Spread 0.5 puts most turns and trajectories far outside the clip
    range."""
    logp, old, adv, mask, turns = random_case(seed, batch=8, length=40, spread=spread)
    outs, grads = [], []
    for implementation in (reference_sequence_loss, loop_policy_loss):
        x = logp.clone().requires_grad_(True)
        out = implementation(x, old, adv, mask, epsilon=EPS, divisor=32, ratio_level=level, turn_ids=turns)
        out.loss.backward()
        outs.append(out)
        grads.append(x.grad)
    want, got = outs
    for field in ("clip_frac", "ratio_min", "ratio_max", "num_tokens"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    for field in ("loss", "kl", "ratio_mean"):
        assert getattr(got, field).dtype == torch.float32
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# GRPO's group-mean advantage


def brute_force_group_mean(rewards, groups, std_normalize=False, eps=1e-4):
    out = []
    for r_i, g_i in zip(rewards, groups, strict=True):
        members = [r for r, g in zip(rewards, groups, strict=True) if g == g_i]
        mean = sum(members) / len(members)
        a = r_i - mean
        if std_normalize:
            std = math.sqrt(sum((r - mean) ** 2 for r in members) / (len(members) - 1)) if len(members) > 1 else 0.0
            a /= std + eps
        out.append(a)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_group_mean_advantages_match_brute_force(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 7) for _ in range(6)]  # includes groups of one
    groups = [g for g, n in enumerate(sizes) for _ in range(n)]
    rng.shuffle(groups)
    rewards = [rng.choice([0.0, 0.25, 0.5, 1.0, rng.random()]) for _ in groups]
    got = group_mean_advantages(torch.tensor(rewards), torch.tensor(groups))
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(brute_force_group_mean(rewards, groups), abs=1e-6)
    for std_eps in (1e-4, 1e-2):
        normed = group_mean_advantages(
            torch.tensor(rewards), [f"task-{g}" for g in groups], std_normalize=True, std_eps=std_eps
        )
        assert normed.tolist() == pytest.approx(
            brute_force_group_mean(rewards, groups, True, std_eps), rel=1e-4, abs=1e-4
        )


def test_group_mean_advantages_special_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.7])
    groups = ["a", "a", "a", "b", "b", "b", "c"]
    adv = group_mean_advantages(rewards, groups)
    assert adv[:3].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])  # the mean includes r_i
    assert adv[3:].tolist() == [0.0, 0.0, 0.0, 0.0]  # all equal; a group of one
    normed = group_mean_advantages(rewards, groups, std_normalize=True)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    assert normed[:3].tolist() == pytest.approx(
        [(2 / 3) / (std + 1e-4), (-1 / 3) / (std + 1e-4), (-1 / 3) / (std + 1e-4)], rel=1e-6
    )
    assert torch.isfinite(normed).all() and normed[3:].tolist() == [0.0, 0.0, 0.0, 0.0]
    # the leave-one-out advantage is the group-mean one times n / (n - 1)
    from loop_trainer.objective import leave_one_out_advantages

    loo = leave_one_out_advantages(rewards, groups)
    assert loo[:3].tolist() == pytest.approx((adv[:3] * 1.5).tolist())
    with pytest.raises(ValueError):
        group_mean_advantages(torch.zeros(3), [0, 1])


# ---------------------------------------------------------------------------------------------
# turn ids through TrainingSample and collate


def test_turn_ids_are_carried_into_the_batch_and_cut_with_the_sample():
    t = Trajectory(task_id="x", group=0)
    t.append([1, 2, 3], sampled=False)
    t.append([4, 5], sampled=True, logprobs=[-0.1, -0.2], turn=0)
    t.num_turns += 1
    t.append([6, 7], sampled=False)
    t.append([8], sampled=True, logprobs=[-0.3])  # default label: num_turns
    t.append([9], sampled=False)
    assert t.turn_ids == [-1, -1, -1, 0, 0, -1, -1, 1, -1]
    assert t.to_dict()["turn_ids"] == t.turn_ids
    full = TrainingSample.from_trajectory(t, 0.5, max_tokens=100)
    assert full.turn_ids == [-1, -1, -1, 0, 0, -1, -1, 1]  # cut after the last sampled token
    cut = TrainingSample.from_trajectory(t, 0.5, max_tokens=4)
    assert cut.turn_ids == [-1, -1, -1, 0] and cut.truncated
    batch = collate([full, cut], pad_token_id=0)
    assert batch.turn_ids.dtype == torch.long
    assert batch.turn_ids.tolist() == [[-1, -1, -1, 0, 0, -1, -1, 1], [-1, -1, -1, 0, -1, -1, -1, -1]]
    assert batch.to(torch.device("cpu")).turn_ids.tolist() == batch.turn_ids.tolist()


def test_samples_without_recorded_turns_get_turns_from_their_mask():
    assert turn_ids_from_mask([0, 1, 1, 0, 0, 1, 0, 1, 1]) == [-1, 0, 0, -1, -1, 1, -1, 2, 2]
    assert turn_ids_from_mask([]) == []
    # the positional five-field form used across the code base still works
    sample = TrainingSample([5, 6, 7, 8], [0, 1, 0, 1], [0.0] * 4, 1.0, False)
    assert collate([sample], 0).turn_ids.tolist() == [[-1, 0, -1, 1]]
    # a Trajectory built by hand without turn_ids
    t = Trajectory(task_id="x", group=0, token_ids=[1, 2, 3], loss_mask=[0, 1, 1], sampler_logprobs=[0.0] * 3)
    assert TrainingSample.from_trajectory(t, 1.0, 10).turn_ids is None
    # a Batch built without turn ids moves to a device
    plain = Batch(*(torch.zeros(1, 2) for _ in range(3)), torch.zeros(1), torch.zeros(1, 2))
    assert plain.to(torch.device("cpu")).turn_ids is None


def test_reference_kl_penalty_is_k3_token_mean_per_trajectory_over_the_divisor():
    from loop_trainer.objective import reference_kl_penalty

    torch.manual_seed(0)
    logprobs, reference = -torch.rand(3, 7) * 3, -torch.rand(3, 7) * 3
    mask = (torch.rand(3, 7) > 0.3).long()
    mask[2] = 0  # a row with nothing sampled contributes nothing
    reference[0, ~mask[0].bool()] = float("inf")  # padding is never read
    penalty, mean = reference_kl_penalty(logprobs, reference, mask, divisor=4.0)
    expected, tokens, total = 0.0, 0, 0.0
    for i in range(3):
        k3 = [
            float(torch.exp(reference[i, t] - logprobs[i, t]) - (reference[i, t] - logprobs[i, t]) - 1)
            for t in range(7)
            if mask[i, t]
        ]
        expected += sum(k3) / max(len(k3), 1)
        tokens, total = tokens + len(k3), total + sum(k3)
    assert penalty.item() == pytest.approx(expected / 4.0, rel=1e-5) and mean.item() == pytest.approx(
        total / tokens, rel=1e-5
    )
    same, zero = reference_kl_penalty(logprobs, logprobs.clone(), mask)
    assert same.item() == 0.0 and zero.item() == 0.0
