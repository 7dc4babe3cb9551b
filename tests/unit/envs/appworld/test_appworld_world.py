"""The synthetic AppWorld world runs and grades under the real AppWorld engine.

Every check runs in a subprocess under AppWorld's own venv (one world open at a time per
process: an open world freezes its process's clock). The first run builds the venv (~40 s, PyPI)
and the world (~15 s); both are cached under LOOP_CACHE_DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from support.appworld_world import appworld_python, build_synthetic_world

pytestmark = pytest.mark.appworld

RUN_TASKS = textwrap.dedent(
    """
    import json, os, sys
    from appworld import AppWorld

    root = os.environ["APPWORLD_ROOT"]
    solutions = json.load(open(sys.argv[1]))
    results = {}
    for task_id, solution in solutions.items():
        result = results[task_id] = {}
        with AppWorld(task_id=task_id, experiment_name="solved") as world:
            dbs = os.path.join(root, "experiments", "outputs", "solved", "tasks", task_id, "dbs")
            result["dbs_written_on_init"] = sorted(os.listdir(dbs))
            result["completed_before"] = world.task_completed()
            result["output"] = world.execute(solution["solution_code"])
            result["completed_after"] = world.task_completed()
            result["solved"] = world.evaluate(suppress_errors=True).to_dict()
        with AppWorld(task_id=task_id, experiment_name="noop") as world:
            result["noop"] = world.evaluate(suppress_errors=True).to_dict()
        with AppWorld(task_id=task_id, experiment_name="complete_only") as world:
            world.execute("apis.supervisor.complete_task()")
            result["complete_only"] = world.evaluate(suppress_errors=True).to_dict()
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(appworld python, world root, a fresh APPWORLD_ROOT whose data links to the world's)."""
    root = build_synthetic_world()
    python = appworld_python()
    workdir = tmp_path_factory.mktemp("appworld-root")
    (workdir / "data").symlink_to(root / "data")
    return python, root, workdir


def _appworld(python: Path, workdir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPWORLD_")}
    env["APPWORLD_ROOT"] = str(workdir)
    result = subprocess.run([str(python), *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    return result


def _solutions(root: Path) -> dict:
    return json.loads((root / "synthetic_solutions.json").read_text())


def _split(root: Path, name: str) -> list[str]:
    return (root / "data" / "datasets" / f"{name}.txt").read_text().split()


def test_world_layout(world):
    _, root, _ = world
    solutions = _solutions(root)
    splits = {name: _split(root, name) for name in ("train", "dev", "test_normal", "test_challenge")}
    assert all(splits.values())
    assert sorted(t for ids in splits.values() for t in ids) == sorted(solutions)
    assert "3ab5b8b_3" in splits["dev"]
    assert [t for t in splits["dev"] if t.startswith("3ab5b8b_") and t != "3ab5b8b_3"]
    assert {solutions[t]["difficulty"] for t in splits["train"]} >= {1, 2}
    assert {s["difficulty"] for s in solutions.values()} == {1, 2, 3}
    scenarios = defaultdict(list)
    for task_id, solution in solutions.items():
        prefix, number = task_id.split("_")
        assert len(prefix) == 7 and all(c in "0123456789abcdef" for c in prefix) and number.isdigit()
        scenarios[prefix].append(task_id)
        assert solution["num_tests"] >= 3
        assert 0 < solution["noop_pass_fraction"] < 1
        assert task_id in splits[solution["split"]]
        ground_truth = root / "data" / "tasks" / task_id / "ground_truth"
        metadata = json.loads((ground_truth / "metadata.json").read_text())
        assert metadata["mode"] == "minimal" and metadata["difficulty"] == solution["difficulty"]
        test_data = json.loads((ground_truth / "test_data.json").read_text())
        assert len(test_data) == solution["num_tests"]
        evaluation = (ground_truth / "evaluation.py").read_text()
        for test in test_data:
            assert f'with test("{test["requirement"]}")' in evaluation
    assert len(scenarios) >= 3 and all(2 <= len(ids) <= 3 for ids in scenarios.values())
    answers = [json.loads((root / "data/tasks" / t / "ground_truth/answer.json").read_text()) for t in solutions]
    assert any(a is None for a in answers) and any(a is not None for a in answers)


def test_engine_grades_solutions_and_noops(world):
    python, root, workdir = world
    solutions = _solutions(root)
    script = workdir / "run_tasks.py"
    script.write_text(RUN_TASKS)
    result = _appworld(python, workdir, str(script), str(root / "synthetic_solutions.json"))
    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(solutions)
    for task_id, solution in solutions.items():
        r = results[task_id]
        assert "simple_note.jsonl" in r["dbs_written_on_init"], task_id
        assert r["completed_before"] is False and r["completed_after"] is True, task_id
        assert r["output"] == "Execution successful.", (task_id, r["output"])
        solved = r["solved"]
        assert set(solved) == {"success", "difficulty", "num_tests", "passes", "failures"}
        assert solved["success"] is True and not solved["failures"], (task_id, solved["failures"])
        assert len(solved["passes"]) == solved["num_tests"] == solution["num_tests"]
        assert solved["difficulty"] == solution["difficulty"]
        for key in ("noop", "complete_only"):
            evaluation = r[key]
            assert evaluation["success"] is False, (task_id, key)
            fraction = len(evaluation["passes"]) / evaluation["num_tests"]
            assert fraction == pytest.approx(solution["noop_pass_fraction"]), (task_id, key)
            assert {p["label"] for p in evaluation["passes"]} == {"no_op_pass"}
            assert {f["label"] for f in evaluation["failures"]} == {"no_op_fail"}

    # `appworld evaluate <experiment> <split>` (cwd = APPWORLD_ROOT) on saved experiment outputs.
    outputs = workdir / "experiments" / "outputs"
    train = _split(root, "train")
    solved_train = [t for t in train if t.startswith("a1c4e02_")] + ["9f04a7b_1"]
    for task_id in train:
        source = "solved" if task_id in solved_train else "noop"
        shutil.copytree(outputs / source / "tasks" / task_id / "dbs", outputs / "mixed" / "tasks" / task_id / "dbs")
    appworld_cli = [str(Path(python).parent / "appworld")]
    expected = {
        ("solved", "dev"): (100.0, 100.0),
        ("noop", "dev"): (0.0, 0.0),
        ("mixed", "train"): (66.7, 50.0),  # tasks 4/6; scenarios: a1c4e02 all solved, 9f04a7b not
    }
    for (experiment, split), (tgc, sgc) in expected.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith("APPWORLD_")}
        cli = subprocess.run(
            [*appworld_cli, "evaluate", experiment, split],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert cli.returncode == 0, cli.stderr[-4000:]
        report = json.loads((outputs / experiment / "evaluations" / f"{split}.json").read_text())
        assert report["aggregate"] == {"task_goal_completion": tgc, "scenario_goal_completion": sgc}
        assert sorted(report["individual"]) == sorted(_split(root, split))
        assert (outputs / experiment / "evaluations" / f"{split}.txt").is_file()
        assert "task_goal_completion" in cli.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
