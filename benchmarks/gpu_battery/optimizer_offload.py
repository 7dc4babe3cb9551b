"""The update's peak memory with the optimizer state on the CPU (ZeRO-Offload), against GRPOTrainer's on the same
workload in the same call: the lever left for the memory goal (LOOP's update peak <= 0.6x GRPOTrainer's).

Round three's profile left LOOP's peak at 0.73x GRPOTrainer's with activation offloading (16.46 against 22.52 GiB,
full fine-tuning of the 1.5B shape); what remained at the peak was the optimizer state (5.75 GiB), the weights and
their gradients (2.88 GiB each) and the recomputed layer. A user moves the optimizer state with the accelerate
recipe ``recipes/accelerate/zero2-offload.yaml``: ZeRO-2 with ``offload_optimizer_device: cpu``, the fp32 master
weights, gradients and Adam's moments in host memory, the step on the CPU in DeepSpeed's CPU Adam (accelerate's
swap for the Trainer's AdamW; DeepSpeed compiles it on first use, about a minute).

Both runs are :mod:`.profile_memory`'s watches of ``update_throughput``'s workload (the profile section's: its
``update_spec``), each in a child process of its own: GRPOTrainer as the profile section runs it (one epoch, its peak
repeats in each), LOOP under ``accelerate launch --config_file recipes/accelerate/zero2-offload.yaml
--num_processes 1``, once plain and once with ``activation_offloading`` as well. CPU mode runs the same code on the
tiny shape (fp32, gloo; no allocator numbers), in the DeepSpeed venv; elsewhere the section says it is skipped.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from benchmarks.common import ROOT
from benchmarks.gpu_battery.common import deepspeed_environment, deepspeed_missing, device_for, section_limit, sizes_for
from benchmarks.gpu_battery.profile import trainer_memory_lines, update_spec, watched_in_a_process
from benchmarks.gpu_battery.report import _f

OFFLOAD_CONFIG = ROOT / "recipes" / "accelerate" / "zero2-offload.yaml"
DEADLINE_S = {"cuda": 285.0, "cpu": 560.0}  # gpu_check allows the section 300 s on a GPU, twice that on CPU
LAUNCH_MIN_S = 90.0  # a LOOP run under accelerate launch starts only with this much left: engine set-up and CPU Adam


def build_cpu_adam(mode: str) -> str | None:
    """DeepSpeed's CPU Adam compiled here (or loaded from the cache the children share), before any child needs it:
    the compile (about a minute) is then not inside a watched run, and a machine where it cannot be built says so.
    Returns why it cannot, or None."""
    os.environ.update(deepspeed_environment(mode))  # the children's extension cache and op settings
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
    except Exception as error:  # noqa: BLE001 - a compiler or header missing on this machine: said, not raised
        return f"DeepSpeed's CPU Adam does not build here ({type(error).__name__}: {str(error)[:300]})"
    return None


def run(mode: str) -> dict[str, Any]:
    missing = deepspeed_missing(mode)
    if missing:
        return {"skipped": missing}
    started = time.perf_counter()
    print("offload: building DeepSpeed's CPU Adam (cached after the first time)", flush=True)
    unbuilt = build_cpu_adam(mode)
    if unbuilt:
        return {"skipped": unbuilt}
    built_seconds = time.perf_counter() - started
    device = device_for(mode)
    spec = update_spec(sizes_for(mode), device)
    result: dict[str, Any] = {
        "shape": spec.shape or "tiny",
        "lengths": spec.lengths,
        "spec": dataclasses.asdict(spec),
        "cpu_adam_build_seconds": built_seconds,
    }
    # 15 s before the section's limit where gpu_check --seconds lowered it
    deadline = min(DEADLINE_S[device], section_limit("offload", mode) - 15.0)
    print("offload: GRPOTrainer's update, watched in a child process", flush=True)
    result["grpo"] = watched_in_a_process("grpo", dataclasses.replace(spec, ppo_epochs=1), deadline, started)
    offloaded = dataclasses.replace(spec, deepspeed=True)
    print(
        f"offload: LOOP's update under ZeRO-2 with the optimizer state on the CPU ({OFFLOAD_CONFIG.name})", flush=True
    )
    result["loop"] = watched_in_a_process(
        "loop", offloaded, deadline, started, launch=OFFLOAD_CONFIG, min_seconds=LAUNCH_MIN_S
    )
    if device == "cuda":  # activation offloading needs a GPU (TRL's offloader pins host memory)
        print("offload: the same with activation_offloading", flush=True)
        both = dataclasses.replace(offloaded, activation_offloading=True)
        result["loop_activations_offloaded"] = watched_in_a_process(
            "loop", both, deadline, started, launch=OFFLOAD_CONFIG, min_seconds=LAUNCH_MIN_S
        )
    grpo_peak = result["grpo"].get("peak_allocated_gib")
    for name in ("loop", "loop_activations_offloaded"):
        peak = result.get(name, {}).get("peak_allocated_gib")
        result[f"{name}_over_grpo_peak"] = peak / grpo_peak if peak and grpo_peak else None
    return result


def render(result: dict[str, Any]) -> list[str]:
    spec = result["spec"]
    lines = [
        "## The update's peak with the optimizer state on the CPU (ZeRO-Offload)",
        "",
        f"{result['shape']}, full fine-tuning, lengths {result['lengths']}, minibatch {spec['minibatch_size']}, "
        f"ppo_epochs {spec['ppo_epochs']} (GRPOTrainer: 1), micro-batch 1. LOOP under `accelerate launch --config_file "
        "recipes/accelerate/zero2-offload.yaml --num_processes 1` (ZeRO-2, fp32 master weights, gradients and Adam "
        "in CPU memory, DeepSpeed's CPU Adam); GRPOTrainer as the profile section runs it, without DeepSpeed.",
        "",
        f"LOOP, optimizer state on the CPU / GRPOTrainer peak allocated: **{_f(result.get('loop_over_grpo_peak'), 3)}"
        "**",
        "",
    ]
    if "loop_activations_offloaded" in result:
        ratio = _f(result.get("loop_activations_offloaded_over_grpo_peak"), 3)
        lines += [f"... and with `activation_offloading: true` as well: **{ratio}**", ""]
    engine = result["loop"].get("deepspeed")
    if engine:
        lines += [
            f"LOOP's engine: ZeRO-{engine['zero_stage']}, offload {engine['offload_optimizer']}, "
            f"`{engine['optimizer']}`.",
            "",
        ]
    lines += trainer_memory_lines("loop, optimizer state on the CPU", result["loop"])
    if "loop_activations_offloaded" in result:
        lines += trainer_memory_lines(
            "loop, optimizer state and activations on the CPU", result["loop_activations_offloaded"]
        )
    return lines + trainer_memory_lines("grpo", result["grpo"])
