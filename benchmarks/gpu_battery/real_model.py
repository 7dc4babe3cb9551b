"""A real pretrained model on the GPU: SmolLM2-135M-Instruct (the packaged Q4_1 GGUF, carried in two
parts: tools/gguf_chunks.sh, tools/gpu_gguf_unpack.sh) learning ``contacts`` with the real-model recipe
(recipes/smollm2-135m-contacts.yaml, the one docs/real-model.md settles on), in bf16, sampling on the
GPU's fast path (``static_decode``, ``compile_decode_step``, ``merge_adapter_for_sampling``).

Reported: the learning curve (reward, success and the answered-field check per iteration), seconds
per iteration split into rollout and update, iterations per minute, and the same recipe's committed
2-core CPU run (benchmarks/results/real-model/seed0-metrics.jsonl) beside it. GPU mode only: on the
CPU the section says so (the CPU runs are ``python -m benchmarks.real_model``'s, and
tests/integration/test_real_model.py trains the recipe for 2 iterations).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT
from benchmarks.gpu_battery.common import read_jsonl, scratch, train_in_a_child
from benchmarks.gpu_battery.report import _f, _table

RECIPE = ROOT / "recipes" / "smollm2-135m-contacts.yaml"
CPU_REFERENCE = ROOT / "benchmarks" / "results" / "real-model" / "seed0-metrics.jsonl"
TIME_LIMIT_S = 390.0  # conversion and training; gpu_check allows the section 420 s (the iterations done are reported)
DEFAULT_GGUF = "/tmp/loop-gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
GPU_KEYS = {
    "dtype": "bfloat16",
    "bf16": "true",
    "static_decode": "true",
    "compile_decode_step": "true",
    "merge_adapter_for_sampling": "true",
}
CURVE_KEYS = (
    "reward_mean",
    "success_rate",
    "train_passed_answered_field",
    "rollout_seconds",
    "update_seconds",
    "seconds",
)


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = sum(r["seconds"] for r in records)
    return {
        "iterations": len(records),
        "minutes": seconds / 60,
        "iterations_per_minute": 60 * len(records) / seconds if seconds else None,
        "rollout_seconds_mean": sum(r["rollout_seconds"] for r in records) / max(1, len(records)),
        "update_seconds_mean": sum(r["update_seconds"] for r in records) / max(1, len(records)),
        "success_first": records[0]["success_rate"] if records else None,
        "success_last": records[-1]["success_rate"] if records else None,
    }


def run(mode: str) -> dict[str, Any]:
    if mode == "cpu":
        return {
            "skipped": "GPU mode only; the CPU runs are benchmarks/real_model.py's (docs/real-model.md), and "
            "tests/integration/test_real_model.py trains this recipe for 2 iterations"
        }
    gguf = Path(os.environ.get("LOOP_SMOLLM2_GGUF") or DEFAULT_GGUF)
    if not gguf.is_file():
        return {
            "skipped": f"no GGUF at {gguf}: carry it in two calls (tools/gpu_gguf_unpack.sh's header), or set "
            "LOOP_SMOLLM2_GGUF"
        }
    from loop_trainer.models.packaged import convert_gguf

    with scratch() as directory:
        model_dir = Path(directory) / "model"
        started = time.perf_counter()
        convert_gguf(gguf, model_dir)
        convert_seconds = time.perf_counter() - started
        out = Path(directory) / "run"
        overrides = {**GPU_KEYS, "model_name_or_path": str(model_dir), "output_dir": str(out)}
        argv = ["--config", str(RECIPE), "--disable_tqdm", "true", "--save_strategy", "no"]
        for key, value in overrides.items():
            argv += [f"--{key}", value]
        done = train_in_a_child(argv, out, TIME_LIMIT_S - convert_seconds)
    records = done.iterations
    wall = done.wall_seconds
    if done.status not in (0, None) or not records:
        raise RuntimeError(
            f"loop-train exited {done.status} after {wall:.0f} s with {len(records)} iterations logged:\n"
            + done.output_tail
        )
    cpu = read_jsonl(CPU_REFERENCE)
    return {
        "gguf": str(gguf),
        "convert_seconds": convert_seconds,
        "settings": GPU_KEYS,
        "wall_seconds": wall,
        "stopped_at_time_limit": done.status is None,
        "curve": [{"iteration": r["iteration"], **{k: r.get(k) for k in CURVE_KEYS}} for r in records],
        "gpu": _summary(records),
        "cpu_reference": {"source": str(CPU_REFERENCE.relative_to(ROOT)), **_summary(cpu)} if cpu else None,
    }


def render(result: dict[str, Any]) -> list[str]:
    gpu, cpu = result["gpu"], result.get("cpu_reference") or {}
    lines = [
        "## A real model on the GPU: SmolLM2-135M-Instruct learning contacts (the real-model recipe, bf16)",
        "",
        f"GGUF converted in {_f(result['convert_seconds'], 1)} s; recipe keys set for the GPU: "
        + ", ".join(f"`{k}: {v}`" for k, v in result["settings"].items())
        + f"; loop-train ran {_f(result['wall_seconds'], 0)} s"
        + (" and was stopped at the section's time limit." if result.get("stopped_at_time_limit") else "."),
        "",
    ]
    rows = [
        [
            name,
            part.get("iterations"),
            _f(part.get("minutes"), 2),
            _f(part.get("iterations_per_minute"), 2),
            _f(part.get("rollout_seconds_mean"), 2),
            _f(part.get("update_seconds_mean"), 2),
            _f(part.get("success_first"), 3),
            _f(part.get("success_last"), 3),
        ]
        for name, part in (("GPU (this run)", gpu), ("2-core CPU (committed seed 0, float32)", cpu))
        if part
    ]
    lines += _table(
        [
            "run",
            "iterations",
            "minutes",
            "iterations/min",
            "rollout s/iteration",
            "update s/iteration",
            "success, iteration 1",
            "success, last",
        ],
        rows,
    )
    lines += ["Learning curve on the GPU:", ""]
    lines += _table(
        ["iteration", "reward", "success", "answered the asked field", "rollout s", "update s"],
        [
            [
                r["iteration"],
                _f(r["reward_mean"], 3),
                _f(r["success_rate"], 3),
                _f(r.get("train_passed_answered_field"), 3),
                _f(r["rollout_seconds"], 2),
                _f(r["update_seconds"], 2),
            ]
            for r in result["curve"]
        ],
    )
    return lines
