"""The docs' table of a ``multiturn_throughput.py`` JSON (docs/benchmarks.md pastes its output).

python -m benchmarks.multiturn_table benchmarks/results/multiturn-cpu.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def runs_of(result: dict[str, Any], side: str, n: int) -> list[dict[str, Any]]:
    return [r for r in result["runs"] if r["side"] == side and r["concurrency"] == n]


def table(result: dict[str, Any]) -> str:
    decode = {row["concurrency"]: row for row in result.get("decode_check", [])}
    lines = [
        "| N | ours episodes/s (runs) | TRL episodes/s (runs) | **ours / TRL** | ours mean batch (decode steps) "
        "| env sleep s | wall s ours / TRL | generation s ours / TRL | lower bound s (limited by) "
        "| **ours / bound** (runs) | TRL / bound | decode only s ours / TRL |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["summary"]:
        n, ours, trl = row["concurrency"], row["ours"], row["trl"]
        ours_runs = runs_of(result, "ours", n)
        steps = ", ".join(str(r.get("engine_steps", "-")) for r in ours_runs)
        bound = ours_runs[0]["bound"]
        check = decode.get(n)
        decode_only = f"{check['ours_s']:.2f} / {check['trl_s']:.2f}" if check else "-"
        lines.append(
            f"| {n} | {ours['episodes_per_s']:.3f} ({', '.join(f'{v:.3f}' for v in ours['episodes_per_s_runs'])}) "
            f"| {trl['episodes_per_s']:.3f} ({', '.join(f'{v:.3f}' for v in trl['episodes_per_s_runs'])}) "
            f"| **×{row['ratio_ours_over_trl']:.2f}** | {ours['mean_batch_size']:.1f} ({steps}) "
            f"| {ours['env_sleep_total_s']:.1f} | {ours['seconds']:.1f} / {trl['seconds']:.1f} "
            f"| {ours['generation_seconds']:.1f} / {trl['generation_seconds']:.1f} "
            f"| {row['bound_s']:.1f} ({bound['limited_by']}) "
            f"| **×{ours['over_bound']:.2f}** ({', '.join(f'{v:.2f}' for v in ours['over_bound_runs'])}) "
            f"| ×{trl['over_bound']:.2f} "
            f"| {decode_only} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(table(json.loads(Path(path).read_text())))
