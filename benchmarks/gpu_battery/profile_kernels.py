"""Where a policy update's time goes, from one ``torch.profiler`` run: every GPU kernel (on CPU,
every op's self time) put in one category, by the op that launched it and that op's callers.

The update is marked (:mod:`.profile_marks`) with ``record_function`` ranges so the profile can
be cut without guessing:

* ``profile::old_logprobs`` / ``forward`` / ``backward`` / ``optimizer``: PolicyUpdate's phases
  (fixed log-probs, each micro-batch's log-prob forward, its backward, clip + AdamW + zero_grad);
  each range ends after ``synchronize``, so a phase's wall time holds its kernels; a kernel's phase
  is the range its launching op started in;
* ``profile::recompute``: a checkpointed decoder layer run again inside the backward;
* ``profile::logprob_head``: TRL's fused log-prob head (``ChunkedLogProbFunction``); its backward
  is the autograd node ``ChunkedLogProbFunctionBackward``;
* ``profile::lora_layer``: a PEFT LoRA layer's forward (its base GEMM, adapter GEMMs, casts, scaling
  and add): the non-GEMM kernels under it are reported apart, as the adapters' forward overhead.

A kernel's category: optimizer phase -> "optimizer"; under the head -> "log-prob head" (also any
GEMM with a vocabulary-sized dimension); under an SDPA op or an attention kernel -> "attention";
memcpy/memset or launched by a copy/cast/fill op -> "memcpy and copies" (autocast's casts inside a
linear too); under a GEMM op whose recorded shapes have the LoRA rank as a dimension -> "LoRA
GEMMs", other GEMMs -> "base GEMMs"; any other aten op -> "norms and elementwise"; the rest (no
launching op found) -> "other".
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.gpu_battery.profile_marks import RANGE

PHASES = ("old_logprobs", "forward", "backward", "recompute", "optimizer", "other")
PHASE_RANGES = ("old_logprobs", "forward", "backward", "optimizer")  # never nested in one another
CATEGORIES = (
    "base GEMMs",
    "LoRA GEMMs",
    "attention",
    "log-prob head",
    "norms and elementwise",
    "optimizer",
    "memcpy and copies",
    "other",
)
LEAF_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::addmm_"}
GEMM_OPS = LEAF_GEMMS | {"aten::matmul", "aten::linear"}
COPY_OPS = {
    "aten::copy_",
    "aten::_to_copy",
    "aten::to",
    "aten::clone",
    "aten::contiguous",
    "aten::cat",
    "aten::stack",
    "aten::fill_",
    "aten::zero_",
    "aten::zeros",
    "aten::zeros_like",
    "aten::new_zeros",
    "aten::full",
    "aten::ones_like",
}
ATTENTION_MARKS = (
    "scaled_dot_product",
    "scaleddotproduct",
    "flash_attention",
    "efficient_attention",
    "cudnn_attention",
)
ATTENTION_KERNELS = ("flash", "fmha", "attention", "sdpa")
HEAD_MARKS = (RANGE + "logprob_head", "ChunkedLogProb")
HEAD_KERNELS = ("_forward_kernel", "_backward_kernel")  # TRL's Triton kernels, should one come unlinked to its op
NOT_TIMED = ("Stream Sync", "Event Sync", "Context Sync", "Device Sync")


@dataclass
class Op:
    """A CPU-side event: an aten op, an autograd node or a ``record_function`` range."""

    name: str
    start: int  # ns
    end: int
    thread: int
    shapes: list
    parent: int = -1  # index of the enclosing op on the same thread


@dataclass
class Unit:
    """What is timed: a GPU kernel, memcpy or memset (GPU mode), or an op's self time (CPU mode)."""

    name: str
    start: int  # ns
    duration: int
    op: int  # index of the op that launched it (CPU mode: the op itself); -1 if none was found


# --- reading the profile ------------------------------------------------------------------------
def read_events(profiler: Any, device: str) -> tuple[list[Op], list[Unit]]:
    """The ops (nested per thread) and the timed units of a finished ``torch.profiler.profile``."""
    from torch.autograd import DeviceType

    events = profiler.profiler.kineto_results.events()
    ops: list[Op] = []
    op_by_correlation: dict[int, int] = {}
    device_events = []
    for event in events:
        if event.device_type() != DeviceType.CPU:
            device_events.append(event)
        elif event.linked_correlation_id() == 0 and not event.name().startswith("["):  # not runtime/memory rows
            op_by_correlation[event.correlation_id()] = len(ops)
            ops.append(Op(event.name(), event.start_ns(), event.end_ns(), event.start_thread_id(), event.shapes()))
    _nest(ops)
    ranges = {op.name for op in ops if op.name.startswith(RANGE) or "#" in op.name}
    if device == "cpu":
        return ops, _self_times(ops)
    units = []
    for event in device_events:
        name = event.name()
        if event.is_user_annotation() or name in ranges or name.startswith(NOT_TIMED):
            continue
        op = op_by_correlation.get(event.linked_correlation_id(), -1)
        units.append(Unit(name, event.start_ns(), event.end_ns() - event.start_ns(), op))
    return ops, units


def _nest(ops: list[Op]) -> None:
    """Set each op's parent: the innermost op of its thread whose span holds it."""
    order = sorted(range(len(ops)), key=lambda i: (ops[i].thread, ops[i].start, -ops[i].end))
    stack: list[int] = []
    thread = None
    for i in order:
        op = ops[i]
        if op.thread != thread:
            stack, thread = [], op.thread
        while stack and ops[stack[-1]].end < op.end:
            stack.pop()
        op.parent = stack[-1] if stack else -1
        stack.append(i)


def _self_times(ops: list[Op]) -> list[Unit]:
    child_time = [0] * len(ops)
    for op in ops:
        if op.parent >= 0:
            child_time[op.parent] += op.end - op.start
    return [
        Unit(op.name, op.start, max(0, op.end - op.start - child_time[i]), i)
        for i, op in enumerate(ops)
        if op.end > op.start
    ]


# --- categories ---------------------------------------------------------------------------------
def _dims(shapes: list) -> list[int]:
    return [d for shape in shapes if isinstance(shape, list | tuple) for d in shape if isinstance(d, int)]


def gemm_flops(name: str, shapes: list) -> float:
    """2·M·N·K (times the batch) of a leaf GEMM op from its recorded input shapes; 0 if unknown."""
    matrices = [s for s in shapes if isinstance(s, list | tuple) and len(s) >= 2]
    if len(matrices) < 2:
        return 0.0
    a, b = matrices[-2], matrices[-1]  # addmm/baddbmm: the bias comes first
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


class Classifier:
    def __init__(self, ops: list[Op], lora_r: int, vocab_size: int):
        self.ops, self.lora_r, self.vocab_size = ops, lora_r, vocab_size
        self._chains: dict[int, list[int]] = {}

    def chain(self, index: int) -> list[int]:
        """The op and its callers, innermost first."""
        if index < 0:
            return []
        if index not in self._chains:
            parent = self.ops[index].parent
            self._chains[index] = [index, *self.chain(parent)]
        return self._chains[index]

    def category(self, unit: Unit, phase: str) -> str:
        if phase == "optimizer":
            return "optimizer"
        chain = self.chain(unit.op)
        names = [self.ops[i].name for i in chain]
        gemm = next((i for i in chain if self.ops[i].name in GEMM_OPS), None)
        dims = _dims(self.ops[gemm].shapes) if gemm is not None else []
        if any(mark in name for name in names for mark in HEAD_MARKS) or self.vocab_size in dims:
            return "log-prob head"
        if not names and unit.name in HEAD_KERNELS:
            return "log-prob head"
        lowered = unit.name.lower()
        if any(mark in name.lower() for name in names for mark in ATTENTION_MARKS) or any(
            mark in lowered for mark in ATTENTION_KERNELS
        ):
            return "attention"
        if unit.name.startswith(("Memcpy", "Memset")) or (names and names[0] in COPY_OPS):
            return "memcpy and copies"  # also autocast's casts and matmul's reshape copies inside a linear
        if gemm is not None:
            return "LoRA GEMMs" if self.lora_r in dims else "base GEMMs"
        if names and names[0].startswith("aten::"):
            return "norms and elementwise"
        return "other"


def _phase_finder(ops: list[Op]) -> Callable[[int], str]:
    spans = sorted((op.start, op.end, op.name[len(RANGE) :]) for op in ops if op.name[len(RANGE) :] in PHASE_RANGES)
    starts = [s[0] for s in spans]

    def phase(time: int) -> str:
        k = bisect.bisect_right(starts, time) - 1
        return spans[k][2] if k >= 0 and spans[k][1] >= time else "other"

    return phase


def _union(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


@dataclass
class _Kernel:
    """One kernel name's launches in the update: seconds, count, and seconds by category."""

    seconds: float = 0.0
    count: int = 0
    by_category: dict[str, float] = field(default_factory=lambda: defaultdict(float))


def _largest(seconds: dict[str, float], n: int) -> list[tuple[str, float]]:
    """The ``n`` largest entries, the largest first (ties in insertion order, as ``Counter.most_common``)."""
    return sorted(seconds.items(), key=lambda item: item[1], reverse=True)[:n]


def summarize(ops: list[Op], units: list[Unit], *, lora_r: int, vocab_size: int, top: int = 15) -> dict[str, Any]:
    """Seconds per category, per phase and for the recomputation; the busy fraction; the top kernels."""
    update = next((op for op in ops if op.name == RANGE + "update"), None)
    if update is None:
        raise RuntimeError("the profile holds no profile::update range")
    units = [u for u in units if update.start <= u.start <= update.end]
    classifier = Classifier(ops, lora_r, vocab_size)
    phase_at = _phase_finder(ops)
    marks: dict[tuple[int, str], bool] = {}

    def under(op: int, mark: str) -> bool:
        if (op, mark) not in marks:
            marks[op, mark] = op >= 0 and any(ops[i].name == RANGE + mark for i in classifier.chain(op))
        return marks[op, mark]

    seconds: dict[str, float] = defaultdict(float)
    counts: Counter = Counter()
    by_phase: dict[str, float] = defaultdict(float)
    recompute: dict[str, float] = defaultdict(float)
    top_ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    kernels: dict[str, _Kernel] = {}
    flops: dict[str, float] = defaultdict(float)
    gemm_seconds: dict[str, float] = defaultdict(float)
    counted_gemms: set[int] = set()
    lora_extra: dict[str, float] = defaultdict(float)
    for unit in units:
        launched_at = ops[unit.op].start if unit.op >= 0 else unit.start
        phase = "recompute" if under(unit.op, "recompute") else phase_at(launched_at)
        category = classifier.category(unit, phase)
        s = unit.duration / 1e9
        launcher = ops[unit.op].name if unit.op >= 0 else ""
        if launcher.startswith("aten::") and "GEMMs" not in category and under(unit.op, "lora_layer"):
            lora_extra[launcher] += s  # a LoRA layer's casts, scaling and add (forward and recompute)
        seconds[category] += s
        counts[category] += 1
        by_phase[phase] += s
        if phase == "recompute":
            recompute[category] += s
        top_ops[category][launcher or "(no op)"] += s
        kernel = kernels.setdefault(unit.name[:120], _Kernel())
        kernel.seconds += s
        kernel.count += 1
        kernel.by_category[category] += s
        if launcher in LEAF_GEMMS:
            gemm_seconds[category] += s
            if unit.op not in counted_gemms:  # an op's FLOPs once, however many kernels it launched
                counted_gemms.add(unit.op)
                flops[category] += gemm_flops(launcher, ops[unit.op].shapes)
    total = sum(seconds.values())
    wall = (update.end - update.start) / 1e9
    busy = _union([(u.start, u.start + u.duration) for u in units]) / 1e9
    phase_wall: dict[str, float] = defaultdict(float)
    for op in ops:
        name = op.name[len(RANGE) :]
        if op.name.startswith(RANGE) and name in PHASE_RANGES:
            phase_wall[name] += (op.end - op.start) / 1e9
    return {
        "wall_seconds": wall,
        "timed_seconds": total,
        "units": len(units),
        "busy_seconds": busy,
        "busy_fraction": busy / wall if wall else None,
        "sum_over_wall": total / wall if wall else None,
        "categories": [
            {
                "category": c,
                "seconds": seconds[c],
                "share": seconds[c] / total if total else 0.0,
                "count": counts[c],
                "mean_us": 1e6 * seconds[c] / counts[c] if counts[c] else None,
                "gemm_seconds": gemm_seconds[c],
                "gemm_tflop_per_s": flops[c] / gemm_seconds[c] / 1e12 if flops.get(c) and gemm_seconds[c] else None,
                "top_ops": [[name, s] for name, s in _largest(top_ops[c], 3)],
            }
            for c in CATEGORIES
        ],
        "phases": [
            {
                "phase": p,
                "seconds": by_phase[p],
                "share": by_phase[p] / total if total else 0.0,
                "wall_seconds": phase_wall.get(p),
            }
            for p in PHASES
        ],
        "lora_layer_other_seconds": sum(lora_extra.values()),
        "lora_layer_other_top_ops": [[name, s] for name, s in _largest(lora_extra, 4)],
        "recompute_seconds": sum(recompute.values()),
        "recompute_share": sum(recompute.values()) / total if total else 0.0,
        "recompute_by_category": {c: s for c, s in recompute.items() if s},
        "top_kernels": [
            {
                "name": name,
                "seconds": kernel.seconds,
                "share": kernel.seconds / total if total else 0.0,
                "count": kernel.count,
                "category": _largest(kernel.by_category, 1)[0][0],
            }
            for name, kernel in sorted(kernels.items(), key=lambda item: -item[1].seconds)[:top]
        ],
    }
