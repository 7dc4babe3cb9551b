"""AppWorld (Trivedi et al. 2024) as a LOOP environment, driven over HTTP (see ``env.py``).

A plugin: ``make_environment("appworld")`` finds it through the ``loop_trainer.environments``
entry point (pyproject.toml), and nothing in the core imports this package."""

from .agent import ReActPrompts, extract_code, truncate_at_line
from .data import DENYLIST, AppWorldData, AppWorldDataError, scenario_id
from .env import AppWorldEpisode, AppWorldRolloutEnv
from .metrics import evaluation_summary, goal_completion, goal_completion_report
from .pool import AppWorldCallError, AppWorldServerError, AppWorldServerPool, find_appworld_python

__all__ = [
    "DENYLIST",
    "AppWorldCallError",
    "AppWorldData",
    "AppWorldDataError",
    "AppWorldEpisode",
    "AppWorldRolloutEnv",
    "AppWorldServerError",
    "AppWorldServerPool",
    "ReActPrompts",
    "evaluation_summary",
    "extract_code",
    "find_appworld_python",
    "goal_completion",
    "goal_completion_report",
    "scenario_id",
    "truncate_at_line",
]
