"""Training an episode a context policy split into segments: one advantage, one per-trajectory token mean
(and, per trajectory, one ratio) across its segment rows, minibatched and micro-batched whole; and an
append-only episode trained exactly as before."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from loop_trainer.objective import loop_policy_loss, reference_kl_penalty
from loop_trainer.training.batching import TrainingSample, collate, training_samples, trajectory_rows, whole_chunks
from loop_trainer.trajectory import Trajectory
from support.updates import policy_update, samples_for


def split_row(sample: TrainingSample, at: int, trajectory: int) -> list[TrainingSample]:
    """One trajectory as two rows that each hold its whole context, sampled tokens before ``at`` in the
    first and the rest in the second: the brute-force twin of a segmented episode whose second segment
    happens to see the whole history (the log-probs of every token are those of the single row)."""
    first = [m if i < at else 0 for i, m in enumerate(sample.loss_mask)]
    second = [m if i >= at else 0 for i, m in enumerate(sample.loss_mask)]
    return [
        dataclasses.replace(sample, loss_mask=first, trajectory=trajectory),
        dataclasses.replace(sample, loss_mask=second, trajectory=trajectory),
    ]


def random_rows(seed: int):
    g = torch.Generator().manual_seed(seed)
    b, t = 3, 12
    logprobs = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 2).requires_grad_()
    old = logprobs.detach() + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.2
    mask = torch.zeros(b, t, dtype=torch.long)
    mask[:, 4:] = 1
    mask[1, 8:] = 0
    turns = torch.where(mask.bool(), torch.arange(t) // 3, -1)
    advantages = torch.tensor([0.7, -0.4, 0.2], dtype=torch.float64)
    return logprobs, old, advantages, mask, turns


@pytest.mark.parametrize("level", ["token", "turn", "trajectory"])
def test_a_trajectory_split_into_rows_has_the_loss_and_gradient_of_the_whole(level):
    logprobs, old, advantages, mask, turns = random_rows(0)
    whole = loop_policy_loss(logprobs, old, advantages, mask, ratio_level=level, turn_ids=turns, divisor=3.0)
    (grad_whole,) = torch.autograd.grad(whole.loss, logprobs)
    # row 0 split at token 7 (inside turn 2) would cut a turn: split at a turn boundary (9) instead
    first, second = mask.clone(), mask.clone()
    first[0, 9:], second[0, :9] = 0, 0
    rows = torch.stack([logprobs[0], logprobs[0], logprobs[1], logprobs[2]])
    split = loop_policy_loss(
        rows,
        torch.stack([old[0], old[0], old[1], old[2]]),
        torch.stack([advantages[0], advantages[0], advantages[1], advantages[2]]),
        torch.stack([first[0], second[0], mask[1], mask[2]]),
        ratio_level=level,
        turn_ids=torch.stack([turns[0], turns[0], turns[1], turns[2]]),
        divisor=3.0,
        trajectory_ids=torch.tensor([5, 5, 1, 9]),
    )
    (grad_split,) = torch.autograd.grad(split.loss, logprobs)
    torch.testing.assert_close(split.loss, whole.loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_split, grad_whole, rtol=0, atol=1e-12)
    for stat in ("clip_frac", "kl", "ratio_mean", "num_tokens"):
        torch.testing.assert_close(getattr(split, stat), getattr(whole, stat), rtol=0, atol=1e-6)


def test_the_reference_penalty_takes_one_token_mean_across_a_trajectorys_rows():
    logprobs, old, _, mask, _ = random_rows(1)
    whole, _ = reference_kl_penalty(logprobs, old, mask, divisor=3.0)
    first, second = mask[0].clone(), mask[0].clone()
    first[9:], second[:9] = 0, 0
    split, _ = reference_kl_penalty(
        torch.stack([logprobs[0], logprobs[0], logprobs[1], logprobs[2]]),
        torch.stack([old[0], old[0], old[1], old[2]]),
        torch.stack([first, second, mask[1], mask[2]]),
        divisor=3.0,
        trajectory_ids=torch.tensor([0, 0, 1, 2]),
    )
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-12)


def test_rows_labelled_as_their_own_trajectories_give_the_unlabelled_loss_bit_for_bit():
    logprobs, old, advantages, mask, turns = random_rows(2)
    for level in ("token", "turn", "trajectory"):
        plain = loop_policy_loss(
            logprobs.float(), old.float(), advantages.float(), mask, ratio_level=level, turn_ids=turns
        )
        labelled = loop_policy_loss(
            logprobs.float(),
            old.float(),
            advantages.float(),
            mask,
            ratio_level=level,
            turn_ids=turns,
            trajectory_ids=torch.arange(3),
        )
        assert torch.equal(plain.loss, labelled.loss), level


def test_training_samples_one_per_segment_that_sampled():
    t = Trajectory(task_id="t", group=0)
    t.append([1, 2, 3], sampled=False)
    t.append([4, 5], sampled=True, logprobs=[-0.1, -0.2], turn=0)
    t.segment_starts.append(len(t.token_ids))
    t.append([1, 2, 9], sampled=False)
    t.append([6], sampled=True, logprobs=[-0.3], turn=1)
    t.append([7, 8], sampled=False)
    t.segment_starts.append(len(t.token_ids))
    t.append([1, 2], sampled=False)  # opened, then the episode ended: nothing sampled, not trained
    assert t.segments == [(0, 5), (5, 11), (11, 13)]
    first, second = training_samples(t, 0.5, 100, index=7)
    assert first.token_ids == [1, 2, 3, 4, 5] and first.sampler_logprobs[3:] == [-0.1, -0.2]
    assert second.token_ids == [1, 2, 9, 6] and second.loss_mask == [0, 0, 0, 1] and second.turn_ids == [-1, -1, -1, 1]
    assert first.trajectory == second.trajectory == 7 and first.advantage == second.advantage == 0.5
    (cut,) = training_samples(t, 0.5, 4, index=7)[:1]
    assert cut.truncated and cut.token_ids == [1, 2, 3, 4]
    plain = Trajectory(task_id="p", group=0)
    plain.append([1, 2], sampled=False)
    plain.append([3], sampled=True, logprobs=[-1.0], turn=0)
    (only,) = training_samples(plain, 1.0, 100, index=3)
    assert only == TrainingSample.from_trajectory(plain, 1.0, 100) and only.trajectory is None


def test_rows_and_micro_batches_keep_a_trajectory_whole():
    samples = [TrainingSample([1], [1], [0.0], 1.0, False, trajectory=t) for t in (None, 4, 4, None, 2, 4)]
    assert trajectory_rows(samples) == [[0], [1, 2, 5], [3], [4]]
    assert list(whole_chunks([[0], [1, 2, 5], [3], [4]], 2)) == [[0], [1, 2, 5], [3, 4]]
    assert list(whole_chunks([[0], [1], [2]], 2)) == [[0, 1], [2]]
    batch = collate([samples[i] for i in (1, 0, 2)], pad_token_id=0)
    assert batch.trajectory_ids.tolist() == [0, 1, 0]
    assert collate([samples[0], samples[3]], pad_token_id=0).trajectory_ids is None


def updated_weights(model, samples, **settings):
    model = copy.deepcopy(model)  # a fresh copy of the same weights for every run
    add_fused_lm_head(model)
    update, _ = policy_update(model, pad_token_id=0, **settings)
    metrics = update(samples, iteration=0)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, metrics


@pytest.mark.parametrize(
    "settings",
    [
        {"ratio_level": "token"},
        {"ratio_level": "turn"},
        {"ratio_level": "trajectory"},
        {"epsilon_high": 0.28, "sampler_importance_cap": 2.0},  # the stabilisers that enter the loss
    ],
    ids=["token", "turn", "trajectory", "clip-higher+importance-cap"],
)
def test_an_update_on_split_trajectories_ends_where_the_whole_ones_do(vault_tiny, settings):
    """The same four trajectories, whole or each split into two rows of the same context: minibatches of
    two trajectories, micro-batches of one (a split trajectory's two rows share one), two epochs."""
    _, model, tokenizer = vault_tiny
    whole = samples_for(tokenizer)
    weights_whole, metrics_whole = updated_weights(model, whole, **settings)
    split = [row for i, s in enumerate(whole) for row in split_row(s, len(s.token_ids) - 1, trajectory=i)]
    weights_split, metrics_split = updated_weights(model, split, **settings)
    assert metrics_split["optimizer_steps"] == metrics_whole["optimizer_steps"] == 4
    # abs: the loss is a mean of terms of order 1 (advantages +-1) that cancel to ~5e-4, so float32 rounding of
    # the terms (~1e-7) is what a reordering moves it by; relative to 5e-4 that exceeds 1e-5 on some CPUs
    for key in ("loss", "kl", "clip_frac", "ratio_mean", "grad_norm"):
        assert metrics_split[key] == pytest.approx(metrics_whole[key], rel=1e-5, abs=1e-6), key
    # float32 rounding (a two-row batch vs one row) that four AdamW steps amplify to ~1e-5; the steps moved
    # the weights by ~1e-2
    moved = max(float((weights_whole[n] - p.detach()).abs().max()) for n, p in model.named_parameters())
    assert moved > 5e-3
    for name in weights_whole:
        torch.testing.assert_close(weights_split[name], weights_whole[name], rtol=0, atol=2e-4, msg=name)


def test_labelling_every_sample_as_its_own_trajectory_changes_no_bit(vault_tiny):
    _, model, tokenizer = vault_tiny
    plain = samples_for(tokenizer)
    weights_plain, _ = updated_weights(model, plain)
    labelled = [dataclasses.replace(s, trajectory=i) for i, s in enumerate(plain)]
    weights_labelled, _ = updated_weights(model, labelled)
    for name in weights_plain:
        assert torch.equal(weights_labelled[name], weights_plain[name]), name
