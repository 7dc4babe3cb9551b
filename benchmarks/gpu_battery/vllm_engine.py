"""One engine of the battery's vllm section (benchmarks/gpu_battery/vllm_generation.py), in a child
process of its own: build the trainer's colocated engine, then the LoRA syncs, the episode
collections and the full weight reload, rewriting its JSON after every step.

    python -m benchmarks.gpu_battery.vllm_engine --engine SPEC.json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.gpu_battery.common import qwen_tokenizer, sizes_for

GPU_MEMORY_UTILIZATION = 0.3
MAX_MODEL_LEN = 4096
LORA_RANK = 8
PROBE_TOKENS = 64


def measure(spec: dict[str, Any], record: dict[str, Any], save: Any) -> None:
    if spec["mode"] == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default 4 costs seconds to allocate
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING" if spec["mode"] == "cpu" else "INFO")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        # The GPU machine's carry leaves FlashInfer out (tools/vllm_chunks.sh); vLLM 0.26's GPU sampler
        # imports it unless its top-k/top-p sampler is switched off (our sampling uses neither). The
        # first H200 run failed there (benchmarks/results/gpu/).
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from benchmarks.gpu_battery.common import lora_config
    from benchmarks.gpu_battery.loop_bf16 import _shaped_vault
    from loop_trainer.chat import ChatFormatter, stop_token_ids
    from loop_trainer.rollout.vllm_backend import VLLMBackend, build_colocated_llm
    from loop_trainer.rollout.weight_sync import WeightSync, default_tolerance, probe_token_ids

    sizes = sizes_for(spec["mode"])
    device = torch.device("cpu" if spec["mode"] == "cpu" else "cuda")
    dtype = getattr(torch, spec["dtype"])
    tokenizer = qwen_tokenizer()

    def load_policy() -> Any:
        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype, attn_implementation="sdpa")
        # PreTrainedModel.to is functools.wraps(Module.to), which typeshed types without binding self
        return model.to(device).eval()  # type: ignore[arg-type]

    def scorer(model: Any) -> Any:
        """The policy's log-probs of a probe at temperature 1 (plain logits: the probe is 64 tokens)."""

        def logprobs(ids: list[int]) -> Any:
            tokens = torch.tensor([ids], device=device)
            with torch.no_grad():
                logits = model(input_ids=tokens).logits.float()
            return logits.log_softmax(-1)[0, :-1].gather(1, tokens[0, 1:, None]).squeeze(1).cpu()

        return logprobs

    # LOOPTrainer's LoRA policy, or (spec "lora" false) a full fine-tuning policy: the engine then has no LoRA
    # layers and takes the full weights, as the trainer streams them without an adapter
    with_lora = spec.get("lora", True)
    base = load_policy()
    policy = get_peft_model(base, lora_config(LORA_RANK)).eval() if with_lora else None
    stop = stop_token_ids(base, tokenizer)
    max_batch = max(sizes.generation_concurrency)
    started = time.perf_counter()
    llm = build_colocated_llm(
        spec["model_dir"],
        dtype=spec["dtype"],
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max_batch,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        seed=0,
        lora_rank=LORA_RANK if with_lora else None,
        **spec["settings"],
    )
    record["startup_seconds"] = time.perf_counter() - started
    record["kv_cache_tokens"] = _kv_cache_tokens(llm)
    record["compilation"] = _compilation(llm)
    print(f"vllm: engine started in {record['startup_seconds']:.1f} s ({record['compilation']})", flush=True)
    save()

    tolerance = default_tolerance(dtype)
    probe = probe_token_ids(len(tokenizer), PROBE_TOKENS, avoid=set(tokenizer.all_special_ids))
    with VLLMBackend(llm, stop_token_ids=stop, temperature=1.0) as backend:
        if policy is not None:
            sync = WeightSync(policy, backend, scorer(policy), probe, tolerance=None, workdir=spec["workdir"])
            record["lora"] = _lora_syncs(sync, policy, tolerance)
            record["lora"]["decode_diff_max"] = decode_gap(backend, scorer(policy), probe[:16])
            print(f"vllm: LoRA syncs {record['lora']}", flush=True)
            save()

        env = _shaped_vault(num_tasks=max(64, max_batch))
        env.set_tokenizer(tokenizer)
        formatter = ChatFormatter(tokenizer)
        started = time.perf_counter()
        _collect(env, formatter, backend, max_batch, sizes.generation_turns, sizes.generation_new_tokens)
        record["warmup_seconds"] = time.perf_counter() - started
        record["rows"] = []
        for concurrency in sizes.generation_concurrency:
            row = _collect(env, formatter, backend, concurrency, sizes.generation_turns, sizes.generation_new_tokens)
            record["rows"].append(row)
            print(f"vllm generation: {row}", flush=True)
            save()

        # a plain model for the base weights: the LoRA policy wrapped ``base`` in place
        reloaded = load_policy() if with_lora else base
        record["weight_reload"] = _weight_reload(backend, reloaded, scorer, probe, tolerance, spec["workdir"])
        print(f"vllm: weight reload {record['weight_reload']}", flush=True)
        save()


def decode_gap(backend: Any, score: Any, prompt: list[int], new_tokens: int = 16) -> float:
    """max |Δ log-prob| between the engine's decode (one sequence: on a GPU a replayed CUDA graph)
    and the policy's scores of the same tokens. The probe checks prefill only; stale weights in a
    captured decode graph would show here."""
    import asyncio

    import torch

    completion = asyncio.run(backend.generate(prompt, new_tokens, seed=0))
    expected = score(list(prompt) + list(completion.token_ids))[len(prompt) - 1 :]
    return float((torch.tensor(completion.logprobs) - expected).abs().max())


def _lora_syncs(sync: Any, policy: Any, tolerance: float) -> dict[str, Any]:
    """A first adapter load, then a hot-swap to a changed adapter: the trainer's per-iteration sync."""
    _perturb_adapter(policy, seed=1)
    first = sync(0)
    _perturb_adapter(policy, seed=2)
    stale = sync.compare()[0]  # the engine still serves adapter 0: the check can see a stale policy
    swap = sync(1)
    return {
        "first_load_seconds": first.seconds,
        "first_probe_diff_max": first.logprob_diff_max,
        "stale_probe_diff_max": stale,
        "swap_seconds": swap.seconds,
        "swap_probe_diff_max": swap.logprob_diff_max,
        "swap_probe_diff_mean": swap.logprob_diff_mean,
        "tolerance": tolerance,
        "within_tolerance": first.logprob_diff_max <= tolerance and swap.logprob_diff_max <= tolerance,
    }


def _perturb_adapter(model: Any, seed: int) -> None:
    """A random adapter (PEFT starts lora_B at zero, which would leave the policy the base model)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                noise = torch.randn(param.shape, generator=generator) * 0.05
                param.copy_(noise.to(param.device, param.dtype))


def _weight_reload(backend: Any, model: Any, scorer: Any, probe: list[int], tolerance: float, workdir: str) -> dict:
    """Changed base weights (the embedding, tied to the output layer, scaled) streamed layer by layer
    into the engine, probe-checked on the base model (no adapter)."""
    import torch

    from loop_trainer.rollout.weight_sync import WeightSync

    backend.lora_request = None  # the probe and the reload are about the base weights (no-op without LoRA)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1.5)
    sync = WeightSync(model, backend, scorer(model), probe, tolerance=None, workdir=workdir + "-full")
    try:
        stale = sync.compare()[0]
        report = sync(2)
        decoded = decode_gap(backend, scorer(model), probe[:16])
    except Exception as error:  # noqa: BLE001 - reported: the trainer's LoRA path does not need it
        return {"error": f"{type(error).__name__}: {error}"[:1000]}
    finally:
        sync.close()
    return {
        "seconds": report.seconds,
        "stale_probe_diff_max": stale,
        "probe_diff_max": report.logprob_diff_max,
        "decode_diff_max": decoded,
        "within_tolerance": max(report.logprob_diff_max, decoded) <= tolerance,
    }


def _collect(env: Any, formatter: Any, backend: Any, concurrency: int, turns: int, new_tokens: int) -> dict:
    from loop_trainer.rollout import EpisodeLimits, RolloutEngine

    tasks = list(env.tasks("train"))
    limits = EpisodeLimits(max_turns=turns, max_new_tokens_per_turn=new_tokens, max_trajectory_tokens=MAX_MODEL_LEN)
    steps_before, backend.max_running = backend.num_engine_steps, 0
    with RolloutEngine(
        env, backend, formatter, limits, max_concurrent_episodes=concurrency, show_progress=False
    ) as engine:
        started = time.perf_counter()
        batch = engine.collect([tasks[i % len(tasks)] for i in range(concurrency)], 1, seed=0)
        seconds = time.perf_counter() - started
    stats = batch.stats()
    steps = backend.num_engine_steps - steps_before
    return {
        "concurrency": concurrency,
        "episodes": len(batch.trajectories),
        "failed_episodes": len(batch.failed),
        "seconds": seconds,
        "sampled_tokens": stats["sampled_tokens"],
        "turns_mean": stats["turns_mean"],
        "sampled_tokens_per_s": stats["sampled_tokens"] / seconds,
        "engine_steps": steps,
        "tokens_per_step": stats["sampled_tokens"] / max(1, steps),
        "max_running": backend.max_running,
    }


def _kv_cache_tokens(llm: Any) -> int | None:
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        return int(cache.num_gpu_blocks * cache.block_size)
    except (AttributeError, TypeError):
        return None


def _compilation(llm: Any) -> str:
    """The engine's compilation mode and CUDA graph mode, as vLLM resolved them."""
    try:
        config = llm.llm_engine.vllm_config.compilation_config
        model = llm.llm_engine.vllm_config.model_config
        mode = getattr(config.mode, "name", config.mode)
        graphs = getattr(config.cudagraph_mode, "name", config.cudagraph_mode)
        sizes = getattr(config, "cudagraph_capture_sizes", None) or []
        eager = " (enforce_eager)" if model.enforce_eager else ""
        return f"compilation {mode}, CUDA graphs {graphs}{eager}, {len(sizes)} capture sizes"
    except AttributeError as error:
        return f"unknown ({error})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", nargs=2, metavar=("SPEC", "OUT"), required=True)
    options = parser.parse_args(argv)
    spec_path, out = Path(options.engine[0]), Path(options.engine[1])
    spec = json.loads(spec_path.read_text())
    # A second guard besides the parent's kill: SIGALRM's default action ends even a process stuck in C.
    signal.alarm(int(spec["seconds"]) + 10)
    record: dict[str, Any] = {"settings": spec["settings"]}

    def save() -> None:  # after every step: a run cut off by its time limit keeps what it finished
        partial = out.with_suffix(".partial")
        partial.write_text(json.dumps(record, default=str))
        partial.replace(out)

    code = 0
    try:
        measure(spec, record, save)
    except Exception as error:  # noqa: BLE001 - recorded for the parent, traceback in the log
        traceback.print_exc()
        record["error"] = f"{type(error).__name__}: {error}"[-2000:]
        save()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Straight out: an in-process engine's exit handlers (NCCL, worker threads) can hang a finished run.
    os._exit(code)


if __name__ == "__main__":
    main()
