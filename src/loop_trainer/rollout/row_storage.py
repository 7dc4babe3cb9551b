"""Where the decode loop keeps its running rows' keys and values: the part of
:class:`~loop_trainer.rollout.continuous_batch.DecodeBatch` that ``static_decode`` swaps.

- :class:`PaddedRows`: one ``DynamicCache`` for the batch, left-padded, concatenated at every step
  (the default; works with any cache the model fills).
- :class:`SlotRows`: fixed-shape slots, one per row (:mod:`.slot_decode`), replayed as one CUDA graph per
  step on a GPU; only for caches whose rows can be cut (:class:`~.kv_layout.KVLayout`).

Both take prefilled rows in (:meth:`~RowStorage.admit`), run one token for every running row
(:meth:`~RowStorage.step`), hand a finished row's states out (:meth:`~RowStorage.states`) and drop the
rows that left (:meth:`~RowStorage.select`). Neither changes what is sampled: each row attends to
exactly its own tokens at its own positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .kv_layout import KV, kv_layers, layer_states, left_pad, row_states
from .records import Completion
from .slot_decode import SlotDecoder


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int | None
    deliver: Callable[[Completion | BaseException], None]
    """Hands the reply (or the error) to whoever waits for it; called from the decode thread."""
    abandoned: Callable[[], bool] = lambda: False
    """True once nobody waits for the reply any more (the episode was cancelled)."""


@dataclass
class Row:
    """A request being decoded: its sampler and its reply so far."""

    request: Request
    generator: torch.Generator | None
    cache_length: int
    """Tokens of this row in the KV cache; also the position id of the next token it feeds."""
    next_token: int = -1
    """The last token sampled: fed at the next step."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False
    slot: int = -1
    """Its slot in the fixed-shape decode state (:class:`SlotRows`), else -1."""


class RowStorage(Protocol):
    def step(self, rows: list[Row]) -> torch.Tensor:
        """Feed every running row (``rows``, in storage order) its ``next_token`` at position
        ``cache_length``; their next-token logits, in that order."""
        ...

    def admit(self, cache: DynamicCache, mask: torch.Tensor, count: int) -> list[int]:
        """Take in the ``count`` rows just prefilled (``mask[r]`` marks row r's columns), after the
        running ones; their slots, or -1 each."""
        ...

    def states(self, index: int, row: Row) -> KV:
        """Row ``row`` (at ``index`` of the running rows): its keys and values, without padding."""
        ...

    def select(self, rows: list[Row], keep: list[int]) -> None:
        """Keep only ``rows[i]`` for ``i`` in ``keep`` (the others left the batch)."""
        ...


class PaddedRows:
    """The running rows' cache as one ``DynamicCache``, one column per position: ``mask[r]`` marks row
    r's ``cache_length`` tokens (left padding, and holes where a cached prefix and its new tokens were
    padded separately, are zeros)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None

    def step(self, rows: list[Row]) -> torch.Tensor:
        assert self.mask is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(rows), 1))], dim=1)
        out = self.model(
            input_ids=torch.tensor([[row.next_token] for row in rows], device=self.device),
            attention_mask=self.mask,
            position_ids=torch.tensor([[row.cache_length] for row in rows], device=self.device),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def admit(self, cache: DynamicCache, mask: torch.Tensor, count: int) -> list[int]:
        """Add the joining rows' cache (and attention mask) under the running rows', left-padding
        whichever is shorter."""
        if self.cache is None:
            self.cache, self.mask = cache, mask
            return [-1] * count
        assert self.mask is not None
        old, new = self.mask.shape[1], mask.shape[1]
        width = max(old, new)
        for running, joining in zip(kv_layers(self.cache), kv_layers(cache), strict=True):
            if running.is_initialized:
                (keys, values), (new_keys, new_values) = layer_states(running), layer_states(joining)
                running.keys = torch.cat([left_pad(keys, width - old), left_pad(new_keys, width - new)])
                running.values = torch.cat([left_pad(values, width - old), left_pad(new_values, width - new)])
        self.mask = torch.cat([F.pad(self.mask, (width - old, 0)), F.pad(mask, (width - new, 0))])
        return [-1] * count

    def states(self, index: int, row: Row) -> KV:
        assert self.cache is not None and self.mask is not None
        return row_states(self.cache, self.mask, index)

    def select(self, rows: list[Row], keep: list[int]) -> None:
        """Keep only the rows ``keep``, and drop the columns no row uses."""
        if not keep:
            self.cache, self.mask = None, None
            return
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(keep, device=self.device)
        self.mask = self.mask[index]
        unused = int(self.mask.any(0).int().argmax())  # leading columns no row uses
        self.mask = self.mask[:, unused:]
        for layer in kv_layers(self.cache):
            if layer.is_initialized:
                keys, values = layer_states(layer)
                layer.keys = keys[index, :, unused:]
                layer.values = values[index, :, unused:]


class SlotRows:
    """The running rows in fixed-shape slots of a :class:`~.slot_decode.SlotDecoder` (every slot free
    when this is made)."""

    def __init__(self, slots: SlotDecoder):
        self.slots = slots

    def step(self, rows: list[Row]) -> torch.Tensor:
        return self.slots.step(
            [row.slot for row in rows], [row.next_token for row in rows], [row.cache_length for row in rows]
        )

    def admit(self, cache: DynamicCache, mask: torch.Tensor, count: int) -> list[int]:
        """Copy the joining rows' states, without their padding, into free slots."""
        return self.slots.put_batch([layer_states(layer) for layer in kv_layers(cache)], mask)

    def states(self, index: int, row: Row) -> KV:
        return self.slots.states(row.slot, row.cache_length)

    def select(self, rows: list[Row], keep: list[int]) -> None:
        kept = set(keep)
        for position, row in enumerate(rows):
            if position not in kept:
                self.slots.release(row.slot)
