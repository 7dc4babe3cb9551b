"""LOOP learns a long-horizon task on a CPU: ``recipes/errands.yaml`` over seeds, each seed from its own
warm-up, with held-out evaluations (``loop-eval`` on the test split) of the warm-started model and of the
trained one.

Per seed, in one process on one core and one torch thread (``--workers 2`` runs two seeds at once, one per
core of a 2-core machine; ``--threads 2`` gives one seed both cores, a 4-layer model's warm-up step then costs
what a 2-layer one's does on one, ``benchmarks/tiny_depth_cost.py``):

1. the recipe's ``tiny-instruct:`` model is built and warmed up (``tiny_instruct_steps`` or until fitted),
   its progress kept, and saved;
2. ``loop-eval`` evaluates it on the test split, greedy and at the sampling temperature (1.0), with the
   recipe's episode limits;
3. ``loop-train`` trains it with the recipe (``--model_name_or_path`` the saved warm start: the same
   weights ``tiny-instruct:`` would build for the seed, without a second warm-up);
4. ``loop-eval`` evaluates the trained model the same way.

Written to ``OUT``: per seed ``seed-N/run/metrics.jsonl`` (the run's per-iteration metrics: ``turns_mean``,
``success_rate``, ``reward_mean``, per-level and per-check rates), ``seed-N/eval-{start,end}-T{0,1}/``
(``metrics.json``, ``results.jsonl``, ``viewer.html``) and ``seed-N/warm_up.log``; ``long_horizon.json``
(every seed's timings and held-out results), ``README.md`` (the table) and ``curves.png``.

    python -m benchmarks.long_horizon --workers 2                         # 5 seeds
    python -m benchmarks.long_horizon --seeds 0 --iterations 2 --out /tmp/long-horizon-smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from benchmarks.ablations import collapse_warnings, iteration_rows, read_metrics
from benchmarks.common import RESULTS, ROOT, command_line, torch_threads

EPISODE_KEYS = ("max_turns", "max_new_tokens_per_turn", "max_trajectory_tokens")


def recipe_settings(recipe: str) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(Path(recipe).read_text())


def evaluate(model: str, settings: dict[str, Any], temperature: float, out: Path, seed: int) -> dict[str, Any]:
    from loop_trainer.cli.evaluate import cli as loop_eval

    argv = [
        *("--model_name_or_path", model),
        *("--environment", settings["environment"]),
        *("--environment_kwargs", json.dumps(settings.get("environment_kwargs") or {})),
        *("--split", "test"),
        *("--temperature", str(temperature)),
        *("--seed", str(seed)),
        *("--output_dir", str(out)),
    ]
    for key in EPISODE_KEYS:
        if key in settings:
            argv += [f"--{key}", str(settings[key])]
    if settings.get("eval_max_tasks") is not None:  # the recipe's held-out set, also for loop-eval
        argv += ["--max_tasks", str(settings["eval_max_tasks"])]
    if loop_eval(argv):
        raise SystemExit(f"loop-eval failed: {' '.join(argv)}")
    return json.loads((out / "metrics.json").read_text())


def warm_up_spec(settings: dict[str, Any], seed: int) -> dict[str, Any]:
    """What a warm start depends on: the recipe's model, environment and warm-up, the seed and the fit rule
    (a warm start kept before a change to any of them is made again, not reused)."""
    from loop_trainer.envs import make_environment
    from loop_trainer.models.tiny import DEFAULT_TINY_LAYERS, FitRule, tiny_layers_of

    env = make_environment(settings["environment"], **(settings.get("environment_kwargs") or {}))
    layers, level = tiny_layers_of(env), getattr(env, "warm_up_success", None)
    spec = {
        "model_name_or_path": settings["model_name_or_path"],
        "environment": settings["environment"],
        "environment_kwargs": settings.get("environment_kwargs") or {},
        "tiny_instruct_steps": settings.get("tiny_instruct_steps"),
        "seed": seed,
        "fit_rule": dataclasses.asdict(FitRule()),
        "warm_up_success": level,
        **({"probe_episodes": episode_settings(settings)} if level else {}),
        # only where it is not the default, so that the warm starts kept before depth was a setting still match
        **({"tiny_layers": layers} if layers != DEFAULT_TINY_LAYERS else {}),
    }
    return json.loads(json.dumps(spec))  # as it reads back from warm_up.json


def episode_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The recipe's episode limits (:data:`EPISODE_KEYS`): what the warm-up's greedy
    probe and the held-out evaluations roll out under."""
    return {key: settings[key] for key in EPISODE_KEYS if key in settings}


def kept_warm_start(seed_dir: Path) -> dict[str, Any] | None:
    """The spec of the warm start kept in ``seed_dir`` (``start/`` and ``warm_up.json``), or None."""
    if not (seed_dir / "start" / "model.safetensors").is_file() or not (seed_dir / "warm_up.json").is_file():
        return None
    spec = json.loads((seed_dir / "warm_up.json").read_text()).get("spec")
    return spec if isinstance(spec, dict) else None


def run_seed(seed: int, options: argparse.Namespace) -> dict[str, Any]:
    import torch

    from loop_trainer.cli.evaluate import GreedySuccessOnTrainingTasks
    from loop_trainer.cli.train import cli as loop_train
    from loop_trainer.config import EpisodeSettings
    from loop_trainer.envs import make_environment
    from loop_trainer.models.tiny import build_tiny_from_spec

    settings = recipe_settings(options.recipe)
    out = options.out / f"seed-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    start = out / "start"
    spec = warm_up_spec(settings, seed)
    lines: list[str] = []  # the warm-up's progress lines (warm_up.log)
    reused = kept_warm_start(out) == spec
    if reused:  # kept by --keep-models, made by the same recipe, seed and fit rule
        lines.extend((out / "warm_up.log").read_text().splitlines())
        warm_up_seconds = json.loads((out / "warm_up.json").read_text())["seconds"]
        print(f"seed {seed}: reusing the warm start saved in {start} ({warm_up_seconds / 60:.1f} min)", flush=True)
    else:
        env = make_environment(settings["environment"], **(settings.get("environment_kwargs") or {}))

        def report(line: str) -> None:  # kept for warm_up.log, and shown as it comes (a warm-up can run an hour)
            lines.append(line)
            print(f"seed {seed}: {line}", flush=True)

        model, tokenizer = build_tiny_from_spec(
            settings["model_name_or_path"],
            env,
            seed=seed,
            warm_up_steps=settings.get("tiny_instruct_steps"),
            report=report,
            greedy_success=GreedySuccessOnTrainingTasks(env, EpisodeSettings(**episode_settings(settings))),
            keep_warm_up=False,  # timed: a warm-up kept by another run would cost nothing here
        )
        model.save_pretrained(start)
        tokenizer.save_pretrained(start)
        (out / "warm_up.log").write_text("\n".join(lines) + "\n")
        warm_up_seconds = time.perf_counter() - started
        (out / "warm_up.json").write_text(json.dumps({"seconds": warm_up_seconds, "spec": spec}))
    evaluations: dict[str, Any] = {}
    for temperature in (0.0, 1.0):
        evaluations[f"start_T{temperature:g}"] = evaluate(
            str(start), settings, temperature, out / f"eval-start-T{temperature:g}", seed
        )
    trained = out / "run"
    argv = [
        *("--config", options.recipe),
        *("--seed", str(seed)),
        *("--model_name_or_path", str(start)),
        *("--output_dir", str(trained)),
        *("--overwrite_output_dir", "true"),
        *("--disable_tqdm", "true"),
        *("--save_strategy", "no"),
        *(("--iterations", str(options.iterations)) if options.iterations else ()),
    ]
    training_started = time.perf_counter()
    if loop_train(argv):
        raise SystemExit(f"seed {seed}: loop-train failed: {' '.join(argv)}")
    training_seconds = time.perf_counter() - training_started
    for temperature in (0.0, 1.0):
        evaluations[f"end_T{temperature:g}"] = evaluate(
            str(trained), settings, temperature, out / f"eval-end-T{temperature:g}", seed
        )
    rows = iteration_rows(read_metrics(trained / "metrics.jsonl"))
    if not options.keep_models:  # the results are the metrics; the weights are a few MB a seed
        for weights in (*start.glob("*.safetensors"), *trained.glob("*.safetensors")):
            weights.unlink()
    return {
        "seed": seed,
        "threads": torch.get_num_threads(),
        "warm_up_seconds": warm_up_seconds,
        "warm_up_steps": next(
            (int(line.split("step ")[1].split("/")[0]) for line in reversed(lines) if ", loss" in line), None
        ),
        "training_seconds": training_seconds,
        "warm_up_reused": reused,
        # a seed's whole cost: a reused warm start's minutes are the ones it took when it was made
        "seconds": time.perf_counter() - started + (warm_up_seconds if reused else 0.0),
        "iterations": len(rows),
        "success": [r.get("success_rate") for r in rows],
        "reward": [r.get("reward_mean") for r in rows],
        "turns_mean": [r.get("turns_mean") for r in rows],
        "iteration_seconds": [r.get("seconds") for r in rows],
        "evaluations": evaluations,
        "collapse_warnings": collapse_warnings(rows),
    }


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| seed | warm-up (steps, min) | training (iterations, min) | total min | held-out success at T=1 (the "
        "bar): start -> end | greedy: start -> end | end success by level (T=1) | turns, first -> last 5 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in sorted(runs, key=lambda r: r["seed"]):
        e = run["evaluations"]
        levels = " / ".join(
            f"{e['end_T1'][key]:.2f}" for key in sorted(e["end_T1"]) if key.startswith("success_rate_level_")
        )
        turns = run["turns_mean"]
        lines.append(
            f"| {run['seed']} | {run['warm_up_steps']}, {run['warm_up_seconds'] / 60:.1f}"
            f"{' (kept)' if run.get('warm_up_reused') else ''} | "
            f"{run['iterations']}, {run['training_seconds'] / 60:.1f} | {run['seconds'] / 60:.1f} | "
            f"{e['start_T1']['success_rate']:.2f} -> **{e['end_T1']['success_rate']:.2f}** | "
            f"{e['start_T0']['success_rate']:.2f} -> {e['end_T0']['success_rate']:.2f} | {levels} | "
            f"{statistics.fmean(turns[:5]):.1f} -> {statistics.fmean(turns[-5:]):.1f} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (success_axis, turns_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in sorted(runs, key=lambda r: r["seed"]):
        success = [s if s is not None else float("nan") for s in run["success"]]
        smooth = [statistics.fmean(success[max(0, i - 4) : i + 1]) for i in range(len(success))]
        line = success_axis.plot(range(1, len(smooth) + 1), smooth, alpha=0.8, label=f"seed {run['seed']}")[0]
        end = run["evaluations"]["end_T1"]["success_rate"]
        success_axis.scatter([len(smooth)], [end], color=line.get_color(), marker="*", s=80)
        turns_axis.plot(range(1, len(run["turns_mean"]) + 1), run["turns_mean"], alpha=0.8, color=line.get_color())
    success_axis.set_ylabel("training success (trailing 5-iteration mean); * held-out, T=1")
    turns_axis.set_ylabel("turns per episode (mean)")
    for axis in (success_axis, turns_axis):
        axis.set_xlabel("iteration")
        axis.grid(alpha=0.3)
    success_axis.legend(fontsize=8)
    threads = sorted({run.get("threads", 1) for run in runs})
    per_seed = "one core per seed" if threads == [1] else f"{'/'.join(map(str, threads))} torch threads per seed"
    figure.suptitle(f"LOOP on errands (10-30 dependent calls), tiny-instruct model, {per_seed}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "errands.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--iterations", type=int, default=None, help="override the recipe's iterations")
    parser.add_argument("--workers", type=int, default=1, help="seeds at a time, one process each")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per seed (a core each)")
    parser.add_argument("--out", type=Path, default=RESULTS / "long-horizon")
    parser.add_argument(
        "--keep-models",
        action="store_true",
        help="keep the warm-started and trained weights (a later run into the same OUT reuses the warm starts)",
    )
    options = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    options.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs = []
    if options.workers > 1:
        spawn, threads = get_context("spawn"), (options.threads,)
        with ProcessPoolExecutor(options.workers, spawn, initializer=torch_threads, initargs=threads) as pool:
            futures = [pool.submit(run_seed, seed, options) for seed in options.seeds]
            runs = [future.result() for future in futures]
    else:
        torch_threads(options.threads)
        runs = [run_seed(seed, options) for seed in options.seeds]
    command = command_line("benchmarks.long_horizon", argv)
    (options.out / "long_horizon.json").write_text(
        json.dumps(
            {"command": command, "threads": options.threads, "seconds": time.perf_counter() - started, "runs": runs},
            indent=1,
        )
    )
    plot(runs, options.out / "curves.png")
    table = markdown(runs)
    (options.out / "README.md").write_text(
        f"# LOOP on errands, {len(runs)} seeds\n\n`{command}`\n\n{table}\n\nCurves: curves.png. "
        "Per seed: seed-N/run/metrics.jsonl, seed-N/eval-*/ (loop-eval's metrics.json, results.jsonl, viewer.html), "
        "seed-N/warm_up.log.\n"
    )
    print(table)


if __name__ == "__main__":
    main()
