"""The rollout viewer page: what it shows, and that nothing from a rollout runs as HTML."""

from __future__ import annotations

import json

from loop_trainer.viewer import render_viewer, write_viewer

ROWS = [
    {
        "task_id": "a_1",
        "rollout": 0,
        "reward": 1.0,
        "success": True,
        "status": "completed",
        "num_turns": 1,
        "ending": "done",
        "advantage": 0.25,
        "num_opening_messages": 2,
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "the task"},
            {"role": "assistant", "content": "Here:\n```python\nprint('<b>')\n```\n<script>alert(1)</script>"},
        ],
        "info": {"passes": ["t1"], "failures": []},
    },
    {
        "task_id": 'b_1" onmouseover="alert(2)',
        "reward": 0.5,
        "success": False,
        "status": "completed",
        "num_turns": 0,
        "ending": "turn_limit",
        "messages": [],
        "info": json.dumps(
            {"passes": ["t1"], "failures": [{"requirement": "t2 <img src=x>", "trace": "AssertionError"}]}
        ),
    },
    {
        "task_id": "c_1",
        "reward": 0.0,
        "success": None,
        "status": "failed",
        "error": "AppWorldServerError: <boom>",
        "messages": [],
        "info": {},
    },
]


def test_rollout_text_is_escaped_never_interpreted(tmp_path):
    page = write_viewer(ROWS, tmp_path / "viewer" / "page.html", title="eval <dev>").read_text()
    assert page.count("<script>") == 1  # the page's own filter script, nothing from a rollout
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<title>eval &lt;dev&gt;</title>" in page and "<h1>eval &lt;dev&gt;</h1>" in page
    assert 'onmouseover="alert(2)' not in page and "b_1&#34; onmouseover=&#34;alert(2)" in page
    assert "<img" not in page and "t2 &lt;img src=x&gt;" in page
    assert "AppWorldServerError: &lt;boom&gt;" in page


def test_page_shows_grades_turns_and_tests():
    page = render_viewer(ROWS, "Rollouts")
    assert "3 rollouts · 1 succeeded · 1 failed to run · mean reward 0.750" in page
    assert page.count('class="rollout pass"') == 1 and page.count('class="rollout fail"') == 1
    assert page.count('class="rollout error"') == 1 and '<span class="tag">FAILED</span>' in page
    assert "rollout 0 · reward 1.000 · 1 turns · ended: done · advantage +0.250" in page
    assert "<details><summary>Prompt (2 messages)</summary>" in page  # the system message folds away
    assert '<code class="block">print(&#39;&lt;b&gt;&#39;)\n</code>' in page and "<pre>Here:\n</pre>" in page
    assert "Tests: 1 passed, 0 failed" in page and "Tests: 1 passed, 1 failed" in page
    assert "<details><summary>trace</summary><pre>AssertionError</pre></details>" in page
    assert "failures only" in page and "applyFilter" in page


def test_an_episode_whose_context_was_rewritten_says_in_how_many_segments():
    row = {**ROWS[1], "task_id": "d_1", "num_turns": 5, "segment_starts": [40, 95]}
    page = render_viewer([row], "Rollouts")
    assert "5 turns in 3 segments (context rewritten) · ended: turn_limit" in page
    assert "segments" not in render_viewer(ROWS, "Rollouts").split("<details")[1]
