"""The policy a :class:`~loop_trainer.rollout.backend.TransformersBackend` samples, shared by the backend and
its temperature views (:meth:`~loop_trainer.rollout.backend.TransformersBackend.with_temperature`): the
model, its merged-adapter view if any, the version of its weights, and what its KV cache allows.

The weights version is an integer bumped by whoever changes the weights: the generator's ``sync`` at
every new iteration (``RolloutGenerator.sync``), or :meth:`SampledPolicy.weights_changed` called by code
that changes them itself. Caches computed with the weights (the prefix caches, the merged adapter) are
keyed by it. Nothing reads torch's per-tensor version counters.
"""

from __future__ import annotations

import logging
import threading

import torch

from .kv_layout import KVLayout, probe_kv_layout
from .merged_adapter import MergedAdapter

logger = logging.getLogger(__name__)


class SampledPolicy:
    def __init__(self, model: torch.nn.Module, merged_adapter: MergedAdapter | None = None):
        if merged_adapter is not None and merged_adapter.policy is not model:
            raise ValueError("merged_adapter must be a view of the model the backend samples")
        self.model = model
        self.merged_adapter = merged_adapter
        self.version = 0
        """The weights' version: bumped by :meth:`weights_changed`."""
        self._layout: KVLayout | None = None
        self._layout_lock = threading.Lock()

    def weights_changed(self) -> None:
        """The weights were changed (an optimizer step, loaded weights): caches computed with the old
        ones are dropped at their next look-up, the merged adapter is merged again at the next decode loop."""
        self.version += 1

    @property
    def module(self) -> torch.nn.Module:
        """What the decode loop runs: the policy itself, or its view with the LoRA adapter merged."""
        return self.model if self.merged_adapter is None else self.merged_adapter.model

    def refreshed_module(self) -> torch.nn.Module:
        """:attr:`module`, with the merged adapter brought to the current weights version first (a no-op
        while the version is unchanged). Called at the start of every decode loop."""
        if self.merged_adapter is not None:
            self.merged_adapter.refresh(self.version)
        return self.module

    def kv_layout(
        self, device: torch.device, pad_token_id: int, *, static_decode: bool, share_prefixes: bool
    ) -> KVLayout:
        """What the model's KV cache allows, probed at the first call (one two-token prefill) and kept:
        it depends on the architecture only. The parts it turns off are logged once, in one line."""
        with self._layout_lock:
            if self._layout is None:
                self._layout = probe_kv_layout(self.model, device, pad_token_id)
                if note := self._layout.turned_off(static_decode, share_prefixes):
                    logger.warning(note)
            return self._layout
