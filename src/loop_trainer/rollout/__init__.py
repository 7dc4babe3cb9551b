"""Multi-turn rollouts: generation backends and the concurrent episode engine."""

from .backend import Completion, GenerationBackend, TransformersBackend
from .engine import EpisodeLimits, RolloutBatch, RolloutEngine, RolloutFailureBudgetExceeded, run_coroutine

__all__ = [
    "Completion",
    "EpisodeLimits",
    "GenerationBackend",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutFailureBudgetExceeded",
    "TransformersBackend",
    "run_coroutine",
]
