"""The LOOP objective (Chen et al. 2025, arXiv 2502.01600), in pure torch.

Three functions, each checkable line by line against the paper:

* :func:`leave_one_out_advantages` -- one scalar advantage per rollout, from its task group.
* :func:`advantage_keep_mask` -- drop rollouts whose advantage is (almost) zero.
* :func:`loop_policy_loss` -- the per-token clipped PPO surrogate, token-mean per trajectory,
  summed over trajectories and divided by a constant (the nominal minibatch size).

Nothing here knows about models, tokenizers or TRL.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "PolicyLossOutput",
    "advantage_keep_mask",
    "leave_one_out_advantages",
    "loop_policy_loss",
]


def _group_index(group_ids: Tensor | Sequence[Hashable], device: torch.device) -> Tensor:
    if isinstance(group_ids, Tensor):
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long, device=device)


def leave_one_out_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    *,
    std_normalize: bool = False,
    std_eps: float = 1e-6,
) -> Tensor:
    r"""Leave-one-out advantage of every rollout within its task group.

    For rollout :math:`i` in a group :math:`g` of :math:`n_g` finished rollouts:

    .. math::  A_i = r_i - \frac{1}{n_g - 1} \sum_{j \in g, j \ne i} r_j
                   = \frac{n_g}{n_g - 1} \bigl(r_i - \bar r_g\bigr)

    A group of one rollout gets :math:`A_i = 0` (there is no baseline to compare with). Groups may
    differ in size (failed or cancelled rollouts shrink their group).

    LOOP does *not* divide by the group's standard deviation (the paper's ablation: it hurts).
    ``std_normalize=True`` exists for that ablation only: it divides each advantage by the
    sample (unbiased) standard deviation of its group's rewards plus ``std_eps``.

    Args:
        rewards: ``[N]`` rewards, one per rollout.
        group_ids: ``[N]`` group labels (a tensor or any hashables, e.g. task ids).

    Returns:
        ``[N]`` float32 advantages.
    """
    rewards = rewards.detach().to(torch.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    group = _group_index(group_ids, rewards.device)
    if group.shape != rewards.shape:
        raise ValueError(f"group_ids has {group.numel()} entries for {rewards.numel()} rewards")
    num_groups = int(group.max()) + 1 if group.numel() else 0
    group_sum = torch.zeros(num_groups, device=rewards.device).index_add_(0, group, rewards)
    group_size = torch.zeros(num_groups, device=rewards.device).index_add_(0, group, torch.ones_like(rewards))
    n = group_size[group]
    mean_of_others = (group_sum[group] - rewards) / (n - 1).clamp(min=1)
    advantages = torch.where(n > 1, rewards - mean_of_others, torch.zeros_like(rewards))
    if std_normalize:
        group_mean = group_sum / group_size
        squared_dev = (rewards - group_mean[group]) ** 2
        group_var = torch.zeros(num_groups, device=rewards.device).index_add_(0, group, squared_dev)
        group_std = (group_var / (group_size - 1).clamp(min=1)).sqrt()
        advantages = advantages / (group_std[group] + std_eps)
    return advantages


def advantage_keep_mask(advantages: Tensor, threshold: float = 0.01) -> Tensor:
    r"""Which rollouts LOOP trains on: :math:`|A_i| \ge` ``threshold``.

    Rollouts with a near-zero advantage carry no learning signal but cost a full forward and
    backward pass; with the paper's threshold of 0.01 every group whose rollouts all got the same
    reward disappears.
    """
    return advantages.abs() >= threshold


@dataclass(frozen=True)
class PolicyLossOutput:
    """The loss to back-propagate plus the (detached) statistics people watch."""

    loss: Tensor
    """Scalar: ``-sum_i mean_t objective_{i,t} / divisor``."""
    clip_frac: Tensor
    """Fraction of sampled tokens whose objective took the clipped branch (zero gradient)."""
    kl: Tensor
    """k1 estimate of KL(old || new): mean over sampled tokens of ``old_logp - logp``."""
    ratio_mean: Tensor
    ratio_min: Tensor
    ratio_max: Tensor
    num_tokens: Tensor
    """Number of sampled (loss-mask) tokens in the batch."""


def loop_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    epsilon: float = 0.1,
    divisor: float | None = None,
) -> PolicyLossOutput:
    r"""LOOP's per-token clipped PPO loss for a batch of trajectories.

    For trajectory :math:`i` with advantage :math:`A_i` and sampled tokens :math:`t \in T_i`
    (``loss_mask == 1``):

    .. math::
        \rho_{i,t} = \exp(\log\pi_\theta(y_t) - \log\pi_{old}(y_t)) \\
        o_{i,t} = \min\bigl(\rho_{i,t} A_i,\ \mathrm{clip}(\rho_{i,t}, \tfrac{1}{1+\epsilon}, 1+\epsilon) A_i\bigr) \\
        L = -\frac{1}{D} \sum_i \frac{1}{|T_i|} \sum_{t \in T_i} o_{i,t}

    The clip range is symmetric in log space (``[1/1.1, 1.1]`` for the paper's
    :math:`\epsilon = 0.1`). :math:`D` is a *constant* divisor, the nominal minibatch size
    (paper: 32), so a short minibatch or a trajectory split across gradient-accumulation
    micro-batches is weighted exactly as in a full one. It defaults to the batch size.

    Args:
        logprobs: ``[B, T]`` log-probs of the tokens under the policy being trained (with grad).
        old_logprobs: ``[B, T]`` log-probs of the same tokens under the policy that is held fixed
            for this iteration.
        advantages: ``[B]`` one advantage per trajectory.
        loss_mask: ``[B, T]`` 1 on tokens the policy sampled, 0 elsewhere (prompt, environment
            messages, padding).
        epsilon: clip parameter.
        divisor: constant :math:`D`.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must have the same shape"
        )
    # The ratio is exp of a small difference of large numbers: do it in float32 whatever the model dtype.
    logprobs, old_logprobs = logprobs.float(), old_logprobs.detach().float()
    mask = loss_mask.to(torch.float32)
    divisor = float(logprobs.shape[0] if divisor is None else divisor)

    # Masked positions get log-ratio 0 so padding can never produce inf * 0 = nan.
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
        stats = PolicyLossOutput(
            loss=loss,
            clip_frac=took_clipped.sum() / denom,
            kl=(-log_ratio * mask).sum() / denom,
            ratio_mean=(ratio * mask).sum() / denom,
            ratio_min=selected.min() if not empty else ratio.new_tensor(1.0),
            ratio_max=selected.max() if not empty else ratio.new_tensor(1.0),
            num_tokens=num_tokens,
        )
    return stats
