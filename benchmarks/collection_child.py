"""What a collection child (``collection_process: true``) costs as it starts: seconds until it has rebuilt and
prepared its environment, its resident memory, and whether it loaded torch.

The child is started as a run starts it: ``errands`` in plain English with Qwen2.5's tokenizer, spawned from a
main module that imports ``loop_trainer.cli.train`` at its top, as ``loop-train`` and ``-m loop_trainer.cli.train``
do (a spawned child imports the launch's main module again). Each start is measured ``--repeats`` times, one after
another; run it alone (two processes on two cores stall each other).

    python -m benchmarks.collection_child --out benchmarks/results/collection-child-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import loop_trainer.cli.train  # noqa: F401 - as loop-train's main module imports it (see above)
from benchmarks.common import command_line, software


def child_status(pid: int) -> dict[str, Any]:
    """The child's resident memory (``VmRSS``) and whether a torch library is mapped into it."""
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/maps") as maps:
        torch_mapped = any("libtorch" in line for line in maps)
    return {"rss_mib": round(rss / 2**20, 1), "torch_loaded": torch_mapped}


def measure(repeats: int) -> list[dict[str, Any]]:
    from loop_trainer.chat import ChatFormatter
    from loop_trainer.envs.errands import ErrandsEnv
    from loop_trainer.models.tiny_chat import build_qwen25_tokenizer
    from loop_trainer.rollout.collection_process import CollectionProcess
    from loop_trainer.rollout.engine import EngineSetup
    from loop_trainer.rollout.records import EpisodeLimits

    tokenizer = build_qwen25_tokenizer(Path.home() / ".cache" / "loop_trainer" / "test-assets")
    env = ErrandsEnv(num_tasks=2, form="english")
    setup = EngineSetup(env, ChatFormatter(tokenizer), EpisodeLimits(), 60.0, None, 8)
    starts = []
    for _ in range(repeats):
        started = time.perf_counter()
        with CollectionProcess(setup) as process:
            seconds = time.perf_counter() - started
            assert process.pid is not None
            starts.append({"start_seconds": round(seconds, 2), **child_status(process.pid)})
        print(json.dumps(starts[-1]), flush=True)
    return starts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    options = parser.parse_args(argv)
    starts = measure(options.repeats)
    result = {
        "command": command_line("benchmarks.collection_child", argv),
        "software": software(["torch", "transformers", "datasets"], host=True, checkout=True),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "starts": starts,
        "start_seconds_median": statistics.median(s["start_seconds"] for s in starts),
    }
    print(f"median start {result['start_seconds_median']} s; child RSS {starts[-1]['rss_mib']} MiB")
    if options.out:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
