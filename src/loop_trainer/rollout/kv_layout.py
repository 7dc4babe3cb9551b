"""What a model's KV cache allows the transformers backend's decode loop, decided once per backend
(:meth:`~loop_trainer.rollout.sampled_policy.SampledPolicy.kv_layout`), and the helpers that read
and cut a :class:`~transformers.DynamicCache` per row.

Most decoder-only models fill a ``DynamicCache`` with one plain ``[batch, heads, length, dim]`` key and
value tensor per layer: a row's states can then be cut out, kept as a prefix, stacked again, or copied
into a fixed-shape slot, and rows can join and leave a running batch. Some models' caches cannot be:
sliding-window layers keep only the last window (their own layer type), and layers that share another
layer's cache hold no states of their own. The decode loop's parts are configured from this decision
up front; the batch never changes mode while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""One row's key and value states per layer, ``[heads, length, dim]`` each."""


@dataclass(frozen=True)
class KVLayout:
    """What the model's cache allows."""

    rows_can_leave: bool
    """Rows can join a running batch and leave it (every layer a ``DynamicLayer`` of 4-dim states, or
    none); otherwise a batch runs until all its rows are done."""
    rows_can_be_cut: bool
    """Every layer holds its own plain per-row states: a row's cache can be kept as a prefix (the
    previous turn's, a shared opening) and copied into a slot (``static_decode``)."""
    layer_types: tuple[str, ...] = ()
    """The cache's layer types, for the log line when something is off."""

    @classmethod
    def of(cls, cache: DynamicCache) -> KVLayout:
        layers = kv_layers(cache)
        return cls(
            rows_can_leave=all(
                type(layer) is DynamicLayer and (not layer.is_initialized or layer_states(layer)[0].dim() == 4)
                for layer in layers
            ),
            rows_can_be_cut=is_plain(cache),
            layer_types=tuple(sorted({type(layer).__name__ for layer in layers})),
        )

    def turned_off(self, static_decode: bool, share_prefixes: bool) -> str | None:
        """The one log line saying which parts this layout turns off and why; None if it is plain."""
        if self.rows_can_be_cut:
            return None
        parts = ["reusing an episode's previous turn's KV cache"]
        if share_prefixes:
            parts.append("shared prefixes")
        if static_decode:
            parts.append("static_decode (the dynamic batch decodes)")
        if not self.rows_can_leave:
            parts.append("rows joining a running batch (a batch runs until all its rows are done)")
        uninitialized = "uninitialized layers sharing another's cache" if self.rows_can_leave else "sliding windows"
        return (
            f"transformers backend: the model's KV cache ({', '.join(self.layer_types)}: {uninitialized}) cannot be "
            f"cut per row into plain [batch, heads, length, dim] states, so these are off: {'; '.join(parts)}"
        )


@torch.no_grad()
def probe_kv_layout(model: torch.nn.Module, device: torch.device, pad_token_id: int) -> KVLayout:
    """The layout of the cache ``model`` fills, from a prefill of two left-padded two-token prompts built as
    the decode loop builds its prefills (the model in eval mode: nothing random is drawn)."""
    cache = DynamicCache()
    mask = torch.tensor([[0, 1], [1, 1]], device=device)
    model(
        input_ids=torch.full((2, 2), pad_token_id, dtype=torch.long, device=device),
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return KVLayout.of(cache)


def is_plain(cache: DynamicCache) -> bool:
    """Every layer holds its own plain ``[batch, heads, length, dim]`` key/value states, which can be
    cut per row, kept, and stacked again as a prefix."""
    return all(
        type(layer) is DynamicLayer and layer.is_initialized and layer_states(layer)[0].dim() == 4
        for layer in kv_layers(cache)
    )


def row_states(cache: DynamicCache, mask: torch.Tensor, index: int) -> KV:
    """Row ``index``'s key and value states per layer, without its padding columns."""
    columns = mask[index].nonzero().squeeze(1)
    return [
        (keys[index].index_select(1, columns), values[index].index_select(1, columns))
        for keys, values in map(layer_states, kv_layers(cache))
    ]


def kv_layers(cache: DynamicCache) -> list[CacheLayerMixin]:
    """The cache's layers. transformers' annotation admits linear-attention layers too, which hold no
    key/value states; the caches built here, by decoder-only attention models, have none of them."""
    return cast("list[CacheLayerMixin]", cache.layers)


def layer_states(layer: CacheLayerMixin) -> tuple[torch.Tensor, torch.Tensor]:
    """An initialized layer's key and value states."""
    assert layer.keys is not None and layer.values is not None, "the layer holds no states yet"
    return layer.keys, layer.values


def left_pad(states: torch.Tensor, columns: int) -> torch.Tensor:
    """Key or value states (``[..., length, dim]``) with ``columns`` zero positions in front."""
    return F.pad(states, (0, 0, columns, 0)) if columns else states
