"""Overlapped iterations (``max_staleness: k``): the batches of the next k iterations are collected while this
iteration's update runs.

The schedule, with a generator apart from the trainer (a vLLM server on GPUs of its own)::

    iteration 0:  collect B0 with pi_0 | sync pi_0 | queue B1 .. Bk with pi_0 ............ | update on B0 -> pi_1
    iteration i:  take B_i (pi_{i-k}) | sync pi_i | queue B_{i+k} with pi_i ............. | update on B_i -> pi_{i+1}

So batch j is sampled by policy ``max(0, j - k)``, whatever the timing: the schedule is a function of the
iteration numbers alone, so a seed repeats and a resumed run continues the uninterrupted one. The queued batches
are collected one after another on one thread, in order. With k = 1 the generator holds one policy, synced at
each iteration boundary once the batch it sampled is complete; with k above 1 it holds every version a queued
batch still needs (a LoRA adapter per version on a vLLM server; :class:`~..rollout.vllm_backend.HoldsVersions`),
each batch sampling through its version's view, and the versions no queued batch needs are released.

Several training processes: each collects its share of every queued batch on its own thread, over HTTP, and runs
no collective there; the shares are gathered on the main thread when the batch is taken, at the iteration boundary
(:func:`~..rollout.sharding.gather_shares`), where the weight sync (ZeRO-3's gathers included) also runs. Every
process queues the same iterations, so they meet at the same gathers.

Checkpoints own every batch in flight: saving after iteration i waits for the queued batches, gathers them and
writes them (``next_rollouts.pt``) beside the weights; the task sampler's state already counts their tasks. A
resumed run trains on them instead of collecting them again (it could not: the policies that sampled them are
not in the checkpoint), so it repeats the uninterrupted run wherever it was stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..rollout import RolloutBatch
from ..trajectory import Trajectory

logger = logging.getLogger(__name__)

NEXT_ROLLOUTS_FILE = "next_rollouts.pt"


@dataclass
class QueuedBatch:
    """One iteration's batch, queued ahead."""

    iteration: int
    """The iteration (0-based) that trains on it."""
    version: int
    """The policy that samples it (the iteration whose weights it is)."""
    share: Future[RolloutBatch] | None = None
    """This process's share, being collected (None once gathered)."""
    gathered: RolloutBatch | None = None
    """Every process's trajectories: after :meth:`OverlappedRollouts.take` or ``settle``, or from a checkpoint."""


class OverlappedRollouts:
    """Up to ``max_staleness`` batches queued ahead: :meth:`start` one for an iteration, :meth:`take` it there.

    ``gather`` turns this process's share of a batch into everyone's (a collective, run only by :meth:`take` and
    :meth:`settle`, which the main thread calls on every process)."""

    def __init__(self, max_staleness: int = 1, gather: Callable[[RolloutBatch], RolloutBatch] = lambda b: b) -> None:
        self.max_staleness = max_staleness
        self.gather = gather
        self._executor: ThreadPoolExecutor | None = None
        self._queue: list[QueuedBatch] = []

    @property
    def iterations(self) -> list[int]:
        """The iterations whose batches are queued (in flight or ready), in order."""
        return [queued.iteration for queued in self._queue]

    def to_queue(self, iteration: int, num_iterations: int) -> range:
        """The iterations to queue at ``iteration``'s boundary (the run has ``num_iterations``): those after the
        last one queued (or ``iteration``), up to ``iteration + max_staleness``."""
        after = max([iteration, *self.iterations])
        return range(after + 1, min(iteration + self.max_staleness, num_iterations - 1) + 1)

    def oldest_version(self, default: int) -> int:
        """The oldest policy a queued batch is sampled by (``default`` when none is queued)."""
        return min([q.version for q in self._queue if q.share is not None], default=default)

    def start(self, iteration: int, version: int, collect: Callable[[], RolloutBatch]) -> None:
        """Queue iteration ``iteration``'s batch, sampled by policy ``version``: ``collect()`` returns this
        process's share; it runs on the collection thread after the batches queued before it."""
        if len(self._queue) >= self.max_staleness:
            raise RuntimeError(f"{len(self._queue)} batches are queued already (max_staleness {self.max_staleness})")
        if self._queue and iteration <= self._queue[-1].iteration:
            raise RuntimeError(
                f"iteration {iteration + 1}'s batch is queued after iteration {self.iterations[-1] + 1}'s"
            )
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="loop-next-rollouts")
        self._queue.append(QueuedBatch(iteration, version, share=self._executor.submit(collect)))

    def take(self, iteration: int) -> tuple[RolloutBatch, int] | None:
        """Iteration ``iteration``'s batch, everyone's (waiting for it; gathering it is a collective), and the
        policy that sampled it; None if it was not queued."""
        if not self._queue or self._queue[0].iteration != iteration:
            return None
        queued = self._queue[0]
        try:
            batch = self._gathered(queued)
        finally:
            self._queue.pop(0)
        return batch, queued.version

    def _gathered(self, queued: QueuedBatch) -> RolloutBatch:
        if queued.gathered is None:
            assert queued.share is not None  # a queued batch has one or the other
            share = queued.share.result()
            queued.gathered, queued.share = self.gather(share), None
        return queued.gathered

    def wait(self) -> None:
        """Let every queued collection finish (before the generator's weights change under it; one cancelled by
        :meth:`cancel_queued` never runs); their errors surface at :meth:`take`. No collective."""
        for queued in self._queue:
            if queued.share is not None and not queued.share.cancelled():
                queued.share.exception()

    def settle(self) -> None:
        """Wait for every queued batch and gather it (a collective: every process calls it, as a checkpoint is
        saved)."""
        for queued in self._queue:
            self._gathered(queued)

    def save(self, directory: Path) -> None:
        """Write the queued batches into a checkpoint ``directory`` (after :meth:`settle`; nothing if none)."""
        if not self._queue:
            return
        self.settle()
        batches = [{"iteration": q.iteration, "version": q.version, "rollouts": q.gathered} for q in self._queue]
        torch.save({"batches": batches}, directory / NEXT_ROLLOUTS_FILE)

    def load(self, checkpoint: str | Path) -> None:
        """The batches a checkpoint holds for its next iterations, as if queued (nothing if none)."""
        path = Path(checkpoint) / NEXT_ROLLOUTS_FILE
        if not path.is_file():
            return
        saved = torch.load(path, weights_only=False)  # our own checkpoint: trajectories, not tensors only
        # A checkpoint written before max_staleness went beyond 1 holds one batch, sampled by the policy before it.
        batches = saved.get("batches") or [{**saved, "version": int(saved["iteration"]) - 1}]
        if len(batches) > self.max_staleness:
            raise ValueError(
                f"the checkpoint {checkpoint} holds {len(batches)} batches collected ahead, more than max_staleness "
                f"{self.max_staleness}: resume with max_staleness: {len(batches)} or more"
            )
        self._queue = [QueuedBatch(int(b["iteration"]), int(b["version"]), gathered=b["rollouts"]) for b in batches]
        logger.info(
            "resumed with the batches of iterations %s from the checkpoint",
            ", ".join(str(i + 1) for i in self.iterations),
        )

    def cancel_queued(self) -> None:
        """Cancel the queued batches whose collection has not started (as the run ends: nothing will take them);
        after it, none starts. The one being collected goes on: :meth:`close` waits for it."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Wait for the collections under way (their errors dropped: nothing takes their batches now), forget the
        queue and release the thread; idempotent. A run that goes on after it queues its batches anew."""
        self.wait()
        self._queue = []
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def tag_versions(trajectories: Sequence[Trajectory], version: int) -> None:
    """Every sampled turn of ``trajectories`` was sampled by policy ``version``."""
    for trajectory in trajectories:
        trajectory.turn_versions = [version] * trajectory.num_turns


def staleness_metrics(trajectories: Sequence[Trajectory], iteration: int) -> dict[str, float]:
    """How many iterations each sampled token's policy lags the one trained at ``iteration``, over the batch's
    sampled tokens: the mean (``policy_staleness``), the least and the most."""
    lags: dict[int, int] = {}  # lag -> sampled tokens
    for trajectory in trajectories:
        for turn in trajectory.turn_ids:
            if turn >= 0:
                lag = iteration - trajectory.turn_versions[turn]
                lags[lag] = lags.get(lag, 0) + 1
    tokens = sum(lags.values())
    if not tokens:
        return {"policy_staleness": 0.0, "policy_staleness_min": 0.0, "policy_staleness_max": 0.0}
    return {
        "policy_staleness": sum(lag * n for lag, n in lags.items()) / tokens,
        "policy_staleness_min": float(min(lags)),
        "policy_staleness_max": float(max(lags)),
    }
