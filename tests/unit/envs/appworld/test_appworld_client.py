"""AppWorld client pieces that need no AppWorld: splits, the agent's format, metrics, the viewer."""

from __future__ import annotations

import itertools
import json

import pytest

from loop_trainer.envs import make_environment
from loop_trainer.envs.appworld import (
    AppWorldData,
    AppWorldDataError,
    ReActPrompts,
    extract_code,
    goal_completion,
    goal_completion_report,
    truncate_at_line,
)
from loop_trainer.viewer import render_viewer

TASKS = {  # task_id: (difficulty, splits)
    "aaaaaaa_1": (1, ["train"]),
    "aaaaaaa_2": (2, ["train"]),
    "bbbbbbb_1": (2, ["train"]),
    "bbbbbbb_2": (3, ["train"]),
    "3ab5b8b_3": (1, ["dev"]),
    "3ab5b8b_1": (2, ["dev"]),
}


@pytest.fixture()
def root(tmp_path):
    for task_id, (difficulty, _splits) in TASKS.items():
        task = tmp_path / "data" / "tasks" / task_id
        (task / "ground_truth").mkdir(parents=True)
        (task / "ground_truth" / "metadata.json").write_text(json.dumps({"difficulty": difficulty}))
        (task / "specs.json").write_text(
            json.dumps(
                {
                    "instruction": f"do {task_id}",
                    "datetime": "2023-05-18T12:00:00",
                    "supervisor": {"first_name": "Ann", "last_name": "Lee", "email": "a@x.com", "phone_number": "1"},
                }
            )
        )
    datasets = tmp_path / "data" / "datasets"
    datasets.mkdir()
    for split in ("train", "dev"):
        (datasets / f"{split}.txt").write_text("\n".join(t for t, (_, s) in TASKS.items() if split in s) + "\n")
    return tmp_path


def test_splits_difficulties_unions_and_the_dev_denylist(root):
    data = AppWorldData.at(root)
    assert data.task_ids("train") == ["aaaaaaa_1", "aaaaaaa_2", "bbbbbbb_1", "bbbbbbb_2"]
    assert data.task_ids("train_difficulty_2") == ["aaaaaaa_2", "bbbbbbb_1"]
    assert data.task_ids("train_difficulty_1_and_train_difficulty_2") == ["aaaaaaa_1", "aaaaaaa_2", "bbbbbbb_1"]
    assert data.task_ids("dev") == ["3ab5b8b_1"]  # 3ab5b8b_3 is denylisted
    assert data.task_ids("train_and_dev")[-1] == "3ab5b8b_1"
    rows = data.tasks("train_difficulty_1")
    assert rows[0] == {
        "task_id": "aaaaaaa_1",
        "scenario_id": "aaaaaaa",
        "difficulty": 1,
        "instruction": "do aaaaaaa_1",
        "supervisor": "Ann Lee",
        "datetime": "2023-05-18T12:00:00",
    }


def test_missing_data_and_unknown_splits_say_what_to_do(root, tmp_path_factory, monkeypatch):
    monkeypatch.delenv("APPWORLD_ROOT", raising=False)
    with pytest.raises(AppWorldDataError, match="APPWORLD_ROOT is not set: run `make appworld`"):
        AppWorldData.at(None)
    with pytest.raises(AppWorldDataError, match="no AppWorld data under"):
        AppWorldData.at(tmp_path_factory.mktemp("empty"))
    with pytest.raises(AppWorldDataError, match="unknown AppWorld split 'tset'; datasets here: dev, train"):
        AppWorldData.at(root).task_ids("tset")


def test_all_python_blocks_are_concatenated_and_other_fences_ignored():
    reply = "Look:\n```python\nx = 1\n```\nthen\n```bash\nls\n```\n```python\nprint(x)\n```"
    assert extract_code(reply) == "x = 1\n\nprint(x)"
    assert extract_code("no code here") is None
    assert extract_code("```python\n\n```") is None
    assert extract_code("```python\nunterminated") is None


def test_truncation_cuts_at_a_line_boundary_within_the_budget():
    count = len  # one "token" per character, to check exactly
    text = "\n".join(f"line {i:03d}" for i in range(100))  # 8 chars + newline each
    cut = truncate_at_line(text, 50, count)
    assert cut.truncated and cut.shown_lines == 5 and cut.total_lines == 100
    assert cut.text == "\n".join(f"line {i:03d}" for i in range(5)) and len(cut.text) <= 50
    assert truncate_at_line("short", 50, count).truncated is False
    one_line = truncate_at_line("x" * 500, 50, count)
    assert one_line.truncated and 0 < len(one_line.text) <= 50


def test_prompt_has_the_papers_parts_and_alternates_roles():
    prompts = ReActPrompts.load(max_observation_tokens=20)
    supervisor = {"first_name": "Ann", "last_name": "Lee", "email": "ann@x.com", "phone_number": "555"}
    messages = prompts.opening_messages(supervisor, "2023-05-18", "Send Bob $5 on Venmo.")
    roles = [m["role"] for m in messages]
    assert roles[0] == "system" and roles[-1] == "user"
    assert all(a != b for a, b in itertools.pairwise(roles[1:]))
    assert "apis.api_docs.show_api_doc" in messages[1]["content"] and "ann@x.com" in messages[1]["content"]
    assert any("```python" in m["content"] for m in messages if m["role"] == "assistant")  # the worked example
    final = messages[-1]["content"]
    assert "2023-05-18" in final and "Ann Lee" in final and final.rstrip().endswith("Send Bob $5 on Venmo.")
    observation = prompts.observation("\n".join(["row"] * 200), "Send Bob $5 on Venmo.")
    assert "cut after" in observation and observation.rstrip().endswith("Send Bob $5 on Venmo.")
    assert "no ```python code block" in prompts.no_code("T")


def test_custom_prompt_directory_must_be_complete(tmp_path):
    (tmp_path / "system.md").write_text("hi")
    with pytest.raises(FileNotFoundError, match="lacks intro.md"):
        ReActPrompts.load(tmp_path)


def test_goal_completion_matches_appworlds_definition_and_rounding():
    successes = {"aaaaaaa_1": True, "aaaaaaa_2": True, "bbbbbbb_1": True, "bbbbbbb_2": False, "ccccccc_1": False}
    assert goal_completion(successes) == {"tgc": 60.0, "sgc": 33.3, "num_tasks": 5.0, "num_scenarios": 3.0}
    # AppWorld rounds the mean to 4 places first: 2/3 -> 0.6667 -> 66.67 -> 66.7
    assert goal_completion({"a_1": True, "a_2": True, "b_1": False})["tgc"] == 66.7
    report = goal_completion_report(
        {t: {"success": s, "difficulty": 1 + i % 2} for i, (t, s) in enumerate(successes.items())}
    )
    assert report["difficulty_1"]["tgc"] == 66.7 and report["difficulty_2"]["tgc"] == 50.0
    assert report["difficulty_3"] == {"tgc": 0.0, "sgc": 0.0, "num_tasks": 0.0, "num_scenarios": 0.0}


def test_viewer_escapes_content_and_marks_failures():
    rows = [
        {
            "task_id": "a_1",
            "reward": 1.0,
            "success": True,
            "status": "completed",
            "num_turns": 1,
            "ending": "done",
            "num_opening_messages": 2,
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "task"},
                {"role": "assistant", "content": "```python\nprint('<b>')\n```"},
            ],
            "info": {"passes": ["t1"], "failures": []},
        },
        {
            "task_id": "b_1",
            "reward": 0.5,
            "success": False,
            "status": "completed",
            "num_turns": 0,
            "ending": "turn_limit",
            "messages": [],
            "info": json.dumps({"passes": ["t1"], "failures": [{"requirement": "t2", "trace": "Assert"}]}),
        },
        {
            "task_id": "c_1",
            "reward": 0.0,
            "success": None,
            "status": "failed",
            "error": "AppWorldServerError: boom",
            "messages": [],
            "info": {},
        },
    ]
    page = render_viewer(rows, "eval <dev>")
    assert "<title>eval &lt;dev&gt;</title>" in page
    assert any(f"print({quote}&lt;b&gt;{quote})" in page for quote in ("&#x27;", "&#39;"))  # html.escape or jinja2's
    assert page.count('class="rollout pass"') == 1 and page.count('class="rollout fail"') == 1
    assert 'class="rollout error"' in page and "AppWorldServerError: boom" in page
    assert "1 passed, 1 failed" in page and "failures only" in page


def test_appworld_summary_is_goal_completion_per_rollout_averaged(root):
    # Resolved through the plugin entry point; remote URLs, so no server or AppWorld venv is needed.
    env = make_environment("appworld", root=str(root), server_urls=["http://127.0.0.1:9"])
    outcomes = {  # rollout -> task -> (status, success); bbbbbbb_2 failed to run in rollout 0
        0: {
            "aaaaaaa_1": ("completed", True),
            "aaaaaaa_2": ("completed", True),
            "bbbbbbb_1": ("completed", True),
            "bbbbbbb_2": ("failed", False),
        },
        1: {
            "aaaaaaa_1": ("completed", True),
            "aaaaaaa_2": ("completed", True),
            "bbbbbbb_1": ("completed", True),
            "bbbbbbb_2": ("completed", True),
        },
    }
    rows = [
        {"task_id": task_id, "rollout": k, "status": status, "success": success, "reward": float(success), "info": {}}
        for k, tasks in outcomes.items()
        for task_id, (status, success) in tasks.items()
    ]
    assert env.summarize(rows) == {
        "success_rate": 7 / 8,
        "reward_mean": 7 / 8,
        "tgc": (75.0 + 100.0) / 2,
        "sgc": (50.0 + 100.0) / 2,  # scenario bbbbbbb fails in rollout 0
        "tgc_difficulty_1": 100.0,
        "sgc_difficulty_1": 100.0,
        "tgc_difficulty_2": 100.0,
        "sgc_difficulty_2": 100.0,
        "tgc_difficulty_3": 50.0,
        "sgc_difficulty_3": 50.0,
    }
