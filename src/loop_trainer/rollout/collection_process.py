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
of a batch, closing its environment first, as it does on SIGTERM: what it does is :mod:`.collection_child`; what
crosses is :mod:`.collection_protocol`.

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
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from .collection_child import CLOSE_WHEN_LEAVING_S, serve_collection
from .collection_protocol import ChildTotals, CollectionJob, CollectionProcessError, ContinuingCall, Request, doing
from .engine import EngineSetup
from .partial import CarriedGroup
from .records import GenerationBackend, RolloutBatch
from .server_client import ServerSampling
from .vllm_server import server_sampling

logger = logging.getLogger(__name__)


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


class _ChildProcess:
    """The child's :class:`multiprocessing.Process`, waited for and polled by one thread at a time.

    Three threads of the trainer's may look at the child at once: the batch's wait and the control pipe's wait each
    join it when their pipe ends, and :meth:`CollectionProcess.close` ends it. multiprocessing's own waits are not
    safe across threads (CPython gh-130895, open): the first ``waitpid`` reaps the child, a concurrent one gets
    ECHILD, which ``poll()`` takes for "still running" until the first thread has stored the exit code. Measured
    with three threads joining a child that had just ended: one in three times, a thread saw it alive after its
    join (exit code None). Then a close warned that the child did not end, and signalled a process id that may
    have been reused. Here each wait, poll and signal holds one lock, so a reap and the exit code it stores
    happen together. (multiprocessing also polls every child it started without this lock: when another process
    starts, in ``active_children()`` and at exit. The trainer starts no other process while a collection process
    runs and calls neither; at exit, only a trainer that was not closed still has a child.)"""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def sentinel(self) -> int:
        return self._process.sentinel

    def start(self) -> None:
        self._process.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the child's end, at most ``timeout`` (and for a join of another thread's under way)."""
        with self._lock:
            self._process.join(timeout)

    def is_alive(self) -> bool:
        with self._lock:
            return self._process.is_alive()

    @property
    def exitcode(self) -> int | None:
        with self._lock:
            return self._process.exitcode

    def terminate(self) -> None:
        with self._lock:
            self._process.terminate()  # nothing once its exit code is known: never a reused process id

    def kill(self) -> None:
        with self._lock:
            self._process.kill()


class CollectionProcess:
    """A child process that collects batches (:meth:`collect`, the signature of :meth:`~.engine.RolloutEngine.collect`),
    one at a time, or holds a run's partial rollouts (:meth:`continuing`); started (its environment rebuilt and
    prepared) by the time the constructor returns. Release it with :meth:`close`; a daemon, it is also ended when
    this process exits."""

    def __init__(self, setup: EngineSetup, *, start_timeout: float = 300.0, close_timeout: float = 30.0):
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
        self._process = _ChildProcess(
            context.Process(
                target=serve_collection,
                args=(child_end, control_end, payload, logging.getLogger("loop_trainer").getEffectiveLevel()),
                name="loop-collection",
                daemon=True,  # never outlives this process (whose exit waits for it to close its environment)
            )
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
        self._ended_by_close = False  # close() ended it while a batch was being collected
        self.close_timeout = close_timeout
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

    def _ask(self, request: Request, control: bool = False) -> Any:
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
                if self._ended_by_close:
                    raise CollectionProcessError(
                        f"the collection process was ended by close() while {doing(request)}"
                    ) from None
                raise CollectionProcessError(
                    f"the collection process died (exit code {self._process.exitcode}) while {doing(request)}: its "
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

    def close(self, timeout: float | None = None) -> None:
        """End the child; idempotent. A batch it is collecting may finish first, within ``timeout`` (by default
        ``close_timeout``, 30 s); one that does not is abandoned (its wait raises :class:`CollectionProcessError`),
        and the child is ended: an episode stuck where no bound reaches it (an environment's ``step`` blocking the
        event loop in C) would otherwise hold this close, and the trainer's, for ever. The child closes its
        environment either way; its partial rollouts are cancelled."""
        timeout = self.close_timeout if timeout is None else timeout
        if not self._lock.acquire(timeout=timeout):  # a batch is being collected: its wait holds the lock
            logger.warning(
                "the batch the collection process collects did not end within %g s of close(): ending the process",
                timeout,
            )
            self._ended_by_close = True
            self._end()
            self._stop_waiting()  # the batch's wait sees the pipe end, and lets go of the lock
            self._lock.acquire()
        try:
            if not self._closed:
                self._closed = True
                with contextlib.suppress(OSError):  # it is gone already
                    self._connection.send(None)
                # A broken one may be blocked sending the answer nobody will read: no use waiting for it.
                self._process.join(0 if self._broken else timeout)
                if self._process.is_alive() and not self._broken:
                    logger.warning("the collection process did not end within %g s: terminating it", timeout)
            self._end()  # also where a close before was interrupted (Ctrl-C) before it ended the child
            self._finalizer()
        finally:
            self._lock.release()

    def _stop_waiting(self) -> None:
        """Make a wait for an answer on the batch pipe end (it reads EOF), even where the child's end is still open:
        held by a grandchild the environment forked without exec, which survives the child's end. The pipe is a
        socket pair, whose shutdown wakes a ``recv`` (or ``send``) on another thread."""
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self._connection.fileno())) as end:
            end.shutdown(socket.SHUT_RDWR)  # OSError: closed already

    def _end(self) -> None:
        """SIGTERM (the child closes its environment first, within CLOSE_WHEN_LEAVING_S), then SIGKILL if none of
        its threads could run (a C call holding the interpreter lock); nothing if it has ended."""
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(CLOSE_WHEN_LEAVING_S + 5)
        if self._process.is_alive():
            logger.warning("the collection process did not end on SIGTERM: killing it")
            self._process.kill()
            self._process.join(5)

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


def _close_all(*connections: multiprocessing.connection.Connection) -> None:
    for connection in connections:
        connection.close()
