"""Ctrl-C anywhere: SIGINT sent to a tiny ``loop-train`` at a random moment, ``--trials`` times, and what each run
said and did. Every run must end with one ``loop-train: interrupted ...`` line, nothing after it, no traceback, and
exit status 130 (or be killed by SIGINT after printing that line: ``python -m`` does that where the interrupt came
during the imports, inside a string ``exec``, which dataclasses uses; a shell shows 130 for both). A run that goes on
to its last iteration lost the Ctrl-C.

The moments are drawn uniformly from ``--earliest`` to ``--latest`` seconds after the start: the imports (about 6 s
on two cores), the tiny model's warm-up, then iterations, checkpoints and learning-curve drawings. Run it alone (two
processes on two cores stall each other, and move every moment).

    python -m benchmarks.ctrl_c --out benchmarks/results/ctrl-c-cpu.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.tiny_run import TINY_VAULT_RUN

from benchmarks.common import command_line, software

TINY_RUN = [*TINY_VAULT_RUN, "--iterations", "200"]  # the curve drawn, as by default

ONE_LINE = "loop-train: interrupted"


def outcome(returncode: int, stderr: str) -> str:
    """``interrupted``: the one line, last, and exit status 130 (or SIGINT, see above); otherwise what went wrong."""
    lines = stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    if returncode == 0:
        return "not interrupted: trained to its last iteration"
    if "Traceback" in stderr or "Exception ignored" in stderr:
        return f"a traceback (exit {returncode})"
    if not last.startswith(ONE_LINE):
        return f"another last line (exit {returncode}): {last[:120]}"
    if returncode in (130, -signal.SIGINT):
        return "interrupted"
    return f"the line, exit {returncode}"


def trial(command: list[str], delay: float, keep: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        process = subprocess.Popen(
            [*command, *TINY_RUN, "--output_dir", str(Path(scratch) / "run")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            # Python's own SIGINT handling in the child, even where this script was started with SIGINT ignored
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=300)
    said = outcome(process.returncode, stderr)
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    record = {"delay_s": round(delay, 3), "exit": process.returncode, "outcome": said, "last_line": last}
    if said != "interrupted":
        kept = keep / f"stderr-{delay:.3f}.txt"
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(stderr)
        record["stderr"] = str(kept)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--earliest", type=float, default=0.5, help="seconds after the start")
    parser.add_argument("--latest", type=float, default=12.0, help="seconds after the start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--module", action="store_true", help="python -m loop_trainer.cli.train, not loop-train")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write (stderr of bad runs beside it)")
    args = parser.parse_args()
    script = Path(sys.executable).parent / "loop-train"
    command = [sys.executable, "-m", "loop_trainer.cli.train"] if args.module or not script.exists() else [str(script)]
    keep = (args.out.parent if args.out else Path(tempfile.gettempdir())) / "ctrl-c-stderr"
    rng = random.Random(args.seed)
    records = []
    for number in range(args.trials):
        record = trial(command, rng.uniform(args.earliest, args.latest), keep)
        records.append(record)
        print(f"{number + 1:3}/{args.trials}  {record['delay_s']:6.2f} s  exit {record['exit']:4}  {record['outcome']}")
        if "stderr" in record:
            print(f"          its stderr: {record['stderr']}")
    tally = collections.Counter(record["outcome"] for record in records)
    print("\n".join(f"{count:4}  {said}" for said, count in tally.most_common()))
    if args.out:
        result = {
            "command": command_line("benchmarks.ctrl_c"),
            "launched_as": " ".join(Path(part).name for part in command),
            "software": software(["torch", "transformers", "matplotlib"]),
            "outcomes": dict(tally),
            "trials": records,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
