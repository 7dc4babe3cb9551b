"""Where the policy update's time and peak memory go, to decide the fixes for MFU (0.288 on the
7B LoRA update at 16k tokens; goal >= 0.35) and for the update's peak (0.84x GRPOTrainer's; goal
<= 0.6x). One run collects what the decisions need:

1. **Kernel time** of the MFU measurement's update (``memory.py``: its trainer, trajectories and
   :func:`~benchmarks.gpu_battery.memory.measure_mfu`, whose MFU is recomputed here the same way),
   then one more update under ``torch.profiler`` with recorded shapes: kernel time per category,
   phase and recomputation, the GPU-busy fraction and the top kernels
   (:mod:`.profile_kernels`). No trace file is written. The update without activation checkpointing
   runs too where the memory plan says it fits.
2. **Peak memory** of the update comparison's workload (``update.py``'s sizes, through
   ``update_throughput.run_loop`` / ``run_grpo``): memory at each stage and, on CUDA, the bytes alive
   at the peak by term (:mod:`.profile_memory`). GRPOTrainer runs one epoch (its peak repeats in
   each) and only while the section has time for it.

CPU mode runs the same code on the tiny shapes, without the MFU updates (the memory section runs
those): CPU ops' self time instead of kernels, tensor counts instead of allocator numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT
from benchmarks.gpu_battery import memory as mfu_section
from benchmarks.gpu_battery.common import (
    GIB,
    TINY_CONFIG,
    bf16_peak,
    deepspeed_launch,
    device_for,
    gpu_name,
    qwen_tokenizer,
    scratch,
    shape_config,
    sizes_for,
    stop_process_tree,
)
from benchmarks.gpu_battery.profile_kernels import PHASE_RANGES, read_events, summarize
from benchmarks.gpu_battery.profile_marks import RANGE, update_phases
from benchmarks.gpu_battery.profile_memory import observe_loop
from benchmarks.gpu_battery.report import _f, _table

# The section must end by DEADLINE_S (gpu_check allows it 300 s on a GPU, twice that on CPU): the LOOP watch
# starts only with LOOP_WATCH_S left; the GRPOTrainer watch (about a minute on an H100) runs in a child
# process stopped at the deadline, and only with MIN_WATCH_S left.
DEADLINE_S = {"cuda": 265.0, "cpu": 400.0}
MIN_WATCH_S = 30.0
LOOP_WATCH_S = 40.0  # the LOOP watch runs in this process: about 30 s on an H100
FITS_FRACTION = 0.85  # run without checkpointing only where the plan needs less than this share of the GPU


def _progress(message: str, started: float) -> None:
    print(f"profile [{time.perf_counter() - started:5.0f} s] {message}", flush=True)


def _attempt(what: str, started: float, function: Any, *args: Any) -> dict[str, Any]:
    """``function(*args)``, or ``{"error": its traceback}``: one broken part leaves the others' results."""
    try:
        return function(*args)
    except Exception:  # noqa: BLE001 - the one GPU run must bring back whatever did work
        error = traceback.format_exc()
        _progress(f"{what} FAILED:\n{error}", started)
        return {"error": error[-3000:]}


def _free(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# --- 1. kernel time ------------------------------------------------------------------------------
@contextlib.contextmanager
def _profiler_range(name: str, tokens: int | None = None, *, device: str) -> Iterator[None]:
    from torch.profiler import record_function

    with record_function(RANGE + name):
        yield
        if name in PHASE_RANGES:  # a phase's range then ends after its kernels
            mfu_section._sync(device)


def checkpointing_variant(
    trainer: Any, shape: Any, samples: list[Any], device: str, tokens: int, every_n_layers: int | None
) -> dict[str, Any]:
    """The update with activation checkpointing off (``every_n_layers`` None) or on every n-th decoder layer only
    (transformers' ``every_n_layers``: the others keep their activations, less recomputation), where the memory
    plan says it fits: on CUDA a warm-up, then timed, with its MFU counted as :func:`measure_mfu` counts it (model
    FLOPs: no recomputation); otherwise why not. Leaves the model checkpointed as the variant set it."""
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

    from loop_trainer.config.loop_config import checkpointing_kwargs
    from loop_trainer.models.memory_plan import plan_memory
    from loop_trainer.training.activation_checkpointing import enable_checkpointing, is_checkpointing

    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB if device == "cuda" else None
    plan = plan_memory(
        shape,
        world_size=1,
        gpu_memory_gib=gpu_gib or 80.0,
        zero_stage=0,
        lora={"r": mfu_section.LORA_R, "target_modules": "all-linear", "dropout": 0.0},
        bf16=device == "cuda",
        activation_checkpointing=every_n_layers is not None,
        checkpoint_every_n_layers=every_n_layers or 1,
        max_training_tokens=tokens,
        per_device_train_batch_size=1,
    )
    result: dict[str, Any] = {"every_n_layers": every_n_layers, "plan_gib": plan.training_gib, "gpu_gib": gpu_gib}
    if gpu_gib is not None and plan.training_gib > FITS_FRACTION * gpu_gib:
        return {**result, "ran": False, "why": f"the plan needs {plan.training_gib:.0f} GiB of {gpu_gib:.0f}"}
    model = trainer.accelerator.unwrap_model(trainer.model)
    if every_n_layers is None:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()
        if is_checkpointing(model):
            return {**result, "ran": False, "why": "checkpointing could not be switched off"}
    else:
        enable_checkpointing(model, {**checkpointing_kwargs(trainer.args), "every_n_layers": every_n_layers})
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]  # what every_n_layers counts
        result["checkpointed_layers"] = sum(bool(m.gradient_checkpointing) for m in layers)
        result["layers"] = len(layers)
    try:
        if device == "cuda":
            trainer.update_policy(samples)  # warm-up: the allocator grows to this variant's peak
            torch.cuda.reset_peak_memory_stats()
        mfu_section._sync(device)
        started = time.perf_counter()
        trainer.update_policy(samples)
        mfu_section._sync(device)
        seconds = time.perf_counter() - started
    except torch.OutOfMemoryError as error:
        return {**result, "ran": False, "why": f"out of memory: {str(error).splitlines()[0][:200]}"}
    peak = torch.cuda.max_memory_allocated() / GIB if device == "cuda" else None
    flops = mfu_section.update_flops(
        shape,
        [len(s.token_ids) for s in samples],
        mfu_section.scored_tokens(samples),
        lora_r=mfu_section.LORA_R,
        epochs=trainer.args.ppo_epochs,
    )
    dense_peak = bf16_peak(gpu_name()) if device == "cuda" else None
    mfu = flops["model_flops"] / seconds / dense_peak if dense_peak else None
    return {**result, "ran": True, "update_seconds": seconds, "peak_allocated_gib": peak, "mfu_model": mfu}


def kernel_profile(trainer: Any, samples: list[Any], vocab_size: int, device: str, started: float) -> dict[str, Any]:
    """One update under torch.profiler, marked by :func:`update_phases`, summarized by category."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with (
        update_phases(trainer, functools.partial(_profiler_range, device=device)),
        profile(activities=activities, record_shapes=True) as profiler,
        record_function(RANGE + "update"),
    ):
        trainer.update_policy(samples)
        mfu_section._sync(device)
    ops, units = read_events(profiler, device)
    _progress(f"profile read: {len(ops)} ops, {len(units)} timed units", started)
    summary = summarize(ops, units, lora_r=mfu_section.LORA_R, vocab_size=vocab_size)
    return {"timed_unit": "kernel time" if device == "cuda" else "op self time", **summary}


def profile_update(sizes: Any, device: str, tokenizer: Any, started: float) -> dict[str, Any]:
    from loop_trainer.models.model_shape import ModelShape

    name, tokens, count = sizes.mfu_shape, sizes.mfu_tokens, sizes.mfu_trajectories
    shape = ModelShape.from_config(shape_config(name), name)
    with scratch() as output_dir:
        trainer = mfu_section._build_trainer(name, device, tokens, output_dir, tokenizer)
        trainer.prepare_for_iterations()
        _progress(f"{name} built for {count} x {tokens} tokens", started)
        mfu = None  # CPU mode: no MFU (the memory section runs measure_mfu there) and no warm-up
        if device == "cuda":
            mfu = mfu_section.measure_mfu(trainer, shape, tokens, count, device)  # a warm-up and 2 timed updates
            _progress(f"MFU {mfu['mfu_model']} (update {min(mfu['update_seconds']):.2f} s)", started)
        _progress("profiled update", started)
        samples = [mfu_section._trajectory(tokens, shape.vocab_size, seed) for seed in range(count)]
        kernels = _attempt(
            "kernel profile", started, kernel_profile, trainer, samples, shape.vocab_size, device, started
        )
        _progress(f"profile summarized: busy {kernels.get('busy_fraction')}; every other layer next", started)
        every_other = _attempt(
            "update checkpointing every other layer",
            started,
            *(checkpointing_variant, trainer, shape, samples, device, tokens, 2),
        )
        _progress(f"every other layer checkpointed: {every_other}; checkpointing off next", started)
        uncheckpointed = _attempt(
            "update without checkpointing",
            started,
            *(checkpointing_variant, trainer, shape, samples, device, tokens, None),
        )
        _progress(f"without checkpointing: {uncheckpointed}", started)
        trainer.close()
        del trainer
    return {
        "shape": name,
        "tokens_per_trajectory": tokens,
        "trajectories": count,
        "lora_r": mfu_section.LORA_R,
        "mfu": mfu,
        **kernels,
        "every_other_layer_checkpointed": every_other,
        "without_checkpointing": uncheckpointed,
    }


# --- 2. peak memory ------------------------------------------------------------------------------
def update_spec(sizes: Any, device: str) -> Any:
    """``update.py``'s workload as ``update_throughput``'s Spec (lengths cycled to the trajectory count)."""
    from benchmarks.update_throughput import Spec

    n = sizes.update_trajectories
    lengths = [sizes.update_lengths[i % len(sizes.update_lengths)] for i in range(n)]
    tiny = sizes.update_shape == "tiny"
    return Spec(
        device=device,
        lengths=lengths,
        minibatch_size=sizes.update_minibatch,
        ppo_epochs=sizes.update_epochs,
        micro_batch=1,
        hidden_size=TINY_CONFIG["hidden_size"] if tiny else 128,
        layers=TINY_CONFIG["num_hidden_layers"] if tiny else 2,
        heads=TINY_CONFIG["num_attention_heads"] if tiny else 4,
        kv_heads=TINY_CONFIG["num_key_value_heads"] if tiny else 2,
        checkpointing=True,
        seed=0,
        shape=None if tiny else sizes.update_shape,
    )


def watched_in_a_process(
    trainer: str,
    spec: Any,
    deadline: float,
    started: float,
    launch: Path | None = None,
    min_seconds: float = MIN_WATCH_S,
) -> dict[str, Any]:
    """:mod:`.profile_memory`'s watch of ``trainer`` in a child process, stopped at ``deadline``
    (seconds since ``started``), started only with ``min_seconds`` left; a fresh process also starts with an empty
    allocator. With ``launch`` (an accelerate config) the child runs under ``accelerate launch``, as a user's
    DeepSpeed run does."""
    limit = deadline - (time.perf_counter() - started)
    if limit < min_seconds:
        return {"skipped": f"{limit:.0f} s left before the section's deadline: too little for the {trainer} run"}
    with scratch() as directory:
        spec_path, out_path = Path(directory) / "spec.json", Path(directory) / "out.json"
        spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
        module = ["benchmarks.gpu_battery.profile_memory", trainer, str(spec_path), str(out_path)]
        if launch is None:
            argv, env = [sys.executable, "-m", *module], dict(os.environ)
        else:
            argv, env = deepspeed_launch(launch, "cpu" if spec.device == "cpu" else "gpu", module)
        env["HF_HUB_OFFLINE"] = "1"  # as update_throughput's workers: no hub lookups
        # its own session, so that the deadline ends a launcher's worker with it
        child = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            stdout, stderr = child.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            stop_process_tree(child)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.communicate(timeout=30)
            return {"skipped": f"stopped after {limit:.0f} s, at the section's deadline"}
        print(stdout[-2000:], flush=True)
        if child.returncode or not out_path.exists():
            return {"error": f"exit {child.returncode}:\n{stdout[-1000:]}\n{stderr[-2500:]}"}
        return json.loads(out_path.read_text())


def memory_breakdown(sizes: Any, device: str, started: float) -> dict[str, Any]:
    from benchmarks.update_throughput import make_trajectories

    spec = update_spec(sizes, device)
    result: dict[str, Any] = {"shape": spec.shape or "tiny", "lengths": spec.lengths, "spec": dataclasses.asdict(spec)}
    if device == "cuda":  # what the MFU part may have left allocated: in the LOOP stages' numbers too
        import torch

        result["allocated_before_gib"] = torch.cuda.memory_allocated() / GIB
    left = DEADLINE_S[device] - (time.perf_counter() - started)
    if left < LOOP_WATCH_S:
        result["loop"] = {"skipped": f"{left:.0f} s left before the section's deadline: too little for the LOOP run"}
    else:
        with scratch() as output_dir:
            _progress(f"LOOP update, watched: {spec.shape or 'tiny'}, lengths {spec.lengths}", started)
            result["loop"] = _attempt("LOOP memory", started, observe_loop, spec, make_trajectories(spec), output_dir)
    _free(device)
    _progress("GRPOTrainer update (1 epoch: its peak repeats in every epoch), watched in a child process", started)
    grpo_spec = dataclasses.replace(spec, ppo_epochs=1)
    result["grpo"] = watched_in_a_process("grpo", grpo_spec, DEADLINE_S[device], started)
    loop_peak, grpo_peak = result["loop"].get("peak_allocated_gib"), result["grpo"].get("peak_allocated_gib")
    result["loop_over_grpo_peak"] = loop_peak / grpo_peak if loop_peak and grpo_peak else None
    if device == "cuda":  # the lever the breakdown points at (offloading needs a GPU)
        _progress("LOOP update with activation_offloading, watched in a child process", started)
        offloaded_spec = dataclasses.replace(spec, activation_offloading=True)
        result["loop_offloaded"] = watched_in_a_process("loop", offloaded_spec, DEADLINE_S[device], started)
        offloaded = result["loop_offloaded"].get("peak_allocated_gib")
        result["loop_offloaded_over_grpo_peak"] = offloaded / grpo_peak if offloaded and grpo_peak else None
    return result


def run(mode: str) -> dict[str, Any]:
    started = time.perf_counter()
    sizes = sizes_for(mode)
    device = device_for(mode)
    tokenizer = qwen_tokenizer()
    kernels = _attempt("MFU profile", started, profile_update, sizes, device, tokenizer, started)
    _free(device)
    memory = _attempt("peak memory", started, memory_breakdown, sizes, device, started)
    _progress("done", started)
    return {"device": gpu_name() if device == "cuda" else "cpu", "kernels": kernels, "memory": memory}


# --- the report ----------------------------------------------------------------------------------
def _error(what: str, part: dict[str, Any]) -> list[str]:
    return [f"**{what} failed**:", "", "```", part["error"][-1200:], "```", ""] if "error" in part else []


def _kernel_lines(k: dict[str, Any]) -> list[str]:
    if "mfu" not in k:
        return _error("MFU profile", k)
    mfu = k["mfu"]
    measured = (
        f"**{_f(mfu['mfu_model'], 3)}** (update {_f(min(mfu['update_seconds']), 2)} s unprofiled)" if mfu else "n/a"
    )
    lines = [
        f"### Time: LoRA update of {k['shape']}, {k['trajectories']} x {k['tokens_per_trajectory']} tokens, "
        f"r={k['lora_r']}, activation checkpointing",
        "",
        f"MFU as in the memory section: {measured}.",
        "",
    ]
    if "error" in k:
        lines += _error("the profiled update", k)
    else:
        unit = k["timed_unit"]
        lines += [
            f"Profiled update: {_f(k['wall_seconds'], 2)} s wall, {_f(k['timed_seconds'], 2)} s of {unit} in "
            f"{k['units']} units; busy {_f(k['busy_fraction'], 3)} of the wall (idle: launch and CPU overhead); "
            f"recomputation {_f(k['recompute_seconds'], 2)} s ({_f(k['recompute_share'], 3)} of the {unit}); "
            f"LoRA layers' forward kernels other than GEMMs (casts, scaling, add; forward and recompute, not "
            f"backward) {_f(k['lora_layer_other_seconds'], 3)} s: "
            + ", ".join(f"{name} {_f(s, 3)}" for name, s in k["lora_layer_other_top_ops"])
            + ".",
            "",
        ]
        rows = [
            [c["category"], _f(c["seconds"], 3), _f(c["share"], 3), c["count"], _f(c["mean_us"], 1)]
            + [_f(c["gemm_tflop_per_s"], 0), ", ".join(name for name, _ in c["top_ops"])]
            for c in k["categories"]
        ]
        lines += _table(["category", "s", "share", "units", "mean µs", "TFLOP/s in its GEMMs", "top ops"], rows)
        rows = [[p["phase"], _f(p["seconds"], 3), _f(p["share"], 3), _f(p["wall_seconds"], 3)] for p in k["phases"]]
        lines += _table(["phase", f"{unit} s", "share", "wall s (synchronized)"], rows)
        rows = [
            [t["name"][:90], t["category"], t["count"], _f(t["seconds"], 3), _f(t["share"], 3)]
            for t in k["top_kernels"]
        ]
        lines += _table(["top kernels", "category", "count", "s", "share"], rows)
    for key, label in (
        ("every_other_layer_checkpointed", "Every other layer checkpointed (every_n_layers 2)"),
        ("without_checkpointing", "Without activation checkpointing"),
    ):
        variant = k.get(key)
        if variant is None:  # a result from before the variant was measured
            continue
        if "error" in variant:
            lines += _error(label, variant)
            continue
        outcome = (
            f"update {_f(variant['update_seconds'], 2)} s, MFU {_f(variant.get('mfu_model'), 3)}, peak "
            f"{_f(variant['peak_allocated_gib'])} GiB (plan {_f(variant['plan_gib'])} GiB)"
            if variant["ran"]
            else f"not run: {variant['why']}"
        )
        lines += [f"{label}: {outcome}.", ""]
    return lines


def _stage_row(label: str, gib: float | None, record: dict[str, Any]) -> list[str]:
    return [label, _f(gib), *(_f(record[f"{term}_gib"]) for term in ("weights", "gradients", "optimizer_state"))]


def trainer_memory_lines(trainer: str, result: dict[str, Any]) -> list[str]:
    if "stages" not in result:
        return [f"{trainer}: {result['skipped']}", ""] if "skipped" in result else _error(f"{trainer} memory", result)
    spans = [s for s in result["stages"] if "peak_gib" in s]
    rows = [_stage_row(s["stage"], s["allocated_gib"], s) for s in result["stages"] if "peak_gib" not in s]
    for stage in ("old_logprobs", "forward", "backward", "optimizer"):
        of_stage = [s for s in spans if s["stage"] == stage]
        if of_stage:
            top = max(of_stage, key=lambda s: s["peak_gib"] or 0)
            label = f"{stage}: highest peak of {len(of_stage)} ({top['tokens'] or '-'} tokens)"
            rows.append(_stage_row(label, top["peak_gib"], top))
    lines = [f"{trainer}: stages (GiB allocated; weights, gradients, optimizer state counted from the tensors)", ""]
    lines += _table(["stage", "allocated", "weights", "gradients", "optimizer state"], rows)
    breakdown = result.get("breakdown") or {}
    if "terms" not in breakdown:
        return lines + _error(f"{trainer} peak breakdown", breakdown)
    span = breakdown["peak_span"] or {}
    lines += [
        f"{trainer}: at the peak ({_f(breakdown['peak_allocated_gib'])} GiB allocated, "
        f"{_f(breakdown['reserved_at_peak_gib'])} GiB reserved, in a {span.get('stage')} span of {span.get('tokens')} "
        f"tokens; {_f(breakdown['outside_allocator_gib'])} GiB outside the allocator; {breakdown['trace_entries']} "
        "history entries" + (", TRUNCATED" if breakdown["trace_truncated"] else "") + ")",
        "",
    ]
    rows = [[t["term"], _f(t["gib"]), _f(t["share"], 3)] for t in breakdown["terms"]]
    return lines + _table(["term", "GiB", "share of reserved"], rows)


def _memory_lines(m: dict[str, Any]) -> list[str]:
    if "loop" not in m:
        return _error("peak memory", m)
    lines = [
        f"### Peak memory: {m['shape']} (full fine-tuning, as update.py), lengths {m['lengths']}, minibatch "
        f"{m['spec']['minibatch_size']}, {m['spec']['ppo_epochs']} epochs (GRPOTrainer: 1), micro-batch 1",
        "",
        f"LOOP / GRPO peak allocated: {_f(m.get('loop_over_grpo_peak'), 3)}",
        "",
    ]
    lines += trainer_memory_lines("loop", m["loop"]) + trainer_memory_lines("grpo", m["grpo"])
    if "loop_offloaded" in m:
        lines += [
            f"LOOP with activation_offloading / GRPO peak allocated: {_f(m.get('loop_offloaded_over_grpo_peak'), 3)}",
            "",
        ]
        lines += trainer_memory_lines("loop, activation_offloading", m["loop_offloaded"])
    return lines


def render(result: dict[str, Any]) -> list[str]:
    lines = [
        "## Profile: where the policy update's time and peak memory go",
        "",
        "Time: the MFU section's LoRA update once more under torch.profiler (recorded shapes), each GPU kernel "
        "(CPU mode: each op's self time) put in a category by the op that launched it and its callers; phases "
        "from record_function ranges. Memory: update_throughput's LOOP and GRPOTrainer runs watched per stage, "
        "and on CUDA the allocator history replayed to the peak and the live blocks attributed by address and "
        "allocating Python stack.",
        "",
    ]
    return lines + _kernel_lines(result["kernels"]) + _memory_lines(result["memory"])
