"""loop_trainer: LOOP (Leave-One-Out PPO) for multi-turn LLM agents, as a TRL trainer."""

from .config import LOOPConfig
from .envs import Environment, Episode, Score, Step, make_environment
from .objective import advantage_keep_mask, leave_one_out_advantages, loop_policy_loss
from .training.trainer import LOOPTrainer
from .trajectory import Trajectory

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
