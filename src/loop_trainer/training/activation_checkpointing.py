"""Activation checkpointing across the transformers versions LOOP supports: 5.18+ names it
``activation_checkpointing`` (``model.activation_checkpointing_enable``, ``is_activation_checkpointing``);
5.17, the version vLLM <= 0.31 accepts, only ``gradient_checkpointing``. A GPU run on 5.17 once
trained with checkpointing silently off because only the new names were looked for. LOOP reads the
name the installed transformers has, so none of its calls triggers 5.18+'s FutureWarning about the old
one (:func:`peft_wrapping`: PEFT's wrapping reads the old name itself). And the activations
checkpointing keeps, offloaded to CPU memory (``activation_offloading``)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..config.loop_config import checkpointing_kwargs, checkpointing_kwargs_key

if TYPE_CHECKING:
    from ..config import LOOPConfig

_OLD_NAME_WARNING = r"`is_gradient_checkpointing` is deprecated"


def is_checkpointing(model: Any) -> bool:
    """Whether ``model`` (a PreTrainedModel, or a PEFT model around one) recomputes activations; read
    under 5.18+'s name where the model has it (the old one warns there), else 5.17's."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(model.is_gradient_checkpointing if flag is None else flag)


@contextlib.contextmanager
def peft_wrapping() -> Iterator[None]:
    """Around PEFT's wrapping of a model (``get_peft_model``, ``PeftModel.from_pretrained``): without the
    FutureWarning it triggers on transformers 5.18+, where PEFT (0.21) reads ``model.is_gradient_checkpointing``,
    the deprecated alias of ``is_activation_checkpointing`` (the same value). Only that warning, only inside
    the block: any other warning of the wrapping still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_OLD_NAME_WARNING, category=FutureWarning)
        yield


def get_peft_model(model: Any, peft_config: Any, **kwargs: Any) -> Any:
    """``peft.get_peft_model`` inside :func:`peft_wrapping`."""
    from peft import get_peft_model as wrap

    with peft_wrapping():
        return wrap(model, peft_config, **kwargs)


def update_checkpointing_kwargs(args: LOOPConfig, **changes: Any) -> None:
    """Set ``changes`` in the config's checkpointing kwargs, under the name this transformers reads."""
    setattr(args, checkpointing_kwargs_key(args), {**checkpointing_kwargs(args), **changes})


def enable_checkpointing(model: Any, kwargs: dict[str, Any] | None = None) -> None:
    """Checkpoint ``model``'s decoder layers; ``kwargs`` as in a config's ``*_checkpointing_kwargs``
    (``every_n_layers`` and ``offload`` are transformers' own, the rest go to ``torch.utils.checkpoint``)."""
    kwargs = dict(kwargs or {})
    every_n_layers = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
        )
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
        )


def activation_offloading(model: Any, enabled: bool) -> Callable[[], contextlib.AbstractContextManager]:
    """The context of the update's forward passes: ``activation_offloading`` moves the tensors they
    save for the backward (with checkpointing, each layer's input: ``layers x tokens x hidden`` of
    the update's peak) to pinned CPU memory on a side stream, and back for the backward. TRL's
    offloader (SFTConfig's ``activation_offloading``), made once and entered for every forward; it
    skips the output head, whose activations the backward needs at once. Else nothing."""
    if not enabled:
        return contextlib.nullcontext
    from trl.models import get_act_offloading_ctx_manager

    offloader = get_act_offloading_ctx_manager(model, warn_if_no_head=False)
    return lambda: offloader
