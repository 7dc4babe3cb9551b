"""The KL penalty's reference policy (``beta > 0``): the model whose log-probs the penalty keeps the policy near,
the policy's starting weights.

- :class:`AdapterDisabled`: with a LoRA adapter, the policy's own base model, the adapter switched off for the
  pass. No second copy of the model.
- :class:`FrozenCopy`: full fine-tuning has no base left to switch to, so the starting weights are copied once,
  before any step, and kept frozen (no gradients, no optimizer state), as TRL's GRPOTrainer keeps its
  ``ref_model``. It costs one more copy of the weights in their dtype; under ZeRO-3, whose weights are
  sharded, it is refused
  (:data:`~loop_trainer.config.combinations.KL_COPY_NEEDS_WHOLE_WEIGHTS`).

Either is built once, at start-up; a resumed run builds it the same way, from the weights it started from
(a checkpoint's weights are loaded into the policy only).
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel
from trl.trainer import add_fused_lm_head

from ..config.combinations import KL_COPY_NEEDS_WHOLE_WEIGHTS, ConfigCombinationError
from .batching import Batch
from .logprobs import token_logprobs


class ReferencePolicy(Protocol):
    def logprobs(self, policy: torch.nn.Module, batch: Batch) -> Tensor:
        """``[B, T]`` log-probs of ``batch`` under the reference; ``policy`` is the model being trained, as
        the update calls it (wrapped for the distribution strategy)."""
        ...


class AdapterDisabled:
    """The policy's base model: its LoRA adapter (on ``unwrapped``, the PeftModel) off for the pass."""

    def __init__(self, unwrapped: Any):
        self.unwrapped = unwrapped

    def logprobs(self, policy: torch.nn.Module, batch: Batch) -> Tensor:
        with self.unwrapped.disable_adapter():
            return token_logprobs(policy, batch)


class FrozenCopy:
    """A frozen copy of the starting weights (full fine-tuning), on the policy's device once
    :meth:`to` has put it there."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def to(self, device: torch.device, dtype: torch.dtype) -> FrozenCopy:
        """Onto the policy's device, in the dtype its parameters ended in once prepared (a DeepSpeed engine
        casts them to bfloat16; accelerate's mixed precision keeps them and autocasts both passes alike)."""
        self.model.to(device=device, dtype=dtype)
        return self

    def logprobs(self, policy: torch.nn.Module, batch: Batch) -> Tensor:
        return token_logprobs(self.model, batch)


def frozen_copy(model: PreTrainedModel, temperature: float, zero3: bool) -> FrozenCopy:
    """Copy ``model`` (its starting weights, before the fused head or an adapter is added to it) as the
    reference of full fine-tuning; refused under ZeRO-3, whose sharded weights a copy would gather."""
    if zero3:
        raise ConfigCombinationError(KL_COPY_NEEDS_WHOLE_WEIGHTS)
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1:  # accelerate's dispatch hooks, which a copy would share with the policy
        raise ConfigCombinationError(
            f"beta > 0 with full fine-tuning keeps a frozen copy of the starting weights, and this model is split over "
            f"{len(devices)} devices (device_map): launch one process per GPU with accelerate launch, train a LoRA "
            "adapter (use_peft: true), or set beta: 0"
        )
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    # A model already given a fused head carries it as an instance attribute whose plain (unfused) path calls
    # the original model's forward: drop it from the copy, or the copy's plain passes would run the policy.
    vars(reference).pop("forward", None)
    # the log-probs at the sampling temperature, through the same fused head as the policy's
    add_fused_lm_head(reference, temperature=temperature, outputs=("log_probs",))
    return FrozenCopy(reference)
