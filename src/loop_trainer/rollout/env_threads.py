"""Daemon threads for synchronous environment calls, and the bookkeeping of calls abandoned after
``env_timeout``.

Python cannot kill a thread, so a sync call that outlives ``env_timeout`` is abandoned: its
rollout fails at once, the call keeps its thread until it returns (if ever), it is counted, the
episode's ``close`` waits for it (then runs in that thread, never beside it), and since the thread
is a daemon it never holds up the process's exit.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

from ..envs.base import Episode


class EnvThreads:
    """Daemon threads for synchronous environment calls, reused while idle.

    Unlike a ``ThreadPoolExecutor`` (whose workers the interpreter joins at exit), a thread stuck
    in a call that never returns neither holds up the process's exit nor takes a worker from the
    calls after it: a call that finds no idle thread starts one. (How many run at once is bounded
    by the engine's episode limit, plus the threads still inside abandoned calls.)
    """

    def __init__(self, name: str = "env"):
        self.name = name
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._started = itertools.count()
        self._closed = False

    def run(self, work: Callable[[], None]) -> None:
        """Run ``work()`` on a thread of this pool. ``work`` must not raise."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the environment threads were closed")
            self._work.put(work)
            if self._idle.acquire(blocking=False):
                return  # an idle thread takes it
            thread = threading.Thread(target=self._worker, name=f"{self.name}-{next(self._started)}", daemon=True)
            self._threads.add(thread)
            thread.start()

    def _worker(self) -> None:
        try:
            while (work := self._work.get()) is not None:
                work()
                self._idle.release()
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def close(self) -> None:
        """Idle threads end now, busy ones when their call returns. Never waits. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in range(len(self._threads)):
                    self._work.put(None)


class AbandonedCalls:
    """Counts of abandoned synchronous calls, shared by an engine's episodes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.total = 0
        self.running = 0


class EpisodeCalls:
    """One episode and its synchronous calls, as seen from both sides: the event loop that awaits them
    and the thread that runs them. While an abandoned call is still running, ``close`` is held
    back (:meth:`defer_close`) and runs in that call's thread as soon as it returns."""

    def __init__(self, episode: Episode, counts: AbandonedCalls) -> None:
        self.episode = episode
        self._lock = threading.Lock()
        self._counts = counts
        self.running: str | None = None
        self._abandoned = False
        self._late_close: Callable[[], None] | None = None

    def begin(self, name: str) -> None:
        with self._lock:
            self.running, self._abandoned = name, False

    def abandon(self) -> bool:
        """The caller stopped waiting: True (and counted) if the call is still running."""
        with self._lock:
            if self.running is None or self._abandoned:
                return self._abandoned
            self._abandoned = True
            with self._counts.lock:
                self._counts.total += 1
                self._counts.running += 1
            return True

    def end(self) -> Callable[[], None] | None:
        """The call returned: what must run now that it has (a held-back close), if anything."""
        with self._lock:
            if self._abandoned:
                with self._counts.lock:
                    self._counts.running -= 1
            self.running, self._abandoned = None, False
            late_close, self._late_close = self._late_close, None
        return late_close

    def defer_close(self, close: Callable[[], None]) -> str | None:
        """If a call is still running, hold ``close`` back until it returns and name that call."""
        with self._lock:
            if self.running is not None:
                self._late_close = close
            return self.running


def deliver(answer: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Hand a sync call's outcome to the coroutine awaiting it (on the event loop), unless it stopped waiting."""
    if answer.done():  # the caller gave up waiting (timeout or cancellation)
        return
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(result)
