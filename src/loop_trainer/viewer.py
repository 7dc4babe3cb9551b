"""A self-contained HTML page for reading rollouts: every turn's reply, what the environment
answered, and the final grade, failures easy to find (``loop-eval`` and training runs write one).

Input rows are trajectory dicts (:meth:`Trajectory.to_dict` or ``loop-eval``'s results):
``task_id``, ``reward``, ``success``, ``messages``, ``num_opening_messages``, ``ending``,
``status``, ``error`` and ``info`` (``passes`` / ``failures`` lists if the environment grades tests).
The page is ``templates/viewer.html.j2``, rendered with autoescape: model output and environment
text are shown, never interpreted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jinja2

_PAGES = jinja2.Environment(
    loader=jinja2.PackageLoader("loop_trainer", "templates"),
    autoescape=True,  # not select_autoescape: the template's name ends in .j2
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
)
_FENCE = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)


def _parts(content: str) -> list[tuple[str, str]]:
    """A message as ("text" | "code", text) parts: fenced code shows as code blocks."""
    parts, last = [], 0
    for match in _FENCE.finditer(content):
        parts += [("text", content[last : match.start()]), ("code", match.group(2))]
        last = match.end()
    parts.append(("text", content[last:]))
    return [(kind, text) for kind, text in parts if kind == "code" or text]


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    return {"role": str(message.get("role", "?")), "parts": _parts(str(message.get("content", "")))}


def _info(row: Mapping[str, Any]) -> dict[str, Any]:
    info = row.get("info") or {}
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except ValueError:
            info = {"raw": info}
    return info if isinstance(info, dict) else {}


def _failure(failure: Any) -> dict[str, str]:
    if isinstance(failure, Mapping):
        return {"requirement": str(failure.get("requirement", "")), "trace": str(failure.get("trace") or "")}
    return {"requirement": str(failure), "trace": ""}


def _rollout(row: Mapping[str, Any]) -> dict[str, Any]:
    messages = list(row.get("messages") or [])
    opening = int(row.get("num_opening_messages") or 0)
    status = row.get("status", "completed")
    kind = (
        "error"
        if status != "completed"
        else (
            "pass"
            if row.get("success") or (row.get("success") is None and float(row.get("reward") or 0) >= 1.0)
            else "fail"
        )
    )
    info = _info(row)
    return {
        "kind": kind,
        "tag": {"pass": "PASS", "fail": "FAIL", "error": str(status).upper()}[kind],
        "task_id": str(row.get("task_id")),
        "rollout": row.get("rollout"),
        "reward": None if row.get("reward") is None else float(row["reward"]),
        "num_turns": row.get("num_turns", "?"),
        "ending": str(row.get("ending", "?")),
        # a context policy's episode: the model saw its history rewritten this many times, plus one
        "segments": 1 + len(row.get("segment_starts") or []),
        "advantage": None if row.get("advantage") is None else float(row["advantage"]),
        "error": str(row["error"]) if row.get("error") else None,
        # The opening messages fold away, except the last one (the task itself).
        "opening": opening,
        "prompt": [_message(m) for m in messages[: max(opening - 1, 0)]],
        "messages": [_message(m) for m in messages[max(opening - 1, 0) :]],
        "passes": [str(p) for p in info.get("passes") or []],
        "failures": [_failure(f) for f in info.get("failures") or []],
    }


def render_viewer(rows: Iterable[Mapping[str, Any]], title: str = "Rollouts") -> str:
    rows = list(rows)
    completed = [r for r in rows if r.get("status", "completed") == "completed"]
    summary = {
        "rollouts": len(rows),
        "successes": sum(bool(r.get("success")) for r in completed),
        "failed_to_run": len(rows) - len(completed),
        "mean_reward": sum(float(r.get("reward") or 0) for r in completed) / len(completed)
        if completed
        else float("nan"),
    }
    return _PAGES.get_template("viewer.html.j2").render(
        title=title, summary=summary, rollouts=[_rollout(row) for row in rows]
    )


def write_viewer(rows: Iterable[Mapping[str, Any]], path: str | Path, title: str = "Rollouts") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_viewer(rows, title), encoding="utf-8")
    return path
