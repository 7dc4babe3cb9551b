"""Task and scenario goal completion, computed the way ``appworld evaluate`` computes them.

TGC is the percentage of tasks whose tests all pass; SGC the percentage of scenarios (task-id
prefix before ``_``) whose tasks all pass. AppWorld rounds the mean to 4 places, then the
percentage to 1 place, and reports an empty difficulty bucket as 0.0; we do exactly the same so
that numbers match its reports to the digit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from .data import scenario_id


def _percentage(values: list[float]) -> float:
    mean = round(sum(values) / len(values), 4) if values else 0.0
    return round(100 * mean, 1)


def goal_completion(successes: Mapping[str, bool]) -> dict[str, float]:
    """``{"tgc": ..., "sgc": ..., "num_tasks": ...}`` for ``{task_id: success}``."""
    by_scenario: dict[str, list[float]] = defaultdict(list)
    for task_id, success in successes.items():
        by_scenario[scenario_id(task_id)].append(float(success))
    return {
        "tgc": _percentage([s for scores in by_scenario.values() for s in scores]),
        "sgc": _percentage([min(scores) for scores in by_scenario.values()]),
        "num_tasks": float(len(successes)),
        "num_scenarios": float(len(by_scenario)),
    }


def goal_completion_report(results: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """TGC/SGC overall and per difficulty 1-3, for ``{task_id: {"success": bool, "difficulty": int}}``
    (the rows AppWorld's report has: aggregate, difficulty_1, difficulty_2, difficulty_3)."""
    report = {"aggregate": goal_completion({t: bool(r["success"]) for t, r in results.items()})}
    for level in (1, 2, 3):
        report[f"difficulty_{level}"] = goal_completion(
            {t: bool(r["success"]) for t, r in results.items() if int(r["difficulty"]) == level}
        )
    return report


def evaluation_summary(rows: Sequence[Mapping[str, Any]], difficulty_of: Mapping[str, int]) -> dict[str, float]:
    """``tgc`` / ``sgc`` overall and ``tgc_difficulty_<1..3>`` / ``sgc_difficulty_<1..3>`` for
    evaluation rows (one per rollout, with ``task_id``, ``rollout``, ``status``, ``success``).

    As ``appworld evaluate`` grades one experiment, i.e. one rollout of every task, the report is
    computed per rollout index and then averaged. A rollout that failed to run is a failed task."""
    per_rollout = []
    for k in sorted({int(row["rollout"]) for row in rows}):
        results = {
            str(row["task_id"]): {
                "success": row["status"] == "completed" and bool(row["success"]),
                "difficulty": difficulty_of[str(row["task_id"])],
            }
            for row in rows
            if int(row["rollout"]) == k
        }
        per_rollout.append(goal_completion_report(results))
    summary: dict[str, float] = {}
    for level in ("aggregate", "difficulty_1", "difficulty_2", "difficulty_3"):
        suffix = "" if level == "aggregate" else f"_{level}"
        for measure in ("tgc", "sgc"):
            values = [report[level][measure] for report in per_rollout]
            summary[f"{measure}{suffix}"] = sum(values) / len(values) if values else float("nan")
    return summary
