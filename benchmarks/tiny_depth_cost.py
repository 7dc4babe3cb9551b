"""What the tiny model's depth and a second torch thread cost on ``errands``, side by side on one machine.

The warm-up: seconds a step of the fit rule's warm-up, on the same demonstrations and the same length-grouped
batches, for a 2- and a 4-layer model. LOOP: seconds an iteration of the recipe (rollout and update) from seed 0's
kept warm starts, 2 layers (``cooled-seeds-0-3``) and 4 (``four-layers-seeds-0-3``), the same tasks for both.
Each at 1 and 2 torch threads. Run it alone: another torch process on the same cores stalls both.

    python -m benchmarks.tiny_depth_cost                       # about 6 minutes on 2 cores
    python -m benchmarks.tiny_depth_cost --steps 20 --iterations 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT, command_line, software, torch_threads

KEPT_STARTS = {
    2: RESULTS / "long-horizon" / "cooled-seeds-0-3" / "seed-0" / "start",
    4: RESULTS / "long-horizon" / "four-layers-seeds-0-3" / "seed-0" / "start",
}


def warm_up_seconds_per_step(layers: int, threads: int, steps: int, conversations: int) -> float:
    """The fit rule's warm-up (its rate, beta2, length pooling and weight average) for ``steps`` steps."""
    from loop_trainer.envs import ErrandsEnv
    from loop_trainer.models.tiny import FitRule, build_tiny_for_environment, warm_start

    torch_threads(threads)
    env = ErrandsEnv()
    model, tokenizer = build_tiny_for_environment(env.vocabulary(), seed=0, num_layers=layers)
    drawn = env.demonstrations(conversations, seed=0)
    held_out = env.demonstrations(8, seed=1)
    fit = dataclasses.replace(FitRule(), max_steps=steps, check_every=steps, cool_steps=0)
    started = time.perf_counter()
    warm_start(model, tokenizer, drawn, steps=None, held_out=held_out, fit=fit, seed=0, report=lambda line: None)
    return (time.perf_counter() - started) / steps


def loop_iteration_seconds(layers: int, threads: int, iterations: int) -> dict[str, float]:
    """The recipe for ``iterations`` iterations from the kept ``layers``-layer warm start of seed 0, in a process of
    its own with ``threads`` torch threads; means over all but the first iteration."""
    with tempfile.TemporaryDirectory() as out:
        argv = [
            *("--config", str(ROOT / "recipes" / "errands.yaml")),
            *("--model_name_or_path", str(KEPT_STARTS[layers])),
            *("--output_dir", out),
            *("--iterations", str(iterations)),
            *("--eval_every", "0"),
            *("--save_strategy", "no"),
            *("--disable_tqdm", "true"),
        ]
        code = f"import sys; from loop_trainer.cli.train import cli; sys.exit(cli({argv!r}))"
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
        subprocess.run([sys.executable, "-c", code], check=True, env=environment, cwd=ROOT, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [row for row in rows if "rollout_seconds" in row][1:]
    return {key: statistics.mean(row[key] for row in rows) for key in ("rollout_seconds", "update_seconds", "seconds")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="warm-up steps timed per setting")
    parser.add_argument("--conversations", type=int, default=1024, help="demonstrations the warm-up draws from")
    parser.add_argument("--iterations", type=int, default=6, help="LOOP iterations per setting (the first not timed)")
    parser.add_argument("--out", type=Path, default=RESULTS / "tiny-depth-cost")
    options = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows: list[dict[str, Any]] = []
    for layers in (2, 4):
        for threads in (1, 2):
            step = warm_up_seconds_per_step(layers, threads, options.steps, options.conversations)
            iteration = loop_iteration_seconds(layers, threads, options.iterations)
            rows.append({"layers": layers, "threads": threads, "warm_up_step_seconds": step, **iteration})
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    lines = [
        "| layers | threads | warm-up s/step (x 2 layers, 1 thread) | LOOP s/iteration (x) | rollout s | update s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['layers']} | {row['threads']} | {row['warm_up_step_seconds']:.2f} "
            f"({row['warm_up_step_seconds'] / base['warm_up_step_seconds']:.2f}) | {row['seconds']:.1f} "
            f"({row['seconds'] / base['seconds']:.2f}) | {row['rollout_seconds']:.1f} | {row['update_seconds']:.1f} |"
        )
    table = "\n".join(lines)
    options.out.mkdir(parents=True, exist_ok=True)
    command = command_line("benchmarks.tiny_depth_cost", argv)
    measured_with = software(["torch", "transformers"], host=True, checkout=True)
    (options.out / "tiny_depth_cost.json").write_text(
        json.dumps({"command": command, "software": measured_with, "rows": rows}, indent=1)
    )
    title = "# The tiny model's depth and threads on errands"
    (options.out / "README.md").write_text(f"{title}\n\n`{command}`\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
