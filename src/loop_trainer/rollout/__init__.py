"""Multi-turn rollouts: generation backends and the concurrent episode engine."""

from .backend import Completion, GenerationBackend, TransformersBackend, build_transformers_backend
from .collection import run_coroutine
from .engine import RolloutEngine
from .records import EpisodeLimits, GenerationError, RolloutBatch, RolloutFailureBudgetExceeded, mix_seed
from .sampling_parts import TransformersSamplingSettings

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
    "TransformersSamplingSettings",
    "build_transformers_backend",
    "run_coroutine",
]
