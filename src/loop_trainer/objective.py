"""The LOOP objective (Chen et al. 2025, arXiv 2502.01600), in pure torch.

Six functions, each checkable line by line against the paper:

* :func:`leave_one_out_advantages` -- one scalar advantage per rollout, from its task group.
* :func:`group_mean_advantages` -- GRPO's advantage (reward minus the group mean, optionally over
  the group's standard deviation), for the paper's ablations.
* :func:`advantages_for` -- one of the two above, by name (``advantage_estimator``).
* :func:`advantage_keep_mask` -- drop rollouts whose advantage is (almost) zero.
* :func:`loop_policy_loss` -- the clipped PPO surrogate (importance ratio per token, as LOOP, or
  per turn / per trajectory for the ablations, or GSPO's geometric mean per trajectory), token-mean
  per trajectory, summed over
  trajectories and divided by a constant (the nominal minibatch size).
* :func:`reference_kl_penalty` -- a KL penalty to a reference policy, aggregated like the loss
  (not LOOP's: GRPO's ``beta > 0``).

Nothing here knows about models, tokenizers or TRL.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "MAX_LOG_RATIO",
    "RATIO_LEVELS",
    "STD_EPS",
    "PolicyLossOutput",
    "RatioLevel",
    "advantage_keep_mask",
    "advantages_for",
    "group_mean_advantages",
    "leave_one_out_advantages",
    "loop_policy_loss",
    "reference_kl_penalty",
]

RatioLevel = Literal["token", "turn", "trajectory", "sequence"]
RATIO_LEVELS: tuple[str, ...] = ("token", "turn", "trajectory", "sequence")

MAX_LOG_RATIO = 20.0
"""Overflow guard of the per-turn, per-trajectory and per-sequence ratios: their summed log-ratio is clamped to
``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` before ``exp`` (ratios within ``[2e-9, 4.9e8]``). See
:func:`loop_policy_loss`."""

STD_EPS = 1e-4
"""Added to a group's reward standard deviation by the ``std_normalize`` ablations of both
advantage estimators: TRL's ``GRPOTrainer`` constant (``advantages / (std + 1e-4)``). LOOP itself
does not divide by the standard deviation."""


def _group_index(group_ids: Tensor | Sequence[Hashable], device: torch.device) -> Tensor:
    if isinstance(group_ids, Tensor):
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long, device=device)


def _group_sums(rewards: Tensor, group_ids: Tensor | Sequence[Hashable]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Float32 rewards, each reward's group index, and every group's reward sum and size."""
    rewards = rewards.detach().to(torch.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    group = _group_index(group_ids, rewards.device)
    if group.shape != rewards.shape:
        raise ValueError(f"group_ids has {group.numel()} entries for {rewards.numel()} rewards")
    num_groups = int(group.max()) + 1 if group.numel() else 0
    group_sum = torch.zeros(num_groups, device=rewards.device).index_add_(0, group, rewards)
    group_size = torch.zeros(num_groups, device=rewards.device).index_add_(0, group, torch.ones_like(rewards))
    return rewards, group, group_sum, group_size


def leave_one_out_advantages(
    rewards: Tensor, group_ids: Tensor | Sequence[Hashable], *, std_normalize: bool = False, std_eps: float = STD_EPS
) -> Tensor:
    r"""Leave-one-out advantage of every rollout within its task group.

    For rollout :math:`i` in a group :math:`g` of :math:`n_g` finished rollouts:

    .. math::  A_i = r_i - \frac{1}{n_g - 1} \sum_{j \in g, j \ne i} r_j
                   = \frac{n_g}{n_g - 1} \bigl(r_i - \bar r_g\bigr)

    A group of one rollout gets :math:`A_i = 0` (there is no baseline to compare with). Groups may
    differ in size (failed or cancelled rollouts shrink their group).

    LOOP does *not* divide by the group's standard deviation (the paper's ablation: it hurts).
    ``std_normalize=True`` exists for that ablation only: it divides each advantage by the
    sample (unbiased) standard deviation of its group's rewards plus ``std_eps`` (:data:`STD_EPS`).

    Args:
        rewards: ``[N]`` rewards, one per rollout.
        group_ids: ``[N]`` group labels (a tensor or any hashables, e.g. task ids).

    Returns:
        ``[N]`` float32 advantages.
    """
    rewards, group, group_sum, group_size = _group_sums(rewards, group_ids)
    n = group_size[group]
    mean_of_others = (group_sum[group] - rewards) / (n - 1).clamp(min=1)
    advantages = torch.where(n > 1, rewards - mean_of_others, torch.zeros_like(rewards))
    if std_normalize:
        group_mean = group_sum / group_size
        squared_dev = (rewards - group_mean[group]) ** 2
        group_var = torch.zeros_like(group_sum).index_add_(0, group, squared_dev)
        group_std = (group_var / (group_size - 1).clamp(min=1)).sqrt()
        advantages = advantages / (group_std[group] + std_eps)
    return advantages


def group_mean_advantages(
    rewards: Tensor, group_ids: Tensor | Sequence[Hashable], std_normalize: bool = False, *, std_eps: float = STD_EPS
) -> Tensor:
    r"""GRPO's group-mean advantage of every rollout (Shao et al. 2024), for the paper's ablations.

    For rollout :math:`i` in a group :math:`g` of :math:`n_g` finished rollouts:

    .. math::  A_i = r_i - \bar r_g, \qquad \bar r_g = \frac{1}{n_g} \sum_{j \in g} r_j

    (the mean includes :math:`r_i` itself, unlike :func:`leave_one_out_advantages`, whose
    advantages are these times :math:`n_g / (n_g - 1)`). With ``std_normalize=True``:

    .. math::  A_i = \frac{r_i - \bar r_g}{s_g + \epsilon_{std}}, \qquad
               s_g = \sqrt{\frac{1}{n_g - 1} \sum_{j \in g} (r_j - \bar r_g)^2}

    the sample (unbiased) standard deviation, and :math:`\epsilon_{std}` = ``std_eps``, by
    default :data:`STD_EPS` = 1e-4, TRL's ``GRPOTrainer`` constant. A group of one rollout gets
    :math:`A_i = 0` (it is its own mean; its :math:`s_g` is taken as 0, where TRL would get NaN).
    A group whose rewards are all equal gets 0 (up to float rounding) with or without
    normalisation.

    Args:
        rewards: ``[N]`` rewards, one per rollout.
        group_ids: ``[N]`` group labels (a tensor or any hashables, e.g. task ids).
        std_normalize: divide by the group's standard deviation plus ``std_eps``.
        std_eps: added to the standard deviation.

    Returns:
        ``[N]`` float32 advantages.
    """
    rewards, group, group_sum, group_size = _group_sums(rewards, group_ids)
    group_mean = group_sum / group_size.clamp(min=1)
    advantages = rewards - group_mean[group]
    if std_normalize:
        group_var = torch.zeros_like(group_sum).index_add_(0, group, advantages**2)
        group_std = (group_var / (group_size - 1).clamp(min=1)).sqrt()
        advantages = advantages / (group_std[group] + std_eps)
    return advantages


ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("leave_one_out", "group_mean")


def advantages_for(
    estimator: str, rewards: Tensor, group_ids: Tensor | Sequence[Hashable], std_normalize: bool = False
) -> Tensor:
    """The advantages of ``estimator``: LOOP's ``"leave_one_out"`` (the paper's) or GRPO's
    ``"group_mean"``, each optionally divided by its group's reward std."""
    if estimator == "leave_one_out":
        return leave_one_out_advantages(rewards, group_ids, std_normalize=std_normalize)
    if estimator == "group_mean":
        return group_mean_advantages(rewards, group_ids, std_normalize=std_normalize)
    raise ValueError(f"advantage_estimator must be one of {', '.join(ADVANTAGE_ESTIMATORS)}, got {estimator!r}")


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
    """Fraction of sampled tokens whose objective took the clipped branch (zero gradient); with a
    per-turn or per-trajectory ratio a token took it when its turn (trajectory) did."""
    kl: Tensor
    """k1 estimate of KL(old || new): mean over sampled tokens of ``old_logp - logp`` (per token
    whatever the ratio level)."""
    ratio_mean: Tensor
    """Mean over sampled tokens of the ratio each token's objective used: its own, its turn's or
    its trajectory's (token-weighted; per turn or trajectory as clamped by ``MAX_LOG_RATIO``)."""
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
    ratio_level: RatioLevel = "token",
    turn_ids: Tensor | None = None,
    epsilon_high: float | None = None,
    token_weights: Tensor | None = None,
    trajectory_ids: Tensor | None = None,
) -> PolicyLossOutput:
    r"""LOOP's clipped PPO loss for a batch of trajectories.

    For trajectory :math:`i` with advantage :math:`A_i` and sampled tokens :math:`t \in T_i`
    (``loss_mask == 1``), each token :math:`t` in a ratio group :math:`k(t) \subseteq T_i`:

    .. math::
        \rho_{i,t} = \exp\Bigl(\sum_{u \in k(t)} \log\pi_\theta(y_u) - \log\pi_{old}(y_u)\Bigr) \\
        o_{i,t} = \min\bigl(\rho_{i,t} A_i,\
                  \mathrm{clip}(\rho_{i,t}, \tfrac{1}{1+\epsilon}, 1+\epsilon_{high}) A_i\bigr) \\
        L = -\frac{1}{D} \sum_i \frac{1}{|T_i|} \sum_{t \in T_i} w_{i,t}\, o_{i,t}

    The group is the **ratio level** (the paper's Table 1 ablations): ``"token"`` (LOOP) is the
    token alone, :math:`k(t) = \{t\}`, so :math:`\rho_{i,t} = \pi_\theta(y_t) / \pi_{old}(y_t)`;
    ``"turn"`` is the token's assistant turn (the sampled tokens of its row with its ``turn_ids``
    label), so every token of a turn carries the turn's ratio and a turn weighs by its number of
    sampled tokens; ``"trajectory"`` is all of :math:`T_i` (``turn_ids`` not needed). A trajectory
    cut to the training budget has the ratio of the part kept.

    ``"sequence"`` is GSPO's ratio (Zheng et al. 2025, arXiv 2507.18071; TRL's
    ``importance_sampling_level: sequence``): the *geometric mean* of the token ratios of :math:`T_i`,

    .. math::  \rho_{i,t} = \exp\Bigl(\frac{1}{|T_i|} \sum_{u \in T_i}
               \log\pi_\theta(y_u) - \log\pi_{old}(y_u)\Bigr),

    one ratio per trajectory that does not grow with its length, clipped as every level is. Every
    token of :math:`T_i` carries it, so the token mean is GSPO's per-sequence objective
    :math:`\min(\rho_i A_i, \mathrm{clip}(\rho_i) A_i)` and each sampled token's log-prob gets the
    gradient :math:`\rho_i A_i / |T_i|` (unclipped). GSPO clips far tighter than PPO (its paper:
    :math:`3 \cdot 10^{-4}` below, :math:`4 \cdot 10^{-4}` above): set ``epsilon`` (and
    ``epsilon_high``) to match.

    The clip range is symmetric in log space (``[1/1.1, 1.1]`` for the paper's
    :math:`\epsilon = 0.1`): :math:`\epsilon_{high} = \epsilon` unless ``epsilon_high`` is given
    (DAPO's *clip-higher*, Yu et al. 2025, arXiv 2503.14476: a larger upper bound lets a token the
    old policy found unlikely gain more probability in one step, which keeps the policy from
    collapsing onto the choices it already prefers; the lower bound stays LOOP's). :math:`w_{i,t}`
    is 1 unless ``token_weights`` is given (the truncated importance weights toward the sampler,
    :func:`loop_trainer.stabilisers.truncated_importance_weights`; held fixed, no gradient).

    A trajectory may span several rows (``trajectory_ids``): the segments of an episode whose
    context policy rewrote its history, each row exactly the context the sampler saw. Then
    :math:`T_i` is the sampled tokens of all its rows: one token mean across the segments, and
    (``"trajectory"``, ``"sequence"``) one ratio over all of them; each turn is within one row.

    :math:`D` is a *constant* divisor, the nominal minibatch size (paper: 32), so a short minibatch
    or a trajectory split across gradient-accumulation micro-batches is weighted exactly as in a
    full one. It defaults to the batch size.

    Arithmetic is in float32 (float64 if the inputs are float64). A turn or trajectory sum (or a
    sequence mean) :math:`S` is clamped to :math:`[-S_{max}, S_{max}]`, :data:`MAX_LOG_RATIO` = 20, before
    ``exp``: a long turn's sum may be far outside float32's ``exp`` range. Since
    :math:`S_{max} > \log(1+\epsilon)`, the clipped branch and every choice the ``min`` makes
    are unchanged; only where :math:`|S| > S_{max}` does the unclipped branch see
    :math:`e^{\pm S_{max}}` with zero gradient (there: :math:`S > S_{max}` with :math:`A < 0`,
    whose true gradient would be astronomically large, and :math:`S < -S_{max}` with
    :math:`A > 0`, whose true gradient is below :math:`2 \cdot 10^{-9} A`). A single token's
    log-ratio (the ``"token"`` level) is not clamped. Positions with ``loss_mask == 0`` are never
    read (padding may hold anything, ``inf`` and ``nan`` included).

    **Statistics** (:class:`PolicyLossOutput`, float32) are over sampled tokens, each carrying
    the ratio its level uses: ``clip_frac`` is the fraction of sampled tokens whose objective took
    the clipped branch, ``ratio_mean/min/max`` are over the per-token ratios (token-weighted;
    as guarded by the clamp), and ``kl`` is the per-token k1 estimate at every level (so a KL
    threshold means the same whatever the level).

    Args:
        logprobs: ``[B, T]`` log-probs of the tokens under the policy being trained (with grad).
        old_logprobs: ``[B, T]`` log-probs of the same tokens under the policy that is held fixed
            for this iteration.
        advantages: ``[B]`` one advantage per trajectory.
        loss_mask: ``[B, T]`` 1 on tokens the policy sampled, 0 elsewhere (prompt, environment
            messages, padding).
        epsilon: clip parameter.
        divisor: constant :math:`D`.
        ratio_level: ``"token"`` (LOOP), ``"turn"``, ``"trajectory"`` or ``"sequence"`` (GSPO).
        turn_ids: ``[B, T]`` integer turn index of every token, read only where ``loss_mask`` is 1
            (any non-negative labels; tokens of one row with the same label form one turn).
            Required for ``"turn"``, ignored otherwise.
        epsilon_high: the upper clip bound is ``1 + epsilon_high`` (default: ``epsilon``).
        token_weights: ``[B, T]`` non-negative weight of every token's objective, read only where
            ``loss_mask`` is 1 (detached). None: every weight is 1.
        trajectory_ids: ``[B]`` integer label of each row's trajectory: rows with one label are
            segments of one trajectory, and all of them must be in this batch. None: every row is a
            whole trajectory.
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {', '.join(RATIO_LEVELS)}; got {ratio_level!r}")
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape or logprobs.ndim != 2:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must have the same [B, T] shape"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must have shape ({logprobs.shape[0]},), got {tuple(advantages.shape)}")
    if token_weights is not None and token_weights.shape != logprobs.shape:
        raise ValueError(f"token_weights {tuple(token_weights.shape)} must have the shape of logprobs")
    if trajectory_ids is not None and trajectory_ids.shape != advantages.shape:
        raise ValueError(f"trajectory_ids must have shape ({logprobs.shape[0]},), got {tuple(trajectory_ids.shape)}")
    upper = 1.0 + (epsilon if epsilon_high is None else epsilon_high)
    if upper < 1.0:
        raise ValueError(f"epsilon_high must be >= 0, got {epsilon_high}")
    divisor = float(logprobs.shape[0] if divisor is None else divisor)
    # The ratio is exp of a small difference of large numbers: float32 at least, whatever the model
    # dtype (float64 stays float64: gradcheck).
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    sampled = loss_mask.bool()
    mask = loss_mask.to(dtype)

    # Per token log pi_theta - log pi_old; 0 where not sampled, so padding never reaches the loss.
    log_ratio = torch.where(sampled, logprobs.to(dtype) - old_logprobs.detach().to(dtype), 0.0)
    trajectory = None if trajectory_ids is None else _group_index(trajectory_ids, logprobs.device)
    ratio = torch.exp(_grouped_log_ratio(log_ratio, sampled, ratio_level, turn_ids, trajectory))
    adv = advantages.detach().to(dtype)[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 / (1.0 + epsilon), upper) * adv
    objective = torch.minimum(unclipped, clipped)
    if token_weights is not None:
        objective = objective * torch.where(sampled, token_weights.detach().to(dtype), 0.0)

    loss = -_trajectory_means(objective * mask, mask, trajectory).sum() / divisor

    with torch.no_grad():
        num_tokens = mask.sum()
        denom = num_tokens.clamp(min=1)
        took_clipped = (clipped < unclipped).to(mask.dtype) * mask
        selected = ratio[sampled]
        empty = selected.numel() == 0
        stats = {
            "clip_frac": took_clipped.sum() / denom,
            "kl": (-log_ratio * mask).sum() / denom,
            "ratio_mean": (ratio * mask).sum() / denom,
            "ratio_min": selected.min() if not empty else ratio.new_tensor(1.0),
            "ratio_max": selected.max() if not empty else ratio.new_tensor(1.0),
            "num_tokens": num_tokens,
        }
    return PolicyLossOutput(loss=loss, **{name: value.to(torch.float32) for name, value in stats.items()})


def _trajectory_means(values: Tensor, mask: Tensor, trajectory: Tensor | None) -> Tensor:
    """Each trajectory's sum of ``values`` (``[B, T]``, 0 where not sampled) over its sampled tokens
    (``mask``): per row, or, with ``trajectory`` (each row's trajectory index, 0..n-1), over all the
    rows of a trajectory."""
    sums, counts = values.sum(dim=1), mask.sum(dim=1)
    if trajectory is not None:
        num = int(trajectory.max()) + 1 if trajectory.numel() else 0
        sums = sums.new_zeros(num).index_add(0, trajectory, sums)
        counts = counts.new_zeros(num).index_add(0, trajectory, counts)
    return sums / counts.clamp(min=1)


def _grouped_log_ratio(
    log_ratio: Tensor, sampled: Tensor, ratio_level: str, turn_ids: Tensor | None, trajectory: Tensor | None = None
) -> Tensor:
    """``[B, T]``: every sampled token's log-ratio of its ratio group (see :func:`loop_policy_loss`):
    its own (``"token"``), the sum over its turn or over its trajectory, or the mean over its
    trajectory (``"sequence"``) (clamped to ``MAX_LOG_RATIO``); 0 where not sampled. ``log_ratio``
    is 0 where not sampled. ``trajectory``:
    each row's trajectory index when a trajectory spans rows (None: each row is one)."""
    if ratio_level == "token":
        return log_ratio
    batch_size = log_ratio.shape[0]
    if ratio_level in ("trajectory", "sequence"):
        turn = torch.zeros_like(sampled, dtype=torch.long)
    else:
        if turn_ids is None:
            raise ValueError('ratio_level="turn" needs turn_ids ([B, T] turn index of every sampled token)')
        if turn_ids.shape != sampled.shape:
            raise ValueError(
                f"turn_ids {tuple(turn_ids.shape)} must have the shape of loss_mask {tuple(sampled.shape)}"
            )
        turn = turn_ids.to(device=log_ratio.device, dtype=torch.long)
        if bool((turn[sampled] < 0).any()):
            raise ValueError("turn_ids must be >= 0 on every sampled token (loss_mask == 1)")
    width = int(turn[sampled].max()) + 1 if bool(sampled.any()) else 1
    rows = torch.arange(batch_size, device=log_ratio.device) if trajectory is None else trajectory
    row = rows[:, None]
    # One group per (trajectory, turn) label; every token not sampled in one more (log-ratio 0).
    _, group = torch.unique(torch.where(sampled, row * width + turn, -1), return_inverse=True)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    sums = log_ratio.new_zeros(num_groups).index_add(0, group.flatten(), log_ratio.flatten())
    if ratio_level == "sequence":  # GSPO: the mean log-ratio over the trajectory's sampled tokens
        counts = log_ratio.new_zeros(num_groups).index_add(0, group.flatten(), sampled.flatten().to(log_ratio.dtype))
        sums = sums / counts.clamp(min=1)
    # Overflow guard (see MAX_LOG_RATIO): exact wherever |S| <= MAX_LOG_RATIO, finite everywhere.
    return torch.where(sampled, sums[group], 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def reference_kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    divisor: float | None = None,
    trajectory_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""The KL penalty to a reference policy, aggregated like :func:`loop_policy_loss`.

    Per sampled token, the k3 estimator TRL's GRPO uses,

    .. math::
        k3_{i,t} = e^{\log\pi_{ref} - \log\pi_\theta} - (\log\pi_{ref} - \log\pi_\theta) - 1 \ge 0,

    then the token mean within each trajectory, the sum over trajectories and the constant divisor.
    Since the token mean is linear, ``loss + beta * penalty`` equals adding ``beta * k3`` to every
    token's objective before the token mean (across a trajectory's rows, with ``trajectory_ids``, as
    :func:`loop_policy_loss`). Returns ``(penalty, mean k3 over sampled tokens)``.
    """
    mask = loss_mask.to(torch.float32)
    divisor = float(logprobs.shape[0] if divisor is None else divisor)
    # Masked positions get difference 0 (k3 = 0) so padding can never produce inf * 0 = nan.
    diff = torch.where(mask.bool(), ref_logprobs.detach().float() - logprobs.float(), 0.0)
    k3 = torch.exp(diff) - diff - 1.0
    trajectory = None if trajectory_ids is None else _group_index(trajectory_ids, logprobs.device)
    per_trajectory = _trajectory_means(k3 * mask, mask, trajectory)
    with torch.no_grad():
        mean = (k3 * mask).sum() / mask.sum().clamp(min=1)
    return per_trajectory.sum() / divisor, mean
