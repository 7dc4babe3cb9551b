"""From kept trajectories to padded tensors, and the minibatch schedule over them (the log-prob
forward passes over those tensors are :mod:`.logprobs`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..trajectory import Trajectory


@dataclass
class TrainingSample:
    """A kept trajectory, cut to the training budget, with its advantage."""

    token_ids: list[int]
    loss_mask: list[int]
    sampler_logprobs: list[float]
    advantage: float
    truncated: bool
    """True if the trajectory was longer than the training budget and only its prefix is trained."""
    turn_ids: list[int] | None = None
    """Per token: the assistant turn of a sampled token, -1 elsewhere (:attr:`Trajectory.turn_ids`).
    None where not recorded: :func:`collate` then numbers the runs of consecutive sampled tokens."""
    trajectory: int | None = None
    """For one segment of an episode a context policy split (:attr:`Trajectory.segments`): which of
    the update's trajectories it belongs to. Its segments share its advantage, one token mean and
    (``ratio_level="trajectory"``) one ratio, and are trained in the same minibatch and micro-batch.
    None: the sample is a whole trajectory."""

    @classmethod
    def from_trajectory(cls, trajectory: Trajectory, advantage: float, max_tokens: int) -> TrainingSample:
        # Tokens after the last sampled one carry no loss: don't spend a forward pass on them.
        mask = trajectory.loss_mask
        end = max((i + 1 for i, m in enumerate(mask) if m), default=0)
        truncated = end > max_tokens
        end = min(end, max_tokens)
        # A trajectory built by hand may not record turns (then collate derives them).
        recorded = len(trajectory.turn_ids) == len(trajectory.token_ids)
        return cls(
            token_ids=trajectory.token_ids[:end],
            loss_mask=mask[:end],
            sampler_logprobs=trajectory.sampler_logprobs[:end],
            advantage=advantage,
            truncated=truncated,
            turn_ids=trajectory.turn_ids[:end] if recorded else None,
        )


def training_samples(trajectory: Trajectory, advantage: float, max_tokens: int, index: int) -> list[TrainingSample]:
    """The samples one kept trajectory trains as: itself (:meth:`TrainingSample.from_trajectory`),
    or, when a context policy split it, one per segment that sampled a token, each the context the
    model saw and cut to ``max_tokens`` on its own, labelled trajectory ``index``."""
    if not trajectory.segment_starts:
        return [TrainingSample.from_trajectory(trajectory, advantage, max_tokens)]
    samples = []
    for start, end in trajectory.segments:
        segment = dataclasses.replace(
            trajectory,
            token_ids=trajectory.token_ids[start:end],
            loss_mask=trajectory.loss_mask[start:end],
            sampler_logprobs=trajectory.sampler_logprobs[start:end],
            turn_ids=trajectory.turn_ids[start:end] if len(trajectory.turn_ids) == len(trajectory.token_ids) else [],
            segment_starts=[],
        )
        if any(segment.loss_mask):
            samples.append(
                dataclasses.replace(TrainingSample.from_trajectory(segment, advantage, max_tokens), trajectory=index)
            )
    return samples


def trajectory_rows(samples: Sequence[TrainingSample]) -> list[list[int]]:
    """The sample indices of each trajectory, in order of first appearance: ``[[0], [1], ...]`` when
    every sample is a whole trajectory; a split episode's segments together."""
    rows: dict[tuple[bool, int], list[int]] = {}
    for i, sample in enumerate(samples):
        key = (False, i) if sample.trajectory is None else (True, sample.trajectory)
        rows.setdefault(key, []).append(i)
    return list(rows.values())


def turn_ids_from_mask(loss_mask: Sequence[int]) -> list[int]:
    """Turn labels for a sample that recorded none: each run of consecutive sampled tokens is one
    turn (0, 1, ...), -1 elsewhere. The rollout engine's turns are such runs (an assistant header,
    never sampled, separates two replies), except that a reply of zero tokens has no run."""
    labels, turn, previous = [], -1, 0
    for m in loss_mask:
        if m and not previous:
            turn += 1
        labels.append(turn if m else -1)
        previous = m
    return labels


@dataclass
class Batch:
    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    advantages: Tensor
    sampler_logprobs: Tensor
    turn_ids: Tensor | None = None
    """``[B, T]`` long: the assistant turn of each sampled token, -1 elsewhere (padding included)."""
    trajectory_ids: Tensor | None = None
    """``[B]`` long: rows with one label are segments of one trajectory (:attr:`TrainingSample.trajectory`);
    None when every row is a whole trajectory."""

    def to(self, device: torch.device) -> Batch:
        return dataclasses.replace(
            self, **{name: value.to(device) for name, value in vars(self).items() if value is not None}
        )


def collate(samples: Sequence[TrainingSample], pad_token_id: int) -> Batch:
    """Right-pad a list of samples into tensors."""
    width = max(len(s.token_ids) for s in samples)
    shape = (len(samples), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.long)
    sampler_logprobs = torch.zeros(shape, dtype=torch.float32)
    turn_ids = torch.full(shape, -1, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample.token_ids)
        input_ids[row, :n] = torch.tensor(sample.token_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.long)
        sampler_logprobs[row, :n] = torch.tensor(sample.sampler_logprobs, dtype=torch.float32)
        turns = sample.turn_ids if sample.turn_ids is not None else turn_ids_from_mask(sample.loss_mask)
        turn_ids[row, :n] = torch.tensor(turns, dtype=torch.long)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    trajectory_ids = None
    if any(s.trajectory is not None for s in samples):
        trajectory_ids = torch.empty(len(samples), dtype=torch.long)
        for label, rows in enumerate(trajectory_rows(samples)):
            trajectory_ids[rows] = label
    return Batch(input_ids, attention_mask, loss_mask, advantages, sampler_logprobs, turn_ids, trajectory_ids)


def minibatch_indices(num_samples: int, minibatch_size: int, generator: torch.Generator) -> Iterator[list[int]]:
    """One epoch: a fresh shuffle of all samples (across tasks), cut into minibatches."""
    order = torch.randperm(num_samples, generator=generator).tolist()
    for start in range(0, num_samples, minibatch_size):
        yield order[start : start + minibatch_size]


def chunks(items: Sequence[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def whole_chunks(groups: Sequence[Sequence[int]], size: int) -> Iterator[list[int]]:
    """``groups`` (each a trajectory's sample indices) packed in order into chunks of at most ``size``
    indices, never splitting a group (a group larger than ``size`` is a chunk of its own): the
    micro-batches of a minibatch, each holding its trajectories whole. Single-index groups give
    :func:`chunks`' chunks."""
    chunk: list[int] = []
    for group in groups:
        if chunk and len(chunk) + len(group) > size:
            yield chunk
            chunk = []
        chunk.extend(group)
    if chunk:
        yield chunk
