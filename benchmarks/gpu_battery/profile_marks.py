"""How the battery marks a policy update for a profile or a memory watch: a context ``phase(name)``
around each of PolicyUpdate's phases, around the fused log-prob head's forward and around each
checkpointed decoder layer recomputed in the backward, installed for one block and then removed.

A recomputed layer is told from its first run by the autograd graph task (set while a backward
runs), through the function each layer hands to ``torch.utils.checkpoint``; that function runs the
layer through :func:`_forward_layer` or :func:`_recomputed_layer`, so an allocation's Python stack
says which run made it too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

RANGE = "profile::"


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (the recompute of a checkpointed layer)."""
    import torch

    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class _LayerCall:
    """The function a checkpointed layer hands to ``torch.utils.checkpoint``: runs it through
    :func:`_forward_layer` or :func:`_recomputed_layer`, so both a profiler range and an
    allocation's Python stack say which run it was."""

    def __init__(self, function: Callable, on_recompute: Callable[[], contextlib.AbstractContextManager]):
        self.function, self.on_recompute = function, on_recompute

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if in_backward():
            return _recomputed_layer(self, args, kwargs)
        return _forward_layer(self, args, kwargs)


def _forward_layer(call: _LayerCall, args: tuple, kwargs: dict) -> Any:
    return call.function(*args, **kwargs)


def _recomputed_layer(call: _LayerCall, args: tuple, kwargs: dict) -> Any:
    with call.on_recompute():
        return call.function(*args, **kwargs)


class _MarkingCheckpointing:
    """A layer's ``_gradient_checkpointing_func``, wrapped: the original, handed the layer's function as
    a :class:`_LayerCall`."""

    def __init__(self, original: Callable, on_recompute: Callable[[], contextlib.AbstractContextManager]):
        self.original, self.on_recompute = original, on_recompute

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        return self.original(_LayerCall(function, self.on_recompute), *args, **kwargs)


def mark_checkpointed_layers(model: Any, on_recompute: Callable[[], contextlib.AbstractContextManager]) -> Callable:
    """Wrap every module's ``_gradient_checkpointing_func`` (transformers sets one per layer when
    checkpointing is enabled); returns the function that restores them."""
    wrapped: list[tuple[Any, Callable]] = []
    for module in model.modules():
        original = module.__dict__.get("_gradient_checkpointing_func")
        if original is None or isinstance(original, _MarkingCheckpointing):
            continue
        module._gradient_checkpointing_func = _MarkingCheckpointing(original, on_recompute)
        wrapped.append((module, original))

    def restore() -> None:
        for module, original in wrapped:
            module._gradient_checkpointing_func = original

    return restore


@contextlib.contextmanager
def patched(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """``owner.name = replacement`` for the block (an instance, class or module attribute)."""
    had = name in vars(owner)
    original = vars(owner)[name] if had else None
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def around(function: Callable, context: Callable[[], contextlib.AbstractContextManager]) -> Callable:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with context():
            return function(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def update_phases(trainer: Any, phase: Callable[..., contextlib.AbstractContextManager]) -> Iterator[None]:
    """Run ``phase(name)`` around each phase of ``trainer``'s PolicyUpdate (the forward's with
    ``tokens=`` its batch's), ``phase("logprob_head")`` around the fused head's forward,
    ``phase("lora_layer")`` around each LoRA layer's forward and ``phase("recompute")`` around each
    recomputed decoder layer, for the block."""
    # The fused head (trl.trainer.add_fused_lm_head) runs TRL's public autograd Function
    # trl.kernels.ChunkedLogProbFunction, looking its apply up on each call.
    from trl.kernels import ChunkedLogProbFunction

    from loop_trainer.training import update as update_module

    policy_update = trainer.policy_update
    strategy = policy_update.strategy
    # its forward inside a range
    marked_head = staticmethod(around(ChunkedLogProbFunction.apply, lambda: phase("logprob_head")))

    token_logprobs = update_module.token_logprobs

    def forward(model: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        with phase("forward", tokens=int(batch.input_ids.numel())):
            return token_logprobs(model, batch, *args, **kwargs)

    restore = mark_checkpointed_layers(strategy.model, lambda: phase("recompute"))
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                patched(
                    policy_update, "fixed_logprobs", around(policy_update.fixed_logprobs, lambda: phase("old_logprobs"))
                )
            )
            stack.enter_context(patched(update_module, "token_logprobs", forward))
            stack.enter_context(patched(strategy, "backward", around(strategy.backward, lambda: phase("backward"))))
            stack.enter_context(patched(strategy, "step", around(strategy.step, lambda: phase("optimizer"))))
            stack.enter_context(patched(ChunkedLogProbFunction, "apply", marked_head))
            for layer in strategy.model.modules():  # PEFT's LoRA layers: base_layer beside lora_A / lora_B
                if hasattr(layer, "base_layer") and hasattr(layer, "lora_A"):
                    stack.enter_context(patched(layer, "forward", around(layer.forward, lambda: phase("lora_layer"))))
            yield
    finally:
        restore()
