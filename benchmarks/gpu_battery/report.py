"""The battery's markdown summary, from its JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines + [""]


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 10**-digits or value == 0 else f"{value:.2e}"
    return str(value)


def _failed(name: str, record: dict) -> list[str]:
    return [
        f"**{name}: {record['status']}** after {record.get('seconds', 0):.0f} s",
        "",
        "```",
        record.get("error", "")[-1500:],
        "```",
        "",
    ]


def loop_bf16(result: dict) -> list[str]:
    bf16, generation = result["bf16"], result["generation"]
    lines = [
        f"## bf16 correctness ({bf16['shape']}, LoRA r=8 all-linear, {bf16['attention']} attention, "
        f"activation checkpointing {'on' if bf16['activation_checkpointing'] else 'OFF'})",
        "",
    ]
    rows = [
        [
            i + 1,
            _f(r.get("sampler_logprob_diff"), 4),
            _f(r.get("sampler_logprob_diff_max"), 3),
            _f(r.get("loss"), 4),
            _f(r.get("kl"), 5),
            _f(r.get("clip_frac"), 3),
            _f(r.get("grad_norm"), 3),
            r.get("skipped_nonfinite_steps"),
            _f(r.get("reward_std"), 3),
        ]
        for i, r in enumerate(bf16["iterations"])
    ]
    lines += _table(
        [
            "iteration",
            "sampler gap mean abs",
            "sampler gap max abs",
            "loss",
            "KL",
            "clip fraction",
            "grad norm",
            "non-finite steps",
            "reward std",
        ],
        rows,
    )
    lines += [
        f"Adapter moved by up to {_f(bf16['adapter_max_abs_change'], 5)} (finite: {bf16['adapter_finite']}); "
        f"parameter dtypes {', '.join(bf16['parameter_dtypes'])}.",
        "",
    ]
    lines += [
        f"## Generation ({generation['shape']}, {generation['backend']} backend, {generation['turns']} turns x "
        f"{generation['new_tokens_per_turn']} new tokens)",
        "",
    ]
    rows = [
        [
            r["concurrency"],
            r["episodes"],
            _f(r["sampled_tokens"], 0),
            _f(r["seconds"], 1),
            _f(r["sampled_tokens_per_s"], 0),
            _f(r["mean_batch"], 1),
            _f(r.get("hf_generate_tokens_per_s"), 0),
            _f(r.get("hf_generate_no_adapter_tokens_per_s"), 0),
        ]
        for r in generation["rows"]
    ]
    return lines + _table(
        [
            "concurrent episodes",
            "episodes",
            "sampled tokens",
            "seconds",
            "sampled tokens/s",
            "mean batch",
            "model.generate tokens/s (1 turn, same batch)",
            "model.generate, adapter disabled",
        ],
        rows,
    )


def memory(result: dict) -> list[str]:
    lines = [
        f"## Memory plan vs measured (LoRA r={result['lora_r']}, bf16, activation checkpointing, world size 1, "
        "no DeepSpeed; plan: training phase, zero_stage 0)",
        "",
    ]
    rows = [
        [
            r["shape"].replace("-Instruct", ""),
            r["tokens"],
            _f(r.get("peak_allocated_gib")),
            _f(r.get("peak_reserved_gib")),
            _f(r.get("outside_allocator_gib")),
            _f(r.get("measured_gib")),
            _f(r["plan_training_gib"]),
            _f(r.get("measured_over_plan")),
            _f(r["seconds"], 1),
        ]
        for r in result["memory"]
    ]
    lines += _table(
        [
            "shape",
            "tokens",
            "max allocated GiB",
            "max reserved GiB",
            "outside allocator GiB",
            "measured GiB (reserved + outside)",
            "plan GiB",
            "measured / plan",
            "fwd+bwd s",
        ],
        rows,
    )
    mfu = result.get("mfu")
    if mfu:
        matmul = mfu["matmul"]
        peak = _f((mfu["bf16_dense_peak"] or 0) / 1e12, 1) if mfu["bf16_dense_peak"] else "unknown"
        lines += [
            f"## MFU: LoRA update of {mfu['shape']}, {mfu['trajectories']} x {mfu['tokens_per_trajectory']} tokens",
            "",
            f"- update seconds {', '.join(_f(s, 2) for s in mfu['update_seconds'])} (best used); "
            f"{_f(mfu['tokens_per_s'], 0)} tokens/s",
            f"- model FLOPs {mfu['model_flops']:.3e} -> {mfu['model_flops_per_s'] / 1e12:.1f} TFLOP/s; "
            f"with recomputation {mfu['hardware_flops']:.3e} -> {mfu['hardware_flops_per_s'] / 1e12:.1f} TFLOP/s",
            f"- measured {matmul['n']}^3 {matmul['dtype']} matmul: {matmul['flops_per_s'] / 1e12:.1f} TFLOP/s; "
            f"bf16 dense peak: {peak} TFLOP/s",
            f"- **MFU (model FLOPs / peak) {_f(mfu['mfu_model'], 3)}**; "
            f"hardware FLOPs / peak {_f(mfu['mfu_hardware'], 3)}; "
            f"model FLOPs / matmul {_f(mfu['model_flops_over_matmul'], 3)}; "
            f"hardware FLOPs / matmul {_f(mfu['hardware_flops_over_matmul'], 3)}",
            "",
        ]
    return lines


def update(result: dict) -> list[str]:
    lines = [f"## Policy update, LOOP vs GRPOTrainer (`{result['command']}`)", ""]
    rows = [
        [
            r["trainer"],
            r["optimizer_steps"],
            r["padded_width"],
            _f(r["seconds"], 2),
            _f(r["tokens_per_s"], 0),
            _f(r["peak_mib"] / 1024),
            _f(r["peak_delta_mib"] / 1024),
            _f(r["first_loss"], 4),
            _f(r["first_loss_expected"], 4),
        ]
        for r in result["rows"]
    ]
    lines += _table(
        [
            "trainer",
            "optimizer steps",
            "padded width",
            "update s",
            "tokens/s",
            "peak GiB",
            "rise GiB",
            "1st loss",
            "expected",
        ],
        rows,
    )
    for ratio in result["ratios"]:
        lines.append(
            "LOOP / GRPO: " + ", ".join(f"{key} x{value:.2f}" for key, value in ratio.items() if key != "checkpointing")
        )
    return lines + [""]


RENDER = {"loop_bf16": loop_bf16, "memory": memory, "update": update}


def render(name: str, result: dict) -> list[str]:
    """A section's markdown: the three first sections' here, every later section's from its own
    module's ``render`` (each section owns its table)."""
    if "skipped" in result:  # a section that cannot run here says why (e.g. DeepSpeed is not installed)
        return [f"**{name}: skipped**: {result['skipped']}", ""]
    if name in RENDER:
        return RENDER[name](result)
    import importlib

    from benchmarks.gpu_check import SECTIONS

    return importlib.import_module(SECTIONS[name][0]).render(result)


def write_summary(results: dict, path: Path) -> None:
    if results["mode"] == "cpu":
        lines = [
            "# gpu-check: CPU MODE (no CUDA device): not a GPU result",
            "",
            "Tiny shapes on the CPU, to check that the battery's code runs.",
            "",
        ]
    else:
        lines = [f"# gpu-check on {results['device']} ({results['mode']} mode)", ""]
    software = results["software"]
    lines += [
        f"{results['date']}, commit {results['commit']}; " + ", ".join(f"{k} {v}" for k, v in software.items()),
        "",
        f"Host: {results.get('host', {}).get('cpus')} CPUs ({results.get('host', {}).get('cpu_model')}).",
        "",
        f"Generation backend: {results['generation_backend']}.",
        "",
    ]
    for name, record in results["sections"].items():
        lines += render(name, record["result"]) if record["status"] == "ok" else _failed(name, record)
    path.write_text("\n".join(lines))
