"""Overlapped iterations (``max_staleness: 1``): iteration i+1's rollouts are collected while iteration i's
update runs.

The schedule, with a generator apart from the trainer (a vLLM server on GPUs of its own)::

    iteration 0:  collect B0 with pi_0 | sync pi_0 | start B1 with pi_0 ........ | update on B0 -> pi_1
    iteration i:  wait for B_i (pi_{i-1}) | sync pi_i | start B_{i+1} with pi_i ... | update on B_i -> pi_{i+1}

So a batch is always trained one iteration after the policy that sampled it: its behaviour policy is
pi_{i-1}, the policy before the update (pi_old, the trainer's log-probs of the batch) is pi_i, and the
update weights each token by min(pi_old / pi_behaviour, C) (:func:`.update.importance_cap`). The
generator's weights change only between collections: a sync, an evaluation or a checkpoint first waits
for the collection in flight.

Checkpoints: the batch in flight belongs to the checkpoint. Saving after iteration i waits for B_{i+1}
and writes it (``next_rollouts.pt``) beside the weights; the task sampler's state already includes its
tasks. A resumed run trains on that batch instead of collecting it again, so it repeats the
uninterrupted run exactly wherever it was stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

NEXT_ROLLOUTS_FILE = "next_rollouts.pt"


class OverlappedRollouts:
    """At most one collection ahead: :meth:`start` it for an iteration, :meth:`take` it there."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._iteration: int | None = None
        self._future: Future[Any] | None = None

    @property
    def iteration(self) -> int | None:
        """The iteration whose rollouts are in flight or ready, if any."""
        return self._iteration

    def start(self, iteration: int, collect: Callable[[], Any]) -> None:
        """Run ``collect()`` (iteration ``iteration``'s collection) on a thread of its own."""
        if self._future is not None:
            raise RuntimeError(f"the rollouts of iteration {self._iteration + 1} are still pending")  # type: ignore[operator]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="loop-next-rollouts")
        self._iteration, self._future = iteration, self._executor.submit(collect)

    def take(self, iteration: int) -> Any | None:
        """Iteration ``iteration``'s rollouts (waiting for them), or None if none were collected ahead."""
        if self._future is None or self._iteration != iteration:
            return None
        try:
            return self._future.result()
        finally:
            self._future, self._iteration = None, None

    def wait(self) -> None:
        """Let the collection in flight finish (before the generator's weights change); its errors
        surface at :meth:`take`."""
        if self._future is not None:
            self._future.exception()

    def save(self, directory: Path) -> None:
        """Write the rollouts collected ahead (waiting for them) into a checkpoint ``directory``."""
        if self._future is None:
            return
        torch.save({"iteration": self._iteration, "rollouts": self._future.result()}, directory / NEXT_ROLLOUTS_FILE)

    def load(self, checkpoint: str | Path) -> None:
        """The rollouts a checkpoint holds for its next iteration, as if collected ahead (nothing if none)."""
        path = Path(checkpoint) / NEXT_ROLLOUTS_FILE
        if not path.is_file():
            return
        saved = torch.load(path, weights_only=False)  # our own checkpoint: trajectories, not tensors only
        future: Future[Any] = Future()
        future.set_result(saved["rollouts"])
        self._iteration, self._future = int(saved["iteration"]), future
        logger.info("resumed with iteration %d's rollouts from the checkpoint", self._iteration + 1)

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
