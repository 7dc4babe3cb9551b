"""Decode steps of fixed shape for :class:`~loop_trainer.rollout.backend.TransformersBackend`
(``static_decode=True``), replayed as one CUDA graph on a GPU.

Why: a decode step of a small model is a few hundred tiny kernels (every layer's projections, LoRA's
extra matmuls, norms, rotary embeddings), each launched from Python, and the dynamic batch also
re-concatenates every layer's KV cache at every step. On an H100 a 0.5B model's step took ~150 ms at
64 rows (benchmarks/results/gpu/h100-2026-11-23-generation.md) where reading its weights takes
~0.3 ms. With fixed shapes the whole step is captured once and replayed as one graph launch.

The state: ``slots`` rows, each row a sequence of its own. Slot s holds one request's keys and values
in columns ``[0, length_s)`` of a ``[slots, kv_heads, capacity, head_dim]`` buffer per layer, so no
row is ever padded or moved: a joining group's prefilled states are scattered into free slots (one copy per layer), a
finished request frees its slot, and a step writes each row's new key/value at column ``length_s``
and attends to columns ``<= length_s`` (a boolean mask computed inside the graph from the lengths).
Idle slots compute a throw-away row. When a request needs more columns than the buffers have, they
are reallocated at the next power of two (at least 256) and the graph is captured again.

Prefills stay eager (their shapes vary); only the one-token steps of the running rows are replayed.
What a step samples is the same distribution as the dynamic batch's: each row attends to exactly its
own tokens, at its own positions; only float rounding differs (other kernels, other summation order).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from .kv_layout import KV

MIN_CAPACITY = 256
logger = logging.getLogger(__name__)


class SlotCache(Cache):
    """The model's KV cache during a fixed-shape step: ``update`` writes each slot's new key and
    value at the slot's length and returns the whole buffer (the mask hides what is not the slot's)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: torch.Tensor):
        super().__init__(layers=[])
        self.keys, self.values, self.lengths = keys, values, lengths
        self.slots = torch.arange(len(lengths), device=lengths.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.slots, :, self.lengths] = key_states[:, :, 0]  # [slots, heads, dim] at column length_s
        values[self.slots, :, self.lengths] = value_states[:, :, 0]
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[2]


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int, torch.dtype]:
    """Layers, key/value heads, head dimension and dtype of a decoder-only model's KV cache."""
    config: Any = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dtype = model.get_input_embeddings().weight.dtype  # type: ignore[operator]
    return config.num_hidden_layers, kv_heads, head_dim, dtype


class SlotDecoder:
    """Fixed-shape decode state for ``slots`` rows; :meth:`step` runs one token for every slot."""

    def __init__(self, model: torch.nn.Module, slots: int, device: torch.device, *, cuda_graphs: bool):
        self.model, self.device = model, device
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = kv_shape(model)
        self.slots = slots
        self.free = list(range(slots))
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.input_ids = torch.zeros((slots, 1), dtype=torch.long, device=device)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.staging = torch.zeros((2, slots), dtype=torch.long, pin_memory=self.cuda_graphs)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.num_captures = 0
        """Graphs captured (one per capacity reached)."""
        self.capture_error: str | None = None
        """Why capturing failed, if it did: the steps then run eagerly (same results, slower)."""
        self.compile_step = False
        """Run the step through ``torch.compile`` (fusing the modelling code's small kernels: RMSNorm's
        casts, rotary embeddings, the KV writes) before capturing it; compiled again for each
        capacity (``compile_decode_step``)."""
        self.compile_falls_back = False
        """If compiling fails, log one line and run the step uncompiled from then on (``compile_decode_step``
        on by default, not asked for); otherwise the error reaches the rows."""
        self.compile_error: str | None = None
        """Why compiling failed, if it did and the step fell back."""
        self._compiled: Any = None

    def reserve(self, columns: int) -> None:
        """Make room for ``columns`` tokens per slot (the buffers grow to the next power of two, their
        contents kept; the graph is captured again at the next step)."""
        if columns <= self.capacity:
            return
        capacity = max(MIN_CAPACITY, 1 << (columns - 1).bit_length())
        shape = (self.slots, self.kv_heads, capacity, self.head_dim)
        grown: list[list[torch.Tensor]] = [[], []]
        for old_list, new_list in zip((self.keys, self.values), grown, strict=True):
            for layer in range(self.num_layers):
                buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if old_list:
                    buffer[:, :, : self.capacity] = old_list[layer]
                new_list.append(buffer)
        self.keys, self.values = grown
        self.capacity = capacity
        self.columns = torch.arange(capacity, device=self.device)
        self.cache = SlotCache(self.keys, self.values, self.lengths)
        self.graph, self.logits = None, None

    def put_batch(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> list[int]:
        """Copy every row of a prefill's cache (``[rows, heads, width, dim]`` per layer, ``mask[r]``
        marking row r's columns, padding and holes zeros) into free slots, one slot per row, without
        its padding: one gather-scatter per layer and key/value, not one copy per row and layer."""
        rows = mask.shape[0]
        slots = [self.free.pop() for _ in range(rows)]
        valid = mask.bool()
        self.reserve(int(valid.sum(1).max()) + 1)
        source_row, source_column = valid.nonzero(as_tuple=True)  # row-major: each row's columns in order
        target_column = (valid.cumsum(1) - 1)[source_row, source_column]
        target_slot = torch.tensor(slots, dtype=torch.long, device=mask.device)[source_row]
        for layer, (keys, values) in enumerate(layers):
            self.keys[layer][target_slot, :, target_column] = keys[source_row, :, source_column]
            self.values[layer][target_slot, :, target_column] = values[source_row, :, source_column]
        return slots

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def states(self, slot: int, length: int) -> KV:
        """A copy of slot ``slot``'s first ``length`` columns (its buffers are reused)."""
        return [
            (self.keys[layer][slot, :, :length].clone(), self.values[layer][slot, :, :length].clone())
            for layer in range(self.num_layers)
        ]

    def step(self, slots: Sequence[int], tokens: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        """Feed ``tokens[i]`` at position ``lengths[i]`` to slot ``slots[i]``; the next-token logits of
        those slots, in that order. Idle slots feed a pad token at position 0 (thrown away)."""
        self.reserve(max(lengths) + 1)
        self.staging.zero_()
        index = torch.tensor(slots, dtype=torch.long)
        self.staging[0, index] = torch.tensor(tokens, dtype=torch.long)
        self.staging[1, index] = torch.tensor(lengths, dtype=torch.long)
        self.input_ids[:, 0].copy_(self.staging[0], non_blocking=True)
        self.lengths.copy_(self.staging[1], non_blocking=True)
        if not self.cuda_graphs:
            logits = self._run_step()
        else:
            if self.graph is None:
                self._capture()
            if self.graph is None:  # capture failed: eager from now on
                logits = self._run_step()
            else:
                assert self.logits is not None
                self.graph.replay()
                logits = self.logits
        return logits[index.to(self.device)]

    def _forward(self) -> torch.Tensor:
        mask = (self.columns[None, :] <= self.lengths[:, None])[:, None, None, :]  # [slots, 1, 1, capacity]
        out = self.model(
            input_ids=self.input_ids,
            attention_mask=mask,
            position_ids=self.lengths[:, None],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _step_function(self) -> Any:
        if not self.compile_step:
            return self._forward
        if self._compiled is None:
            self._compiled = torch.compile(self._forward, dynamic=False)
        return self._compiled

    def _run_step(self) -> torch.Tensor:
        """One step, outside a graph capture: compiled if :attr:`compile_step`; a failed compilation
        falls back to the uncompiled step where :attr:`compile_falls_back` allows (running the step again
        writes the same keys and values at the same columns)."""
        step = self._step_function()
        if not (self.compile_step and self.compile_falls_back):
            return step()
        try:
            return step()
        except Exception as error:  # noqa: BLE001 - any compiler failure: the uncompiled step computes the same
            self.compile_step, self._compiled = False, None
            self.compile_error = f"{type(error).__name__}: {error}"[:500]
            logger.warning(
                "compile_decode_step: torch.compile failed, the step runs uncompiled: %s", self.compile_error
            )
            return self._forward()

    def _capture(self) -> None:
        # Warm-up runs on a side stream before capture, as CUDA graphs require; they compute this very
        # step (the same keys and values written at the same columns), so they change nothing.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # with compile_step, the first compiles
                self._run_step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        step = self._step_function()  # uncompiled if compiling failed in the warm-up
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the decode thread captures while the event loop's thread goes on (it launches nothing)
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.logits = step()
        except RuntimeError as error:  # an operation that cannot be captured (e.g. a host sync in a model)
            self.cuda_graphs, self.capture_error = False, f"{type(error).__name__}: {error}"[:500]
            self.logits = None
            logger.warning("static_decode: CUDA graph capture failed, decoding eagerly: %s", self.capture_error)
            return
        self.graph = graph
        self.num_captures += 1
