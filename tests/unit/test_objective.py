"""The LOOP math against brute-force loops written straight from the paper's formulas."""

from __future__ import annotations

import inspect
import math
import random

import pytest
import torch

from loop_trainer.objective import STD_EPS, advantage_keep_mask, leave_one_out_advantages, loop_policy_loss


def brute_force_loo(rewards: list[float], groups: list[int], std_normalize: bool = False) -> list[float]:
    out = []
    for i, (r_i, g_i) in enumerate(zip(rewards, groups, strict=True)):
        others = [r for j, (r, g) in enumerate(zip(rewards, groups, strict=True)) if g == g_i and j != i]
        if not others:
            out.append(0.0)
            continue
        a = r_i - sum(others) / len(others)
        if std_normalize:
            members = [r for r, g in zip(rewards, groups, strict=True) if g == g_i]
            mean = sum(members) / len(members)
            std = math.sqrt(sum((r - mean) ** 2 for r in members) / (len(members) - 1))
            a /= std + STD_EPS
        out.append(a)
    return out


def brute_force_loss(logp, old, adv, mask, eps, divisor):
    total = 0.0
    for i in range(len(logp)):
        terms = []
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(ratio, 1 / (1 + eps)), 1 + eps)
            terms.append(min(ratio * adv[i], clipped * adv[i]))
        if terms:
            total += sum(terms) / len(terms)
    return -total / divisor


@pytest.mark.parametrize("seed", range(5))
def test_leave_one_out_matches_brute_force_on_unequal_groups(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 7) for _ in range(6)]  # includes groups of one
    groups = [g for g, n in enumerate(sizes) for _ in range(n)]
    rng.shuffle(groups)
    rewards = [rng.choice([0.0, 0.25, 0.5, 1.0, rng.random()]) for _ in groups]
    got = leave_one_out_advantages(torch.tensor(rewards), torch.tensor(groups))
    assert got.tolist() == pytest.approx(brute_force_loo(rewards, groups), abs=1e-6)
    normed = leave_one_out_advantages(torch.tensor(rewards), groups, std_normalize=True)
    assert normed.tolist() == pytest.approx(brute_force_loo(rewards, groups, std_normalize=True), rel=1e-4, abs=1e-4)


def test_leave_one_out_identity_and_special_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.7])
    groups = ["a", "a", "a", "b", "b", "b", "c"]
    adv = leave_one_out_advantages(rewards, groups)
    # n/(n-1) * (r - mean) for the group of three
    assert adv[:3].tolist() == pytest.approx([1.5 * (1 - 1 / 3), 1.5 * (0 - 1 / 3), 1.5 * (0 - 1 / 3)])
    assert adv[3:6].tolist() == [0.0, 0.0, 0.0]  # all-equal rewards: no signal
    assert adv[6].item() == 0.0  # a group of one has no baseline
    assert advantage_keep_mask(adv).tolist() == [True, True, True, False, False, False, False]
    assert advantage_keep_mask(torch.tensor([0.0099, -0.01, 0.01, -0.2]), 0.01).tolist() == [False, True, True, True]


def test_leave_one_out_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        leave_one_out_advantages(torch.zeros(3), [0, 1])


@pytest.mark.parametrize("seed", range(5))
def test_policy_loss_matches_brute_force_and_its_gradient(seed):
    g = torch.Generator().manual_seed(seed)
    batch, length, eps = 5, 9, 0.1
    old = -torch.rand(batch, length, generator=g) * 3
    # ratios spread well outside [1/1.1, 1.1] on both sides
    logp = (old + (torch.rand(batch, length, generator=g) - 0.5) * 0.8).requires_grad_(True)
    mask = (torch.rand(batch, length, generator=g) > 0.3).long()
    mask[0] = 0  # a trajectory without sampled tokens contributes nothing
    adv = torch.tensor([0.5, -0.7, 1.2, -0.1, 0.3])
    out = loop_policy_loss(logp, old, adv, mask, epsilon=eps, divisor=32)
    expected = brute_force_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), eps, 32)
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)

    out.loss.backward()
    # d loss / d logp_t = -(1/divisor)(1/|T_i|) * ratio * A on unclipped tokens, 0 on clipped ones
    ratio = torch.exp(logp.detach() - old)
    low, high = 1 / (1 + eps), 1 + eps
    for i in range(batch):
        n = int(mask[i].sum())
        for t in range(length):
            a = adv[i].item()
            clipped = (a > 0 and ratio[i, t] > high) or (a < 0 and ratio[i, t] < low)
            want = 0.0 if (not mask[i, t] or clipped) else -ratio[i, t].item() * a / (n * 32)
            assert logp.grad[i, t].item() == pytest.approx(want, abs=1e-7)


def test_policy_loss_metrics():
    old = torch.zeros(2, 4)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5, 1.05], [0.8, 1.0, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    adv = torch.tensor([1.0, -1.0])
    out = loop_policy_loss(logp, old, adv, mask)
    # clipped branch taken: ratio 1.5 with A>0 (above 1.1) and ratio 0.8 with A<0 (below 1/1.1)
    assert out.clip_frac.item() == pytest.approx(2 / 5)
    assert out.kl.item() == pytest.approx(-(logp * mask).sum().item() / 5, rel=1e-6)
    assert out.ratio_min.item() == pytest.approx(0.5)
    assert out.ratio_max.item() == pytest.approx(1.5)
    assert out.num_tokens.item() == 5
    # default divisor is the batch size
    assert out.loss.item() == pytest.approx(
        brute_force_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.1, 2), rel=1e-4
    )


def test_policy_loss_is_zero_at_ratio_one_and_finite_with_padding():
    old = torch.full((2, 3), -1e9)  # padding positions may hold garbage
    logp = torch.zeros(2, 3)
    mask = torch.zeros(2, 3, dtype=torch.long)
    out = loop_policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask)
    assert torch.isfinite(out.loss) and out.loss.item() == 0.0


def test_one_std_eps_for_both_advantage_estimators():
    """Both std-normalisation ablations add the same named constant, TRL's GRPO one; LOOP itself
    (std_normalize=False, the default and the demo's) never reads it."""
    from loop_trainer import objective

    assert STD_EPS == 1e-4
    for estimator in (objective.leave_one_out_advantages, objective.group_mean_advantages):
        assert inspect.signature(estimator).parameters["std_eps"].default is STD_EPS
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.5]), [0, 0, 0, 1]
    for name in objective.ADVANTAGE_ESTIMATORS:
        plain = objective.advantages_for(name, rewards, groups)
        assert torch.equal(plain, objective.advantages_for(name, rewards, groups, std_normalize=False))
        std = math.sqrt(((1 - 1 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
        normed = objective.advantages_for(name, rewards, groups, std_normalize=True)
        assert normed[:3].tolist() == pytest.approx((plain[:3] / (std + STD_EPS)).tolist(), rel=1e-6)


def test_module_docstring_and_all_name_every_public_function():
    from loop_trainer import objective

    functions = {
        name
        for name, value in vars(objective).items()
        if inspect.isfunction(value) and value.__module__ == objective.__name__ and not name.startswith("_")
    }
    assert functions == {
        "leave_one_out_advantages",
        "group_mean_advantages",
        "advantages_for",
        "advantage_keep_mask",
        "loop_policy_loss",
        "reference_kl_penalty",
    }
    assert functions <= set(objective.__all__)
    assert all(hasattr(objective, name) for name in objective.__all__)
    public = {name for name in vars(objective) if not name.startswith("_") and name.isupper()}
    assert public <= set(objective.__all__)  # the constants too
    doc = objective.__doc__
    assert "Six functions" in doc
    assert all(f":func:`{name}`" in doc for name in functions)
    assert "trl" not in {
        line.split()[1].split(".")[0]
        for line in inspect.getsource(objective).splitlines()
        if line.startswith(("import ", "from "))
    }
