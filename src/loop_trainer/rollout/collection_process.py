"""A collection in a process of its own (``collection_process: true``): the batches an overlapped run queues ahead
(``max_staleness``), collected by a child of the training process while the update runs in the parent.

Why: a collection's host work (rendering and tokenising each turn, its HTTP request, the environment's step, the
event loop's hand-offs) is Python, and on a thread of the training process it holds the interpreter lock that the
update's kernel launches need too. Measured on two CPU cores, a launch-bound update beside a collection thread ran
8-11 times slower than alone, and 1.5 times beside a collection process (docs/benchmarks.md, "A server generator's
requests"); on an H200 the overlap on a thread gained nothing (0.99x). In a child process the two share nothing but
the cores.

What crosses: the environment and the chat formatter (its tokenizer), pickled once when the child starts (a copy
of the run's; the parent keeps its own for the first batch and evaluation); then, per batch, the tasks, the seeds
and what samples it as settings (:class:`~.server_client.ServerSampling`: the server, the policy version's model
name, the temperature), so the child sends the same requests the thread would; back come the batch and the
child's running totals (generation retries, abandoned environment calls, the environment's own metrics).

Only a generator the child can reach by itself can sample: a vLLM server (``vllm_mode: server``); and only an
environment that pickles, whose class the child can import, and that does not say it must run in the trainer's
process (:attr:`~..envs.base.Environment.in_process_only`). The child's copy is its own: it calls ``prepare()`` on
it before its first batch, and ``close()`` when the parent closes it, or before it ends early. The child is
spawned (it imports the training script again: a script needs the ``if __name__ == "__main__":`` guard), a daemon,
ignores SIGINT (the parent stops the run and closes it), and leaves as soon as the parent goes, even in the middle
of a batch, closing its environment first (within :data:`CLOSE_WHEN_LEAVING_S`), as it does on SIGTERM.

With partial rollouts (``partial_rollouts: true``) the child holds the run's
:class:`~.partial.ContinuingCollection`: the episodes carried across batches run there, and the parent drives them
through :class:`ContinuingInChild`, which has the collection's methods. A batch's collection goes over one pipe
(the overlap thread waits on it for most of an update); the calls around a weight change
(:meth:`~ContinuingInChild.hold`, :meth:`~ContinuingInChild.release`, which names the new policy as settings) and
around a checkpoint (finish the carried episodes, fetch them, restore them) go over a second one, answered by a
thread of the child's while the batch is collected, as they are on the collection's own thread in the trainer's
process.
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
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..envs.base import Environment, EnvironmentSetupError
from .backend import GenerationBackend
from .engine import EngineSetup, RolloutEngine
from .env_metrics import EnvMetricsReader
from .partial import CarriedGroup, ContinuingCollection
from .records import RolloutBatch
from .server_client import ServerClient, ServerSampler, ServerSampling
from .vllm_server import server_sampling

logger = logging.getLogger(__name__)


class CollectionProcessError(RuntimeError):
    """The collection process cannot start, or died, or cannot sample with what it was given."""


@dataclass(frozen=True)
class CollectionJob:
    """One batch: :meth:`RolloutEngine.collect`'s arguments, its sampler as settings."""

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


GUARD = (
    'a script run as `python train.py` must keep its training under `if __name__ == "__main__":` (the child '
    "imports the script again)"
)


class RemoteTraceback(Exception):
    """The traceback of an error raised in the collection process (the ``__cause__`` of the error re-raised here)."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]) if self.args else ""


def sampling_of(backend: GenerationBackend) -> ServerSampling:
    """``backend`` as settings the child samples through; refused unless it samples on a vLLM server."""
    sampling = server_sampling(backend)
    if sampling is None:
        raise CollectionProcessError(
            f"collection_process samples through a vLLM server, not {type(backend).__name__}: set vllm_mode: "
            "server, or collection_process: false"
        )
    return sampling


class CollectionProcess:
    """A child process that collects batches (:meth:`collect`, the signature of :meth:`RolloutEngine.collect`),
    one at a time, or holds a run's partial rollouts (:meth:`continuing`); started (its environment rebuilt and
    prepared) by the time the constructor returns. Release it with :meth:`close`; a daemon, it is also ended when
    this process exits."""

    def __init__(self, setup: EngineSetup, *, start_timeout: float = 300.0):
        env_name = type(setup.env).__name__
        if setup.env.in_process_only:
            raise CollectionProcessError(
                f"collection_process: the environment {env_name} runs in the trainer's process only "
                f"({setup.env.in_process_only}): set collection_process: false"
            )
        try:
            payload = pickle.dumps(setup)
        except Exception as error:  # noqa: BLE001 - any pickling failure: the user's environment, named below
            raise CollectionProcessError(
                f"collection_process: the environment {env_name} (or the tokenizer) cannot be sent to a process of "
                f"its own ({type(error).__name__}: {error}): set collection_process: false"
            ) from None
        context = multiprocessing.get_context("spawn")  # not fork: the parent has threads, maybe CUDA
        self._connection, child_end = context.Pipe()
        # The calls around a weight change or a checkpoint, answered while a batch is collected on the first pipe.
        self._control, control_end = context.Pipe()
        self._process = context.Process(
            target=_serve,
            args=(child_end, control_end, payload, logging.getLogger("loop_trainer").getEffectiveLevel()),
            name="loop-collection",
            daemon=True,  # never outlives this process (whose exit waits for it to close its environment)
        )
        self._process.start()
        child_end.close()
        control_end.close()
        self._lock = threading.Lock()  # one batch at a time: the pipe carries one job and its answer
        self._control_lock = threading.Lock()
        self._totals_lock = threading.Lock()
        self.totals = ChildTotals()
        self._closed = False
        self._broken = False  # a wait for an answer was interrupted: a pipe is out of step
        # Dropped without close(): the pipes close, so the child reads its end and leaves.
        self._finalizer = weakref.finalize(self, _close_all, self._connection, self._control)
        try:
            self._wait_started(env_name, start_timeout)
        except BaseException:
            self.close(timeout=5)
            raise

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def collect(
        self,
        tasks: Sequence[Mapping[str, Any]],
        rollouts_per_task: int,
        *,
        backend: GenerationBackend | None = None,
        **options: Any,
    ) -> RolloutBatch:
        """The batch the engine would collect with these arguments, collected by the child; ``backend`` samples on
        a vLLM server (the server backend or one version's view of it)."""
        if backend is None:
            raise CollectionProcessError("collection_process samples through a vLLM server: pass its backend")
        job = CollectionJob(list(tasks), rollouts_per_task, sampling_of(backend), dict(options))
        return self._ask(job)

    def continuing(self, max_span: int, backend: GenerationBackend) -> ContinuingInChild:
        """The run's partial rollouts, held by the child: a :class:`~.partial.ContinuingCollection` built there
        (one per child), its episodes' turns sampled by the policies :meth:`ContinuingInChild.release` names
        (``backend``: the engine's default, which no turn of a continuing episode uses)."""
        self._ask(ContinuingCall("open", (max_span, sampling_of(backend))), control=True)
        return ContinuingInChild(self)

    def _ask(self, request: CollectionJob | ContinuingCall, control: bool = False) -> Any:
        """Send ``request`` and wait for its answer: over the batch pipe, or the control pipe (``control``). The
        child's error is raised here as itself, its traceback as its ``__cause__``."""
        message = pickle.dumps(request)  # a request that does not pickle is raised here, the pipe untouched
        connection, lock = (self._control, self._control_lock) if control else (self._connection, self._lock)
        with lock:
            if self._closed or self._broken:
                raise CollectionProcessError(f"the collection process is {'closed' if self._closed else 'broken'}")
            try:
                connection.send_bytes(message)
                kind, value, totals, remote = connection.recv()
            except (EOFError, OSError):
                self._broken = True
                self._process.join(timeout=5)
                raise CollectionProcessError(
                    f"the collection process died (exit code {self._process.exitcode}) while {_doing(request)}: its "
                    "log lines above say why; set collection_process: false to collect on a thread"
                ) from None
            except BaseException:
                self._broken = True  # its answer, if it comes, would be taken for the next request's
                raise
        with self._totals_lock:
            if totals.taken >= self.totals.taken:
                self.totals = totals
        if kind == "error":
            raise value from RemoteTraceback(remote)
        return value

    def _wait_started(self, env_name: str, timeout: float) -> None:
        """The child's first two messages: it has rebuilt the environment and tokenizer (within ``timeout``: a
        fresh interpreter importing loop_trainer), then prepared its copy (however long ``prepare()`` takes)."""
        for step, wait in (("rebuilt", timeout), ("prepared", None)):
            if not multiprocessing.connection.wait([self._connection, self._process.sentinel], wait):
                raise CollectionProcessError(
                    f"the collection process did not start within {timeout:g} s; {GUARD}. Or set collection_process: "
                    "false"
                )
            try:  # its answer, or the end of the pipe if it ended without one
                kind, value, _, remote = self._connection.recv()
            except (EOFError, OSError):
                self._process.join(timeout=5)
                raise CollectionProcessError(
                    f"the collection process died as it started (exit code {self._process.exitcode}): its log lines "
                    f"above say why; {GUARD}. Or set collection_process: false"
                ) from None
            if kind != "error":
                continue
            if step == "rebuilt":
                raise CollectionProcessError(
                    f"collection_process: the child process could not rebuild the environment {env_name} and the "
                    f"tokenizer ({type(value).__name__}: {value}): define the environment's class in an importable "
                    "module (not a notebook's), or set collection_process: false"
                ) from RemoteTraceback(remote)
            raise CollectionProcessError(
                f"collection_process: the environment {env_name}'s prepare() failed in the child process "
                f"({type(value).__name__}: {value}): fix it, or set collection_process: false"
            ) from RemoteTraceback(remote)

    @property
    def is_usable(self) -> bool:
        """Neither closed nor broken: it still answers."""
        return not (self._closed or self._broken)

    def close(self, timeout: float = 30.0) -> None:
        """End the child (after the batch it is collecting, if any; its partial rollouts cancelled); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(OSError):  # it is gone already
                self._connection.send(None)
            # A broken one may be blocked sending the answer nobody will read: no use waiting for it.
            self._process.join(0 if self._broken else timeout)
            if self._process.is_alive():
                if not self._broken:
                    logger.warning("the collection process did not end within %g s: terminating it", timeout)
                self._process.terminate()  # it closes its environment first, within CLOSE_WHEN_LEAVING_S
                self._process.join(CLOSE_WHEN_LEAVING_S + 5)
            if self._process.is_alive():  # SIGTERM's handler could not run (a call that never returns to Python)
                logger.warning("the collection process did not end on SIGTERM: killing it")
                self._process.kill()
                self._process.join(5)
            self._finalizer()

    def __enter__(self) -> CollectionProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ContinuingInChild:
    """A run's partial rollouts held by a :class:`CollectionProcess`: the methods of
    :class:`~.partial.ContinuingCollection` the trainer calls, each answered by the child's collection. Built by
    :meth:`CollectionProcess.continuing`."""

    def __init__(self, process: CollectionProcess):
        self.process = process
        self._closed = False

    def hold(self) -> None:
        """Before the generator's weights change: the turns being sampled finish, no other starts."""
        self.process._ask(ContinuingCall("hold"), control=True)

    def release(self, version: int | None = None, backend: GenerationBackend | None = None) -> None:
        """After :meth:`hold`: turns start again, sampled by ``backend`` (on the server) as policy ``version``;
        nothing given: the policy before."""
        sampling = None if backend is None else sampling_of(backend)
        self.process._ask(ContinuingCall("release", (version, sampling)), control=True)

    def collect(self, tasks: Sequence[Mapping[str, Any]], rollouts_per_task: int, **kwargs: Any) -> RolloutBatch:
        """:meth:`.ContinuingCollection.collect`, in the child (over the batch pipe: the calls above still go)."""
        return self.process._ask(ContinuingCall("collect", (list(tasks), rollouts_per_task), kwargs))

    def finish_in_flight(self) -> None:
        """Run every carried episode to its end (before a checkpoint)."""
        self.process._ask(ContinuingCall("finish_in_flight"), control=True)

    def carried(self) -> list[CarriedGroup]:
        """The carried groups, every episode ended (after :meth:`finish_in_flight`)."""
        return self.process._ask(ContinuingCall("carried"), control=True)

    def restore(self, groups: Sequence[CarriedGroup]) -> None:
        """Carry ``groups`` (from a checkpoint) into the next batch."""
        if groups:
            self.process._ask(ContinuingCall("restore", (list(groups),)), control=True)

    def cancel_in_flight(self) -> int:
        """Cancel the episodes still running; returns how many."""
        return self.process._ask(ContinuingCall("cancel_in_flight"), control=True)

    def close(self) -> None:
        """Cancel what still runs and close the child's collection (the child goes on). Idempotent; nothing to do
        once the child is closed or broken (closing it cancels them)."""
        if self._closed:
            return
        self._closed = True
        if self.process.is_usable:
            try:
                self.process._ask(ContinuingCall("close"), control=True)
            except CollectionProcessError as error:  # it died since: what it held went with it
                logger.info("the collection process's partial rollouts were not closed: %s", error)


def _doing(request: CollectionJob | ContinuingCall) -> str:
    if isinstance(request, CollectionJob) or request.method == "collect":
        return "collecting a batch"
    return f"answering {request.method}()"


def _answer_name(request: CollectionJob | ContinuingCall) -> str:
    """What the answer to ``request`` is, as errors name it."""
    if isinstance(request, CollectionJob) or request.method == "collect":
        return "batch"
    return f"answer to {request.method}()"


def _close_all(*connections: multiprocessing.connection.Connection) -> None:
    for connection in connections:
        connection.close()


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
    on the main thread as before): then it waits for that close, within the same bound. SIGTERM's handler only
    starts such a thread, so it never waits on the main thread it interrupted."""

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

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM's handler (on the main thread): a second SIGTERM ends the process at once; this one ends it
        through :meth:`now`, on a thread of its own."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        why = "it was told to end (SIGTERM)"
        threading.Thread(target=self.now, args=(why,), name="loop-collection-leaving", daemon=True).start()


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
        self._totals_lock = threading.Lock()
        self._answers = itertools.count(1)
        self._env_metrics = EnvMetricsReader(setup.env, "in the collection process", setup.env_timeout)

    def sampler(self, sampling: ServerSampling) -> ServerSampler:
        with self._lock:
            if sampling.endpoint not in self.clients:
                self.clients[sampling.endpoint] = ServerClient(sampling.endpoint)
            sampler = ServerSampler(self.clients[sampling.endpoint], sampling)
            if self.engine is None:
                self.engine = self.setup.build(sampler)
            return sampler

    def answer(self, request: CollectionJob | ContinuingCall) -> Any:
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
        """The running totals now, numbered as they are taken (one at a time: a higher number is never older). If
        the environment's ``metrics()`` fails, its last answer stands (:class:`~.env_metrics.EnvMetricsReader`)."""
        with self._totals_lock:
            env_metrics = self._env_metrics.read()
            engine = self.engine
            return ChildTotals(
                generation_retries=engine.generation_retries if engine else 0,
                abandoned_calls=engine.abandoned_calls if engine else 0,
                env_metrics=env_metrics,
                metrics_call_failures=self._env_metrics.failures,
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
                kind, value = _answer_name(request), self.answer(request)
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


def _serve(
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
    signal.signal(signal.SIGTERM, leaving.on_sigterm)
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
