"""Generation on the transformers backend: where a decode step's time goes, and what fixed-shape
steps replayed as CUDA graphs (``static_decode``) change.

The policy is the LOOP section's (Qwen2.5-0.5B shape, random init, bf16, LoRA r=8 on every linear
layer, PEFT-wrapped as LOOPTrainer builds it). Vault episodes (2 turns x 64 new tokens on a GPU) are
collected through ``RolloutEngine`` + ``TransformersBackend`` at each concurrency, these ways with
the same seeds:

- ``dynamic``: the default decode loop (the batch's KV cache concatenated at every step, eager);
- ``static eager``: fixed-shape slots (:mod:`loop_trainer.rollout.slot_decode`), eager;
- ``static + CUDA graph``: the same steps captured once and replayed (``static_decode=True``);
- ``... no cuDNN attention``: the same with PyTorch's cuDNN attention off (GPU only), whose per-shape
  plans the first H200 profile found costly in the prefills;
- ``... merged adapter``: sampling from the policy's view with the LoRA adapter merged into a copy of
  the weights (``merge_adapter_for_sampling``), dynamic (here and on a GPU) and on CUDA graphs (GPU);
- ``static + compiled CUDA graph ...``: the step run through ``torch.compile`` before it is captured
  (``SlotDecoder.compile_step``, being measured: it fuses the modelling code's small kernels).

``DECODE_VARIANTS`` ('|'-separated) runs only the named variants, at the largest concurrency and
without profiles (a short device call); ``GENERATION_CONCURRENCY`` ("64 256") names the concurrencies.

Reported per run: sampled tokens/s (sampled tokens / wall seconds of the collection, after a
warm-up), milliseconds per decode step (the decode loop's busy seconds / its steps), mean rows per
step, graphs captured, and against ``dynamic``: the episodes whose sampled tokens are identical and
the mean |log-prob difference| of the tokens before the first one that differs (bf16 kernels round
differently, so a sampled token can flip; the distribution is the same).

Profiles (``torch.profiler``) of a short ``dynamic`` and, on a GPU, ``static + CUDA graph``
collection at the largest concurrency list the operators with the most self time on the CPU and on
the GPU: why a step is slow. And the decode loop's batched draws are checked against
``torch.multinomial`` row by row on the section's device.
"""

from __future__ import annotations

import os
import time
from typing import Any

from benchmarks.gpu_battery.common import (
    build_model,
    device_for,
    generation_concurrency_override,
    loop_config,
    lora_config,
    qwen_tokenizer,
    scratch,
    sizes_for,
)
from benchmarks.gpu_battery.loop_bf16 import _shaped_vault
from benchmarks.gpu_battery.report import _f, _table

GRAPH, NO_CUDNN = "static + CUDA graph", "static + CUDA graph, no cuDNN attention"
DYNAMIC_MERGED, MERGED = "dynamic, merged adapter", "static + CUDA graph, no cuDNN attention, merged adapter"
COMPILED = "static + compiled CUDA graph, no cuDNN attention, merged adapter"
VARIANTS = ("dynamic", DYNAMIC_MERGED, "static eager", GRAPH, NO_CUDNN, MERGED, COMPILED)
NO_CUDNN_VARIANTS = (NO_CUDNN, MERGED, COMPILED)


def _selected() -> tuple[str, ...]:
    """``DECODE_VARIANTS`` ('|'-separated names) runs only those, to fit a short device call."""
    chosen = [name.strip() for name in os.environ.get("DECODE_VARIANTS", "").split("|") if name.strip()]
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown:
        raise ValueError(f"DECODE_VARIANTS: unknown {unknown}; known: {list(VARIANTS)}")
    return tuple(chosen) or VARIANTS


def _backend(trainer: Any, variant: str, concurrency: int) -> Any:
    import torch

    from loop_trainer.chat import stop_token_ids
    from loop_trainer.rollout import TransformersBackend

    backend = TransformersBackend(
        trainer.model,
        stop_token_ids=stop_token_ids(trainer.model, trainer.tokenizer),
        pad_token_id=trainer.tokenizer.pad_token_id,
        max_batch_size=concurrency,
        static_decode=not variant.startswith("dynamic"),
        merged_adapter=_merged(trainer) if "merged adapter" in variant else None,
    )
    if variant == "static eager":
        backend.slot_decoder(next(trainer.model.parameters()).device).cuda_graphs = False
    elif variant in (GRAPH, NO_CUDNN, MERGED, COMPILED) and not torch.cuda.is_available():
        return None  # graphs need CUDA; the CPU mode runs the eager slots only
    if variant == COMPILED:
        backend.slot_decoder(next(trainer.model.parameters()).device).compile_step = True
    return backend


def _merged(trainer: Any) -> Any:
    """One merged view of the policy for every merged variant (``merge_adapter_for_sampling``)."""
    from loop_trainer.rollout.merged_adapter import MergedAdapter

    if getattr(trainer, "_battery_merged", None) is None:
        trainer._battery_merged = MergedAdapter(trainer.model)
    return trainer._battery_merged


def _collect(
    trainer: Any, backend: Any, concurrency: int, turns: int, new_tokens: int, cudnn_attention: bool = True
) -> tuple[Any, float]:
    """One collection (after a warm-up). ``cudnn_attention=False``: PyTorch's SDPA may not pick cuDNN
    (a process-wide switch, so the decode thread sees it): cuDNN builds an execution plan for every new
    prefill shape, 15 ms of CPU per layer call in the first H200 profile."""
    import torch

    from loop_trainer.rollout import EpisodeLimits, RolloutEngine

    tasks = list(trainer.env.tasks("train"))
    limits = EpisodeLimits(max_turns=turns, max_new_tokens_per_turn=new_tokens, max_trajectory_tokens=8192)
    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(cudnn_before and cudnn_attention)
    with RolloutEngine(
        trainer.env, backend, trainer.formatter, limits, max_concurrent_episodes=concurrency, show_progress=False
    ) as engine:
        chosen = [tasks[i % len(tasks)] for i in range(concurrency)]
        pad = trainer.tokenizer.pad_token_id
        backend.sample([[pad] * 8] * concurrency, [2] * concurrency)  # warm-up (and the first graph capture)
        backend.counters.num_steps, backend.counters.busy_seconds = 0, 0.0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        batch = engine.collect(chosen, 1, seed=0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    torch.backends.cuda.enable_cudnn_sdp(cudnn_before)
    return batch, time.perf_counter() - started


def _sampled(trajectory: Any) -> tuple[list[int], list[float]]:
    pairs = [
        (t, lp)
        for t, lp, m in zip(trajectory.token_ids, trajectory.sampler_logprobs, trajectory.loss_mask, strict=True)
        if m
    ]
    return [t for t, _ in pairs], [lp for _, lp in pairs]


def _agreement(batch: Any, reference: Any) -> dict[str, float]:
    """Episodes with identical sampled tokens, and the mean |Δ log-prob| before the first difference."""
    identical, diffs = 0, []
    by_key = {(t.task_id, t.rollout): t for t in reference.trajectories}
    for trajectory in batch.trajectories:
        tokens, logprobs = _sampled(trajectory)
        ref_tokens, ref_logprobs = _sampled(by_key[(trajectory.task_id, trajectory.rollout)])
        identical += tokens == ref_tokens
        for token, ref_token, logprob, ref_logprob in zip(tokens, ref_tokens, logprobs, ref_logprobs, strict=False):
            if token != ref_token:
                break
            diffs.append(abs(logprob - ref_logprob))
    return {
        "identical_episodes": identical / max(1, len(batch.trajectories)),
        "logprob_diff_mean": sum(diffs) / max(1, len(diffs)),
        "logprob_diff_max": max(diffs, default=0.0),
    }


def _profile(trainer: Any, variant: str, concurrency: int, new_tokens: int) -> dict[str, Any]:
    """Top operators by self time of a short collection (1 turn)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    backend = _backend(trainer, variant, concurrency)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        _collect(trainer, backend, concurrency, 1, new_tokens, cudnn_attention=variant not in NO_CUDNN_VARIANTS)
    events = prof.key_averages()
    on_gpu = torch.cuda.is_available()

    def top(attribute: str) -> list[dict[str, Any]]:
        ranked = sorted(events, key=lambda e: getattr(e, attribute), reverse=True)[:12]
        return [
            {
                "name": e.key[:80],
                "calls": e.count,
                "self_cpu_ms": e.self_cpu_time_total / 1e3,
                "self_device_ms": getattr(e, "self_device_time_total", 0.0) / 1e3,
            }
            for e in ranked
        ]

    return {
        "variant": variant,
        "steps": backend.num_steps,
        "concurrency": concurrency,
        "new_tokens": new_tokens,
        "cpu_total_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
        "device_total_ms": sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e3 if on_gpu else None,
        "kernel_launches": sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel"))),
        "top_cpu": top("self_cpu_time_total"),
        "top_device": top("self_device_time_total") if on_gpu else [],
    }


def run(mode: str) -> dict[str, Any]:
    from loop_trainer import LOOPTrainer

    sizes = sizes_for(mode)
    device = device_for(mode)
    override = generation_concurrency_override()  # GENERATION_CONCURRENCY: exactly these counts
    concurrency = override or sorted({sizes.generation_concurrency[0], sizes.generation_concurrency[-1]})
    rows: list[dict[str, Any]] = []
    with scratch() as output_dir:
        args = loop_config(output_dir, device, max_turns=sizes.generation_turns)
        env = _shaped_vault(num_tasks=max(64, max(concurrency)))
        model = build_model(sizes.loop_shape, device)
        trainer = LOOPTrainer(model, env, args, processing_class=qwen_tokenizer(), peft_config=lora_config(8))
        try:
            trainer.model.eval()
            # first: a failed graph capture must not leave the profile (or the eager rows) unmeasured
            selected = _selected()
            restricted = selected != VARIANTS  # a short call: the largest concurrency, no profiles
            concurrency = concurrency[-1:] if restricted and not override else concurrency
            profiles = (
                [_profile(trainer, "dynamic", concurrency[-1], min(16, sizes.generation_new_tokens))]
                if not restricted
                else []
            )
            for n in concurrency:
                reference = None
                for variant in selected:
                    backend = _backend(trainer, variant, n)
                    if backend is None:
                        continue
                    try:
                        batch, seconds = _collect(
                            trainer,
                            backend,
                            n,
                            sizes.generation_turns,
                            sizes.generation_new_tokens,
                            cudnn_attention=variant not in NO_CUDNN_VARIANTS,
                        )
                    except Exception as error:  # noqa: BLE001 - the other variants' rows still count
                        rows.append({"variant": variant, "concurrency": n, "error": repr(error)[:500]})
                        print(f"decode: {rows[-1]}", flush=True)
                        continue
                    sampled = batch.stats()["sampled_tokens"]
                    row = {
                        "variant": variant,
                        "concurrency": n,
                        "episodes": len(batch.trajectories),
                        "sampled_tokens": sampled,
                        "seconds": seconds,
                        "sampled_tokens_per_s": sampled / seconds,
                        "decode_steps": backend.num_steps,
                        "ms_per_step": 1e3 * backend.busy_seconds / max(1, backend.num_steps),
                        "mean_rows_per_step": backend.num_step_rows / max(1, backend.num_steps),
                        "graphs_captured": backend._slot_decoder.num_captures if backend._slot_decoder else 0,
                        "capture_error": backend._slot_decoder.capture_error if backend._slot_decoder else None,
                        "failed_episodes": sum(t.status != "completed" for t in batch.trajectories),
                    }
                    if reference is None:
                        reference = batch
                    else:
                        row.update(_agreement(batch, reference))
                    rows.append(row)
                    print(f"decode: {row}", flush=True)
            fastest = COMPILED if COMPILED in selected else MERGED
            # where the fastest path's steps still spend their time
            if not restricted and _backend(trainer, fastest, 1) is not None:
                try:
                    profiles.append(_profile(trainer, fastest, concurrency[-1], min(16, sizes.generation_new_tokens)))
                except Exception as error:  # noqa: BLE001 - the rows above are measured already
                    print(f"decode: profile of {fastest} failed: {error!r}", flush=True)
            draws = _draw_check(device)
        finally:
            trainer.close()
    return {
        "shape": sizes.loop_shape,
        "turns": sizes.generation_turns,
        "new_tokens_per_turn": sizes.generation_new_tokens,
        "rows": rows,
        "profiles": profiles,
        "draw_check": draws,
    }


def render(result: dict) -> list[str]:
    lines = [
        f"## Decode steps: dynamic vs fixed-shape slots vs CUDA graphs ({result['shape']}, LoRA r=8, "
        f"transformers backend, {result['turns']} turns x {result['new_tokens_per_turn']} new tokens)",
        "",
        "Same seeds in every run; 'identical' and 'Δ log-prob' compare each run's episodes with the dynamic run's "
        "(Δ over the tokens before the first that differs).",
        "",
    ]
    failed = [r for r in result["rows"] if "error" in r or r.get("capture_error")]
    rows = [
        [
            r["variant"],
            r["concurrency"],
            r["episodes"],
            _f(r["sampled_tokens"], 0),
            _f(r["seconds"], 2),
            _f(r["sampled_tokens_per_s"], 0),
            _f(r["ms_per_step"], 1),
            _f(r["mean_rows_per_step"], 1),
            r["graphs_captured"],
            _f(r.get("identical_episodes"), 2),
            _f(r.get("logprob_diff_mean"), 4),
            r["failed_episodes"],
        ]
        for r in result["rows"]
        if "error" not in r
    ]
    lines += _table(
        [
            "decode",
            "concurrent episodes",
            "episodes",
            "sampled tokens",
            "seconds",
            "sampled tokens/s",
            "ms per step",
            "rows per step",
            "graphs",
            "identical",
            "Δ log-prob",
            "failed",
        ],
        rows,
    )
    for r in failed:
        lines += [f"- {r['variant']} at {r['concurrency']}: {r.get('error') or r.get('capture_error')}"]
    lines += [""] if failed else []
    draws = result.get("draw_check")
    if draws:
        lines += [
            f"Batched draws vs `torch.multinomial` row by row on {draws['device']} ({draws['rows']} rows x "
            f"{draws['steps']} steps, seeded): {draws['equal']} of {draws['rows'] * draws['steps']} tokens equal.",
            "",
        ]
    for profiled in result.get("profiles", [result.get("profile")]):
        if not profiled:
            continue
        lines += [
            f"### Profile of a {profiled.get('variant', 'dynamic')} collection ({profiled['concurrency']} episodes, "
            f"1 turn x {profiled['new_tokens']} tokens, {profiled['steps']} decode steps)",
            "",
            f"CPU self time {_f(profiled['cpu_total_ms'], 0)} ms, GPU self time "
            f"{_f(profiled['device_total_ms'], 0)} ms, kernel launches {profiled['kernel_launches']}.",
            "",
        ]
        for key, title in (("top_cpu", "most CPU self time"), ("top_device", "most GPU self time")):
            if profiled[key]:
                lines += [f"Operators with the {title}:", ""]
                lines += _table(
                    ["operator", "calls", "self CPU ms", "self GPU ms"],
                    [
                        [e["name"], e["calls"], _f(e["self_cpu_ms"], 1), _f(e["self_device_ms"], 1)]
                        for e in profiled[key]
                    ],
                )
    return lines


def _draw_check(device: str) -> dict[str, Any]:
    """The decode loop's batched draws against ``torch.multinomial`` row by row, same seeds, on the
    section's device: they must pick the same tokens (the CPU tests check it there)."""
    import torch

    from loop_trainer.rollout.token_draws import draw_tokens

    rows, steps, equal = 64, 4, 0
    generator = torch.Generator(device).manual_seed(0)
    for step in range(steps):
        logits = torch.randn(rows, 151936, device=device, generator=generator) * 3
        probs = torch.softmax(logits, dim=-1)
        seeds = [1000 * step + r for r in range(rows)]
        got = draw_tokens(probs, [torch.Generator(device).manual_seed(s) for s in seeds], None).tolist()
        for r, s in enumerate(seeds):
            want = torch.multinomial(probs[r], 1, generator=torch.Generator(device).manual_seed(s)).item()
            equal += got[r] == want
    return {"device": device, "rows": rows, "steps": steps, "equal": equal}
