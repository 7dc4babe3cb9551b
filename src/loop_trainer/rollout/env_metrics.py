"""An environment's running totals (:meth:`~..envs.base.Environment.metrics`), read each iteration by the trainer
and with each answer of a collection process.

Why not call ``metrics()`` directly: they are diagnostics, and a ``metrics()`` that raises or never returns (a bug
in the environment, a server that is down or hangs) must not end or stall a run that collects and trains well.

- A read gets no answer when the call raised, did not return within ``env_timeout`` (the bound of every
  environment call), or could not start (no thread to run it on). Then the last answer stands, and the read is
  counted (the run's ``metrics_call_failures``).
- The call runs on a daemon thread of its own, so one that never returns holds up neither the run nor its exit.
  While it runs, no other starts: a later read only looks whether it has returned since (without waiting), and
  takes its answer if it has. A hung ``metrics()`` thus costs one wait of ``env_timeout``, not one per iteration.
- A failure is logged once, and again only when a different kind follows or once ``metrics()`` answers again: a
  ``metrics()`` that always fails costs one log line, not one per iteration.
- A call may still run when the environment's creator closes it (a hung one, or one a read stopped waiting for):
  unlike an episode's ``close()``, the environment's is not held back for it.
- In a collection process the read comes with every answer, so the one wait delays that answer, and a hung call
  there is counted once per read (about one per answer), not per iteration. An answer given while the child's
  other thread is reading (a call around a weight change, beside a batch's answer) does not wait: it carries the
  last read's answer. Its copy of the environment has a reader of its own: a ``metrics()`` that hangs in both
  costs a wait in each.
"""

from __future__ import annotations

import logging
import threading

from ..envs.base import Environment

logger = logging.getLogger(__name__)


class _MetricsCall:
    """One ``metrics()`` call on a daemon thread of its own, and its outcome once :attr:`returned` is set."""

    def __init__(self, env: Environment):
        self.returned = threading.Event()
        self.answer: dict[str, float] = {}
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(env,), name="env-metrics", daemon=True).start()

    def _run(self, env: Environment) -> None:
        try:
            self.answer = dict(env.metrics())
        except BaseException as error:  # noqa: BLE001 - the reader counts and logs it
            self.error = error
        finally:
            self.returned.set()


class EnvMetricsReader:
    """Reads ``env.metrics()`` within ``timeout`` seconds (the run's ``env_timeout``); see the module. Not
    thread-safe: one reader per caller, or a lock around it."""

    def __init__(self, env: Environment, where: str = "", timeout: float = 300.0):
        self.env = env
        self.where = f" {where}" if where else ""
        self.timeout = timeout
        self.failures = 0
        """Reads that got no answer so far: ``metrics()`` raised, had not returned within ``timeout``, or could not
        start."""
        self._last: dict[str, float] = {}
        self._failing: str | None = None  # the kind of failure the reads get now, None while they are answered
        self._late: _MetricsCall | None = None  # a call that outlived its read, still running when last looked at

    def read(self) -> dict[str, float]:
        """The environment's answer now, or its last one (empty before any) if this read got none."""
        if self._late is not None:
            call, wait = self._late, 0.0
        else:
            try:
                call, wait = _MetricsCall(self.env), self.timeout
            except RuntimeError as error:  # no thread to call it on (the process is at its limit)
                return self._failed("no thread", f"the environment's metrics() could not be called{self.where}", error)
        if not call.returned.wait(wait):
            self._late = call
            late = f"did not return within env_timeout ({self.timeout:g}s)"
            return self._failed("hang", f"the environment's metrics() {late}{self.where}", None)
        self._late = None
        if call.error is not None:
            kind = f"{type(call.error).__module__}.{type(call.error).__qualname__}"
            return self._failed(kind, f"the environment's metrics() failed{self.where}", call.error)
        if self._failing is not None:
            logger.warning(
                "the environment's metrics() answered again%s (%d reads got no answer so far)",
                self.where,
                self.failures,
            )
            self._failing = None
        self._last = call.answer
        return dict(call.answer)

    def _failed(self, kind: str, what: str, error: BaseException | None) -> dict[str, float]:
        self.failures += 1
        if kind != self._failing:
            logger.error(
                "%s (the last answer stands; counted in metrics_call_failures, logged once until the kind of failure "
                "changes or metrics() answers)",
                what,
                exc_info=error,
            )
        self._failing = kind
        return dict(self._last)
