"""The collection process's side (:mod:`.collection_process` is the training process's): rebuild the engine's
setup sent pickled, prepare the environment's copy, then answer each request (:mod:`.collection_protocol`) until the
parent closes it: batches on one pipe, on the main thread; the partial rollouts' calls around a weight change or a
checkpoint on the other, on a thread of their own. Every answer carries the child's running totals.

The copy of the environment is the child's own: it prepares it and closes it, also when it ends early (the parent
is gone, or sent SIGTERM), within :data:`CLOSE_WHEN_LEAVING_S`, before the process ends (:class:`_Leaving`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import traceback
from typing import Any

from ..envs.base import Environment, EnvironmentSetupError
from .collection_protocol import ChildTotals, CollectionJob, CollectionProcessError, Request, answer_name
from .engine import EngineSetup, RolloutEngine
from .env_metrics import EnvMetricsReader
from .partial import ContinuingCollection
from .server_client import ServerClient, ServerSampler, ServerSampling

logger = logging.getLogger(__name__)


CLOSE_WHEN_LEAVING_S = 10.0
"""How long the child waits for its environment's ``close()`` when it ends early, before it ends without it."""


class _Leaving:
    """How the child ends before its parent closes it: the parent is gone (killed, or exited without closing it:
    then multiprocessing's exit sends SIGTERM), the parent's close timed out (SIGTERM), or the child's control
    thread failed. The environment's copy is closed first, on a thread of its own, for at most
    :data:`CLOSE_WHEN_LEAVING_S` (episodes may still be running on it: the process ends right after), then the
    process ends at once (``os._exit``: a thread stuck in the environment cannot hold it up). Without this, what
    ``close()`` releases (a sandbox, a container, a temporary folder) outlived the run: ``os._exit`` and SIGTERM's
    default run no ``finally`` and no ``atexit`` hook, and a killed trainer cannot close the child's copy.

    :meth:`now` runs on threads other than the main one, which may be in the child's own close (:meth:`close_env`,
    on the main thread as before): then it waits for that close, within the same bound. A SIGTERM only starts such a
    thread (:class:`_SigtermWatch`), so it needs nothing of the main thread, wherever that is."""

    def __init__(self) -> None:
        self._env: Environment | None = None
        self._held = False
        self._leaving = False  # now() has begun: nothing is held (and prepared) from then on
        self._lock = threading.Lock()  # never taken by a signal handler: only the threads below take it
        self._ready = threading.Event()  # the held environment's prepare() has returned (or raised)
        self._closed = threading.Event()  # the held environment's close has returned (or raised)

    def hold(self, env: Environment) -> bool:
        """``env`` is the child's to close from now on; :meth:`prepared` follows its ``prepare()``. False (nothing
        held) once the process is ending: then do not prepare it."""
        with self._lock:
            if self._leaving:
                return False
            self._env, self._held = env, True
            return True

    def prepared(self) -> None:
        """The held environment's ``prepare()`` has returned or raised: an early end may close it now (not while
        it prepares, which would start what the close had just released)."""
        self._ready.set()

    def _take(self) -> tuple[Environment | None, bool]:
        with self._lock:
            env, self._env = self._env, None
            return env, self._held

    def close_env(self) -> None:
        """The child's own close, on the main thread (the parent bounds how long it waits for it). Once a thread of
        :meth:`now` has taken the environment, wait for that close instead: returning would end the interpreter,
        and with it the close's daemon thread, part-way."""
        env, held = self._take()
        if env is None:
            if held:
                self._closed.wait(CLOSE_WHEN_LEAVING_S)  # the thread of now() ends the process when it returns
            return
        self._close(env)

    def now(self, why: str) -> None:
        """End the process, the environment closed first (within :data:`CLOSE_WHEN_LEAVING_S` in all, a
        ``prepare()`` under way waited for first). Never on the main thread."""
        try:
            deadline = time.monotonic() + CLOSE_WHEN_LEAVING_S
            logger.info("the collection process ends: %s", why)
            with self._lock:
                held, self._leaving = self._held, True
            ready = held and self._ready.wait(CLOSE_WHEN_LEAVING_S)
            if ready:
                env, _ = self._take()
                if env is not None:
                    threading.Thread(target=self._close, args=(env,), name="loop-collection-close", daemon=True).start()
            if held and not self._closed.wait(max(0.0, deadline - time.monotonic())):
                late = "close()" if ready else "prepare()"
                logger.error(
                    "the environment's %s did not return within %g s: ending without closing it",
                    late,
                    CLOSE_WHEN_LEAVING_S,
                )
        finally:
            os._exit(1)

    def _close(self, env: Environment) -> None:
        try:
            env.close()
        except BaseException as error:  # noqa: BLE001 - the child ends after it anyway: logged, not raised
            logger.error("the environment's close() failed in the collection process", exc_info=error)
        finally:
            self._closed.set()


_SEEN_BY_THE_HANDLER = 0
"""What SIGTERM's Python handler writes to the watch's pipe: not a signal's number, so never a second SIGTERM."""


class _SigtermWatch:
    """From :meth:`start` on, a SIGTERM ends the process through ``leaving.now()``, and a second one at once.

    Seen by a thread of its own (:meth:`watch`), not by a Python handler alone: that runs only once the main thread is
    back in Python, and a main thread stuck in native code (an environment's C call that never returns, releasing the
    interpreter lock) never is. The interpreter's C-level handler writes the signal's number to the wakeup fd, this
    watch's pipe, at once, wherever the main thread is. The Python handler, when it runs, puts SIGTERM's default back
    (a second one then ends the process in the kernel) and writes to the pipe too, which counts only if the C handler
    has not: code on the main thread may have taken the wakeup fd over (an event loop's ``add_signal_handler``)."""

    def __init__(self, leaving: _Leaving):
        self.leaving = leaving
        self._read_end, self._write_end = os.pipe()  # neither is inherited by a program a subprocess runs
        os.set_blocking(self._write_end, False)  # the C handler must never block

    def start(self) -> None:
        """On the main thread, once."""
        signal.set_wakeup_fd(self._write_end, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self.on_sigterm)
        os.register_at_fork(after_in_child=_forget_sigterm)
        threading.Thread(target=self.watch, name="loop-collection-signals", daemon=True).start()

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM's Python handler (see the class)."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(OSError):  # the pipe is full: the watch has a SIGTERM to read already
            os.write(self._write_end, bytes([_SEEN_BY_THE_HANDLER]))

    def watch(self) -> None:
        """Read the pipe: the first SIGTERM starts ``leaving.now()`` on a thread of its own, a second (that the C
        handler wrote: the Python handler's SIGTERM default was not back yet) ends the process at once."""
        signals, told = 0, False
        while numbers := os.read(self._read_end, 64):  # the write end stays open: this watch holds it
            for number in numbers:
                if number == signal.SIGTERM:
                    signals += 1
                    if signals > 1:  # without waiting for the close
                        os._exit(1)
                elif number != _SEEN_BY_THE_HANDLER:
                    continue  # another signal with a Python handler
                if not told:
                    told = True
                    why = "it was told to end (SIGTERM)"
                    ending = threading.Thread(target=self.leaving.now, args=(why,), name="loop-collection-leaving")
                    ending.daemon = True
                    ending.start()


def _forget_sigterm() -> None:
    """In a process forked from the child without exec by ``os.fork()`` (an environment's or a library's Python; a
    fork in C runs no such hook): SIGTERM's default, and no wakeup fd writing into the child's watch. The forking
    thread is the new process's main thread, which may set both."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _leave_with_the_parent(leaving: _Leaving) -> None:
    """End this process as soon as the trainer's process is gone, even in the middle of a batch."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()
        leaving.now("the trainer's process is gone")


class _Child:
    """What the child holds: the prepared setup, a client per server, the engine (built with the first sampler
    it gets) and, with partial rollouts, the run's continuing collection. Used by the child's two serving threads."""

    CONTINUING_METHODS = ("hold", "release", "collect", "finish_in_flight", "carried", "restore", "cancel_in_flight")

    def __init__(self, setup: EngineSetup, leaving: _Leaving):
        self.setup = setup
        self.leaving = leaving
        self.clients: dict[Any, ServerClient] = {}
        self.engine: RolloutEngine | None = None
        self.continuing: ContinuingCollection | None = None
        self._lock = threading.Lock()  # the two threads build the clients and the engine
        self._totals_lock = threading.Lock()  # held only to number the totals: never while metrics() is read
        self._answers = itertools.count(1)
        self._env_metrics = EnvMetricsReader(setup.env, "in the collection process", setup.env_timeout)
        self._metrics_lock = threading.Lock()  # one read of metrics() at a time (the reader is not thread-safe)
        self._metrics_read: tuple[dict[str, float], int] = ({}, 0)  # the last read's answer, and failures so far

    def sampler(self, sampling: ServerSampling) -> ServerSampler:
        with self._lock:
            if sampling.endpoint not in self.clients:
                self.clients[sampling.endpoint] = ServerClient(sampling.endpoint)
            sampler = ServerSampler(self.clients[sampling.endpoint], sampling)
            if self.engine is None:
                self.engine = self.setup.build(sampler)
            return sampler

    def answer(self, request: Request) -> Any:
        if isinstance(request, CollectionJob):
            sampler = self.sampler(request.sampling)
            assert self.engine is not None  # built with the first sampler
            return self.engine.collect(request.tasks, request.rollouts_per_task, backend=sampler, **request.options)
        if request.method == "open":
            max_span, sampling = request.args
            self.sampler(sampling)
            assert self.engine is not None
            if self.continuing is not None:
                self.continuing.close()
            self.continuing = ContinuingCollection(self.engine, max_span)
            return None
        if self.continuing is None:
            raise CollectionProcessError(f"{request.method}() before the partial rollouts were opened")
        if request.method == "close":
            self.continuing.close()
            self.continuing = None
            return None
        if request.method not in self.CONTINUING_METHODS:
            raise CollectionProcessError(f"the collection process has no {request.method}()")
        args = request.args
        if request.method == "release" and args[1] is not None:
            args = (args[0], self.sampler(args[1]))
        return getattr(self.continuing, request.method)(*args, **request.kwargs)

    def totals(self) -> ChildTotals:
        """The running totals now, numbered as they are taken (a higher number is never older). The environment's
        ``metrics()`` is read first (:class:`~.env_metrics.EnvMetricsReader`: a failure keeps its last answer),
        unless the other thread is reading it: a read may wait ``env_timeout`` for a hung call, and the answer of
        a call around a weight change must not wait behind a batch's. Then the last read's answer stands."""
        if self._metrics_lock.acquire(blocking=False):
            try:
                env_metrics = self._env_metrics.read()
                with self._totals_lock:
                    self._metrics_read = (env_metrics, self._env_metrics.failures)
            finally:
                self._metrics_lock.release()
        with self._totals_lock:
            env_metrics, failures = self._metrics_read
            engine = self.engine
            return ChildTotals(
                generation_retries=engine.generation_retries if engine else 0,
                abandoned_calls=engine.abandoned_calls if engine else 0,
                env_metrics=dict(env_metrics),
                metrics_call_failures=failures,
                taken=next(self._answers),
            )

    def serve(self, connection: multiprocessing.connection.Connection) -> None:
        """Answer each request on ``connection`` until None, or its end closes (the parent closed it, or left)."""
        while True:
            try:
                message = connection.recv_bytes()
            except EOFError:
                return
            kind: str
            value: Any
            try:
                request = pickle.loads(message)
                if request is None:
                    return
                kind, value = answer_name(request), self.answer(request)
            except BaseException as error:  # noqa: BLE001 - the parent raises it where it asked
                kind, value = "error", error
            _send(connection, kind, value, self.totals())

    def serve_control(self, connection: multiprocessing.connection.Connection) -> None:
        """:meth:`serve` on the control pipe's thread. If it fails (the pipe, or an answer that cannot be sent), the
        child ends: the parent waiting on that pipe then hears that it died, instead of waiting for ever."""
        try:
            self.serve(connection)
        except BaseException as error:  # noqa: BLE001 - logged, then the process ends
            logger.error("the collection process's control thread failed: ending the process", exc_info=error)
            self.leaving.now("its control thread failed")

    def close(self) -> None:
        try:
            if self.continuing is not None:
                self.continuing.close()
            if self.engine is not None:
                self.engine.close()
            for client in self.clients.values():
                client.close()
        finally:
            self.leaving.close_env()  # the child's copy: its own to close


def serve_collection(
    connection: multiprocessing.connection.Connection,
    control: multiprocessing.connection.Connection,
    payload: bytes,
    log_level: int,
) -> None:
    """The child: rebuild and prepare the setup, then answer each request sent until None (or the parent goes):
    batches on ``connection``, here; the partial rollouts' other calls on ``control``, on a thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the parent decides
    logging.basicConfig(level=log_level, format="[collection process] %(levelname)s %(name)s: %(message)s")
    leaving = _Leaving()
    _SigtermWatch(leaving).start()
    threading.Thread(target=_leave_with_the_parent, args=(leaving,), name="loop-collection-parent", daemon=True).start()
    try:
        setup: EngineSetup = pickle.loads(payload)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it
        logger.error("rebuilding the environment failed", exc_info=error)  # the parent reports it in one line
        _send(connection, "error", error, ChildTotals())
        return
    _send(connection, "rebuilt", None, ChildTotals())
    if not leaving.hold(setup.env):  # this copy is the child's: prepared and closed here, whatever happens next
        return  # ending already (SIGTERM while it was rebuilt): nothing prepared, nothing to close
    child: _Child | None = None
    try:
        try:
            setup.env.prepare()
        except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it
            if not isinstance(error, EnvironmentSetupError):  # a bug, not a setup's one-line refusal: its traceback
                logger.error("the environment's prepare() failed", exc_info=error)
            leaving.prepared()
            _send(connection, "error", error, ChildTotals())
            return
        leaving.prepared()
        _send(connection, "prepared", None, ChildTotals())
        child = _Child(setup, leaving)
        control_thread = threading.Thread(target=child.serve_control, args=(control,), name="loop-collection-control")
        control_thread.daemon = True
        control_thread.start()
        child.serve(connection)
    finally:
        if child is not None:
            child.close()  # the environment's close last
        else:
            leaving.close_env()


def _portable(error: BaseException) -> BaseException:
    """``error``, or, if it does not pickle, a :class:`CollectionProcessError` that names it (its traceback then
    logged here, since a one-line report of it in the parent would drop the one it travels with)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - whatever pickling raises, the error still reaches the parent
        logger.error("%s in the collection process", type(error).__name__, exc_info=error)
        return CollectionProcessError(f"in the collection process: {type(error).__name__}: {error}")


def _send(connection: multiprocessing.connection.Connection, kind: str, value: Any, totals: ChildTotals) -> None:
    """One answer; an error's traceback goes as text beside it. An answer that does not pickle (a batch holding an
    object that cannot) becomes an error that says so."""
    remote = "".join(traceback.format_exception(value)).rstrip() if isinstance(value, BaseException) else ""
    if isinstance(value, BaseException):
        value = _portable(value)
    try:
        data = pickle.dumps((kind, value, totals, remote))
    except Exception as error:  # noqa: BLE001 - reported instead of the answer
        try:
            pickle.dumps(value)
            culprit = "the environment's metrics() returned a value that does not pickle (return floats)"
        except Exception:  # noqa: BLE001 - whatever pickling raises: the answer is what did not pickle
            culprit = "an episode's Score.info or a trajectory holds an object that does not pickle"
        failure = CollectionProcessError(
            f"the collection process's {kind} cannot be sent back ({type(error).__name__}: {error}): {culprit}"
        )
        remote = "".join(traceback.format_exception(error)).rstrip()
        # The totals may be what did not pickle: none go (numbered 0, the parent keeps the ones it has).
        data = pickle.dumps(("error", failure, ChildTotals(), remote))
    connection.send_bytes(data)
