"""The long-horizon environment on the GPU: ``recipes/errands.yaml`` (10-30 dependent calls an episode, up to
32 turns) trained from a carried warm start, beside the same recipe's 2-core CPU run from the same warm start
and seed (``benchmarks/results/long-horizon/cpu-seed1-warm8k-lr1e-4-metrics.jsonl``: one core, float32).

The warm start is the tiny-instruct model warmed up on 8,192 errands demonstrations (seed 1; about 25 minutes
on one core, so it travels to the GPU machine instead: a 1.3 MB folder, ``$LOOP_ERRANDS_WARM_START``, default
``.gpu-carry/errands-warm-start``). The run is ``loop-train`` in a child process stopped at the section's time
limit, so a slower run still reports the iterations it finished.

Reported: the learning curve (success and turns per iteration), seconds per iteration split into rollout and
update, iterations per minute on each machine. CPU mode runs the same code for one small iteration of the
recipe on a tiny-instruct model warmed up for 2 steps (no warm start needed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT
from benchmarks.gpu_battery.common import read_jsonl, scratch, train_in_a_child, training_summary
from benchmarks.gpu_battery.report import _f, _table

RECIPE = ROOT / "recipes" / "errands.yaml"
CPU_REFERENCE = ROOT / "benchmarks" / "results" / "long-horizon" / "cpu-seed1-warm8k-lr1e-4-metrics.jsonl"
DEFAULT_WARM_START = ROOT / ".gpu-carry" / "errands-warm-start"
SEED = 1  # the warm start's and the CPU reference's
GPU_ITERATIONS = int(os.environ.get("LOOP_ERRANDS_ITERATIONS") or 40)  # 40: the CPU reference's
GPU_TIME_LIMIT_S = 190.0  # gpu_check allows the section 240 s
CPU_TIME_LIMIT_S = 400.0  # and twice that in CPU mode
CPU_KEYS = {  # one small iteration, in seconds
    "model_name_or_path": "tiny-instruct:errands",
    "tiny_instruct_steps": "2",
    "iterations": "1",
    "tasks_per_iteration": "2",
    "rollouts_per_task": "2",
    "minibatch_size": "4",
    "per_device_train_batch_size": "4",
    "use_cpu": "true",
}


def run(mode: str) -> dict[str, Any]:
    gpu = mode != "cpu"
    warm_start = Path(os.environ.get("LOOP_ERRANDS_WARM_START") or DEFAULT_WARM_START)
    if gpu and not (warm_start / "config.json").is_file():
        return {
            "skipped": f"no warm start at {warm_start}: carry the 8,192-demonstration tiny-instruct errands model "
            "(benchmarks/long_horizon.py --keep-models saves one) or set LOOP_ERRANDS_WARM_START"
        }
    with scratch() as directory:
        out = Path(directory) / "run"
        overrides = (
            {"model_name_or_path": str(warm_start), "iterations": str(GPU_ITERATIONS)} if gpu else dict(CPU_KEYS)
        )
        overrides |= {"seed": str(SEED), "output_dir": str(out)}
        argv = ["--config", str(RECIPE), "--disable_tqdm", "true", "--save_strategy", "no", "--plot_curves", "false"]
        for key, value in overrides.items():
            argv += [f"--{key}", value]
        done = train_in_a_child(argv, out, GPU_TIME_LIMIT_S if gpu else CPU_TIME_LIMIT_S)
    records = done.iterations
    if not records or (done.status not in (0, None)):
        raise RuntimeError(
            f"loop-train exited {done.status} with {len(records)} iterations logged:\n{done.output_tail}"
        )
    cpu = read_jsonl(CPU_REFERENCE)
    return {
        "warm_start": str(warm_start) if gpu else CPU_KEYS["model_name_or_path"],
        "settings": overrides,
        "stopped_at_time_limit": done.status is None,
        "wall_seconds": done.wall_seconds,
        "curve": [
            {
                "iteration": r["iteration"],
                **{k: r.get(k) for k in ("success_rate", "turns_mean", "rollout_seconds", "update_seconds", "seconds")},
            }
            for r in records
        ],
        "this_run": training_summary(records, 5),
        "cpu_reference": {"source": str(CPU_REFERENCE.relative_to(ROOT)), **training_summary(cpu, 5)} if cpu else None,
    }


def render(result: dict[str, Any]) -> list[str]:
    this, cpu = result["this_run"], result.get("cpu_reference") or {}
    lines = [
        "## The long-horizon environment: errands (recipes/errands.yaml, seed 1) beside its CPU run",
        "",
        f"Model: {result['warm_start']} (the CPU run's: the 8,192-demonstration warm start); "
        f"loop-train ran {_f(result['wall_seconds'], 0)} s"
        + (" and was stopped at the section's time limit" if result["stopped_at_time_limit"] else "")
        + ".",
        "",
    ]
    lines += _table(
        [
            "run",
            "iterations",
            "minutes",
            "iterations/min",
            "rollout s/iteration",
            "update s/iteration",
            "success, first 5",
            "success, last 5",
        ],
        [
            [
                name,
                part.get("iterations"),
                _f(part.get("minutes"), 2),
                _f(part.get("iterations_per_minute"), 2),
                _f(part.get("rollout_seconds_mean"), 2),
                _f(part.get("update_seconds_mean"), 2),
                _f(part.get("success_first_5"), 3),
                _f(part.get("success_last_5"), 3),
            ]
            for name, part in (("this run", this), ("1-core CPU (seed 1, float32, same warm start)", cpu))
            if part
        ],
    )
    lines += ["Learning curve (every 5th iteration):", ""]
    lines += _table(
        ["iteration", "success", "turns", "rollout s", "update s"],
        [
            [
                r["iteration"],
                _f(r["success_rate"], 3),
                _f(r["turns_mean"], 1),
                _f(r["rollout_seconds"], 2),
                _f(r["update_seconds"], 2),
            ]
            for r in result["curve"]
            if r["iteration"] % 5 == 0 or r["iteration"] == 1
        ],
    )
    return lines
