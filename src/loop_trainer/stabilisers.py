"""What LOOP can add when learning is fragile, in pure torch: each off by default (LOOP as the paper).

* :func:`tied_groups` -- which task groups got the same reward on every rollout. Their
  leave-one-out advantages are all 0, so they teach nothing: the fraction of tied groups is the signal
  that learning has stalled, and dynamic sampling (DAPO, Yu et al. 2025, arXiv 2503.14476, "dynamic
  sampling"; ``dynamic_sampling_rounds``) collects more tasks until enough groups are not tied.
* :func:`select_informative_groups` -- the first ``wanted`` groups that are not tied, in collection order:
  what an iteration with dynamic sampling trains on.
* :func:`truncated_importance_weights` -- per token, ``min(pi_old / pi_sampler, cap)``: the correction
  for the gap between the policy that sampled a trajectory (vLLM, bf16, another process) and the
  trainer's old policy, truncated so one token the sampler found unlikely cannot dominate (truncated
  importance sampling, Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
  training"; TRL's ``vllm_importance_sampling_correction``; ``sampler_importance_cap``).

The third stabiliser, an upper clip bound larger than the lower one (DAPO's clip-higher,
``epsilon_high``), is a parameter of :func:`loop_trainer.objective.loop_policy_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

__all__ = ["TIE_TOLERANCE", "select_informative_groups", "tied_groups", "truncated_importance_weights"]

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
    r"""Per token :math:`w_t = \min\bigl(\exp(\log\pi_{old}(y_t) - \log\pi_{sampler}(y_t)),\ C\bigr)`.

    Args:
        old_logprobs: ``[B, T]`` the trainer's old-policy log-probs (the ratio's denominator).
        sampler_logprobs: ``[B, T]`` the sampler's log-probs of the same tokens.
        loss_mask: ``[B, T]`` 1 on sampled tokens; elsewhere the weight is 1 and nothing is read.
        cap: :math:`C > 0`.

    Returns:
        ``([B, T]`` float32 weights, detached; the fraction of sampled tokens whose weight was capped
        (a scalar; 0 when nothing is sampled)).
    """
    if cap <= 0:
        raise ValueError(f"the importance weight cap must be > 0, got {cap}")
    sampled = loss_mask.bool()
    log_weight = torch.where(sampled, old_logprobs.detach().float() - sampler_logprobs.detach().float(), 0.0)
    capped = sampled & (log_weight > math.log(cap))
    weights = torch.where(capped, cap, torch.exp(log_weight))
    count = sampled.sum()
    fraction = capped.sum().float() / count.clamp(min=1).float()
    return weights, fraction
