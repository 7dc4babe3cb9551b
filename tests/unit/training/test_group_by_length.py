"""``train_sampling_strategy: group_by_length``: each minibatch cut into micro-batches of trajectories sorted by
length, which pads less and trains the same gradient (a split episode's rows still together); ``random``
(the default) cuts them in the shuffled order, as before."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from loop_trainer.config import LOOPConfig
from loop_trainer.training import update as update_module
from loop_trainer.training.batching import TrainingSample
from loop_trainer.training.settings import update_settings
from support.updates import policy_update, samples_for

COLLATE = update_module.collate


def samples_of_many_lengths(tokenizer) -> list[TrainingSample]:
    """Eight trajectories (the four vault replies twice) whose prompts are padded out to eight different lengths
    with unsampled tokens, in an order that leaves a shuffled micro-batch mixing short and long."""
    base = samples_for(tokenizer) * 2
    filler = base[0].token_ids[0]
    out = []
    for extra, sample in zip((0, 40, 5, 35, 10, 30, 15, 25), base, strict=True):
        out.append(
            dataclasses.replace(
                sample,
                token_ids=[filler] * extra + sample.token_ids,
                loss_mask=[0] * extra + sample.loss_mask,
                sampler_logprobs=[0.0] * extra + sample.sampler_logprobs,
            )
        )
    return out


def run(model, samples, monkeypatch, **settings):
    """The update's final weights, its metrics, and the ``(rows, width)`` of every batch it collated."""
    model = copy.deepcopy(model)
    add_fused_lm_head(model)
    shapes: list[tuple[int, int]] = []

    def recording(batch_samples, pad_token_id):
        batch = COLLATE(batch_samples, pad_token_id)
        shapes.append(tuple(batch.input_ids.shape))
        return batch

    monkeypatch.setattr(update_module, "collate", recording)
    update, _ = policy_update(model, pad_token_id=0, minibatch_size=8, micro_batch_size=2, **settings)
    metrics = update(samples, iteration=0)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return weights, metrics, shapes


def test_grouping_by_length_pads_less_and_trains_the_same_update(vault_tiny, monkeypatch):
    _, model, tokenizer = vault_tiny
    samples = samples_of_many_lengths(tokenizer)
    lengths = sorted((len(s.token_ids) for s in samples), reverse=True)
    plain, plain_metrics, plain_shapes = run(model, samples, monkeypatch)
    grouped, grouped_metrics, grouped_shapes = run(model, samples, monkeypatch, group_by_length=True)
    # the fixed log-probs' four passes, the sampler comparison's four batches (no forward pass: in the shuffled
    # order either way), then two epochs of four micro-batches, each of two rows
    assert len(plain_shapes) == len(grouped_shapes) == 16
    assert [rows for rows, _ in grouped_shapes] == [rows for rows, _ in plain_shapes] == [2] * 16
    assert grouped_shapes[4:8] == plain_shapes[4:8]
    passes, plain_passes = grouped_shapes[:4] + grouped_shapes[8:], plain_shapes[:4] + plain_shapes[8:]
    # sorted longest first, a micro-batch is as wide as its longest member: the 1st, 3rd, 5th and 7th longest
    assert [width for _, width in passes] == [lengths[0], lengths[2], lengths[4], lengths[6]] * 3
    padded = sum(rows * width for rows, width in passes)
    assert padded < sum(rows * width for rows, width in plain_passes)
    assert padded == 3 * (sum(lengths) + sum(a - b for a, b in zip(lengths[::2], lengths[1::2], strict=True)))
    # the same minibatches, the same sum of trajectory losses: float rounding apart, the same step
    assert grouped_metrics["optimizer_steps"] == plain_metrics["optimizer_steps"] == 2
    for key in ("loss", "kl", "clip_frac", "ratio_mean", "grad_norm", "sampler_logprob_diff"):
        assert grouped_metrics[key] == pytest.approx(plain_metrics[key], rel=1e-4, abs=1e-7), key
    # float32 rounding (other padding, another summation order) that AdamW's normalised steps amplify where a
    # gradient is near zero: up to ~2e-5, against ~5e-3 moved
    moved = max(float((plain[n] - p.detach()).abs().max()) for n, p in model.named_parameters())
    assert moved > 1e-3
    for name in plain:
        torch.testing.assert_close(grouped[name], plain[name], rtol=0, atol=1e-4, msg=name)


def test_a_split_trajectory_is_sorted_and_trained_whole(vault_tiny, monkeypatch):
    """Rows labelled as one trajectory (a context policy's segments) move together: every micro-batch holds
    whole trajectories, so with two-row trajectories and micro-batches of two, each holds exactly one."""
    _, model, tokenizer = vault_tiny
    rows = []
    for i, sample in enumerate(samples_of_many_lengths(tokenizer)[:4]):
        rows += [dataclasses.replace(sample, trajectory=i), dataclasses.replace(sample, trajectory=i)]
    seen: list[list[int | None]] = []

    def recording(batch_samples, pad_token_id):
        seen.append([s.trajectory for s in batch_samples])
        return COLLATE(batch_samples, pad_token_id)

    monkeypatch.setattr(update_module, "collate", recording)
    model = copy.deepcopy(model)
    add_fused_lm_head(model)
    update, _ = policy_update(model, pad_token_id=0, minibatch_size=4, micro_batch_size=2, group_by_length=True)
    update(rows, iteration=0)
    steps = seen[-8:]  # two epochs of one minibatch of four trajectories, one trajectory a micro-batch
    assert all(len(set(labels)) == 1 for labels in steps)
    assert [labels[0] for labels in steps[:4]] == [1, 3, 2, 0]  # longest first: extra 40, 35, 5, 0 tokens


def test_the_key_reaches_the_update_and_other_samplers_are_refused():
    assert not update_settings(LOOPConfig(output_dir="x"), pad_token_id=0).group_by_length
    config = LOOPConfig(output_dir="x", train_sampling_strategy="group_by_length")
    assert update_settings(config, pad_token_id=0).group_by_length
    for other in ("sequential", "batch_rebalance"):
        with pytest.raises(ValueError) as caught:
            LOOPConfig(output_dir="x", train_sampling_strategy=other)
        assert str(caught.value) == (
            f"LOOPConfig: train_sampling_strategy must be one of random, group_by_length, got {other!r}"
        )
