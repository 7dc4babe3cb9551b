"""loop_trainer: LOOP (Leave-One-Out PPO) for multi-turn LLM agents, as a TRL trainer.

The names below import on first use (:mod:`.lazy_exports`): ``from loop_trainer import LOOPTrainer`` loads torch and
transformers' trainer, while a process that imports one light module of the package (a collection child) does not.
"""

from typing import TYPE_CHECKING

from .lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .config import LOOPConfig
    from .envs import Environment, Episode, Score, Step, make_environment
    from .objective import advantage_keep_mask, leave_one_out_advantages, loop_policy_loss
    from .training.trainer import LOOPTrainer
    from .trajectory import Trajectory
else:  # not for mypy, which would take any name imported from here as Any (lazy_exports.py)
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            ".config": ("LOOPConfig",),
            ".envs": ("Environment", "Episode", "Score", "Step", "make_environment"),
            ".objective": ("advantage_keep_mask", "leave_one_out_advantages", "loop_policy_loss"),
            ".training.trainer": ("LOOPTrainer",),
            ".trajectory": ("Trajectory",),
        },
    )

__version__ = "0.1.0"

__all__ = [
    "Environment",
    "Episode",
    "LOOPConfig",
    "LOOPTrainer",
    "Score",
    "Step",
    "Trajectory",
    "advantage_keep_mask",
    "leave_one_out_advantages",
    "loop_policy_loss",
    "make_environment",
]
