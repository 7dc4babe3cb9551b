"""For ``multiturn_throughput.py``: the lower bound of one multi-turn collection. (Measuring only
while no other process takes the CPU is ``Alone`` in ``benchmarks/common.py``.)

No schedule can collect N episodes faster than either of two things:

* **the generation work.** Every sampled token has to be generated, and the cheapest way to
  generate a batch's tokens is the widest batch: all N episodes' turn t in one batch, every turn,
  with no environment latency between the turns. ``generation_full_s`` is that lock-step,
  zero-latency collection of the same workload (the same prompts, N x turns replies of exactly
  ``--new-tokens`` tokens, the same contexts growing the same way), timed with each side's decode
  code; the bound takes the faster decoder. While this runs the sampler never waits for anything,
  so a collection with latencies can only match it by hiding every environment step behind
  generation.
* **the slowest episode's critical path.** An episode's replies and environment steps run one
  after another. The slowest episode cannot finish before its own environment latencies
  (``env_sleep_max_episode_s``) plus its own replies generated with nothing batched beside them
  (``generation_alone_s``: the same lock-step collection with N = 1).

    bound = max(generation_full_s, env_sleep_max_episode_s + generation_alone_s)

It is a bound on this machine's *generation path*, not on the hardware: a faster decoder lowers it.
The first term ignores that a batch of N might be cheaper per token split differently (on this CPU
wider batches are never slower per token), and the second term ignores that the slowest episode's
replies are usually generated beside other episodes' (which only makes them slower).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any


def lower_bound(
    generation_full_s: Mapping[str, float], env_sleep_max_episode_s: float, generation_alone_s: float
) -> dict[str, Any]:
    """The bound of one collection. ``generation_full_s`` maps each decoder measured ("ours",
    "trl") to its zero-latency lock-step generation time for this N; the fastest one counts."""
    if not generation_full_s:
        raise ValueError("need at least one lock-step generation time")
    if min(generation_full_s.values()) <= 0 or generation_alone_s <= 0 or env_sleep_max_episode_s < 0:
        raise ValueError("times must be positive (env sleep >= 0)")
    fastest = min(generation_full_s, key=generation_full_s.__getitem__)
    full = generation_full_s[fastest]
    critical = env_sleep_max_episode_s + generation_alone_s
    return {
        "bound_s": max(full, critical),
        "generation_full_s": full,
        "fastest_decoder": fastest,
        "critical_path_s": critical,
        "limited_by": "generation" if full >= critical else "slowest episode",
        **{f"generation_full_{name}_s": seconds for name, seconds in generation_full_s.items()},
    }


def attach_bounds(runs: list[dict[str, Any]], lock_steps: Mapping[int, Sequence[Mapping[str, float]]]) -> None:
    """Give every run (``side``, ``concurrency``, ``seconds``, ``env_sleep_max_episode_s``; TRL's
    with ``generation_seconds``) its ``bound`` and ``over_bound`` (wall seconds / bound).

    ``lock_steps[n]`` holds our lock-step, zero-latency collections of n episodes (``seconds``), n = 1
    included; the fastest of each counts. TRL's tool loop generates lock-step already: its
    generation seconds at n (the fastest of its runs) are the same measurement with its decoder."""
    alone = min(r["seconds"] for r in lock_steps[1])
    for run in runs:
        n = run["concurrency"]
        full = {"ours": min(r["seconds"] for r in lock_steps[n])}
        trl = [r["generation_seconds"] for r in runs if r["side"] == "trl" and r["concurrency"] == n]
        if trl:
            full["trl"] = min(trl)
        run["bound"] = lower_bound(full, run["env_sleep_max_episode_s"], alone)
        run["over_bound"] = run["seconds"] / run["bound"]["bound_s"]


class LockStepBackend:
    """A generation backend for the bound: it holds requests until ``n`` are waiting, then submits
    all of them at once to ``generate`` (a backend's own ``generate``), so they are decoded as one
    batch -- one batch per turn, as TRL's tool loop generates, but with each side's own decode code.
    With ``n`` episodes of the same number of turns, every turn is exactly one batch of ``n``."""

    def __init__(self, generate: Callable[..., Awaitable[Any]], n: int):
        if n < 1:
            raise ValueError("n must be >= 1")
        self._generate, self.n = generate, n
        self.batch_sizes: list[int] = []
        self.generation_seconds = 0.0
        self._waiting: list[tuple[list[int], int, int | None, asyncio.Future[Any]]] = []

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((list(prompt_ids), max_new_tokens, seed, future))
        if len(self._waiting) == self.n:
            batch, self._waiting = self._waiting, []
            started = time.perf_counter()
            results = await asyncio.gather(
                *(self._generate(prompt, limit, seed=seed) for prompt, limit, seed, _ in batch), return_exceptions=True
            )
            self.generation_seconds += time.perf_counter() - started
            self.batch_sizes.append(len(batch))
            for (*_, waiting), result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    waiting.set_exception(result)
                else:
                    waiting.set_result(result)
        return await future
