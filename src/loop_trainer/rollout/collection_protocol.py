"""What crosses between a training process and its collection process: the requests the parent sends
(:mod:`.collection_process`), the running totals that come back with every answer of the child
(:mod:`.collection_child`), and the error either end raises. Each message is pickled; a request is answered by
``(kind, value, totals, traceback)``, ``kind`` "error" when ``value`` is the error the child raised.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .server_client import ServerSampling


class CollectionProcessError(RuntimeError):
    """The collection process cannot start, or died, or cannot sample with what it was given."""


@dataclass(frozen=True)
class CollectionJob:
    """One batch: :meth:`~.engine.RolloutEngine.collect`'s arguments, its sampler as settings."""

    tasks: list[Mapping[str, Any]]
    rollouts_per_task: int
    sampling: ServerSampling
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ContinuingCall:
    """One call of the child's :class:`~.partial.ContinuingCollection` (``open`` builds it): the method's name and
    arguments, a policy as :class:`~.server_client.ServerSampling`."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ChildTotals:
    """The child's running totals since it started."""

    generation_retries: int = 0
    abandoned_calls: int = 0
    env_metrics: dict[str, float] = field(default_factory=dict)
    metrics_call_failures: int = 0
    taken: int = 0
    """Its order among the child's answers: of two answered on the two pipes at once, the later totals win."""


Request = CollectionJob | ContinuingCall
"""What the parent asks: a batch, or a call of the child's partial rollouts."""


def doing(request: Request) -> str:
    """What the child was doing while it answered ``request``, as the parent's errors say it."""
    method = _method(request)
    return "collecting a batch" if method == "collect" else f"answering {method}()"


def answer_name(request: Request) -> str:
    """What the answer to ``request`` is, as errors name it."""
    method = _method(request)
    return "batch" if method == "collect" else f"answer to {method}()"


def _method(request: Request) -> str:
    """The collection's method ``request`` calls: a job is a batch's ``collect``, as the partial rollouts' is."""
    return "collect" if isinstance(request, CollectionJob) else request.method
