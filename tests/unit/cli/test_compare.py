"""loop-compare: the trained policy against the starting one, greedy and sampled, on held-out tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loop_trainer.cli import evaluate as loop_eval
from loop_trainer.cli.compare import cli as compare_cli
from loop_trainer.cli.compare import contrasting_trajectories
from loop_trainer.cli.train import cli as train_cli

RECIPE = str(Path(__file__).resolve().parents[3] / "recipes" / "demo.yaml")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    assert (
        train_cli(
            [
                "--config",
                RECIPE,
                "--output_dir",
                str(out),
                "--iterations",
                "2",
                "--tasks_per_iteration",
                "4",
                "--disable_tqdm",
                "true",
                "--save_strategy",
                "no",
            ]
        )
        == 0
    )
    return out


def test_both_policies_are_evaluated_greedy_and_sampled_on_the_held_out_split(trained, capsys, monkeypatch):
    builds = []
    build = loop_eval.build_tiny_from_spec
    monkeypatch.setattr(
        loop_eval, "build_tiny_from_spec", lambda *args, **kwargs: builds.append(kwargs) or build(*args, **kwargs)
    )
    argv = ["--config", RECIPE, "--output_dir", str(trained), "--max_tasks", "6", "--sampled_rollouts_per_task", "3"]
    assert compare_cli(argv) == 0
    # the starting policy is the run's: the recipe's warm-up (tiny_instruct_steps 400) and seed
    assert [(kwargs["warm_up_steps"], kwargs["seed"]) for kwargs in builds] == [(400, 0)]
    printed = capsys.readouterr().out
    rows = json.loads((trained / "compare" / "compare.json").read_text())
    assert [(r["policy"], r["decoding"]) for r in rows] == [
        ("start", "greedy"),
        ("start", "T=1"),
        ("trained", "greedy"),
        ("trained", "T=1"),
    ]
    for row in rows:
        results = [json.loads(line) for line in (Path(row["output_dir"]) / "results.jsonl").read_text().splitlines()]
        assert len(results) == 6 * row["rollouts_per_task"] and {r["task_id"][:5] for r in results} == {"test-"}
        assert row["rollouts_per_task"] == (1 if row["decoding"] == "greedy" else 3)
        assert row["success_rate"] == pytest.approx(sum(r["success"] for r in results) / len(results))
        metrics = json.loads((Path(row["output_dir"]) / "metrics.json").read_text())
        assert metrics["temperature"] == (0.0 if row["decoding"] == "greedy" else 1.0)
    # the trained policy is the run's saved model, not the starting one again
    assert json.loads((Path(rows[2]["output_dir"]) / "metrics.json").read_text())["model"] == str(trained)
    assert "| greedy | start |" in printed and "| T=1 | trained |" in printed
    assert (trained / "compare" / "compare.md").read_text().count("\n") == 6
    assert "| greedy | start | 6 |" in printed and "| T=1 | start | 18 |" in printed
    shown = (trained / "compare" / "trajectories.md").read_text().splitlines()
    assert sum(line.startswith("## test-") for line in shown) == 3


def test_a_run_that_never_trained_is_one_line(tmp_path, capsys):
    assert compare_cli(["--config", RECIPE, "--output_dir", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no trained model or adapter: run loop-train with this recipe first" in err[0]


def _results(directory: Path, rewards: dict[str, float]) -> str:
    directory.mkdir()
    lines = [
        json.dumps(
            {
                "task_id": task,
                "reward": reward,
                "ending": "done",
                "num_opening_messages": 1,
                "messages": [
                    {"role": "user", "content": f"question {task}"},
                    {"role": "assistant", "content": f"reply {task} {reward}"},
                ],
            }
        )
        for task, reward in rewards.items()
    ]
    (directory / "results.jsonl").write_text("\n".join(lines) + "\n")
    return str(directory)


def test_trajectories_show_the_tasks_where_the_policies_differ_most(tmp_path):
    start = _results(tmp_path / "start", {"a": 0.0, "b": 0.5, "c": 0.25, "d": 1.0})
    trained = _results(tmp_path / "trained", {"a": 1.0, "b": 0.5, "c": 0.75, "d": 0.75})
    rows = [
        {"policy": "start", "decoding": "greedy", "output_dir": start},
        {"policy": "trained", "decoding": "greedy", "output_dir": trained},
        {"policy": "trained", "decoding": "T=1", "output_dir": str(tmp_path / "unread")},
    ]
    text = contrasting_trajectories(rows, 2)
    assert [line for line in text.splitlines() if line.startswith("## ")] == ["## a", "## c"]
    assert "- assistant: `reply a 0.0`" in text and "- assistant: `reply a 1.0`" in text
    assert "- user: `question a`" not in text and "'question a'" in text  # the opening is quoted, not replayed
    assert "**start** (reward 0.25, done)" in text and "**trained** (reward 0.75, done)" in text
