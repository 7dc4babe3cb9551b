"""Per-token log-probs of padded trajectories under a model: the forward passes of the update (old,
current and reference log-probs) and of the weight-sync probe.

They come from TRL's fused LM head (``model(..., labels=..., fused_lm_head=True)``, installed by
:func:`.model_loading.wrap_for_training` with TRL's public ``add_fused_lm_head``): it projects hidden
states through the LM head in tiles and never materialises ``[tokens x vocab]`` logits, so a 32k-token
trajectory with Qwen2.5's 152k vocabulary fits. Only sampled tokens are labelled, so on GPUs only those
positions are projected at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .batching import Batch, TrainingSample, collate


def token_logprobs(model: torch.nn.Module, batch: Batch) -> Tensor:
    """``[B, T]`` log-prob of each token given the ones before it; 0 where ``loss_mask`` is 0."""
    return token_logprobs_and_entropy(model, batch)[0]


def token_logprobs_and_entropy(model: torch.nn.Module, batch: Batch) -> tuple[Tensor, Tensor | None]:
    """``[B, T]`` log-prob of each token given the ones before it and ``[B, T]`` entropy (nats, at the
    sampling temperature) of the distribution it was sampled from; both 0 where ``loss_mask`` is 0.

    The fused head computes the entropy in the same tiles as the log-probs, so no ``[tokens x vocab]``
    tensor is held for it either. The entropy is None if the head was added without ``"entropy"`` in
    its outputs (:func:`.model_loading.wrap_for_training` adds it with)."""
    labels = batch.input_ids.masked_fill(batch.loss_mask == 0, -100)
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        labels=labels,
        fused_lm_head=True,
        use_cache=False,
    )

    def unshifted(shifted: Tensor) -> Tensor:  # [B, T-1]: about token t+1 given tokens <= t
        return torch.cat([shifted.new_zeros(shifted.shape[0], 1), shifted], dim=1) * batch.loss_mask

    entropy = getattr(out, "entropy", None)
    return unshifted(out.log_probs), None if entropy is None else unshifted(entropy)


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module,
    token_ids: Sequence[int],
    pad_token_id: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> Tensor:
    """Log-probs of ``token_ids[1:]`` given the tokens before each, in eval mode, on the CPU (the
    trainer's side of a weight-sync probe)."""
    sample = TrainingSample(
        token_ids=list(token_ids),
        loss_mask=[0] + [1] * (len(token_ids) - 1),
        sampler_logprobs=[0.0] * len(token_ids),
        advantage=0.0,
        truncated=False,
    )
    was_training = model.training
    model.eval()
    try:
        batch = collate([sample], pad_token_id).to(device)
        with autocast():
            return token_logprobs(model, batch)[0, 1:].float().cpu()
    finally:
        model.train(was_training)
