"""Sampling from a LoRA policy with the adapter merged into a copy of the weights it adapts
(``merge_adapter_for_sampling``), for :class:`~loop_trainer.rollout.backend.TransformersBackend`.

Why: an unmerged LoRA layer adds, to every projection of every decode step, two small matmuls in the
adapter's float32 (SIMT kernels, not tensor cores), the casts of its input to float32 and back, a
scaling and an add: on an H200 these were most of a CUDA-graph decode step's GPU time for a 0.5B
model (docs/benchmarks.md). Merged, a decode step is the base model's kernels alone.

How: :class:`MergedAdapter` builds a second module tree over the same parameters (nothing copied)
except that each LoRA ``Linear`` becomes a plain ``torch.nn.Linear`` whose weight is its own tensor,
``W + scale * B @ A`` computed in float32 and rounded once to ``W``'s dtype. :meth:`refresh` recomputes
those weights in place whenever the policy's weights version changed (the backend's, bumped by whoever
changes the weights), so their storage (which a captured CUDA graph reads) never moves. The training
model is never modified: the update, the trainer's log-probs and checkpoints see the unmerged adapter
exactly as before. The sampler's distribution differs from the policy's only by that rounding; LOOP
takes its ratio's denominator from the trainer, so the update is unbiased, and
``sampler_logprob_diff_*`` measures the gap every iteration.

Memory: one more copy of the adapted layers' weights (for all-linear LoRA, most of the model but
the embeddings).
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class MergedAdapterError(ValueError):
    """The model cannot be sampled with its adapter merged (no LoRA adapter, or a kind this does not merge)."""


def _lora_linear_layers(model: torch.nn.Module) -> dict[str, Any]:
    """The model's LoRA layers by module name; refuses the kinds :class:`MergedAdapter` cannot merge."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is a dependency; a model without it has no adapter to merge
        LoraLayer = LoraLinear = ()  # type: ignore[assignment,misc]
    layers: dict[str, Any] = {}
    for name, module in model.named_modules():
        if hasattr(module, "_hf_hook"):
            where = name or "the model"
            raise MergedAdapterError(
                f"merge_adapter_for_sampling cannot copy a model dispatched with accelerate hooks ({where} has one: "
                "device_map offloading): load it on one device, or set merge_adapter_for_sampling: false"
            )
        if not isinstance(module, LoraLayer):
            continue
        if type(module) is not LoraLinear or type(module.get_base_layer()) is not torch.nn.Linear:
            raise MergedAdapterError(
                f"merge_adapter_for_sampling merges LoRA adapters on plain torch.nn.Linear layers; {name} is a "
                f"{type(module).__name__} around a {type(module.get_base_layer()).__name__}: set "
                "merge_adapter_for_sampling: false"
            )
        dora = any(module.use_dora.values())
        if module.fan_in_fan_out or dora or len(module.active_adapters) != 1:
            kinds = ("fan_in_fan_out, " if module.fan_in_fan_out else "") + ("DoRA, " if dora else "")
            raise MergedAdapterError(
                f"merge_adapter_for_sampling merges one plain LoRA adapter per layer; {name} has {kinds}"
                f"active adapters {list(module.active_adapters)}: set merge_adapter_for_sampling: false"
            )
        layers[name] = module
    if not layers:
        raise MergedAdapterError(
            "merge_adapter_for_sampling needs a LoRA adapter on the policy (set lora_r, or pass a peft_config), "
            "or set merge_adapter_for_sampling: false"
        )
    return layers


def merge_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s adapter cannot be merged for sampling (one line), or None if it can."""
    get_base_model: Any = getattr(model, "get_base_model", None)
    try:
        _lora_linear_layers(get_base_model() if callable(get_base_model) else model)
    except MergedAdapterError as error:
        return str(error)
    return None


class MergedAdapter:
    """``model``: a module tree sharing every parameter and buffer of ``policy`` (a PEFT LoRA model)
    except the adapted layers, which are plain linear layers holding the merged weights. Call
    :meth:`refresh` with the policy's weights version before sampling; it recomputes them only if the
    version changed."""

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy
        get_base_model: Any = getattr(policy, "get_base_model", None)  # a PeftModel's; else the model itself
        base: torch.nn.Module = get_base_model() if callable(get_base_model) else policy
        layers = _lora_linear_layers(base)
        shared = {id(tensor): tensor for tensor in [*base.parameters(), *base.buffers()]}
        self.model: torch.nn.Module = copy.deepcopy(base, memo=shared)  # every tensor shared, modules copied
        for module in self.model.modules():
            # A forward patched onto the instance (TRL's fused log-prob head) closes over the policy's own
            # forward, so the copy would run the unmerged policy: the class's forward samples (the head
            # serves the trainer's log-probs, which this view never computes).
            module.__dict__.pop("forward", None)
        self._pairs: list[tuple[Any, torch.Tensor]] = []
        self._plain: list[torch.nn.Linear] = []
        for name, lora in layers.items():
            linear = lora.get_base_layer()
            plain = torch.nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
            merged = torch.empty_like(linear.weight, requires_grad=False)
            plain.weight = torch.nn.Parameter(merged, requires_grad=False)
            plain.bias = linear.bias  # shared (a LoRA layer leaves the bias alone)
            self.model.set_submodule(name, plain)
            self._pairs.append((lora, merged))
            self._plain.append(plain)
        self.model.requires_grad_(False)
        self.version: int | None = None
        self.num_refreshes = 0

    @torch.no_grad()
    def refresh(self, version: int) -> None:
        """Merge the adapter's current weights, those of weights version ``version`` (a no-op if the
        last refresh was of that version)."""
        if version == self.version:
            return
        self._follow_the_policys_placement()
        for lora, merged in self._pairs:
            (adapter,) = lora.active_adapters
            weight = lora.get_base_layer().weight
            if adapter in lora.lora_A:
                merged.copy_(weight.float() + lora.get_delta_weight(adapter).float())
            else:  # the active adapter does not touch this layer
                merged.copy_(weight)
        self.version = version
        self.num_refreshes += 1

    def _follow_the_policys_placement(self) -> None:
        """Reallocate a merged weight whose layer's weight has moved to another device or dtype since the copy
        was made (DeepSpeed places and casts the model after the generator is built): the shared tensors moved
        with the policy, the merged ones are this copy's own. Before any decode step, so no graph reads them."""
        for index, ((lora, merged), plain) in enumerate(zip(self._pairs, self._plain, strict=True)):
            weight = lora.get_base_layer().weight
            if merged.device != weight.device or merged.dtype != weight.dtype:
                moved = torch.empty_like(weight, requires_grad=False)
                plain.weight = torch.nn.Parameter(moved, requires_grad=False)
                self._pairs[index] = (lora, moved)

    def extra_bytes(self) -> int:
        """Device memory the merged weights take."""
        return sum(merged.numel() * merged.element_size() for _, merged in self._pairs)
