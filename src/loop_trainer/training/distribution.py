"""LOOPTrainer's multi-process guards and the DeepSpeed engine it drives directly.

Under DeepSpeed every forward and backward is collective (ZeRO-3 gathers each layer's parameters
and reduce-scatters its gradients), so processes must run the same number of passes, and the
update drives the engine itself rather than through ``accelerator.backward`` (which would take an
optimizer step inside the last micro-batch's backward, before LOOP's loss and KL checks).
"""

from __future__ import annotations

import os
from typing import Any

from accelerate.utils import DistributedType


class DistributedSetupError(RuntimeError):
    """A launch that would train processes apart, or deadlock."""


class DistributedMixin:
    """Mixed into LOOPTrainer (expects ``self.accelerator``, ``self.optimizer``)."""

    def _deepspeed_engine(self) -> Any | None:
        """The DeepSpeed engine accelerate wrapped the model in (None without DeepSpeed)."""
        wrapper = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        return None if wrapper is None else wrapper.engine

    def _discard_gradients(self) -> None:
        """Drop the accumulated gradients of a minibatch whose optimizer step is skipped."""
        engine = self._deepspeed_engine()
        if engine is None:
            self.optimizer.zero_grad()
        else:
            # accelerate's DeepSpeed optimizer wrapper ignores zero_grad(). ZeRO's own zero_grad
            # also restarts accumulation: with ZeRO-3 the next backward overwrites the reduced
            # gradient partitions (micro_step_id 0) instead of adding to them.
            engine.optimizer.zero_grad()

    def check_distributed_launch(self) -> None:
        accelerator = self.accelerator
        world = accelerator.num_processes
        if world > 1 and accelerator.distributed_type == DistributedType.NO:
            # Several processes but no DDP/DeepSpeed wrapping: gradients would never be averaged.
            raise DistributedSetupError(
                f"{world} processes but no distributed backend: launch with `accelerate launch` (or create "
                "PartialState(cpu=True, backend='gloo') on CPU) so gradients are shared"
            )
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if launched > world:
            # On a machine without GPUs accelerate 1.15 sets up no process group for `accelerate
            # launch`/torchrun: every process would train alone on its share of the data.
            raise DistributedSetupError(
                f"{launched} processes were launched (WORLD_SIZE) but accelerate sees {world}: on CPU create "
                "PartialState(backend='gloo') (DeepSpeed, with ACCELERATE_USE_DEEPSPEED=true) or "
                "PartialState(cpu=True, backend='gloo') (DDP) before the LOOPConfig, and pass "
                "accelerator_config={'use_configured_state': True}"
            )

    def check_generation_under_zero3(self, samples_with_training_model: bool) -> None:
        """Sampling with the training model under multi-process ZeRO-3 would deadlock: each decode
        step is a collective forward, and episodes of different processes take different numbers
        of turns and tokens."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        stage = getattr(plugin, "zero_stage", None) if plugin is not None else None
        if samples_with_training_model and stage == 3 and self.accelerator.num_processes > 1:
            raise DistributedSetupError(
                f"ZeRO-3 on {self.accelerator.num_processes} processes cannot sample with the training model (every "
                "forward is collective and episodes differ in length): set use_vllm: true, or use ZeRO-2/DDP"
            )
