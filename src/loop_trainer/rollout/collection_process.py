"""A collection in a process of its own (``collection_process: true``): the batches an overlapped run queues ahead
(``max_staleness``), collected by a child of the training process while the update runs in the parent.

Why: a collection's host work (rendering and tokenising each turn, its HTTP request, the environment's step, the
event loop's hand-offs) is Python, and on a thread of the training process it holds the interpreter lock that the
update's kernel launches need too. Measured, a launch-bound update beside a collection thread ran 3-10 times slower
than alone (docs/benchmarks.md, "A server generator's requests"); on an H200 the overlap gained nothing (0.99x).
In a child process the two share nothing but the cores.

What crosses: the environment and the chat formatter (its tokenizer), pickled once when the child starts (a copy
of the run's; the parent keeps its own for the first batch and evaluation); then, per batch, the tasks, the seeds
and what samples it as settings (:class:`~.server_client.ServerSampling`: the server, the policy version's model
name, the temperature), so the child sends the same requests the thread would; back come the batch and the
child's running totals (generation retries, abandoned environment calls, the environment's own metrics).

Only a generator the child can reach by itself can sample: a vLLM server (``vllm_mode: server``). The child
ignores SIGINT (the parent stops the run and closes it) and ends when the parent closes it or goes away.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import threading
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .backend import GenerationBackend
from .engine import EngineSetup, RolloutEngine
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
class ChildTotals:
    """The child's running totals since it started."""

    generation_retries: int = 0
    abandoned_calls: int = 0
    env_metrics: dict[str, float] = field(default_factory=dict)


class CollectionProcess:
    """A child process that collects batches (:meth:`collect`, the signature of :meth:`RolloutEngine.collect`),
    one at a time. Release it with :meth:`close`."""

    def __init__(self, setup: EngineSetup, *, start_timeout: float = 300.0):
        try:
            payload = pickle.dumps(setup)
        except Exception as error:  # noqa: BLE001 - any pickling failure: the user's environment, named below
            raise CollectionProcessError(
                f"collection_process: the environment {type(setup.env).__name__} (or the tokenizer) cannot be sent "
                f"to a process of its own ({type(error).__name__}: {error}): set collection_process: false"
            ) from None
        context = multiprocessing.get_context("spawn")  # not fork: the parent has threads, maybe CUDA
        self._connection, child_end = context.Pipe()
        self._process = context.Process(
            target=_serve,
            args=(child_end, payload, logging.getLogger("loop_trainer").getEffectiveLevel()),
            name="loop-collection",
        )
        self._process.start()
        child_end.close()
        self._lock = threading.Lock()  # one batch at a time: the pipe carries one job and its answer
        self.totals = ChildTotals()
        self.start_timeout = start_timeout
        self._started = False
        self._closed = False

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
        sampling = None if backend is None else server_sampling(backend)
        if sampling is None:
            raise CollectionProcessError(
                f"collection_process samples through a vLLM server, not {type(backend).__name__}: set vllm_mode: "
                "server, or collection_process: false"
            )
        job = CollectionJob(list(tasks), rollouts_per_task, sampling, dict(options))
        with self._lock:
            if self._closed:
                raise CollectionProcessError("the collection process is closed")
            if not self._started:
                self._wait_started()
            try:
                self._connection.send(job)
                kind, value, totals = self._connection.recv()
            except (EOFError, OSError):
                self._process.join(timeout=5)
                raise CollectionProcessError(
                    f"the collection process died (exit code {self._process.exitcode}) while collecting a batch: "
                    "its log lines above say why; set collection_process: false to collect on a thread"
                ) from None
        self.totals = totals
        if kind == "error":
            raise value
        return value

    def _wait_started(self) -> None:
        """The child's first message: it has built its engine's parts (or failed to)."""
        if not self._connection.poll(self.start_timeout):
            raise CollectionProcessError(f"the collection process did not start within {self.start_timeout:g} s")
        try:
            kind, value, _ = self._connection.recv()
        except (EOFError, OSError):
            self._process.join(timeout=5)
            raise CollectionProcessError(
                f"the collection process died as it started (exit code {self._process.exitcode})"
            ) from None
        if kind == "error":
            raise CollectionProcessError(
                f"collection_process: the child process could not rebuild the environment and tokenizer ({value}): "
                "define the environment's class in an importable module (not a notebook's), or set "
                "collection_process: false"
            )
        self._started = True

    def close(self, timeout: float = 30.0) -> None:
        """End the child (after the batch it is collecting, if any); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(OSError):  # it is gone already
                self._connection.send(None)
            self._process.join(timeout)
            if self._process.is_alive():
                logger.warning("the collection process did not end within %g s: terminating it", timeout)
                self._process.terminate()
                self._process.join(5)
            self._connection.close()

    def __enter__(self) -> CollectionProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _portable(error: BaseException) -> BaseException:
    """``error``, or, if it does not pickle, a :class:`CollectionProcessError` that quotes it and its traceback."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - whatever pickling raises, the error still reaches the parent
        text = "".join(traceback.format_exception(error)).rstrip()
        return CollectionProcessError(f"in the collection process: {type(error).__name__}: {error}\n{text}")


def _serve(connection: multiprocessing.connection.Connection, payload: bytes, log_level: int) -> None:
    """The child: build the setup, then collect each job sent until None (or the parent goes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the parent decides
    logging.basicConfig(level=log_level, format="[collection process] %(levelname)s %(name)s: %(message)s")
    try:
        setup: EngineSetup = pickle.loads(payload)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it
        connection.send(("error", _portable(error), ChildTotals()))
        return
    connection.send(("started", None, ChildTotals()))
    clients: dict[Any, ServerClient] = {}
    engine: RolloutEngine | None = None
    try:
        while True:
            try:
                job: CollectionJob | None = connection.recv()
            except EOFError:  # the parent went away
                return
            if job is None:
                return
            reply: tuple[str, Any]
            try:
                endpoint = job.sampling.endpoint
                if endpoint not in clients:
                    clients[endpoint] = ServerClient(endpoint)
                sampler = ServerSampler(clients[endpoint], job.sampling)
                if engine is None:
                    engine = setup.build(sampler)
                reply = ("batch", engine.collect(job.tasks, job.rollouts_per_task, backend=sampler, **job.options))
            except BaseException as error:  # noqa: BLE001 - the parent raises it where the batch is taken
                reply = ("error", _portable(error))
            totals = ChildTotals(
                engine.generation_retries if engine else 0,
                engine.abandoned_calls if engine else 0,
                dict(setup.env.metrics()),
            )
            connection.send((*reply, totals))
    finally:
        if engine is not None:
            engine.close()
        for client in clients.values():
            client.close()
        setup.env.close()  # the child's copy: its own to close
