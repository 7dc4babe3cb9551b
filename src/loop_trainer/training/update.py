"""The policy update of one LOOP iteration: old log-probs, then shuffled minibatches, one optimizer
step each, with the guards that keep a bad step from reaching the weights.

    fixed log-probs <- current policy on the kept trajectories (no grad, eval mode): the old
                       policy's, and the reference policy's when beta > 0 (FixedLogprobs)
    for epoch in ppo_epochs:   shuffle all trajectories (across tasks), cut into minibatches
        for minibatch:         accumulate loop_policy_loss (+ beta * reference_kl_penalty) over
                               micro-batches, then
                               skip (non-finite loss or gradient)  |  abort the iteration (|KL| too large)
                               |  clip and step

The LOOP math is :func:`loop_trainer.objective.loop_policy_loss`; how passes and gradients are
shared between processes is :class:`~loop_trainer.training.distribution.DistributionStrategy`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..objective import RatioLevel, loop_policy_loss, reference_kl_penalty
from ..rollout.records import stream_seed
from ..stabilisers import (
    SamplerCorrection,
    SamplerWeights,
    sampler_importance_weights,
    sampler_mismatch_sums,
    trajectory_of_rows,
)
from .adapter_casts import adapter_input_casts_off
from .batching import TrainingSample, chunks, collate, minibatch_indices, trajectory_rows, whole_chunks
from .distribution import DistributionStrategy
from .logprobs import token_logprobs, token_logprobs_and_entropy
from .reference import ReferencePolicy

logger = logging.getLogger(__name__)


STALE_IMPORTANCE_CAP = 2.0
"""The cap of the behaviour-policy weights when ``max_staleness`` > 0 and ``sampler_importance_cap`` is unset."""


def importance_cap(sampler_importance_cap: float | None, max_staleness: int) -> float | None:
    """The cap :func:`~loop_trainer.stabilisers.sampler_importance_weights` uses, or None.

    With ``max_staleness`` > 0 the rollouts of iteration i were sampled by policy i-1 (the behaviour
    policy) and are trained at iteration i, whose policy before the update (pi_old, the trainer's
    log-probs) is the clip's proximal policy: decoupled PPO (Hilton et al. 2021, arXiv 2110.00641).
    Each token's objective is then weighted by min(pi_old / pi_behaviour, C), always, with C =
    ``sampler_importance_cap`` or :data:`STALE_IMPORTANCE_CAP` (or bounded as ``sampler_correction`` says)."""
    if max_staleness > 0 and sampler_importance_cap is None:
        return STALE_IMPORTANCE_CAP
    return sampler_importance_cap


@dataclass(frozen=True)
class FixedLogprobs:
    """Per-sample token log-probs held fixed through one iteration's update, keyed by sample index
    (the samples this process trains): the old policy's (the ratio's denominator) and, when
    ``beta > 0``, the reference policy's (the KL penalty's); each ``[len(token_ids)]`` on the CPU."""

    old: dict[int, torch.Tensor]
    reference: dict[int, torch.Tensor] | None = None


@dataclass(frozen=True)
class UpdateSettings:
    epsilon: float
    minibatch_size: int
    ppo_epochs: int
    micro_batch_size: int
    kl_abort_threshold: float
    seed: int
    pad_token_id: int
    ratio_level: RatioLevel = "token"
    beta: float = 0.0
    epsilon_high: float | None = None
    """Upper clip bound 1 + epsilon_high (clip-higher); None: LOOP's 1 + epsilon."""
    sampler_importance_cap: float | None = None
    """The upper bound of the weights pi_old / pi_sampler; with ``sampler_importance_floor`` None too: no
    correction (LOOP)."""
    sampler_importance_floor: float | None = None
    """The lower bound of the weights toward the sampler; None: none."""
    group_by_length: bool = False
    """Cut each minibatch (and the fixed log-probs' passes) into micro-batches of trajectories sorted longest
    first, so a micro-batch pads to a length near its own trajectories' (``train_sampling_strategy``). The
    gradient is the same sum of trajectory losses, accumulated in another order."""
    sampler_correction: SamplerCorrection = "token_truncate"
    """How the bounds apply (:func:`~loop_trainer.stabilisers.sampler_importance_weights`): per token or per
    trajectory, truncated or masked."""

    @property
    def corrects_sampler(self) -> bool:
        """Whether each token's objective is weighted toward the sampler (a bound is set)."""
        return self.sampler_importance_cap is not None or self.sampler_importance_floor is not None


@dataclass
class StepResult:
    """One minibatch's accumulated loss statistics, over all processes."""

    loss: float
    clip_frac: float
    kl: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    num_tokens: float
    grad_norm: float = math.nan
    stepped: bool = False
    kl_ref: float = math.nan
    """Mean k3 estimate of KL(policy || reference) over the minibatch's sampled tokens (beta > 0)."""
    kl_exceeded: bool = False
    """|kl| was over ``kl_abort_threshold``: gradients discarded, the iteration's updates end here."""
    capped_fraction: float = math.nan
    """Fraction of sampled tokens whose importance weight toward the sampler was truncated to a bound (their
    own or their trajectory's; with a ``*_truncate`` correction)."""


class PolicyUpdate:
    """Runs :meth:`__call__` once per iteration on the kept trajectories."""

    def __init__(
        self,
        settings: UpdateSettings,
        strategy: DistributionStrategy,
        autocast: Callable[[], contextlib.AbstractContextManager],
        reference: ReferencePolicy | None = None,
        activation_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        """``reference``: the KL penalty's reference policy (:mod:`.reference`: the base model with the LoRA
        adapter disabled, or a frozen copy of the starting weights); needed when ``settings.beta > 0``.
        ``activation_context``: the context of every forward whose backward follows (the minibatch
        steps'; ``activation_offloading``: TRL's offloader of the tensors saved for the backward)."""
        if settings.beta > 0 and reference is None:
            raise ValueError("beta > 0 needs a reference policy (loop_trainer.training.reference)")
        self.settings = settings
        self.strategy = strategy
        self.autocast = autocast
        self.reference = reference
        self.activation_context = activation_context

    def __call__(self, samples: list[TrainingSample], iteration: int) -> dict[str, float]:
        """``ppo_epochs`` passes of shuffled minibatches over ``samples``; ``iteration`` (0-based,
        the one being trained) seeds the shuffles."""
        with adapter_input_casts_off(self.strategy.model, self.autocast):
            return self._update(samples, iteration)

    def _update(self, samples: list[TrainingSample], iteration: int) -> dict[str, float]:
        s = self.settings
        generator = torch.Generator().manual_seed(stream_seed(s.seed, iteration))
        # Minibatches of trajectories (minibatch_size counts them), each expanded to its samples: a
        # trajectory a context policy split trains all its segments in one step.
        rows = trajectory_rows(samples)
        epochs = [
            [
                [i for t in minibatch for i in rows[t]]
                for minibatch in minibatch_indices(len(rows), s.minibatch_size, generator)
            ]
            for _ in range(s.ppo_epochs)
        ]
        schedule = [minibatch for epoch in epochs for minibatch in epoch]
        mine = sorted(
            {i for minibatch in schedule for group in self._my_trajectories(samples, minibatch)[1] for i in group}
        )
        # Each sample is in exactly one process's share of the first epoch: that process counts it
        # in the sampler comparison, so the combined metric counts every sample once.
        counted = {
            i for minibatch in epochs[0] for group in self._my_trajectories(samples, minibatch)[1] for i in group
        }
        fixed, sampler_diff = self.fixed_logprobs(samples, mine, counted)
        steps: list[StepResult] = []
        skipped_nonfinite = 0
        aborted_on_kl = False
        for minibatch in schedule:
            step = self.minibatch_step(samples, fixed, minibatch)
            if step is None:
                skipped_nonfinite += 1
                logger.warning("iteration %d: non-finite loss or gradient norm, optimizer step skipped", iteration + 1)
                continue
            steps.append(step)
            if step.kl_exceeded:
                logger.warning(
                    "iteration %d: KL estimate %.3g exceeds %.3g; step skipped, remaining updates aborted",
                    iteration + 1,
                    step.kl,
                    s.kl_abort_threshold,
                )
                aborted_on_kl = True
                break
        return {
            **summarize_steps(steps),
            "skipped_nonfinite_steps": skipped_nonfinite,
            "aborted_on_kl": int(aborted_on_kl),
            **sampler_diff,
        }

    @torch.no_grad()
    def fixed_logprobs(
        self, samples: list[TrainingSample], indices: list[int] | None = None, counted: set[int] | None = None
    ) -> tuple[FixedLogprobs, dict[str, float]]:
        """Log-probs of ``samples[i]`` for ``i`` in ``indices`` (default: all) under the current
        policy, in eval mode (and, when ``beta > 0``, under the reference policy), and two metrics
        over the sampled tokens of ``counted`` (default: all of ``indices``), combined over processes:
        how far the sampler's log-probs were from the current policy's, and the policy's mean entropy.

        LOOP takes its PPO denominator from the trainer, not the sampler; the sampler's log-probs
        are only compared, as a health check of the generation path."""
        indices = list(range(len(samples))) if indices is None else indices
        counted = set(indices) if counted is None else counted
        model, strategy = self.strategy.model, self.strategy
        was_training = model.training
        model.eval()
        old: dict[int, torch.Tensor] = {}
        # beta > 0: the reference policy exists (__init__ refused it missing)
        reference_policy = self.reference if self.settings.beta > 0 else None
        reference: dict[int, torch.Tensor] | None = {} if reference_policy is not None else None
        abs_diff_sum, abs_diff_max, count, entropy_sum, has_entropy = 0.0, 0.0, 0, 0.0, True
        in_passes = self._longest_first(samples, [[i] for i in indices])
        work = list(chunks([i for [i] in in_passes], self.settings.micro_batch_size))
        real = len(work)
        # Stand-in passes (results dropped) where forward passes are collective.
        work += [[indices[0] if indices else 0]] * (strategy.matched_pass_count(real) - real)
        try:
            for k, chunk in enumerate(work):
                batch = collate([samples[i] for i in chunk], self.settings.pad_token_id).to(strategy.device)
                with self.autocast():
                    logprobs, entropy = token_logprobs_and_entropy(model, batch)
                    logprobs = logprobs.float()
                    if reference_policy is not None:
                        reference_logprobs = reference_policy.logprobs(model, batch).float()
                if k >= real:
                    continue
                if reference is not None:
                    for row, i in enumerate(chunk):
                        reference[i] = reference_logprobs[row, : len(samples[i].token_ids)].cpu()
                rows = torch.tensor([i in counted for i in chunk], device=logprobs.device)[:, None]
                counted_tokens = batch.loss_mask.bool() & rows
                diff = (logprobs - batch.sampler_logprobs)[counted_tokens].abs()
                if entropy is None:
                    has_entropy = False
                else:
                    entropy_sum += float(entropy.float()[counted_tokens].sum())
                if diff.numel():
                    abs_diff_sum += float(diff.sum())
                    abs_diff_max = max(abs_diff_max, float(diff.max()))
                    count += diff.numel()
                for row, i in enumerate(chunk):
                    old[i] = logprobs[row, : len(samples[i].token_ids)].cpu()
        finally:
            model.train(was_training)
        total_diff, total_count, total_entropy = strategy.sum([abs_diff_sum, float(count), entropy_sum])
        _, abs_diff_max = strategy.min_max(0.0, abs_diff_max)
        metrics = {
            "sampler_logprob_diff": total_diff / total_count if total_count else float("nan"),
            "sampler_logprob_diff_max": abs_diff_max,
            # over the trained (kept) trajectories' sampled tokens, at the sampling temperature
            "entropy": total_entropy / total_count if total_count and has_entropy else float("nan"),
            **self.sampler_mismatch(samples, old, sorted(counted)),
        }
        return FixedLogprobs(old, reference), metrics

    def sampler_weights(
        self,
        old: torch.Tensor,
        sampler_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
        trajectory_ids: torch.Tensor | None,
    ) -> SamplerWeights:
        """The weights toward the sampler of a ``[B, T]`` batch of whole trajectories, bounded as the settings say."""
        s = self.settings
        return sampler_importance_weights(
            old,
            sampler_logprobs,
            loss_mask,
            correction=s.sampler_correction,
            cap=s.sampler_importance_cap,
            floor=s.sampler_importance_floor,
            trajectory_ids=trajectory_ids,
        )

    def sampler_mismatch(
        self, samples: list[TrainingSample], old: dict[int, torch.Tensor], counted: list[int]
    ) -> dict[str, float]:
        """The iteration's sampler/trainer mismatch over the sampled tokens of ``samples[i]``, ``i`` in ``counted``
        (whole trajectories, each counted by one process), combined over processes: the k3 estimate of
        KL(sampler || old policy) and the chi-square divergence of the token and the trajectory weights
        pi_old / pi_sampler (:func:`~loop_trainer.stabilisers.sampler_mismatch_sums`); with a correction, the
        sampled tokens (and, per trajectory, the trajectories) whose weight was truncated or masked."""
        s = self.settings
        keys = ("tokens", "kl", "chi2_token", "trajectories", "chi2_sequence", "truncated", "masked")
        trajectory_keys = ("truncated_trajectories", "masked_trajectories")
        totals = dict.fromkeys(keys + trajectory_keys, 0.0)
        groups = [[counted[j] for j in group] for group in trajectory_rows([samples[i] for i in counted])]
        for chunk in whole_chunks(groups, max(1, s.micro_batch_size)):
            batch = collate([samples[i] for i in chunk], s.pad_token_id)
            logprobs = _padded(old, chunk, like=batch.sampler_logprobs)
            for key, value in sampler_mismatch_sums(
                logprobs, batch.sampler_logprobs, batch.loss_mask, batch.trajectory_ids
            ).items():
                totals[key] += value
            if s.corrects_sampler:
                bounded = self.sampler_weights(logprobs, batch.sampler_logprobs, batch.loss_mask, batch.trajectory_ids)
                totals["truncated"] += float(bounded.truncated.sum())
                totals["masked"] += float(bounded.masked.sum())
                # a sequence correction treats each trajectory whole: count those it touched
                rows, num = trajectory_of_rows(len(chunk), batch.trajectory_ids)
                for flags, key in ((bounded.truncated, "truncated"), (bounded.masked, "masked")):
                    per_trajectory = torch.zeros(num).index_add(0, rows, flags.any(dim=1).float())
                    totals[f"{key}_trajectories"] += float((per_trajectory > 0).sum())
        totals = dict(zip(totals, self.strategy.sum(list(totals.values())), strict=True))
        tokens, trajectories = totals["tokens"], totals["trajectories"]
        metrics = {
            "sampler_kl": totals["kl"] / tokens if tokens else math.nan,
            "sampler_chi2_token": totals["chi2_token"] / tokens if tokens else math.nan,
            "sampler_chi2_sequence": totals["chi2_sequence"] / trajectories if trajectories else math.nan,
        }
        if s.corrects_sampler:
            outcome = "truncated" if s.sampler_correction.endswith("truncate") else "masked"
            metrics[f"importance_{outcome}_tokens"] = totals[outcome]
            if outcome == "masked":  # the truncated fraction is importance_capped_fraction (the steps')
                metrics["importance_masked_fraction"] = totals["masked"] / tokens if tokens else math.nan
            if s.sampler_correction.startswith("sequence"):
                metrics[f"importance_{outcome}_trajectories"] = totals[f"{outcome}_trajectories"]
        return metrics

    def minibatch_step(
        self, samples: list[TrainingSample], fixed: FixedLogprobs, minibatch: list[int]
    ) -> StepResult | None:
        """Accumulate this process's share of one minibatch, then one optimizer step. Returns None
        if the loss or the gradient norm was not finite (the step is skipped), and a result with
        ``kl_exceeded=True`` (``stepped=False``) if the KL estimate is over the abort threshold
        (gradients discarded; the caller ends the iteration's updates)."""
        s, strategy = self.settings, self.strategy
        fixed_reference = fixed.reference if s.beta > 0 else None
        if s.beta > 0 and fixed_reference is None:
            raise ValueError("beta > 0 needs the reference policy's log-probs (FixedLogprobs.reference)")
        num_trajectories, share = self._my_trajectories(samples, minibatch)
        share = self._longest_first(samples, share)
        micro_batches = [(indices, False) for indices in whole_chunks(share, s.micro_batch_size)]
        needed = strategy.micro_batches_per_step(len(micro_batches), num_trajectories, s.micro_batch_size)
        if num_trajectories < len(minibatch):  # split episodes: shares differ in samples, so agree on the count
            needed = strategy.matched_pass_count(needed)
        # A stand-in is a zero-advantage, zero-mask copy: zero loss, zero gradient, matched collectives.
        micro_batches += [(minibatch[:1], True)] * (needed - len(micro_batches))
        # Each process divides by minibatch_size / world so that averaging gradients across
        # processes yields sum(trajectory losses) / minibatch_size, the paper's constant divisor.
        divisor = s.minibatch_size / strategy.num_processes
        strategy.model.train()
        truncating = s.corrects_sampler and s.sampler_correction.endswith("truncate")
        optional = (("kl_ref",) if s.beta > 0 else ()) + (("capped",) if truncating else ())
        totals = dict.fromkeys(("loss", "clip", "kl", "ratio", "tokens") + optional, 0.0)
        ratio_min, ratio_max = math.inf, -math.inf
        for i, (indices, stand_in) in enumerate(micro_batches):
            batch = collate([samples[j] for j in indices], s.pad_token_id).to(strategy.device)
            old = _padded(fixed.old, indices, like=batch.sampler_logprobs)
            if stand_in:
                batch.advantages.zero_()
                batch.loss_mask.zero_()
            weights = None
            if s.corrects_sampler:
                bounded = self.sampler_weights(old, batch.sampler_logprobs, batch.loss_mask, batch.trajectory_ids)
                weights = bounded.weights
                if truncating:
                    totals["capped"] += float(bounded.truncated.sum())
            with strategy.accumulating(last=i == len(micro_batches) - 1):
                with self.autocast(), self.activation_context():
                    logprobs = token_logprobs(strategy.model, batch)
                out = loop_policy_loss(
                    logprobs,
                    old,
                    batch.advantages,
                    batch.loss_mask,
                    epsilon=s.epsilon,
                    divisor=divisor,
                    ratio_level=s.ratio_level,
                    turn_ids=batch.turn_ids,
                    epsilon_high=s.epsilon_high,
                    token_weights=weights,
                    trajectory_ids=batch.trajectory_ids,
                )
                loss = out.loss
                if fixed_reference is not None:  # beta > 0
                    reference = _padded(fixed_reference, indices, like=batch.sampler_logprobs)
                    penalty, kl_ref = reference_kl_penalty(
                        logprobs, reference, batch.loss_mask, divisor=divisor, trajectory_ids=batch.trajectory_ids
                    )
                    loss = loss + s.beta * penalty
                    totals["kl_ref"] += float(kl_ref) * float(out.num_tokens)
                strategy.backward(loss)
            n = float(out.num_tokens)
            totals["loss"] += float(loss.detach())
            totals["clip"] += float(out.clip_frac) * n
            totals["kl"] += float(out.kl) * n
            totals["ratio"] += float(out.ratio_mean) * n
            totals["tokens"] += n
            if n:
                ratio_min, ratio_max = min(ratio_min, float(out.ratio_min)), max(ratio_max, float(out.ratio_max))
        totals = dict(zip(totals, strategy.sum(list(totals.values())), strict=True))
        ratio_min, ratio_max = strategy.min_max(ratio_min, ratio_max)
        tokens = totals["tokens"] or 1.0
        step = StepResult(
            loss=totals["loss"] / strategy.num_processes,
            clip_frac=totals["clip"] / tokens,
            kl=totals["kl"] / tokens,
            ratio_mean=totals["ratio"] / tokens,
            ratio_min=ratio_min,
            ratio_max=ratio_max,
            num_tokens=totals["tokens"],
            kl_ref=totals["kl_ref"] / tokens if "kl_ref" in totals else math.nan,
            capped_fraction=totals["capped"] / tokens if "capped" in totals else math.nan,
        )
        if not math.isfinite(step.loss):
            strategy.discard_gradients()
            return None
        if abs(step.kl) > s.kl_abort_threshold:  # the only KL-abort check: __call__ reads kl_exceeded
            strategy.discard_gradients()
            step.kl_exceeded = True
            return step
        step.grad_norm, step.stepped = strategy.step()
        return step if step.stepped else None

    def _longest_first(self, samples: list[TrainingSample], groups: list[list[int]]) -> list[list[int]]:
        """``groups`` (each a trajectory's sample indices) as they are, or, with ``group_by_length``, sorted by
        their longest sample, longest first (a stable sort: ties keep the shuffled order)."""
        if not self.settings.group_by_length:
            return groups
        return sorted(groups, key=lambda group: -max(len(samples[i].token_ids) for i in group))

    def _my_trajectories(self, samples: list[TrainingSample], minibatch: list[int]) -> tuple[int, list[list[int]]]:
        """How many trajectories ``minibatch`` (sample indices) holds, and this process's share of them,
        each as its sample indices: the strategy's round-robin share over trajectories, so a split
        episode's segments stay together."""
        groups = trajectory_rows([samples[i] for i in minibatch])
        return len(groups), [[minibatch[j] for j in group] for group in self.strategy.share(groups)]


def _padded(per_sample: dict[int, torch.Tensor], indices: list[int], like: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like the ``[B, T]`` tensor ``like``, row ``r`` starting with
    ``per_sample[indices[r]]`` (rows of samples not in ``per_sample`` stay zero)."""
    out = torch.zeros_like(like)
    for row, i in enumerate(indices):
        if i in per_sample:
            out[row, : per_sample[i].numel()] = per_sample[i]
    return out


def summarize_steps(steps: list[StepResult]) -> dict[str, float]:
    """An iteration's update metrics: token-weighted ratio statistics over every accumulated
    minibatch, loss and gradient norm over the steps taken."""
    taken = [s for s in steps if s.stepped]
    tokens = sum(s.num_tokens for s in steps) or 1.0

    def weighted(key: str) -> float:
        return sum(getattr(s, key) * s.num_tokens for s in steps) / tokens if steps else float("nan")

    optional = {"kl_ref": weighted("kl_ref")} if any(math.isfinite(s.kl_ref) for s in steps) else {}
    if any(math.isfinite(s.capped_fraction) for s in steps):
        optional["importance_capped_fraction"] = weighted("capped_fraction")
    return {
        **optional,
        "loss": sum(s.loss for s in taken) / len(taken) if taken else float("nan"),
        "clip_frac": weighted("clip_frac"),
        "kl": weighted("kl"),
        "ratio_mean": weighted("ratio_mean"),
        "ratio_min": min((s.ratio_min for s in steps), default=float("nan")),
        "ratio_max": max((s.ratio_max for s in steps), default=float("nan")),
        "grad_norm": sum(s.grad_norm for s in taken) / len(taken) if taken else float("nan"),
        "optimizer_steps": len(taken),
    }
