"""How the update is shared between processes: one object for a single process, DDP and DeepSpeed.

The policy update and the start-up stress test say *what* to compute; this says how passes and
gradients are matched across processes:

* every process runs the same number of forward/backward passes where the backend needs it
  (under DeepSpeed every pass is collective: ZeRO-3 gathers each layer's parameters and
  reduce-scatters its gradients), padding with stand-in passes whose results are dropped;
* gradients are averaged once per minibatch (DDP's ``no_sync`` on all but the last micro-batch;
  DeepSpeed's accumulation boundary on the last);
* the optimizer step happens only after LOOP's checks, so DeepSpeed's engine is driven directly
  rather than through ``accelerator.backward`` (which would step inside the last backward).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

T = TypeVar("T")


class DistributedSetupError(RuntimeError):
    """A launch that would train processes apart, or deadlock."""


class DistributionStrategy:
    """Backward, step and discard for one optimizer step's worth of micro-batches, plus the
    collectives the update's metrics need. ``optimizer`` and ``scheduler`` are the Trainer's
    (accelerate-wrapped) ones; ``model`` is the wrapped model."""

    def __init__(
        self, accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, scheduler: Any, max_grad_norm: float
    ):
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm

    # --- who does what --------------------------------------------------------------------------
    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def process_index(self) -> int:
        return self.accelerator.process_index

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def deepspeed_engine(self) -> Any | None:
        return deepspeed_engine(self.accelerator)

    def share(self, items: Sequence[T]) -> list[T]:
        """This process's part of ``items`` (round-robin over processes)."""
        return list(items[self.process_index :: self.num_processes])

    @property
    def passes_are_collective(self) -> bool:
        return self.deepspeed_engine is not None and self.num_processes > 1

    def matched_pass_count(self, local: int) -> int:
        """How many forward passes this process must run so that collective passes stay matched:
        the busiest process's count where passes are collective, else ``local``."""
        if not self.passes_are_collective:
            return local
        return int(self.accelerator.gather(torch.tensor([local], device=self.device)).max())

    def micro_batches_per_step(self, local: int, minibatch_size: int, micro_batch_size: int) -> int:
        """Micro-batches each process runs for one optimizer step. Without DeepSpeed a process with
        no trajectory still runs one (a zero-loss stand-in) so DDP's gradient all-reduce happens
        everywhere; under DeepSpeed every process runs as many as the largest share needs."""
        if self.deepspeed_engine is None:
            return max(local, 1)
        largest_share = -(-minibatch_size // self.num_processes)
        return max(local, -(-largest_share // micro_batch_size))

    # --- one optimizer step ---------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulating(self, last: bool) -> Iterator[None]:
        """Wrap one micro-batch's forward and backward; gradients are reduced across processes
        only on the ``last`` micro-batch of the step."""
        engine = self.deepspeed_engine
        if engine is not None:
            engine.set_gradient_accumulation_boundary(last)
            yield
        elif last or self.num_processes == 1:
            yield
        else:
            with self.accelerator.no_sync(self.model):
                yield

    def backward(self, loss: torch.Tensor) -> None:
        engine = self.deepspeed_engine
        if engine is not None:
            # scale_wrt_gas=False: LOOP's constant divisor already makes the accumulated gradient
            # the minibatch's; DeepSpeed must not divide again by its gradient_accumulation_steps.
            engine.backward(loss, scale_wrt_gas=False)
        else:
            self.accelerator.backward(loss)

    def step(self) -> tuple[float, bool]:
        """Clip and apply the accumulated gradients. Returns (pre-clip global gradient norm, whether
        the update was applied); a non-applied or non-finite step leaves no gradients behind."""
        engine = self.deepspeed_engine
        if engine is not None:
            # ZeRO computes the norm over all partitions before clipping. A non-finite norm (or an
            # fp16 overflow) makes it skip the update and clear the gradients itself.
            engine.step()
            norm, applied = engine.get_global_grad_norm(), engine.was_step_applied()
        else:
            norm, applied = self.accelerator.clip_grad_norm_(self.model.parameters(), self.max_grad_norm), True
        grad_norm = float(norm) if norm is not None else float("nan")
        if not applied or not torch.isfinite(torch.tensor(grad_norm)):
            self.discard_gradients()
            return grad_norm, False
        # Under DeepSpeed accelerate's optimizer wrapper ignores step() and zero_grad() (the engine
        # did both), as its scheduler wrapper does when the scheduler is DeepSpeed's own. The
        # Trainer's scheduler is stepped here.
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        return grad_norm, True

    def discard_gradients(self) -> None:
        """Drop the accumulated gradients of a step that is skipped."""
        engine = self.deepspeed_engine
        if engine is None:
            self.optimizer.zero_grad()
        else:
            # accelerate's DeepSpeed optimizer wrapper ignores zero_grad(). ZeRO-3's own zero_grad
            # also restarts accumulation: the next backward overwrites the reduced gradient
            # partitions (micro_step_id 0) instead of adding to them. ZeRO-1/2's does neither.
            engine.optimizer.zero_grad()
            restart_zero_accumulation(engine.optimizer)

    # --- metrics across processes ---------------------------------------------------------------
    def sum(self, values: Sequence[float]) -> list[float]:
        if self.num_processes == 1:
            return list(values)
        return self.accelerator.reduce(torch.tensor(list(values), device=self.device), "sum").tolist()

    def min_max(self, low: float, high: float) -> tuple[float, float]:
        if self.num_processes == 1:
            return low, high
        every = self.accelerator.gather(torch.tensor([[low, -high]], device=self.device))
        return float(every[:, 0].min()), -float(every[:, 1].min())


def deepspeed_engine(accelerator: Accelerator) -> Any | None:
    """The DeepSpeed engine accelerate wrapped the model in (None without DeepSpeed)."""
    wrapper = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return None if wrapper is None else wrapper.engine


def restart_zero_accumulation(optimizer: Any) -> None:
    """Forget a discarded step's gradients in a ZeRO-1/2 optimizer the way its own skipped (overflow) step does;
    its ``zero_grad`` clears only the parameters' ``.grad``. Left behind, the reduced gradient partitions reach the
    next step (the start-up stress test's reached the first one), and with the optimizer state on the CPU
    (ZeRO-Offload) the accumulation counter makes the next minibatch's first backward add to the discarded
    gradients kept in host memory, and the host buffers' NaN flag skips the next step as well
    (tests/vllm_deepspeed/test_zero_updates.py). DeepSpeed 0.19's attributes; any other optimizer is left as it is."""
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID, DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return
    optimizer.micro_step_id = INITIAL_MICRO_STEP_ID  # as step() does first: the next backward overwrites
    optimizer._release_preflattened_grad_buffers()
    # what the step would have taken (averaged) and what earlier backwards summed for it (all_grad_tensors)
    for gradients in (optimizer.averaged_gradients, optimizer.all_grad_tensors):
        for group in gradients:
            gradients[group] = None
    if optimizer.cpu_offload:
        optimizer._offload_accumulated_param_ids = set()  # as step() does: no parameter awaits its host copy
        optimizer.reset_cpu_buffers()  # the NaN flag and per-parameter norms of what was discarded


def check_launch(accelerator: Accelerator) -> None:
    """Refuse launches whose processes would train apart."""
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


def zero_stage(accelerator: Accelerator) -> int | None:
    """The DeepSpeed ZeRO stage the accelerator runs, if any."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return getattr(plugin, "zero_stage", None) if plugin is not None else None


def optimizer_state_layout(stage: int | None, num_processes: int) -> dict[str, int] | None:
    """How a checkpoint holds the optimizer state, where that ties a resume to the launch that wrote it: DeepSpeed
    writes its own checkpoint (``global_step*/``), whose ZeRO stage 1-3 partitions the state over the processes and
    cannot load it into another stage, nor as it is into another process count (DeepSpeed refuses: "a DP world size
    of 2 but the current world size is 1"; :mod:`.repartition` goes through its universal checkpoint), while
    Trainer's ``optimizer.pt`` without DeepSpeed is whole, and a launch with DeepSpeed finds nothing in it (nor does
    one without DeepSpeed in a DeepSpeed checkpoint: the optimizer would restart silently). None: the whole state,
    any number of processes. Offloading the state to the CPU changes nothing here (a ZeRO-2 checkpoint with and
    without ``offload_optimizer_device`` loads either way: measured). ``stage``: the launch's DeepSpeed ZeRO stage
    (None: no DeepSpeed; :func:`zero_stage`); ``num_processes``: its process count."""
    if stage is None:
        return None
    return {"deepspeed_zero_stage": stage, "processes": num_processes} if stage else {"deepspeed_zero_stage": 0}


def end_distributed_run(settle_seconds: float = 0.25) -> None:
    """End this process's part in a finished run, while the interpreter is still whole: destroy the process group
    and, under gloo, give its worker threads a moment to let go of the last collective. Call it last, once this
    process has written everything (``loop-train`` does after a finished run; a script of its own under
    ``accelerate launch`` or torchrun should too); with no process group it does nothing. No barrier: the other
    processes may still be busy without collectives for a long while (the main one uploading to the Hub), and a
    barrier would time out under them (``ddp_timeout``).

    Why: a gloo worker thread releases a collective's tensors after the caller has seen the collective finish, and
    releasing a tensor Python owns takes the GIL. If the process is finalising its interpreter by then, the thread
    is made to exit, which aborts the process (SIGABRT, "terminate called without an active exception") after a
    finished run (torch 2.13; seen in core dumps). Destroying the group does not stop gloo's threads (nor do its
    ``shutdown`` and ``abort``: measured): they live on while anything still holds the group, as DeepSpeed's
    partitioned parameters do, and nothing visible from Python says when they are done, so the GIL is left free for
    ``settle_seconds``. Measured on 2 CPU processes under ZeRO-3 (tests/vllm_deepspeed/test_zero3_overlap.py's
    launch): without this, 2 aborts in 59 launches; with a barrier and the destroy but no pause, 1 in 11 (the
    barrier's own work then held the collectives before it); with the barrier, the destroy and the pause, none in
    100, nor in 50 more with both cores kept busy by other processes; as here (the destroy and the pause), none in
    100."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    gloo = "gloo" in str(torch.distributed.get_backend())
    torch.distributed.destroy_process_group()
    if gloo:
        time.sleep(settle_seconds)
