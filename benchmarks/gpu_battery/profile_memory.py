"""What holds the memory at the peak of a policy update: ``benchmarks/update_throughput.py``'s own
LOOP and GRPOTrainer runs (``run_loop`` / ``run_grpo``), watched from a subclass of each trainer.

* Stages: ``memory_allocated`` after the model, the trainer (adapter, fused head) and the optimizer
  are built and after the first optimizer step; for each phase span (old log-probs, each micro-
  batch's forward and backward, each optimizer step) its start, peak (``max_memory_allocated``,
  reset at the span's start) and end. Weights, gradients and optimizer state are also counted from
  the tensors themselves (their storages), which works on CPU too.
* On CUDA, the allocator's history (``torch.cuda.memory._record_memory_history``, Python stacks at
  allocation) is replayed to the peak; each block alive there is put in one term: optimizer state
  and parameter gradients by address (the optimizer's state tensors, the gradients present in the
  peak's span), then by the allocating Python stack: TRL's log-prob head (``trl/kernels``, TRL's
  fused forward), a checkpointed layer recomputed in the backward or run in the forward (the
  battery's ``_recomputed_layer`` / ``_forward_layer`` frames), the optimizer, the model's forward
  outside the layers, no Python stack at all (autograd's engine thread: activation gradients and
  backward buffers); blocks allocated before the update are weights and "persistent". The reserved
  but unallocated bytes at the peak are the allocator's cache (fragmentation).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
import traceback
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.gpu_battery.common import GIB
from benchmarks.gpu_battery.profile_marks import around, mark_checkpointed_layers, patched, update_phases

MAX_TRACE_ENTRIES = 3_000_000  # one update of the 1.5B model makes a few 100k


def storages(tensors: Any, device_type: str | None = None) -> dict[int, int]:
    """address -> bytes of each distinct storage behind ``tensors`` (those on ``device_type`` where it is given)."""
    found: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None or not hasattr(tensor, "untyped_storage") or tensor.device.type == "meta":
            continue
        if device_type is not None and tensor.device.type != device_type:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _optimizer_tensors(optimizer: Any) -> Iterator[Any]:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps one
    for state in inner.state.values():
        yield from (value for value in state.values() if hasattr(value, "untyped_storage"))


class StageLog:
    """Memory at the points and spans of one trainer's update (see the module docstring)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.model: Any = None
        self.optimizer: Any = None
        self.records: list[dict[str, Any]] = []
        self.gradient_addresses: dict[int, set[int]] = {}  # span seq -> gradients alive in it
        self.running_peak = 0
        self.history: dict[str, Any] | None = None
        self.history_error: str | None = None
        self.engine: dict[str, Any] | None = None  # the DeepSpeed engine's settings, where one wrapped the model
        self._last_tokens: int | None = None
        self._steps = 0
        self._open = 0

    def _tensors(self) -> dict[str, dict[int, int]]:
        """The trainer's weights, gradients and optimizer state on the device it trains on (on a GPU, not what a
        ZeRO-Offload run keeps in host memory)."""
        parameters = list(self.model.parameters()) if self.model is not None else []
        on = "cuda" if self.cuda else None
        optimizer = _optimizer_tensors(self.optimizer) if self.optimizer is not None else []
        return {
            "weights": storages(parameters, on),
            "gradients": storages((p.grad for p in parameters), on),
            "optimizer_state": storages(optimizer, on),
        }

    def _allocated(self) -> dict[str, float | None]:
        import torch

        if not self.cuda:
            return {"allocated_gib": None, "reserved_gib": None}
        return {
            "allocated_gib": torch.cuda.memory_allocated() / GIB,
            "reserved_gib": torch.cuda.memory_reserved() / GIB,
        }

    def point(self, stage: str) -> None:
        tensors = self._tensors()
        self.records.append(
            {
                "seq": len(self.records),
                "stage": stage,
                **self._allocated(),
                **{f"{k}_gib": sum(v.values()) / GIB for k, v in tensors.items()},
            }
        )

    @contextlib.contextmanager
    def span(self, stage: str, tokens: int | None = None) -> Iterator[None]:
        import torch

        if self._open or stage in ("recompute", "logprob_head", "lora_layer"):  # nested: the enclosing span has it
            yield
            return
        tokens = self._last_tokens if tokens is None and stage == "backward" else tokens
        self._last_tokens = tokens if stage in ("forward", "backward") else None
        before = self._tensors()["gradients"]
        start = self._allocated()["allocated_gib"]
        if self.cuda:
            self.running_peak = max(self.running_peak, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
        peak = torch.cuda.max_memory_allocated() if self.cuda else None
        if peak is not None:
            self.running_peak = max(self.running_peak, peak)
        tensors = self._tensors()
        seq = len(self.records)
        self.gradient_addresses[seq] = set(before) | set(tensors["gradients"])
        self.records.append(
            {
                "seq": seq,
                "stage": stage,
                "tokens": tokens,
                "start_gib": start,
                "peak_gib": peak / GIB if peak is not None else None,
                **self._allocated(),
                **{f"{k}_gib": sum(v.values()) / GIB for k, v in tensors.items()},
            }
        )
        if stage == "optimizer":
            self._steps += 1
            if self._steps == 1:
                self.point("after the first optimizer step")


@contextlib.contextmanager
def memory_history(enabled: bool, log: StageLog) -> Iterator[None]:
    """Record the CUDA allocator's history for the block; its snapshot goes to ``log.history``."""
    import torch

    if not enabled:
        yield
        return
    record = torch.cuda.memory._record_memory_history
    options: dict[str, Any] = {"context": "alloc", "stacks": "python", "max_entries": MAX_TRACE_ENTRIES}
    if "clear_history" in inspect.signature(record).parameters:
        options["clear_history"] = True  # a second watch in this process must not replay the first's history
    try:
        record("all", **options)
    except Exception:  # noqa: BLE001 - the stages are worth having without the history
        log.history_error = traceback.format_exc()[-2000:]
        yield
        return
    baseline = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
    weights = sum(log._tensors()["weights"].values())
    try:
        yield
        try:
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            log.history = {**baseline, "weights": weights, "trace": trace}
        except Exception:  # noqa: BLE001 - as above
            log.history_error = traceback.format_exc()[-2000:]
    finally:
        record(None)


# --- the peak, from the allocator's history ----------------------------------------------------
def replay(trace: list[dict[str, Any]], allocated: int, reserved: int) -> dict[str, Any]:
    """Allocated and reserved bytes after each history entry, from the values when recording began;
    the peak, the blocks alive there (their entry indices) and the pre-recording bytes freed by then."""
    peak, peak_index, peak_reserved = allocated, -1, reserved
    for i, entry in enumerate(trace):
        action, size = entry["action"], entry.get("size", 0)
        if action == "alloc":
            allocated += size
        elif action == "free_completed":
            allocated -= size
        elif action in ("segment_alloc", "segment_map"):
            reserved += size
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
        if allocated > peak:
            peak, peak_index, peak_reserved = allocated, i, reserved
    live: dict[int, int] = {}  # address -> index of the entry that allocated it
    freed_before_recording = 0
    for i, entry in enumerate(trace[: peak_index + 1]):
        if entry["action"] == "alloc":
            live[entry["addr"]] = i
        elif entry["action"] == "free_completed" and live.pop(entry["addr"], None) is None:
            freed_before_recording += entry.get("size", 0)
    return {
        "peak": peak,
        "peak_index": peak_index,
        "reserved_at_peak": peak_reserved,
        "live": sorted(live.values()),
        "freed_before_recording": freed_before_recording,
    }


def _innermost_first(trace: list[dict[str, Any]]) -> bool:
    """Whether a stack lists its innermost frame first: the main thread's outermost frame is ``<module>``."""
    for entry in trace:
        names = [frame.get("name") for frame in entry.get("frames") or []]
        if "<module>" in names:
            return names[-1] == "<module>" or names.index("<module>") > len(names) // 2
    return True


def term_of(frames: list[dict[str, Any]]) -> str:
    """The term of a block allocated during the update that is neither optimizer state nor a gradient."""
    if not frames:
        return "activation gradients and backward buffers"
    files = [str(frame.get("filename", "")).replace("\\", "/") for frame in frames]
    names = [frame.get("name", "") for frame in frames]
    owner = next((f for f in files if "/torch/" not in f), "")  # the innermost caller outside torch
    if any("trl/kernels/" in f for f in files) or owner.endswith("trl/trainer/utils.py"):
        return "log-prob head"
    if "_recomputed_layer" in names:
        return "recomputed layer activations (backward)"
    if "_forward_layer" in names:
        return "checkpointed hidden states (forward)"
    if any("/torch/optim/" in f for f in files):
        return "optimizer temporaries"
    if any("/transformers/models/" in f or "/peft/" in f for f in files):
        return "forward activations outside the layers"
    return "other (batch, loss, log-probs)"


def breakdown(log: StageLog, outside_allocator: int) -> dict[str, Any]:
    """The terms alive at the update's peak, in bytes, from ``log.history``."""
    history = log.history
    assert history is not None
    trace = history["trace"]
    state = replay(trace, history["allocated"], history["reserved"])
    peak_span = max(
        (r for r in log.records if r.get("peak_gib") is not None), key=lambda r: r["peak_gib"], default=None
    )
    gradients = log.gradient_addresses.get(peak_span["seq"], set()) if peak_span else set()
    optimizer = set(log._tensors()["optimizer_state"])
    order = 1 if _innermost_first(trace) else -1
    terms: dict[str, int] = defaultdict(int)
    terms["weights"] = history["weights"]
    terms["persistent before the update (buffers, other)"] = (
        history["allocated"] - history["weights"] - state["freed_before_recording"]
    )
    for i in state["live"]:
        entry = trace[i]
        if entry["addr"] in optimizer:
            term = "optimizer state"
        elif entry["addr"] in gradients:
            term = "parameter gradients"
        else:
            term = term_of((entry.get("frames") or [])[::order])
        terms[term] += entry["size"]
    terms["reserved but unallocated (allocator cache)"] = state["reserved_at_peak"] - state["peak"]
    total = state["reserved_at_peak"]
    return {
        "peak_allocated_gib": state["peak"] / GIB,
        "reserved_at_peak_gib": state["reserved_at_peak"] / GIB,
        "outside_allocator_gib": outside_allocator / GIB,
        "peak_span": peak_span,
        "trace_entries": len(trace),
        "trace_truncated": len(trace) >= MAX_TRACE_ENTRIES,
        "terms": [
            {"term": term, "gib": size / GIB, "share": size / total if total else None}
            for term, size in sorted(terms.items(), key=lambda item: -item[1])
        ],
    }


# --- the two trainers ---------------------------------------------------------------------------
def _outside_allocator(cuda: bool) -> int:
    import torch

    if not cuda:
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def _result(trainer: str, log: StageLog, measured: dict[str, Any], outside: int) -> dict[str, Any]:
    result: dict[str, Any] = {
        "trainer": trainer,
        "stages": log.records,
        "watched_update_seconds": measured.get("seconds"),  # with the watch and the snapshot in it
        "optimizer_steps": measured.get("optimizer_steps"),
        "padded_width": measured.get("padded_width"),
        "peak_allocated_gib": log.running_peak / GIB if log.cuda else None,
        "breakdown": {"error": log.history_error} if log.history_error else None,
        "deepspeed": log.engine,
    }
    if log.history is not None:
        try:
            result["breakdown"] = breakdown(log, outside)
        except Exception:  # noqa: BLE001 - the stages above are worth keeping without it
            result["breakdown"] = {"error": traceback.format_exc()[-3000:]}
    log.history = log.model = log.optimizer = None  # free the trace and the trainer's tensors
    return result


def observe_loop(spec: Any, trajectories: list[dict[str, Any]], output_dir: str) -> dict[str, Any]:
    """``update_throughput.run_loop`` with its LOOPTrainer watched by a :class:`StageLog`."""
    import loop_trainer
    from benchmarks import update_throughput

    log = StageLog(spec.device)

    class ObservedLOOPTrainer(loop_trainer.LOOPTrainer):
        def __init__(self, model: Any, *args: Any, **kwargs: Any):
            log.model = model
            log.point("model built")
            super().__init__(model, *args, **kwargs)
            log.model = self.model
            log.point("trainer built (fused head; adapter if any)")

        def prepare_for_iterations(self, *args: Any, **kwargs: Any) -> Any:
            from loop_trainer.training.distribution import deepspeed_engine

            prepared = super().prepare_for_iterations(*args, **kwargs)
            log.optimizer = self.optimizer
            engine = deepspeed_engine(self.accelerator)
            if engine is not None:
                optimizer = type(engine.basic_optimizer)
                log.engine = {
                    "zero_stage": engine.zero_optimization_stage(),
                    "offload_optimizer": engine.zero_cpu_offload(),
                    "optimizer": f"{optimizer.__module__}.{optimizer.__qualname__}",
                }
            log.point("optimizer created")
            return prepared

        def update_policy(self, samples: list[Any]) -> dict[str, float]:
            with memory_history(log.cuda, log), update_phases(self, log.span):
                return super().update_policy(samples)

    with patched(loop_trainer, "LOOPTrainer", ObservedLOOPTrainer):
        measured = update_throughput.run_loop(spec, trajectories, output_dir)
    return _result("loop", log, measured, _outside_allocator(log.cuda))


def observe_grpo(spec: Any, trajectories: list[dict[str, Any]], output_dir: str) -> dict[str, Any]:
    """``update_throughput.run_grpo`` with its GRPOTrainer watched by a :class:`StageLog`."""
    import torch
    import trl

    from benchmarks import update_throughput

    log = StageLog(spec.device)
    restores: list[Any] = []

    class ObservedGRPOTrainer(trl.GRPOTrainer):
        def __init__(self, *args: Any, **kwargs: Any):
            log.model = kwargs.get("model")
            log.point("model built")
            super().__init__(*args, **kwargs)
            log.model = self.model
            log.point("trainer built")
            self.accelerator.backward = around(self.accelerator.backward, lambda: log.span("backward"))

        def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
            optimizer = super().create_optimizer(*args, **kwargs)
            log.optimizer = optimizer
            log.point("optimizer created")
            # each step inside an "optimizer" span, opened and closed by torch's step hooks
            step_span = contextlib.ExitStack()
            optimizer.register_step_pre_hook(lambda *_: step_span.enter_context(log.span("optimizer")))
            optimizer.register_step_post_hook(lambda *_: step_span.close())
            return optimizer

        # The training forward has no public hook: TRL's private log-prob helper is watched (the old
        # log-probs, update_throughput.completion_logprobs, are watched below).
        def _get_per_token_logps_and_entropies(self, model: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
            restores.append(mark_checkpointed_layers(model, contextlib.nullcontext))
            stage = "forward" if torch.is_grad_enabled() else "old_logprobs"
            with log.span(stage, tokens=int(input_ids.numel())):
                return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)

        def train(self, *args: Any, **kwargs: Any) -> Any:
            with memory_history(log.cuda, log):
                return super().train(*args, **kwargs)

    completion_logprobs = update_throughput.completion_logprobs

    def observed_old_logprobs(model: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        restores.append(mark_checkpointed_layers(model, contextlib.nullcontext))
        with log.span("old_logprobs", tokens=int(input_ids.numel())):
            return completion_logprobs(model, input_ids, *args, **kwargs)

    try:
        with (
            patched(trl, "GRPOTrainer", ObservedGRPOTrainer),
            patched(update_throughput, "completion_logprobs", observed_old_logprobs),
        ):
            measured = update_throughput.run_grpo(spec, trajectories, output_dir)
    finally:
        for restore in reversed(restores):
            restore()
    return _result("grpo", log, measured, _outside_allocator(log.cuda))


def main(argv: list[str]) -> None:
    """``python -m benchmarks.gpu_battery.profile_memory grpo|loop SPEC.json OUT.json``: a trainer's watch
    in a process of its own, so the section can stop it at its deadline."""
    from benchmarks.gpu_battery.common import scratch
    from benchmarks.update_throughput import Spec, make_trajectories

    trainer, spec_path, out_path = argv
    spec = Spec(**json.loads(Path(spec_path).read_text()))
    observe = {"grpo": observe_grpo, "loop": observe_loop}[trainer]
    with scratch() as output_dir:
        result = observe(spec, make_trajectories(spec), output_dir)
    Path(out_path).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    if "WORLD_SIZE" not in os.environ:
        main(sys.argv[1:])
    else:  # under accelerate launch: end without a process-group teardown that could hang the launch
        status = 0
        try:
            main(sys.argv[1:])
        except BaseException:  # noqa: BLE001 - said on stderr and in the exit status, which the section reads
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
