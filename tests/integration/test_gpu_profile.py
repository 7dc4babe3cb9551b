"""The GPU battery's profile section (where the update's time and peak memory go): the parts only a GPU run
exercises (kernel events, the allocator history) on made-up events whose answer is known. Its CPU mode end to end
is tested with the battery's other sections, in test_gpu_check.py."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root, for the benchmarks package


class FakeEvent:
    """A ``_KinetoEvent`` as read_events reads it."""

    def __init__(self, name, start, end, *, device=False, correlation=0, linked=0, thread=2, shapes=(), note=False):
        from torch.autograd import DeviceType

        self._values = {
            "name": name,
            "start_ns": start,
            "end_ns": end,
            "device_type": DeviceType.CUDA if device else DeviceType.CPU,
            "correlation_id": correlation,
            "linked_correlation_id": linked,
            "start_thread_id": thread,
            "shapes": [list(s) for s in shapes],
            "is_user_annotation": note,
        }

    def __getattr__(self, name):
        return lambda: self._values[name]


def test_kernels_are_categorised_by_their_launching_op_its_callers_and_the_phase():
    from benchmarks.gpu_battery.profile_kernels import read_events, summarize

    engine = 3  # autograd's device thread; the Python thread is FakeEvent's default
    cpu = [
        FakeEvent("profile::update", 0, 10_000, correlation=1),
        FakeEvent("profile::forward", 100, 3_000, correlation=2),
        FakeEvent("aten::linear", 200, 900, correlation=3),
        FakeEvent("aten::_to_copy", 210, 290, correlation=18),  # autocast's cast of the weight
        FakeEvent("aten::copy_", 220, 280, correlation=19),
        FakeEvent("aten::mm", 300, 400, correlation=4, shapes=[(16384, 3584), (3584, 3584)]),
        FakeEvent("aten::mm", 500, 600, correlation=5, shapes=[(16384, 3584), (3584, 8)]),
        FakeEvent("aten::_scaled_dot_product_flash_attention", 1_000, 1_100, correlation=6),
        FakeEvent("profile::logprob_head", 2_000, 2_500, correlation=7),  # launches a Triton kernel itself
        FakeEvent("aten::copy_", 2_600, 2_700, correlation=8),
        FakeEvent("profile::backward", 3_000, 8_000, correlation=9),
        FakeEvent("autograd::engine::evaluate_function: MmBackward0", 3_100, 3_900, correlation=10, thread=engine),
        FakeEvent("aten::mm", 3_200, 3_800, correlation=11, thread=engine, shapes=[(16384, 3584), (3584, 3584)]),
        FakeEvent("profile::recompute", 4_000, 5_000, correlation=12, thread=engine),
        FakeEvent("aten::mul", 4_100, 4_200, correlation=13, thread=engine),
        FakeEvent(
            "autograd::engine::evaluate_function: ChunkedLogProbFunctionBackward",
            5_100,
            5_900,
            correlation=14,
            thread=engine,
        ),
        FakeEvent(
            "aten::addmm", 5_200, 5_300, correlation=15, thread=engine, shapes=[(4096,), (4096, 3584), (3584, 4096)]
        ),
        FakeEvent("profile::optimizer", 8_000, 9_000, correlation=16),
        FakeEvent("aten::_fused_adamw_", 8_100, 8_200, correlation=17),
        FakeEvent("cudaLaunchKernel", 310, 320, linked=4),  # a runtime row: not an op
    ]

    def kernel(name, start, duration, launched_by):
        return FakeEvent(name, start, start + duration, device=True, linked=launched_by)

    device = [
        kernel("elementwise_copy_kernel", 300, 30, 19),
        kernel("nvjet_base_gemm", 400, 1_000, 4),
        kernel("nvjet_small_gemm", 1_400, 100, 5),
        kernel("pytorch_flash::flash_fwd_kernel", 1_450, 300, 6),
        kernel("_forward_kernel", 2_100, 200, 7),
        kernel("Memcpy DtoH (Device -> Pinned)", 2_650, 50, 8),
        kernel("nvjet_base_gemm", 3_300, 1_000, 11),
        kernel("elementwise_kernel", 4_300, 100, 13),
        kernel("nvjet_head_gemm", 5_300, 500, 15),
        kernel("multi_tensor_apply_kernel", 8_300, 200, 17),
        kernel("stray_kernel", 9_500, 100, 999),  # its op is not in the profile
        FakeEvent("profile::forward", 100, 3_000, device=True, note=True),  # a gpu_user_annotation: not timed
    ]
    profiler = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: cpu + device)))
    ops, units = read_events(profiler, "cuda")
    assert len(units) == 11
    result = summarize(ops, units, lora_r=8, vocab_size=151936)
    seconds = {c["category"]: round(c["seconds"] * 1e9) for c in result["categories"]}
    assert seconds == {
        "base GEMMs": 2_000,
        "LoRA GEMMs": 100,
        "attention": 300,
        "log-prob head": 700,
        "norms and elementwise": 100,
        "optimizer": 200,
        "memcpy and copies": 80,
        "other": 100,
    }
    phases = {p["phase"]: round(p["seconds"] * 1e9) for p in result["phases"]}
    assert phases == {
        "old_logprobs": 0,
        "forward": 1_680,
        "backward": 1_500,
        "recompute": 100,
        "optimizer": 200,
        "other": 100,
    }
    assert round(result["recompute_seconds"] * 1e9) == 100
    assert result["top_kernels"][0] == {
        "name": "nvjet_base_gemm",
        "seconds": pytest.approx(2e-6),
        "share": pytest.approx(2_000 / 3_580),
        "count": 2,
        "category": "base GEMMs",
    }
    gemm = next(c for c in result["categories"] if c["category"] == "base GEMMs")
    assert gemm["gemm_tflop_per_s"] == pytest.approx(2 * 2 * 16384 * 3584 * 3584 / 2e-6 / 1e12)
    # the flash kernel overlaps the small GEMM's end: the busy time counts that stretch once
    assert round(result["busy_seconds"] * 1e9) == 3_580 - 50
    assert result["wall_seconds"] == pytest.approx(1e-5)


def test_the_peak_is_replayed_from_the_allocator_history_and_split_into_terms():
    from benchmarks.gpu_battery.profile_memory import StageLog, breakdown

    mib = 2**20

    def frames(*names):  # innermost first, the main thread ending in <module>
        return [{"filename": f, "name": n, "line": 1} for f, n in names]

    main = [("/x/run.py", "<module>")]
    layer = ("/site-packages/transformers/models/qwen2/modeling_qwen2.py", "forward")
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 64 * mib},
        {
            "action": "alloc",
            "addr": 1,
            "size": 4 * mib,
            "frames": frames(layer, ("/b/profile_marks.py", "_forward_layer"), *main),
        },
        {
            "action": "alloc",
            "addr": 2,
            "size": 8 * mib,
            "frames": frames(("/site-packages/torch/optim/adamw.py", "_init_group"), *main),
        },
        {
            "action": "alloc",
            "addr": 3,
            "size": 2 * mib,
            "frames": frames(("/site-packages/trl/kernels/chunked_logprob.py", "forward"), *main),
        },
        {"action": "free_requested", "addr": 3, "size": 2 * mib},
        {"action": "free_completed", "addr": 3, "size": 2 * mib},
        {"action": "alloc", "addr": 4, "size": 2 * mib, "frames": []},  # autograd's thread: a gradient
        {"action": "alloc", "addr": 5, "size": 3 * mib, "frames": []},  # an activation gradient
        {
            "action": "alloc",
            "addr": 6,
            "size": 5 * mib,
            "frames": frames(layer, ("/b/profile_marks.py", "_recomputed_layer")),
        },
        {
            "action": "alloc",
            "addr": 7,
            "size": 1 * mib,
            "frames": frames(("/site-packages/trl/trainer/utils.py", "_fused_forward"), *main),
        },
        {"action": "free_completed", "addr": 100, "size": 1 * mib},  # allocated before the recording
        {"action": "free_completed", "addr": 6, "size": 5 * mib},  # after the peak
        {"action": "alloc", "addr": 8, "size": 1 * mib, "frames": frames(*main)},
    ]
    log = StageLog("cpu")
    log.records = [{"seq": 0, "stage": "backward", "tokens": 32, "peak_gib": 1.0}]
    log.gradient_addresses = {0: {4}}
    log.optimizer = SimpleNamespace(state={"p": {"exp_avg": FakeStorageTensor(2, 8 * mib)}})
    log.history = {"allocated": 10 * mib, "reserved": 20 * mib, "weights": 6 * mib, "trace": trace}
    result = breakdown(log, outside_allocator=0)
    # before: 10; +4 +8 +2 -2 +2 +3 +5 +1 = 33 MiB at the peak (the pre-recording free comes after it)
    assert result["peak_allocated_gib"] * 1024 == pytest.approx(33)
    assert result["reserved_at_peak_gib"] * 1024 == pytest.approx(84)
    terms = {t["term"]: round(t["gib"] * 1024, 3) for t in result["terms"]}
    assert terms == {
        "weights": 6,
        "persistent before the update (buffers, other)": 4,
        "checkpointed hidden states (forward)": 4,
        "optimizer state": 8,
        "parameter gradients": 2,
        "activation gradients and backward buffers": 3,
        "recomputed layer activations (backward)": 5,
        "log-prob head": 1,
        "reserved but unallocated (allocator cache)": 51,
    }
    assert sum(terms.values()) == pytest.approx(84)


class FakeStorageTensor:
    def __init__(self, address, nbytes):
        self.device = SimpleNamespace(type="cuda")
        self._storage = SimpleNamespace(nbytes=lambda: nbytes, data_ptr=lambda: address)

    def untyped_storage(self):
        return self._storage
