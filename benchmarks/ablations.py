"""A miniature of the LOOP paper's Table 1: every variant trained on the same built-in environment,
the same model and the same number of iterations, over several seeds, through ``loop-train`` flags.

Variants (Chen et al. 2025, Table 1, test-normal TGC in brackets):

* LOOP [71.3]: per-token ratio, leave-one-out advantage (the defaults).
* LOOP per turn [64.1]: ``ratio_level: turn``.
* LOOP per trajectory [53.3]: ``ratio_level: trajectory``.
* LOOP + std [61.9]: ``std_normalize_advantages: true``.
* GRPO w/o KL [59.0]: ``advantage_estimator: group_mean`` + std normalisation.
* GRPO [58.0]: the same + a KL penalty ``beta`` to the base model (the LoRA adapter disabled).
* RLOO [57.2]: leave-one-out advantage, trajectory ratio, one epoch of one minibatch per iteration:
  a single on-policy gradient step (the ratio is 1, clipping never acts), i.e. REINFORCE with a
  leave-one-out baseline. Without the single step it would be "LOOP per trajectory" again.

Every variant trains a LoRA adapter (``beta`` needs one: LOOP's reference is the base model with the
adapter disabled), with the same rank and learning rate. Each run is ``loop-train``'s entry point
with the variant's flags. ``--workers 2`` runs two at a time, each in its own process on one torch
thread (the tiny model gains nothing from a second thread, and one thread each avoids two OpenMP
pools spin-waiting on two cores; the demo's numerics do not depend on the thread count). Reported
per variant: the
mean over seeds of the last-5-iterations mean reward and success rate (± the std over seeds), and
wall seconds per run; one PNG with every variant's mean success-rate curve.

    python -m benchmarks.ablations --workers 2                       # ~30 min on 2 cores
    python -m benchmarks.ablations --iterations 2 --seeds 0 --out /tmp/ablations-smoke   # a check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT, command_line

PAPER = {
    "LOOP": 71.3,
    "LOOP per turn": 64.1,
    "LOOP + std": 61.9,
    "GRPO w/o KL": 59.0,
    "GRPO": 58.0,
    "RLOO": 57.2,
    "LOOP per trajectory": 53.3,
}


def variants(rollouts: int, beta: float) -> dict[str, dict[str, Any]]:
    return {
        "LOOP": {},
        "LOOP per turn": {"ratio_level": "turn"},
        "LOOP per trajectory": {"ratio_level": "trajectory"},
        "LOOP + std": {"std_normalize_advantages": "true"},
        "GRPO w/o KL": {"advantage_estimator": "group_mean", "std_normalize_advantages": "true"},
        "GRPO": {"advantage_estimator": "group_mean", "std_normalize_advantages": "true", "beta": beta},
        "RLOO": {"ratio_level": "trajectory", "ppo_epochs": 1, "minibatch_size": rollouts},
    }


def recipe_rollouts(recipe: str) -> int:
    """Rollouts per iteration in the recipe: RLOO's one minibatch takes all of them."""
    import yaml

    settings = yaml.safe_load(Path(recipe).read_text())
    return int(settings["tasks_per_iteration"]) * int(settings["rollouts_per_task"])


def warmed_up_models(recipe: str, seeds: list[int], out: Path) -> dict[int, str]:
    """The recipe's tiny model, warmed up once per seed and saved: every variant of a seed starts from
    the same weights ``loop-train`` would build for that seed, without paying the warm-up 7 times."""
    import yaml

    from loop_trainer.envs import make_environment
    from loop_trainer.models.tiny import build_tiny_from_spec, is_tiny_spec

    settings = yaml.safe_load(Path(recipe).read_text())
    if not is_tiny_spec(settings["model_name_or_path"]):
        return {}
    env = make_environment(settings["environment"], **(settings.get("environment_kwargs") or {}))
    paths = {}
    for seed in seeds:
        model, tokenizer = build_tiny_from_spec(settings["model_name_or_path"], env, seed=seed)
        paths[seed] = str(out / "models" / f"seed{seed}")
        model.save_pretrained(paths[seed])
        tokenizer.save_pretrained(paths[seed])
    return paths


def one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_one(
    name: str, flags: dict[str, Any], seed: int, options: argparse.Namespace, out: Path, model: str | None
) -> dict[str, Any]:
    run_dir = out / "runs" / f"{name.replace(' ', '_').replace('/', '')}-seed{seed}"
    common = {
        "config": options.recipe,
        "output_dir": run_dir,
        "seed": seed,
        "iterations": options.iterations,
        **({"model_name_or_path": model} if model else {}),
        "overwrite_output_dir": "true",
        "save_strategy": "no",
        "plot_curves": "false",
        "viewer_rollouts_per_iteration": 0,
        "disable_tqdm": "true",
        "use_peft": "true",
        "lora_r": options.lora_r,
        "lora_alpha": 2 * options.lora_r,
        "lora_target_modules": "all-linear",
        "learning_rate": options.learning_rate,
    }
    argv = []
    for key, value in {**common, **flags}.items():
        argv += [f"--{key}", str(value)]
    # loop-train's own entry point, in this process: the flags go through the same parser, and the
    # ~30 s of imports and start-up are paid once instead of once per run (an iteration takes ~1 s).
    from loop_trainer.cli.train import cli

    started = time.perf_counter()
    code = cli(argv)
    seconds = time.perf_counter() - started
    if code:
        raise SystemExit(f"{name} seed {seed} failed ({code}): loop-train {' '.join(argv)}")
    rows = read_metrics(run_dir / "metrics.jsonl")
    rows = [r for r in rows if "reward_mean" in r and "iteration" in r]
    return {
        "variant": name,
        "seed": seed,
        "flags": flags,
        "seconds": seconds,
        "reward": [r["reward_mean"] for r in rows],
        "success": [r.get("success_rate") for r in rows],
    }


def summarize(runs: list[dict[str, Any]], names: list[str], last: int) -> list[dict[str, Any]]:
    table = []
    for name in names:
        mine = [r for r in runs if r["variant"] == name]
        finals = {key: [statistics.fmean(r[key][-last:]) for r in mine] for key in ("reward", "success")}
        table.append(
            {
                "variant": name,
                "paper_tgc": PAPER[name],
                "seeds": len(mine),
                **{f"{key}_mean": statistics.fmean(v) for key, v in finals.items()},
                **{f"{key}_std": statistics.stdev(v) if len(v) > 1 else 0.0 for key, v in finals.items()},
                "first5_success": statistics.fmean(statistics.fmean(r["success"][:last]) for r in mine),
                "seconds_mean": statistics.fmean(r["seconds"] for r in mine),
            }
        )
    return table


def markdown(table: list[dict[str, Any]], last: int) -> str:
    lines = [
        f"| variant | paper TGC | success, last {last} its | reward, last {last} its | success, first {last} its "
        "| seconds per run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in sorted(table, key=lambda r: -r["success_mean"]):
        lines.append(
            f"| {row['variant']} | {row['paper_tgc']} | {row['success_mean']:.3f} ± {row['success_std']:.3f} | "
            f"{row['reward_mean']:.3f} ± {row['reward_std']:.3f} | {row['first5_success']:.3f} | "
            f"{row['seconds_mean']:.0f} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in names:
        mine = [r for r in runs if r["variant"] == name]
        for axis, key in zip(axes, ("success", "reward"), strict=True):
            curves = [[v if v is not None else float("nan") for v in r[key]] for r in mine]
            length = min(len(c) for c in curves)
            mean = [statistics.fmean(c[i] for c in curves) for i in range(length)]
            window = 5  # a trailing mean: single iterations are noisy
            smooth = [statistics.fmean(mean[max(0, i - window + 1) : i + 1]) for i in range(length)]
            axis.plot(range(1, length + 1), smooth, label=f"{name} (paper {PAPER[name]})")
    for axis, key in zip(axes, ("success rate", "mean reward"), strict=True):
        axis.set_xlabel("iteration")
        axis.set_ylabel(f"{key} (mean over seeds, trailing 5-iteration mean)")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle("Miniature Table 1: LOOP variants on vault (tiny-instruct model, LoRA)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "demo.yaml"))
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(PAPER), choices=list(PAPER))
    parser.add_argument("--lora-r", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.04, help="GRPO's KL coefficient (TRL's former default)")
    parser.add_argument("--workers", type=int, default=1, help="runs at a time, one process and one thread each")
    parser.add_argument("--last", type=int, default=5, help="final iterations averaged in the table")
    parser.add_argument("--out", type=Path, default=RESULTS / "ablations")
    options = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    options.out.mkdir(parents=True, exist_ok=True)
    table_of = variants(recipe_rollouts(options.recipe), options.beta)
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    models = warmed_up_models(options.recipe, options.seeds, options.out)
    # seed-major: a cut-off run still has every variant on the first seeds
    jobs = [(name, seed) for seed in options.seeds for name in options.variants]
    workers = None
    if options.workers > 1:
        workers = ProcessPoolExecutor(options.workers, mp_context=get_context("spawn"), initializer=one_thread)
    try:
        pending = [
            (
                name,
                seed,
                workers.submit(run_one, name, table_of[name], seed, options, options.out, models.get(seed))
                if workers
                else None,
            )
            for name, seed in jobs
        ]
        for name, seed, future in pending:
            run = (
                future.result()
                if future
                else run_one(name, table_of[name], seed, options, options.out, models.get(seed))
            )
            runs.append(run)
            print(
                f"{name:20s} seed {seed}: last-{options.last} success "
                f"{statistics.fmean(s for s in run['success'][-options.last :] if s is not None):.3f}, "
                f"{run['seconds']:.0f} s",
                flush=True,
            )
            (options.out / "ablations.json").write_text(
                json.dumps(
                    {
                        "command": command_line("benchmarks.ablations", argv),
                        "options": {k: str(v) for k, v in vars(options).items()},
                        "runs": runs,
                    },
                    indent=1,
                )
            )
    finally:
        if workers:
            workers.shutdown(cancel_futures=True)
    table = summarize(runs, options.variants, options.last)
    text = markdown(table, options.last)
    (options.out / "ablations.json").write_text(
        json.dumps(
            {
                "command": command_line("benchmarks.ablations", argv),
                "options": {k: str(v) for k, v in vars(options).items()},
                "seconds": time.perf_counter() - started,
                "table": table,
                "runs": runs,
            },
            indent=1,
        )
    )
    (options.out / "ablations.md").write_text(text + "\n")
    plot(runs, options.variants, options.out / "ablations.png")
    print(text)
    print(f"wrote {options.out}/ablations.json, .md and .png in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
