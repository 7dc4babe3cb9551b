"""Multi-turn rollouts: generation backends and the concurrent episode engine."""

from .backend import Completion, GenerationBackend, TransformersBackend
from .engine import RolloutEngine, run_coroutine
from .records import EpisodeLimits, GenerationError, RolloutBatch, RolloutFailureBudgetExceeded, mix_seed

__all__ = [
    "Completion",
    "EpisodeLimits",
    "GenerationBackend",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutFailureBudgetExceeded",
    "GenerationError",
    "mix_seed",
    "TransformersBackend",
    "run_coroutine",
]
