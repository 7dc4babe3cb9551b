"""An environment's running totals (:meth:`~..envs.base.Environment.metrics`), read each iteration by the trainer
and with each answer of a collection process.

Why not call ``metrics()`` directly: they are diagnostics, and a ``metrics()`` that raises (a bug in the
environment, a server that is down) must not end a run that collects and trains well. Its last answer stands, the
failure is counted (the run's ``metrics_call_failures``) and logged with its traceback once, and again only when a
different kind of error follows or once it answers again: a ``metrics()`` that always fails costs one log line,
not one per iteration.
"""

from __future__ import annotations

import logging

from ..envs.base import Environment

logger = logging.getLogger(__name__)


class EnvMetricsReader:
    """Reads ``env.metrics()``; see the module. Not thread-safe: one reader per caller, or a lock around it."""

    def __init__(self, env: Environment, where: str = ""):
        self.env = env
        self.where = f" {where}" if where else ""
        self.failures = 0
        """``metrics()`` calls that raised, so far."""
        self._last: dict[str, float] = {}
        self._failing: str | None = None  # the kind of error the calls raise now, None while they answer

    def read(self) -> dict[str, float]:
        """The environment's answer now, or its last one (empty before any) if this call raised."""
        try:
            answer = dict(self.env.metrics())
        except Exception as error:  # noqa: BLE001 - counted and logged: the run goes on with the last answer
            self.failures += 1
            kind = f"{type(error).__module__}.{type(error).__qualname__}"
            if kind != self._failing:
                logger.error(
                    "the environment's metrics() failed%s (the last answer stands; counted in "
                    "metrics_call_failures, this error logged once until it changes or metrics() answers)",
                    self.where,
                    exc_info=error,
                )
            self._failing = kind
            return dict(self._last)
        if self._failing is not None:
            logger.warning(
                "the environment's metrics() answered again%s (%d calls failed so far)", self.where, self.failures
            )
            self._failing = None
        self._last = answer
        return dict(answer)
