"""Multi-turn rollouts: generation backends and the concurrent episode engine.

The names below import on first use (:mod:`loop_trainer.lazy_exports`): the transformers backend needs torch, which
a process that only runs episodes against a vLLM server (a collection child) does not.
"""

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .backend import TransformersBackend, build_transformers_backend
    from .collection import run_coroutine
    from .engine import RolloutEngine
    from .records import (
        Completion,
        EpisodeLimits,
        GenerationBackend,
        GenerationError,
        RolloutBatch,
        RolloutFailureBudgetExceeded,
        mix_seed,
    )
    from .sampling_parts import TransformersSamplingSettings
else:  # not for mypy, which would take any name imported from here as Any (lazy_exports.py)
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            ".backend": ("TransformersBackend", "build_transformers_backend"),
            ".collection": ("run_coroutine",),
            ".engine": ("RolloutEngine",),
            ".records": (
                "Completion",
                "EpisodeLimits",
                "GenerationBackend",
                "GenerationError",
                "RolloutBatch",
                "RolloutFailureBudgetExceeded",
                "mix_seed",
            ),
            ".sampling_parts": ("TransformersSamplingSettings",),
        },
    )

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
