"""LOOP on a real model, reproduced: ``make demo-real`` (train, then ``loop-compare``) for each seed,
one after another on the whole machine, and the numbers docs/real-model.md reports.

For each seed it runs ``loop-train --config RECIPE --seed N`` and then ``loop-compare`` on that run,
each as its own process, and records wall seconds and the process's peak RSS (``os.wait4``). Then it
copies every run's metrics.jsonl, compare table and trajectories into ``--out`` and writes:

* ``summary.json``: per seed, the first/last-5-iteration reward and success, mean rollout and update
  seconds per iteration, wall seconds and peak RSS of each process, and the compare rows (a seed
  run again replaces its entry; the others stay);
* ``curves.png``: reward and success rate per iteration, one line per seed in the summary.

    python -m benchmarks.real_model --seeds 0 1 2        # 13-16 min of training per seed on 2 cores, then loop-compare
    python -m benchmarks.real_model --seeds 0 --iterations 2 --max-tasks 4 --out /tmp/real-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT, command_line
from loop_trainer.training.run_log import read_metrics


def run(command: list[str], log: Path) -> dict[str, float]:
    """Run ``command`` (output to ``log``); its wall seconds and peak RSS in GiB. Fails loudly."""
    started = time.perf_counter()
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited with {process.returncode}; see {log}")
    return {"seconds": time.perf_counter() - started, "peak_rss_gib": usage.ru_maxrss / 2**20}


def first_last(records: list[dict[str, Any]], key: str, window: int = 5) -> tuple[float, float]:
    values = [r[key] for r in records]
    return statistics.fmean(values[:window]), statistics.fmean(values[-window:])


def seed_summary(run_dir: Path, train: dict[str, float], compare: dict[str, float]) -> dict[str, Any]:
    records = read_metrics(run_dir)
    reward, success = first_last(records, "reward_mean"), first_last(records, "success_rate")
    return {
        "iterations": len(records),
        "reward_first5": reward[0],
        "reward_last5": reward[1],
        "success_first5": success[0],
        "success_last5": success[1],
        "rollout_seconds_mean": statistics.fmean(r["rollout_seconds"] for r in records),
        "update_seconds_mean": statistics.fmean(r.get("update_seconds", 0.0) for r in records),
        "iterations_with_update": sum(bool(r.get("optimizer_steps")) for r in records),
        "train": train,
        "compare": compare,
        "compare_rows": json.loads((run_dir / "compare" / "compare.json").read_text()),
    }


def plot(curves: dict[int, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for seed, records in curves.items():
        iterations = [r["iteration"] for r in records]
        for axis, key in zip(axes, ("success_rate", "reward_mean"), strict=True):
            axis.plot(iterations, [r[key] for r in records], marker=".", label=f"seed {seed}")
    for axis, label in zip(axes, ("success rate", "mean reward"), strict=True):
        axis.set_xlabel("iteration")
        axis.set_ylabel(f"{label} (training rollouts)")
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2-135m-contacts.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=int, help="override the recipe's (a smoke run)")
    parser.add_argument("--max-tasks", type=int, default=32, help="held-out tasks loop-compare evaluates")
    parser.add_argument("--sampled-rollouts", type=int, default=2, help="loop-compare's sampled rollouts per task")
    parser.add_argument("--runs", type=Path, default=ROOT / "outputs" / "real-model", help="where the runs go")
    parser.add_argument("--out", type=Path, default=RESULTS / "real-model")
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    summary_path = options.out / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.is_file() else {"seeds": {}}
    summary.update(command=command_line("benchmarks.real_model", argv), recipe=os.path.relpath(options.recipe, ROOT))
    for seed in options.seeds:
        run_dir = options.runs / f"seed{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)
        options.runs.mkdir(parents=True, exist_ok=True)
        recipe = ["--config", options.recipe, "--output_dir", str(run_dir), "--seed", str(seed)]
        extra = ["--iterations", str(options.iterations)] if options.iterations else []
        print(f"seed {seed}: training ({run_dir})", flush=True)
        train = run(
            [python, "-m", "loop_trainer.cli.train", *recipe, *extra, "--disable_tqdm", "true"],
            options.runs / f"seed{seed}-train.log",
        )
        print(
            f"seed {seed}: trained in {train['seconds']:.0f} s, peak RSS {train['peak_rss_gib']:.1f} GiB; comparing",
            flush=True,
        )
        compare = run(
            [
                python,
                "-m",
                "loop_trainer.cli.compare",
                *recipe,
                "--max_tasks",
                str(options.max_tasks),
                "--sampled_rollouts_per_task",
                str(options.sampled_rollouts),
            ],
            options.runs / f"seed{seed}-compare.log",
        )
        for name, target in (
            ("metrics.jsonl", f"seed{seed}-metrics.jsonl"),
            ("compare/compare.md", f"seed{seed}-compare.md"),
            ("compare/trajectories.md", f"seed{seed}-trajectories.md"),
        ):
            shutil.copy(run_dir / name, options.out / target)
        summary["seeds"][str(seed)] = seed_summary(run_dir, train, compare)
        summary_path.write_text(json.dumps(summary, indent=1))
        print(
            json.dumps({k: v for k, v in summary["seeds"][str(seed)].items() if k != "compare_rows"}, indent=1),
            flush=True,
        )
    curves = {}
    for seed in sorted(summary["seeds"], key=int):  # read_metrics wants a run directory's metrics.jsonl
        lines = (options.out / f"seed{seed}-metrics.jsonl").read_text().splitlines()
        curves[int(seed)] = [json.loads(line) for line in lines if line.strip()]
    plot(curves, options.out / "curves.png", f"LOOP on SmolLM2-135M-Instruct, {Path(options.recipe).name}")
    print(f"wrote {options.out}/summary.json, curves.png and each seed's metrics, compare table and trajectories")


if __name__ == "__main__":
    main()
