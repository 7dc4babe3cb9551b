"""``benchmarks/overlap_curves.py``'s summary: the final success per mode over seeds, and the verdict on
whether the overlapped runs' final success lies within the synchronous runs' spread. The committed
result (docs/overlap.md quotes it) is what its own runs give."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root, for the benchmarks package

from benchmarks.overlap_curves import markdown, summarize, verdict  # noqa: E402


def run(staleness: int, seed: int, success: list[float]) -> dict:
    return {
        "max_staleness": staleness,
        "seed": seed,
        "seconds": 100.0,
        "iterations_per_hour": 3600 * len(success) / 100.0,
        "reward": [0.5 + s / 2 for s in success],
        "success": success,
        "collapse_warnings": [],
    }


def test_the_table_averages_each_runs_last_iterations_over_seeds():
    runs = [run(0, 1, [0.0] * 5 + [0.8] * 5), run(0, 0, [0.0] * 5 + [1.0] * 5), run(1, 0, [0.2] * 10)]
    sync, overlapped = summarize(runs, last=5)
    assert sync["seeds"] == [0, 1] and sync["success_mean"] == pytest.approx(0.9)
    assert sync["success_std"] == pytest.approx(0.1414, abs=1e-4) and sync["first_success"] == 0.0
    assert overlapped["seeds"] == [0] and overlapped["success_std"] == 0.0


def test_the_verdict_separates_only_bands_that_do_not_overlap():
    apart = [run(0, s, [v] * 5) for s, v in enumerate((0.9, 0.95))] + [
        run(1, s, [v] * 5) for s, v in enumerate((0.5, 0.55))
    ]
    assert "separate beyond" in verdict(summarize(apart, last=5))
    close = [run(0, s, [v] * 5) for s, v in enumerate((0.9, 0.0))] + [
        run(1, s, [v] * 5) for s, v in enumerate((0.9, 0.95))
    ]
    assert "agree within" in verdict(summarize(close, last=5))
    assert "no spread" in verdict(summarize([run(0, 0, [1.0] * 5), run(1, 0, [0.0] * 5)], last=5))


def test_the_committed_result_is_what_its_runs_give():
    out = ROOT / "benchmarks" / "results" / "overlap-curves"
    saved = json.loads((out / "overlap_curves.json").read_text())
    table = summarize(saved["runs"], last=5)
    assert json.loads(json.dumps(table)) == saved["table"]  # as saved: the seeds of success_by_seed are strings
    assert [row["seeds"] for row in table] == [[0, 1, 2, 3, 4]] * 2
    assert all(len(r["success"]) == 120 for r in saved["runs"])
    assert (out / "overlap_curves.md").read_text() == markdown(table, 5) + "\n"
    assert "agree within" in verdict(table)
