"""A miniature of the LOOP paper's Table 1: every variant trained on the same built-in environment,
the same model and the same number of iterations, over several seeds, through ``loop-train`` flags.

Variants (Chen et al. 2025, Table 1, test-normal TGC in brackets):

* LOOP [71.3]: per-token ratio, leave-one-out advantage (the defaults).
* LOOP per turn [64.1]: ``ratio_level: turn``.
* LOOP per trajectory [53.3]: ``ratio_level: trajectory``.
* LOOP + std [61.9]: ``std_normalize_advantages: true``.
* GRPO w/o KL [59.0]: ``advantage_estimator: group_mean`` + std normalisation.
* GRPO [58.0]: the same + a KL penalty ``beta`` to the starting weights (here the base model: the adapter disabled).
* RLOO [57.2]: leave-one-out advantage, trajectory ratio, one epoch of one minibatch per iteration:
  a single on-policy gradient step (the ratio is 1, clipping never acts), i.e. REINFORCE with a
  leave-one-out baseline. Without the single step it would be "LOOP per trajectory" again.

And rows that are not the paper's: LOOP with one stabiliser each (docs/stabilisers.md),
``LOOP + clip-higher`` (``epsilon_high: 0.28``) and ``LOOP + dynamic sampling``
(``dynamic_sampling_rounds: 2``), and ``LOOP + KL`` (GRPO's ``beta`` on LOOP). ``--variants`` runs some
of them; the saved runs of the others in ``OUT/ablations.json`` are kept and tabled with them.

Every variant trains a LoRA adapter, with the same rank and learning rate (``beta``'s reference is then the base
model with the adapter disabled; full fine-tuning would keep a frozen copy of the starting weights).
The adapter keeps TRL's ``lora_dropout`` (0.05) unless
``--disable-dropout`` is given: with it on, the update's forward differs from the old policy's, so the ratio is not
1 on policy (on ``errands`` RLOO's single step clipped 10-20 % of trajectories; docs/long-horizon.md). Each run is
``loop-train``'s entry point with the variant's flags. ``--workers 2`` runs two at a time, each in its own process
on one torch thread (the tiny model gains nothing from a second thread, and one thread each avoids two OpenMP pools
spin-waiting on two cores; the demo's numerics do not depend on the thread count). Reported per variant: the mean
over seeds of the last-5-iterations mean reward and success rate (± the std over seeds), the runs whose history
shows a collapse signature (the trainer's warning, :mod:`loop_trainer.training.signals`), wall seconds per run, and
which pairs of variants separate beyond the seeds' spread (their mean ± std bands do not overlap); one PNG with
every variant's mean success-rate curve.

    python -m benchmarks.ablations --workers 2                       # ~45 min on 2 cores
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

from benchmarks.common import RESULTS, ROOT, command_line, torch_threads

PAPER: dict[str, float | None] = {
    "LOOP": 71.3,
    "LOOP per turn": 64.1,
    "LOOP + std": 61.9,
    "GRPO w/o KL": 59.0,
    "GRPO": 58.0,
    "RLOO": 57.2,
    "LOOP per trajectory": 53.3,
    "LOOP + clip-higher": None,  # not in the paper: the stabilisers, and LOOP with GRPO's KL penalty
    "LOOP + dynamic sampling": None,
    "LOOP + KL": None,
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
        "LOOP + clip-higher": {"epsilon_high": 0.28},
        "LOOP + dynamic sampling": {"dynamic_sampling_rounds": 2},
        "LOOP + KL": {"beta": beta},
    }


def recipe_environment(recipe: str) -> str:
    import yaml

    return str(yaml.safe_load(Path(recipe).read_text())["environment"])


def recipe_rollouts(recipe: str) -> int:
    """Rollouts per iteration in the recipe: RLOO's one minibatch takes all of them."""
    import yaml

    settings = yaml.safe_load(Path(recipe).read_text())
    return int(settings["tasks_per_iteration"]) * int(settings["rollouts_per_task"])


def warmed_up_models(recipe: str, seeds: list[int], out: Path) -> dict[int, str]:
    """The recipe's tiny model, warmed up once per seed and saved: every variant of a seed starts from
    the same weights ``loop-train`` would build for that seed (its own builder, on the recipe parsed as it parses
    it: the warm-up's steps, timeout and probe), without paying the warm-up 7 times."""
    import yaml

    from loop_trainer.cli.recipe import parse_recipe
    from loop_trainer.envs import make_environment
    from loop_trainer.models.tiny import is_tiny_spec
    from loop_trainer.training.model_loading import build_tiny_model

    settings = yaml.safe_load(Path(recipe).read_text())
    if not is_tiny_spec(settings["model_name_or_path"]):
        return {}
    env = make_environment(settings["environment"], **(settings.get("environment_kwargs") or {}))
    paths = {}
    for seed in seeds:
        argv = ["--config", recipe, "--seed", str(seed), "--output_dir", str(out / "models" / f"seed{seed}-run")]
        _, args, model_args = parse_recipe(argv)
        model, tokenizer = build_tiny_model(model_args.model_name_or_path, env, args)
        paths[seed] = str(out / "models" / f"seed{seed}")
        model.save_pretrained(paths[seed])
        tokenizer.save_pretrained(paths[seed])
    return paths


def kept_warm_starts(folder: Path, seeds: list[int], recipe: str) -> dict[int, str]:
    """The warm starts ``benchmarks/long_horizon.py --keep-models`` saved (``FOLDER/seed-N/start``) for this
    recipe's model, environment and warm-up: on ``errands`` a warm-up takes 25-35 minutes a seed, so the
    variants start from the benchmark's own."""
    import yaml

    from benchmarks.long_horizon import kept_warm_start, warm_up_spec

    settings = yaml.safe_load(Path(recipe).read_text())
    for seed in seeds:
        kept = kept_warm_start(folder / f"seed-{seed}")
        if kept is None:
            raise SystemExit(
                f"--warm-starts: no kept warm start at {folder / f'seed-{seed}'} (long_horizon.py --keep-models)"
            )
        if kept != warm_up_spec(settings, seed):
            raise SystemExit(
                f"--warm-starts: the warm start in {folder / f'seed-{seed}'} was made for another recipe or fit rule "
                f"({kept['model_name_or_path']} on {kept['environment']}); "
                f"run long_horizon.py --keep-models with {recipe}"
            )
    return {seed: str(folder / f"seed-{seed}" / "start") for seed in seeds}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def iteration_rows(logged: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training iterations' rows of a run's metrics (not its held-out checks or its closing summary)."""
    return [r for r in logged if "reward_mean" in r and "iteration" in r]


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
        **({"disable_dropout": "true"} if options.disable_dropout else {}),
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
    logged = read_metrics(run_dir / "metrics.jsonl")
    rows = iteration_rows(logged)
    return {
        "variant": name,
        "seed": seed,
        "flags": flags,
        "seconds": seconds,
        "reward": [r["reward_mean"] for r in rows],
        "success": [r.get("success_rate") for r in rows],
        "tied": [r.get("tied_group_fraction") for r in rows],
        "entropy": [r.get("entropy") for r in rows],
        "clip": [r.get("clip_frac") for r in rows],
        "collapse_warnings": collapse_warnings(rows),
        "held_out": held_out_checks(logged),
    }


def held_out_checks(logged: list[dict[str, Any]]) -> list[list[float]]:
    """The run's held-out checks (the recipe's ``eval_every``), as [iteration, success rate]: on a long task the
    training batches' success moves by 0.1 from one iteration to the next, a check over the test split less."""
    return [[row["iteration"], row["eval_success_rate"]] for row in logged if "eval_success_rate" in row]


def collapse_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """The warnings the trainer logged (or, for a run made before a signature existed, would log) over
    a run's metrics: they depend on the history alone."""
    from loop_trainer.training.signals import collapse_warning

    return [w for n in range(1, len(rows) + 1) if (w := collapse_warning(rows[:n])) is not None]


def summarize(runs: list[dict[str, Any]], names: list[str], last: int) -> list[dict[str, Any]]:
    table = []
    for name in names:
        mine = [r for r in runs if r["variant"] == name]
        last_checks = [r["held_out"][-1] for r in mine if r.get("held_out")]  # none where the recipe makes none
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
                "clip_mean": _mean_clip(mine),
                "held_out_mean": statistics.fmean(rate for _, rate in last_checks) if last_checks else None,
                "held_out_iteration": max((iteration for iteration, _ in last_checks), default=None),
                "warned_seeds": [r["seed"] for r in mine if r.get("collapse_warnings")],
                "success_by_seed": dict(zip([r["seed"] for r in mine], finals["success"], strict=True)),
            }
        )
    return table


def _mean_clip(runs: list[dict[str, Any]]) -> float | None:
    """The clip fraction (at the variant's own ratio level) over every iteration of every seed; None for
    runs saved before it was recorded."""
    clips = [c for r in runs for c in r.get("clip") or [] if c is not None]
    return statistics.fmean(clips) if clips else None


def bands_separate(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two rows' final success rates separate beyond the seeds' spread: their mean ± std bands over
    seeds do not overlap."""
    high, low = (a, b) if a["success_mean"] >= b["success_mean"] else (b, a)
    return high["success_mean"] - high["success_std"] > low["success_mean"] + low["success_std"]


def separated_pairs(table: list[dict[str, Any]]) -> list[str]:
    """The pairs of variants whose final success rates separate beyond the seeds' spread."""
    out = []
    spread = [row for row in table if row["seeds"] > 1]  # one seed has no spread to separate beyond
    for i, a in enumerate(spread):
        for b in spread[i + 1 :]:
            if bands_separate(a, b):
                high, low = (a, b) if a["success_mean"] >= b["success_mean"] else (b, a)
                out.append(f"{high['variant']} > {low['variant']}")
    return out


def markdown(table: list[dict[str, Any]], last: int) -> str:
    lines = [
        f"| variant | paper TGC | success, last {last} its | reward, last {last} its | success, first {last} its "
        "| held-out success (last check) | clip fraction | seeds with a collapse warning | seconds per run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in sorted(table, key=lambda r: -r["success_mean"]):
        warned = ", ".join(map(str, row["warned_seeds"])) or "none"
        held_out = (
            "-" if row.get("held_out_mean") is None else f"{row['held_out_mean']:.3f} (it {row['held_out_iteration']})"
        )
        lines.append(
            f"| {row['variant']} | {row['paper_tgc'] or '-'} | {row['success_mean']:.3f} ± {row['success_std']:.3f} | "
            f"{row['reward_mean']:.3f} ± {row['reward_std']:.3f} | {row['first5_success']:.3f} | "
            f"{held_out} | "
            f"{'-' if row.get('clip_mean') is None else format(row['clip_mean'], '.3f')} | {warned} | "
            f"{row['seconds_mean']:.0f} |"
        )
    pairs = separated_pairs(table)
    lines += [
        "",
        "Pairs whose final success separates beyond the seeds' spread (mean ± std bands do not overlap): "
        + ("; ".join(pairs) if pairs else "none."),
    ]
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], names: list[str], path: Path, environment: str) -> None:
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
            axis.plot(range(1, length + 1), smooth, label=f"{name} (paper {PAPER[name] or '-'})")
    for axis, key in zip(axes, ("success rate", "mean reward"), strict=True):
        axis.set_xlabel("iteration")
        axis.set_ylabel(f"{key} (mean over seeds, trailing 5-iteration mean)")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(f"Miniature Table 1: LOOP variants on {environment} (tiny-instruct model, LoRA)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def write_results(
    options: argparse.Namespace, command: str, runs: list[dict[str, Any]], names: list[str], seconds: float
) -> str:
    table = summarize(runs, names, options.last)
    text = markdown(table, options.last)
    (options.out / "ablations.json").write_text(
        json.dumps(
            {
                "command": command,
                "options": {k: str(v) for k, v in vars(options).items()},
                "seconds": seconds,
                "table": table,
                "runs": runs,
            },
            indent=1,
        )
    )
    (options.out / "ablations.md").write_text(text + "\n")
    plot(runs, names, options.out / "ablations.png", recipe_environment(options.recipe))
    return text


def resummarize(options: argparse.Namespace, argv: list[str] | None) -> None:
    saved = json.loads((options.out / "ablations.json").read_text())
    runs = saved["runs"]
    for run in runs:
        run_dir = options.out / "runs" / f"{run['variant'].replace(' ', '_').replace('/', '')}-seed{run['seed']}"
        logged = read_metrics(run_dir / "metrics.jsonl")
        run["collapse_warnings"] = collapse_warnings(iteration_rows(logged))
        run["held_out"] = held_out_checks(logged)
    names = list(dict.fromkeys(run["variant"] for run in runs))
    # the table of the runs as they were made (their command), the warnings as the code gives them now
    print(write_results(options, saved["command"], runs, names, saved.get("seconds", 0.0)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "demo.yaml"))
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--variants", nargs="+", default=list(PAPER), choices=list(PAPER))
    parser.add_argument("--lora-r", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument(
        "--disable-dropout",
        action="store_true",
        help="switch dropout off in every run (disable_dropout): the adapter's lora_dropout (0.05) otherwise makes the "
        "trainer's forward differ from the sampler's, so the ratio is not 1 on policy",
    )
    parser.add_argument("--beta", type=float, default=0.04, help="GRPO's KL coefficient (TRL's former default)")
    parser.add_argument("--workers", type=int, default=1, help="runs at a time, one process and one thread each")
    parser.add_argument("--last", type=int, default=5, help="final iterations averaged in the table")
    parser.add_argument("--out", type=Path, default=RESULTS / "ablations")
    parser.add_argument(
        "--warm-starts",
        type=Path,
        help="start each seed from FOLDER/seed-N/start (benchmarks/long_horizon.py --keep-models) instead of "
        "warming the recipe's tiny model up again",
    )
    parser.add_argument(
        "--summarize-only",
        action="store_true",
        help="no training: re-read OUT/ablations.json's runs, recompute their collapse warnings from "
        "OUT/runs/*/metrics.jsonl, and rewrite the table and the plot",
    )
    options = parser.parse_args(argv)
    if options.summarize_only:
        resummarize(options, argv)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    options.out.mkdir(parents=True, exist_ok=True)
    table_of = variants(recipe_rollouts(options.recipe), options.beta)
    saved = options.out / "ablations.json"
    # the saved runs of variants not run now stay (a row added later joins the table)
    runs: list[dict[str, Any]] = (
        [r for r in json.loads(saved.read_text())["runs"] if r["variant"] not in options.variants]
        if saved.exists()
        else []
    )
    names = list(dict.fromkeys([*(r["variant"] for r in runs), *options.variants]))
    started = time.perf_counter()
    models = (
        kept_warm_starts(options.warm_starts, options.seeds, options.recipe)
        if options.warm_starts
        else warmed_up_models(options.recipe, options.seeds, options.out)
    )
    # seed-major: a cut-off run still has every variant on the first seeds
    jobs = [(name, seed) for seed in options.seeds for name in options.variants]
    workers = None
    if options.workers > 1:
        workers = ProcessPoolExecutor(
            options.workers, mp_context=get_context("spawn"), initializer=torch_threads, initargs=(1,)
        )
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
    command = command_line("benchmarks.ablations", argv)
    if saved.exists() and len(names) > len(options.variants):  # the kept runs came from an earlier command
        command = f"{json.loads(saved.read_text())['command']} && {command}"
    text = write_results(options, command, runs, names, time.perf_counter() - started)
    print(text)
    print(f"wrote {options.out}/ablations.json, .md and .png in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
