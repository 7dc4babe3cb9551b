"""What LOOP can add when learning is fragile, in pure torch: each off by default (LOOP as the paper).

* :func:`tied_groups` -- which task groups got the same reward on every rollout. Their
  leave-one-out advantages are all 0, so they teach nothing: the fraction of tied groups is the signal
  that learning has stalled, and dynamic sampling (DAPO, Yu et al. 2025, arXiv 2503.14476, "dynamic
  sampling"; ``dynamic_sampling_rounds``) collects more tasks until enough groups are not tied.
* :func:`select_informative_groups` -- the first ``wanted`` groups that are not tied, in collection order:
  what an iteration with dynamic sampling trains on.
* :func:`sampler_importance_weights` -- per token, the correction for the gap between the policy that
  sampled a trajectory (vLLM, bf16, another process, an older policy) and the trainer's old policy,
  ``w = pi_old / pi_sampler``, bounded one of four ways (``sampler_correction``): truncated per
  token (truncated importance sampling, Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"; TRL's ``vllm_importance_sampling_mode: token_truncate``), masked per token
  (IcePop, Ring-1T 2025: a token whose weight is out of bounds leaves the loss), or one weight per
  trajectory, the product of its tokens' weights, truncated or masked (verl's and SkyRL's sequence-level
  truncation and masked importance sampling, MIS). :func:`truncated_importance_weights` is the first
  alone (``sampler_importance_cap``).
* :func:`sampler_mismatch_sums` -- how far the sampler is from the trainer's old policy, from the sampled
  tokens alone: a k3 estimate of KL(sampler || old) and the chi-square divergence of the token and of the
  trajectory weights (the quantities verl and SkyRL report as the rollout/training mismatch).

The third stabiliser, an upper clip bound larger than the lower one (DAPO's clip-higher,
``epsilon_high``), is a parameter of :func:`loop_trainer.objective.loop_policy_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "SAMPLER_CORRECTIONS",
    "TIE_TOLERANCE",
    "SamplerCorrection",
    "SamplerWeights",
    "sampler_importance_weights",
    "sampler_mismatch_sums",
    "select_informative_groups",
    "tied_groups",
    "trajectory_of_rows",
    "truncated_importance_weights",
]

SamplerCorrection = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
SAMPLER_CORRECTIONS: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""How :func:`sampler_importance_weights` bounds the weights toward the sampler: per token or per trajectory
(``sequence``: TRL's word), truncated to the bounds or masked (weight 0) outside them."""

TIE_TOLERANCE = 1e-6
"""Two rewards closer than this are equal (rewards are sums of float fractions: allow their rounding)."""


def tied_groups(rewards: Sequence[float] | Tensor, group_ids: Sequence[Hashable]) -> dict[Hashable, bool]:
    """For every group (in first-seen order): True if all its rewards lie within :data:`TIE_TOLERANCE`
    of each other. A group of one rollout is tied (it has no baseline to differ from)."""
    values = rewards.tolist() if isinstance(rewards, Tensor) else list(rewards)
    if len(values) != len(group_ids):
        raise ValueError(f"{len(values)} rewards for {len(group_ids)} group ids")
    low: dict[Hashable, float] = {}
    high: dict[Hashable, float] = {}
    for reward, group in zip(values, group_ids, strict=True):
        low[group] = min(low.get(group, reward), reward)
        high[group] = max(high.get(group, reward), reward)
    return {group: high[group] - low[group] < TIE_TOLERANCE for group in low}


def select_informative_groups(tied: dict[Hashable, bool], wanted: int) -> tuple[list[Hashable], int]:
    """The first ``wanted`` groups of ``tied`` (its order) that are not tied, and how many groups that
    are not tied were left over beyond them (DAPO keeps the batch size fixed: the surplus is dropped)."""
    informative = [group for group, is_tied in tied.items() if not is_tied]
    return informative[:wanted], max(0, len(informative) - wanted)


def truncated_importance_weights(
    old_logprobs: Tensor, sampler_logprobs: Tensor, loss_mask: Tensor, cap: float
) -> tuple[Tensor, Tensor]:
    r"""Per token :math:`w_t = \min\bigl(\exp(\log\pi_{old}(y_t) - \log\pi_{sampler}(y_t)),\ C\bigr)`:
    :func:`sampler_importance_weights` with ``correction="token_truncate"`` and no floor.

    Args:
        old_logprobs: ``[B, T]`` the trainer's old-policy log-probs (the ratio's denominator).
        sampler_logprobs: ``[B, T]`` the sampler's log-probs of the same tokens.
        loss_mask: ``[B, T]`` 1 on sampled tokens; elsewhere the weight is 1 and nothing is read.
        cap: :math:`C > 0`.

    Returns:
        ``([B, T]`` float32 weights, detached; the fraction of sampled tokens whose weight was capped
        (a scalar; 0 when nothing is sampled)).
    """
    out = sampler_importance_weights(old_logprobs, sampler_logprobs, loss_mask, correction="token_truncate", cap=cap)
    count = loss_mask.bool().sum()
    return out.weights, out.truncated.sum().float() / count.clamp(min=1).float()


def trajectory_of_rows(
    num_rows: int, trajectory_ids: Tensor | None, device: torch.device | None = None
) -> tuple[Tensor, int]:
    """``([B]`` each row's trajectory as 0..n-1, ``n)``: rows with one label in ``trajectory_ids`` are segments of
    one trajectory; None: every row is its own."""
    if trajectory_ids is None:
        return torch.arange(num_rows, device=device), num_rows
    rows = torch.unique(trajectory_ids.to(device), return_inverse=True)[1]
    return rows, int(rows.max()) + 1 if rows.numel() else 0


@dataclass(frozen=True)
class SamplerWeights:
    """The weights toward the sampler of a ``[B, T]`` batch, and which sampled tokens their bounds touched."""

    weights: Tensor
    """``[B, T]`` float32, detached: each sampled token's weight (0 where masked); 1 where not sampled."""
    truncated: Tensor
    """``[B, T]`` bool: sampled tokens whose weight (their own, or their trajectory's) was set to a bound."""
    masked: Tensor
    """``[B, T]`` bool: sampled tokens whose weight (their own, or their trajectory's) was out of bounds: 0."""


def sampler_importance_weights(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    correction: SamplerCorrection = "token_truncate",
    cap: float | None = None,
    floor: float | None = None,
    trajectory_ids: Tensor | None = None,
) -> SamplerWeights:
    r"""The importance weight of every sampled token toward the sampler, bounded as ``correction`` says.

    Per sampled token :math:`t` of trajectory :math:`i`, :math:`\ell_t = \log\pi_{old}(y_t) -
    \log\pi_{sampler}(y_t)`. The weight before bounding is the token's own, :math:`w_t = e^{\ell_t}`
    (``token_*``), or its trajectory's, the product of its tokens' weights, :math:`W_i = \exp\sum_{u \in
    T_i} \ell_u` (``sequence_*``; every token of the trajectory carries it). With the bounds
    :math:`[F, C]` (``floor``, ``cap``; None: unbounded on that side):

    * ``*_truncate``: :math:`\min(\max(w, F), C)`;
    * ``*_mask``: :math:`w` inside :math:`[F, C]`, 0 outside (the token or trajectory leaves the loss; it
      still counts in its trajectory's token mean, as a weight of 0 does).

    The comparison is in log space, so a sequence weight beyond float range is still bounded exactly.

    Args:
        old_logprobs: ``[B, T]`` the trainer's old-policy log-probs.
        sampler_logprobs: ``[B, T]`` the sampler's log-probs of the same tokens.
        loss_mask: ``[B, T]`` 1 on sampled tokens; elsewhere the weight is 1 and nothing is read.
        correction: one of :data:`SAMPLER_CORRECTIONS`.
        cap: :math:`C > 0`, or None.
        floor: :math:`F > 0`, or None.
        trajectory_ids: ``[B]`` rows with one label are segments of one trajectory (``sequence_*``: one
            weight over all of them); None: every row is a trajectory.
    """
    if correction not in SAMPLER_CORRECTIONS:
        raise ValueError(f"correction must be one of {', '.join(SAMPLER_CORRECTIONS)}; got {correction!r}")
    for name, bound in (("cap", cap), ("floor", floor)):
        if bound is not None and bound <= 0:
            raise ValueError(f"the importance weight {name} must be > 0, got {bound}")
    sampled = loss_mask.bool()
    log_weight = torch.where(sampled, old_logprobs.detach().float() - sampler_logprobs.detach().float(), 0.0)
    if correction.startswith("sequence"):
        rows, num = trajectory_of_rows(log_weight.shape[0], trajectory_ids, log_weight.device)
        sums = log_weight.new_zeros(num).index_add(0, rows, log_weight.sum(dim=1))
        log_weight = torch.where(sampled, sums[rows][:, None], 0.0)
    above = sampled & (log_weight > math.log(cap)) if cap is not None else torch.zeros_like(sampled)
    below = sampled & (log_weight < math.log(floor)) if floor is not None else torch.zeros_like(sampled)
    outside = above | below
    weights = torch.exp(log_weight)
    if correction.endswith("mask"):
        return SamplerWeights(torch.where(outside, 0.0, weights), torch.zeros_like(sampled), outside)
    if floor is not None:
        weights = torch.where(below, floor, weights)
    if cap is not None:
        weights = torch.where(above, cap, weights)
    return SamplerWeights(weights, outside, torch.zeros_like(sampled))


def sampler_mismatch_sums(
    old_logprobs: Tensor, sampler_logprobs: Tensor, loss_mask: Tensor, trajectory_ids: Tensor | None = None
) -> dict[str, float]:
    r"""Sums over a batch's sampled tokens and trajectories that estimate how far the sampler is from the
    trainer's old policy (sums, so batches and processes add up; divide by ``tokens`` or ``trajectories``).

    With :math:`\ell_t = \log\pi_{old}(y_t) - \log\pi_{sampler}(y_t)` and the tokens sampled from the
    sampler, :math:`w_t = e^{\ell_t}` has expectation 1, and per token

    * ``kl``: :math:`w_t - 1 - \ell_t \ge 0`, the k3 estimate of :math:`KL(\pi_{sampler} \| \pi_{old})`;
    * ``chi2_token``: :math:`w_t^2 - 1`, the estimate of the chi-square divergence
      :math:`\chi^2(\pi_{old} \| \pi_{sampler}) = E_{sampler}[w^2] - 1` per token;

    and per trajectory, :math:`W_i = \exp\sum_{t \in T_i} \ell_t` (the sequence weight):

    * ``chi2_sequence``: :math:`W_i^2 - 1` (float64; infinite where :math:`W_i^2` is beyond float64);

    and the counts ``tokens`` and ``trajectories`` (those with a sampled token). ``trajectory_ids`` as in
    :func:`sampler_importance_weights`.
    """
    sampled = loss_mask.bool()
    log_weight = torch.where(sampled, old_logprobs.detach().double() - sampler_logprobs.detach().double(), 0.0)
    weight = torch.exp(log_weight)
    rows, num = trajectory_of_rows(log_weight.shape[0], trajectory_ids, log_weight.device)
    sums = log_weight.new_zeros(num).index_add(0, rows, log_weight.sum(dim=1))
    has_tokens = log_weight.new_zeros(num).index_add(0, rows, sampled.sum(dim=1).double()) > 0
    return {
        "tokens": float(sampled.sum()),
        "kl": float(torch.where(sampled, weight - 1.0 - log_weight, 0.0).sum()),
        "chi2_token": float(torch.where(sampled, weight**2 - 1.0, 0.0).sum()),
        "trajectories": float(has_tokens.sum()),
        "chi2_sequence": float((torch.exp(2 * sums[has_tokens]) - 1.0).sum()),
    }
