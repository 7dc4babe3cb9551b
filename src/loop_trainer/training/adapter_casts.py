"""PEFT's input casts switched off where autocast makes them redundant.

A LoRA layer with a float32 adapter (PEFT's default on bfloat16 weights) casts its input to float32
before the adapter's matmuls. Under bf16 autocast those matmuls cast it straight back to bfloat16,
so the pair of copies changes no value: ``x.float().bfloat16() == x``, and the cast's backward is the
reverse, equally exact. But each is a full copy of the layer's activations, forward, in the
checkpointed recomputation and backward: 11 % of a 7B LoRA update's kernel time on an H200
(docs/benchmarks.md). Switched off for a whole policy update, recomputation and backward included
(a checkpointed layer must recompute exactly the operations of its forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def adapter_input_casts_off(
    model: torch.nn.Module, autocast: Callable[[], contextlib.AbstractContextManager]
) -> Iterator[int]:
    """Within this context, ``model``'s PEFT layers do not cast their inputs to the adapter's dtype,
    if ``autocast()`` enables autocast on the model's device (else nothing changes: without autocast
    a float32 adapter needs float32 inputs). Yields how many layers were switched."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no peft, no adapter
        yield 0
        return
    parameter = next(model.parameters(), None)
    device_type = parameter.device.type if parameter is not None else "cpu"
    with autocast():
        active = torch.is_autocast_enabled(device_type)
    layers: list[Any] = [m for m in model.modules() if isinstance(m, BaseTunerLayer)] if active else []
    saved = [layer.cast_input_dtype_enabled for layer in layers]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    try:
        yield len(layers)
    finally:
        for layer, enabled in zip(layers, saved, strict=True):
            layer.cast_input_dtype_enabled = enabled
