"""Multi-turn rollouts: generation backends and the concurrent episode engine."""

from .backend import Completion, GenerationBackend, TransformersBackend
from .collection import run_coroutine
from .engine import RolloutEngine
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
