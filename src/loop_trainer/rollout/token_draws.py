"""The decode loop's sampling step: one token per row, each row from its own seeded generator."""

from __future__ import annotations

import itertools
import math
from concurrent.futures import ThreadPoolExecutor

import torch


def draw_tokens(
    probs: torch.Tensor, generators: list[torch.Generator | None], pool: ThreadPoolExecutor | None
) -> torch.Tensor:
    """One token per row, row r drawn with ``generators[r]``, exactly as ``torch.multinomial(probs[r],
    1, generator=generators[r])`` draws it: the argmax of ``probs / E`` with ``E ~ Exp(1)`` noise from
    the row's generator (multinomial's own one-sample method). Only the noise is drawn per row (the
    rows split over ``pool``'s threads); the division and argmax are one batched pass. Unlike
    multinomial, nothing is checked per row: its check (no inf, nan or negative probability) reads the
    tensor back, one GPU sync per row and step; it is done once for the batch."""
    if not bool(((probs >= 0) & (probs < math.inf)).all()):  # NaN fails both comparisons
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    noise = torch.empty_like(probs)

    def rows(indices: range) -> None:
        for r in indices:
            noise[r].exponential_(1, generator=generators[r])

    count = len(generators)
    if pool is None or count < 2:
        rows(range(count))
    else:
        parts = torch.get_num_threads()  # the pool's size (backend._decode sizes it so); any split draws the same
        bounds = [count * part // parts for part in range(parts + 1)]
        list(pool.map(rows, [range(a, b) for a, b in itertools.pairwise(bounds)]))
    return (probs / noise).argmax(dim=-1)
