"""The policy update with each correction toward the sampler (``sampler_correction``): the iteration's metrics
count the truncated and masked tokens and trajectories, and report the sampler/trainer mismatch (k3 KL,
chi-square), each against loops over the samples; the first step's loss is the brute-force weighted loss. A
trajectory split into two segments (rows) carries one sequence weight."""

from __future__ import annotations

import math

import pytest
from trl.trainer.utils import add_fused_lm_head

from loop_trainer.stabilisers import SAMPLER_CORRECTIONS
from support.updates import policy_update, samples_for

CAP, FLOOR = 1.6, 0.6


def stale_samples(update, tokenizer):
    """The four vault samples, 0 and 2 the two segments of one trajectory (the same advantage), their
    sampler's log-probs those of pi_old moved by fixed log-weights log pi_old - log pi_sampler per sampled
    token: per-token weights on both sides of the bounds and inside them, and trajectory weights too (the split
    trajectory's above, sample 1's below, sample 3's inside)."""
    samples = samples_for(tokenizer)
    samples[0].trajectory = samples[2].trajectory = 0
    fixed, _ = update.fixed_logprobs(samples)
    chosen = ([0.6, 0.1, -0.2], [-0.9, 0.2, 0.1], [0.3, 0.0, 0.2], [0.1, -0.1, 0.2])
    for i, (sample, log_weight) in enumerate(zip(samples, chosen, strict=True)):
        sampled = [t for t, m in enumerate(sample.loss_mask) if m]
        assert len(sampled) == len(log_weight)  # each reply is 3 tokens
        sample.sampler_logprobs = [0.0] * len(sample.token_ids)
        for t, lw in zip(sampled, log_weight, strict=True):
            sample.sampler_logprobs[t] = float(fixed.old[i][t]) - lw
    return samples


def log_weights(samples, old):
    """Per trajectory (a list of its rows), per row: the log-weights log pi_old - log pi_sampler of the
    sampled tokens."""
    trajectories: dict[object, list[list[float]]] = {}
    for i, sample in enumerate(samples):
        key = ("split", sample.trajectory) if sample.trajectory is not None else ("whole", i)
        row = [
            float(o) - s
            for o, s, m in zip(old[i].tolist(), sample.sampler_logprobs, sample.loss_mask, strict=True)
            if m
        ]
        trajectories.setdefault(key, []).append(row)
    return trajectories


@pytest.mark.parametrize("correction", SAMPLER_CORRECTIONS)
def test_the_update_counts_the_bounded_weights_and_trains_on_them(vault_tiny, correction):
    _, model, tok = vault_tiny
    add_fused_lm_head(model)
    settings = {"minibatch_size": 4, "micro_batch_size": 2, "ppo_epochs": 1}
    update, _ = policy_update(
        model,
        tok.pad_token_id,
        sampler_correction=correction,
        sampler_importance_cap=CAP,
        sampler_importance_floor=FLOOR,
        **settings,
    )
    samples = stale_samples(update, tok)
    fixed, metrics = update.fixed_logprobs(samples)
    # brute force: each token's weight and what the bounds did to it, one trajectory at a time
    tokens = truncated = masked = trajectories_touched = 0
    trajectory_loss = 0.0
    for (kind, label), rows in log_weights(samples, fixed.old).items():
        flat = [lw for row in rows for lw in row]
        advantage = samples[label if kind == "whole" else 0].advantage
        weights = []
        for lw in flat:
            level = sum(flat) if correction.startswith("sequence") else lw
            out = level > math.log(CAP) or level < math.log(FLOOR)
            if correction.endswith("mask"):
                weights.append(0.0 if out else math.exp(level))
                masked += out
            else:
                weights.append(min(max(math.exp(level), FLOOR), CAP))
                truncated += out
        tokens += len(flat)
        touched = any(
            (sum(flat) if correction.startswith("sequence") else lw) > math.log(CAP)
            or (sum(flat) if correction.startswith("sequence") else lw) < math.log(FLOOR)
            for lw in flat
        )
        trajectories_touched += touched
        # the first step: pi_theta = pi_old, every ratio 1, so each token's objective is w_t * A
        trajectory_loss += sum(w * advantage for w in weights) / len(weights)
    outcome = "truncated" if correction.endswith("truncate") else "masked"
    count = truncated if outcome == "truncated" else masked
    assert 0 < count < tokens, "the case should bound some tokens, not all"
    assert metrics[f"importance_{outcome}_tokens"] == count
    other = "masked" if outcome == "truncated" else "truncated"
    assert f"importance_{other}_tokens" not in metrics
    if outcome == "masked":
        assert metrics["importance_masked_fraction"] == pytest.approx(masked / tokens)
    if correction.startswith("sequence"):
        assert metrics[f"importance_{outcome}_trajectories"] == trajectories_touched
    else:
        assert f"importance_{outcome}_trajectories" not in metrics
    step = update.minibatch_step(samples, fixed, list(range(len(samples))))
    assert step is not None
    assert step.loss == pytest.approx(-trajectory_loss / settings["minibatch_size"], rel=1e-4)
    if outcome == "truncated":  # the steps' fraction, as before the modes
        assert step.capped_fraction == pytest.approx(truncated / tokens)


def test_the_mismatch_metrics_are_the_brute_force_and_reported_without_a_correction(vault_tiny):
    _, model, tok = vault_tiny
    add_fused_lm_head(model)
    update, _ = policy_update(model, tok.pad_token_id, ppo_epochs=1)  # LOOP's default: no correction
    samples = stale_samples(update, tok)
    fixed, metrics = update.fixed_logprobs(samples)
    kl = chi2 = chi2_sequence = 0.0
    tokens = 0
    trajectories = log_weights(samples, fixed.old)
    for rows in trajectories.values():
        flat = [lw for row in rows for lw in row]
        tokens += len(flat)
        kl += sum(math.exp(lw) - 1 - lw for lw in flat)
        chi2 += sum(math.exp(lw) ** 2 - 1 for lw in flat)
        chi2_sequence += math.exp(sum(flat)) ** 2 - 1
    assert metrics["sampler_kl"] == pytest.approx(kl / tokens, rel=1e-5) and metrics["sampler_kl"] > 0
    assert metrics["sampler_chi2_token"] == pytest.approx(chi2 / tokens, rel=1e-5)
    assert metrics["sampler_chi2_sequence"] == pytest.approx(chi2_sequence / len(trajectories), rel=1e-5)
    assert not any(key.startswith("importance_") for key in metrics)
    # and in the iteration's record
    record = update(samples, iteration=0)
    assert {"sampler_kl", "sampler_chi2_token", "sampler_chi2_sequence"} <= record.keys()


@pytest.mark.slow
def test_a_run_with_gspos_ratio_and_sequence_masking_logs_its_counts(tmp_path):
    """Through the CLI: the keys reach the update, and every iteration's record carries the counts and the
    mismatch (the transformers backend's sampler is the trainer up to float rounding: weights within 1e-6 of 1,
    so a cap of 1 masks the trajectories rounding put above it, and a floor of 0.5 none)."""
    from loop_trainer.cli.train import cli
    from loop_trainer.training.run_log import read_metrics

    out = tmp_path / "run"
    flags = ["--model_name_or_path", "tiny:vault", "--environment_kwargs", '{"num_tasks": 8}', "--iterations", "2"]
    flags += ["--tasks_per_iteration", "4", "--rollouts_per_task", "3", "--minibatch_size", "4", "--max_turns", "4"]
    flags += ["--ratio_level", "sequence", "--epsilon", "0.0003", "--epsilon_high", "0.0004"]
    flags += ["--sampler_correction", "sequence_mask", "--sampler_importance_cap", "1.0"]
    flags += ["--sampler_importance_floor", "0.5", "--output_dir", str(out), "--disable_tqdm", "true"]
    flags += ["--memory_stress_test", "false"]  # at the default 32,000 tokens: most of the test's time
    assert cli(flags) == 0
    records = read_metrics(out)
    assert len(records) == 2
    for record in records:
        if not record["num_kept"]:
            continue
        assert 0 <= record["importance_masked_tokens"] <= record["trained_sampled_tokens"]
        assert 0 <= record["importance_masked_trajectories"] <= record["num_kept"]
        assert record["importance_masked_fraction"] == pytest.approx(
            record["importance_masked_tokens"] / record["trained_sampled_tokens"]
        )
        assert abs(record["sampler_chi2_sequence"]) < 1e-3 and 0 <= record["sampler_kl"] < 1e-6
