"""``benchmarks/ablations.py`` on a miniature of the long-horizon recipe, starting from the warm start that
``benchmarks/long_horizon.py --keep-models`` kept: each variant's flags reach its run, the clip fraction at
the variant's own ratio level is recorded and tabled, and a missing warm start is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root, for the benchmarks package

from benchmarks import ablations, long_horizon  # noqa: E402
from support.miniature_errands import miniature_recipe  # noqa: E402


def test_variants_start_from_the_long_horizon_benchmarks_kept_warm_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe, kept = miniature_recipe(tmp_path), tmp_path / "long-horizon"
    long_horizon.main(
        ["--recipe", str(recipe), "--seeds", "3", "--out", str(kept), "--iterations", "1", "--keep-models"]
    )
    # the variants' runs check the test split at iteration 2 (the long-horizon run above made no checks)
    recipe.write_text(recipe.read_text().replace("eval_every: 0", "eval_every: 2") + "eval_split: test\n")
    out = tmp_path / "ablations"
    argv = ["--recipe", str(recipe), "--seeds", "3", "--iterations", "2", "--out", str(out), "--warm-starts", str(kept)]
    ablations.main([*argv, "--variants", "LOOP", "LOOP per trajectory", "--disable-dropout"])
    saved = json.loads((out / "ablations.json").read_text())
    assert not (out / "models").exists()  # no second warm-up
    by_name = {run["variant"]: run for run in saved["runs"]}
    assert by_name["LOOP per trajectory"]["flags"] == {"ratio_level": "trajectory"}
    for run in by_name.values():  # the clip fraction each iteration logged (None: no update, every group tied)
        run_dir = out / "runs" / f"{run['variant'].replace(' ', '_')}-seed3"
        logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert run["clip"] == [row.get("clip_frac") for row in logged if "reward_mean" in row] and len(run["clip"]) == 2
        assert "disable_dropout: true" in (run_dir / "recipe.yaml").read_text()  # the adapter's dropout is off
        checks = [[row["iteration"], row["eval_success_rate"]] for row in logged if "eval_success_rate" in row]
        assert run["held_out"] == checks and [iteration for iteration, _ in checks] == [2]
    table = (out / "ablations.md").read_text()
    assert "| clip fraction |" in table and "| held-out success (last check) |" in table and " (it 2) | " in table
    with pytest.raises(SystemExit, match="no kept warm start at .*seed-4 "):
        ablations.main([*argv[:2], "--seeds", "4", "--out", str(out), "--warm-starts", str(kept)])
    other = tmp_path / "other"
    other.mkdir()
    longer = miniature_recipe(other)
    longer.write_text(longer.read_text().replace("tiny_instruct_steps: 3", "tiny_instruct_steps: 4"))
    with pytest.raises(SystemExit, match="was made for another recipe or fit rule"):
        ablations.main(["--recipe", str(longer), "--seeds", "3", "--out", str(out), "--warm-starts", str(kept)])
