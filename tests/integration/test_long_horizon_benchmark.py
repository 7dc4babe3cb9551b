"""``benchmarks/long_horizon.py`` end to end on a miniature of its recipe: the seed's warm-up, held-out
evaluations before and after training, the run's metrics with ``turns_mean``, the table and the curves
it writes, and the weights it does not keep."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root, for the benchmarks package

from benchmarks import long_horizon  # noqa: E402
from benchmarks.long_horizon import main  # noqa: E402
from support.miniature_errands import miniature_recipe  # noqa: E402


def test_one_seed_of_a_miniature_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = miniature_recipe(tmp_path)
    recipe = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**recipe, "eval_max_tasks": 1}))  # the recipe's held-out set caps loop-eval too
    out = tmp_path / "results"
    threads: list[int] = []  # --threads reaches torch (recorded, not set: the test process keeps its own)
    monkeypatch.setattr(long_horizon, "torch_threads", threads.append)
    main(["--recipe", str(path), "--seeds", "3", "--out", str(out), "--threads", "2"])
    saved = json.loads((out / "long_horizon.json").read_text())
    assert threads == [2] and saved["threads"] == 2
    (run,) = saved["runs"]
    assert run["seed"] == 3 and run["iterations"] == 2 and run["warm_up_steps"] == 3
    assert len(run["turns_mean"]) == 2 and all(turns >= 1 for turns in run["turns_mean"])
    for name in ("start_T0", "start_T1", "end_T0", "end_T1"):
        metrics = run["evaluations"][name]
        assert metrics["num_rollouts"] == 1 and "success_rate_level_1" in metrics
    seed_dir = out / "seed-3"
    rows = [json.loads(line) for line in (seed_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows if "turns_mean" in row] == [1, 2]
    assert "step 3/3" in (seed_dir / "warm_up.log").read_text()
    assert (seed_dir / "eval-end-T0" / "results.jsonl").exists()
    assert not list(seed_dir.rglob("*.safetensors")) and (out / "curves.png").stat().st_size > 0
    assert "| 3 | 3, " in (out / "README.md").read_text()


def test_a_kept_warm_start_is_reused_by_the_next_run_into_the_same_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path, out = miniature_recipe(tmp_path), tmp_path / "results"
    main(["--recipe", str(path), "--seeds", "3", "--out", str(out), "--keep-models"])
    start = out / "seed-3" / "start" / "model.safetensors"
    weights = start.read_bytes()
    first = json.loads((out / "long_horizon.json").read_text())["runs"][0]
    main(["--recipe", str(path), "--seeds", "3", "--out", str(out), "--iterations", "1", "--keep-models"])
    assert "seed 3: reusing the warm start saved in" in capsys.readouterr().out
    again = json.loads((out / "long_horizon.json").read_text())["runs"][0]
    assert start.read_bytes() == weights and again["iterations"] == 1
    assert again["warm_up_seconds"] == first["warm_up_seconds"] and again["warm_up_steps"] == 3
    assert again["evaluations"]["start_T0"] == first["evaluations"]["start_T0"]  # the same weights, the same seed
    # a seed's total still counts the kept warm-up's minutes, and the table says it was kept
    assert not first["warm_up_reused"] and again["warm_up_reused"]
    assert again["seconds"] > again["warm_up_seconds"] + again["training_seconds"]
    assert "| 3 | 3, " in (out / "README.md").read_text() and " (kept) |" in (out / "README.md").read_text()


def test_the_warm_start_spec_names_a_depth_only_where_the_environment_declares_one(monkeypatch):
    """A kept warm start is reused only under the same spec: a deeper tiny model is another start, while the
    starts kept before depth was a setting (2 layers, no key) still match."""
    import loop_trainer.envs as envs
    from benchmarks.long_horizon import warm_up_spec
    from loop_trainer.envs import VaultEnv

    settings = {"model_name_or_path": "tiny-instruct:vault", "environment": "vault"}
    assert "tiny_layers" not in warm_up_spec(settings, seed=0)

    class DeepVault(VaultEnv):
        tiny_layers = 4

    monkeypatch.setattr(envs, "make_environment", lambda name, **kwargs: DeepVault(**kwargs))
    assert warm_up_spec(settings, seed=0)["tiny_layers"] == 4
