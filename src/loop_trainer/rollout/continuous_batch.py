"""The decode loop's state for :class:`~loop_trainer.rollout.backend.TransformersBackend`: the rows
being decoded (rows join and leave between decode steps), composed of parts the backend configures
once, up front, from what the model's KV cache allows (:class:`~.kv_layout.KVLayout`):

- where the running rows' keys and values live (:mod:`.row_storage`: one padded ``DynamicCache``, or
  fixed-shape slots with ``static_decode``);
- the prefixes a joining prompt need not prefill again (:class:`~.prefix_cache.PrefixReuse`): its
  episode's previous turn, or an opening it shares with other prompts;
- the module it runs (the policy, or its merged-adapter view) and the counters it adds to, both the
  backend's.

A joining prompt is prefilled only from where the longest cached prefix it extends ends.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import DynamicCache

from .kv_layout import KV, left_pad, row_states
from .prefix_cache import Hit, PrefixReuse
from .records import Completion, DecodeCounters
from .row_storage import Request, Row, RowStorage
from .token_draws import draw_tokens

__all__ = ["DecodeBatch", "DecodeSettings", "Request", "Row"]


@dataclass(frozen=True)
class DecodeSettings:
    """What the decode loop samples with: temperature-only (0: greedy), stopping at ``stop_ids``."""

    temperature: float
    stop_ids: frozenset[int]
    pad_token_id: int


class DecodeBatch:
    """The rows being decoded, their keys and values in ``storage``. ``rows_can_leave`` (from the
    model's cache layout): rows join the running batch and leave it when done; otherwise a batch runs
    until all its rows are done, and only then do new rows join."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        settings: DecodeSettings,
        *,
        storage: RowStorage,
        prefixes: PrefixReuse,
        rows_can_leave: bool,
        counters: DecodeCounters,
        weights_version: Callable[[], int],
        pool: ThreadPoolExecutor | None = None,
    ):
        self.model, self.device, self.settings = model, device, settings
        self.storage, self.prefixes, self.rows_can_leave = storage, prefixes, rows_can_leave
        self.counters, self.weights_version, self.pool = counters, weights_version, pool
        self.rows: list[Row] = []

    def can_join(self) -> bool:
        return self.rows_can_leave or not self.rows

    def step(self, joining: list[Request]) -> None:
        counters, device = self.counters, self.device
        logits, rows = [], []
        if self.rows:  # every running row feeds its last sampled token
            logits.append(self.storage.step(self.rows))
            for row in self.rows:
                row.cache_length += 1
        # The joining rows: a prefill of their prompts, or of what a prompt adds to a cached prefix
        # (computed with these weights: they may have changed since the decode loop started).
        hits: list[Hit | None] = []
        if joining:
            version = self.weights_version()
            hits = self.prefixes.previous_turns([r.prompt_ids for r in joining], version)
            counters.num_reused_tokens += sum(hit[0] for hit in hits if hit)
            fresh = [r for r, hit in zip(joining, hits, strict=True) if hit is None]
            shared = self.prefixes.shared_openings([r.prompt_ids for r in fresh], version, self._prefill_states)
            counters.num_shared_tokens += sum(hit[0] for hit in shared if hit)
            by_request = {id(r): hit for r, hit in zip(fresh, shared, strict=True)}
            hits = [hit or by_request.get(id(r)) for r, hit in zip(joining, hits, strict=True)]
        cached = list(zip(joining, hits, strict=True))
        # the requests to prefill whole, then those extending a prefix
        groups: list[list[tuple[Request, Hit | None]]] = [
            [(r, hit) for r, hit in cached if hit is None],
            [(r, hit) for r, hit in cached if hit],
        ]
        for group in groups:
            if not group:
                continue
            cache, mask, out = self._prefill([(r.prompt_ids, hit) for r, hit in group])
            logits.append(out.logits[:, -1, :])
            slots = self.storage.admit(cache, mask, len(group))
            greedy = self.settings.temperature == 0
            rows += [
                Row(request, None if greedy else _generator(request.seed, device), len(request.prompt_ids), slot=slot)
                for (request, _), slot in zip(group, slots, strict=True)
            ]
            counters.num_batches += 1
            counters.num_sequences += len(group)
        self.rows += rows
        counters.num_steps += 1
        counters.num_step_rows += len(self.rows)
        counters.max_running = max(counters.max_running, len(self.rows))
        self._sample(torch.cat(logits) if len(logits) > 1 else logits[0])

    def _prefill_states(self, items: list[tuple[list[int], Hit | None]]) -> list[KV]:
        """Prefill shared prefixes (:meth:`PrefixReuse.shared_openings`): each one's states."""
        cache, mask, _ = self._prefill(items)
        self.counters.num_batches += 1
        return [row_states(cache, mask, index) for index in range(len(items))]

    def _prefill(self, items: list[tuple[list[int], Hit | None]]) -> tuple[DynamicCache, torch.Tensor, Any]:
        """One forward pass over prompts, each whole (``(prompt, None)``) or as what it adds to a
        cached prefix (``(prompt, (length, states))``; all items alike): the new cache, its mask and
        the model's output (the last position's logits)."""
        if items[0][1] is None:
            cache, mask, positions, input_ids = DynamicCache(), *self._prompts([prompt for prompt, _ in items])
        else:
            cache, mask, positions, input_ids = self._extensions(cast("list[tuple[list[int], Hit]]", items))
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return cache, mask, out

    def _prompts(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention mask, position ids and input ids of whole prompts, left-padded."""
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), self.settings.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for index, prompt in enumerate(prompts):
            input_ids[index, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[index, width - len(prompt) :] = 1
        mask = mask.to(self.device)
        return mask, (mask.cumsum(-1) - 1).clamp(min=0), input_ids.to(self.device)

    def _extensions(
        self, hits: list[tuple[list[int], Hit]]
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A cache of the cached prefixes (left-padded) and the mask, position ids and input ids of
        what each prompt adds to its prefix (left-padded after the prefixes)."""
        past = max(length for _, (length, _) in hits)
        width = max(len(prompt) - length for prompt, (length, _) in hits)
        input_ids = torch.full((len(hits), width), self.settings.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(hits), past + width), dtype=torch.long)
        positions = torch.zeros((len(hits), width), dtype=torch.long)
        for index, (prompt, (length, _)) in enumerate(hits):
            new = len(prompt) - length
            input_ids[index, width - new :] = torch.tensor(prompt[length:], dtype=torch.long)
            mask[index, past - length : past] = 1
            mask[index, past + width - new :] = 1
            positions[index, width - new :] = torch.arange(length, length + new)
        cache = DynamicCache()
        for layer in range(len(hits[0][1][1])):
            keys, values = (
                torch.stack([left_pad(states[layer][kv], past - length) for _, (length, states) in hits])
                for kv in (0, 1)
            )
            cache.update(keys, values, layer)
        return cache, mask.to(self.device), positions.to(self.device), input_ids.to(self.device)

    def _sample(self, logits: torch.Tensor) -> None:
        temperature = self.settings.temperature
        logits = logits.float()
        if temperature not in (0.0, 1.0):
            logits = logits / temperature
        step_logprobs = torch.log_softmax(logits, dim=-1)
        if temperature == 0:  # greedy, for evaluation; log-probs are then at temperature 1
            tokens = step_logprobs.argmax(dim=-1)
        else:
            probs = step_logprobs.exp()
            # Threads pay off only on a large vocabulary (the draws' cost grows with rows x vocab).
            tokens = draw_tokens(
                probs, [row.generator for row in self.rows], self.pool if probs.numel() >= 1 << 18 else None
            )
        chosen = step_logprobs.gather(1, tokens[:, None]).squeeze(1)
        keep = []
        for index, (row, token, logprob) in enumerate(zip(self.rows, tokens.tolist(), chosen.tolist(), strict=True)):
            row.next_token = token
            if row.done:  # a finished row of a batch that cannot shrink: its samples are dropped
                keep.append(index)
                continue
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            stopped = token in self.settings.stop_ids
            if stopped or len(row.token_ids) >= row.request.max_new_tokens or row.request.abandoned():
                row.done = True
                if not row.request.abandoned():
                    if self.prefixes.keeps_turns:  # its prompt and reply but the last token (never fed)
                        held = (*row.request.prompt_ids, *row.token_ids[:-1])
                        self.prefixes.keep(held, self.storage.states(index, row))
                    row.request.deliver(Completion(token_ids=row.token_ids, logprobs=row.logprobs, stopped=stopped))
            if not row.done or not self.rows_can_leave:
                keep.append(index)
        if all(self.rows[index].done for index in keep):
            keep = []
        if len(keep) < len(self.rows):
            self.storage.select(self.rows, keep)
            self.rows = [self.rows[index] for index in keep]


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    if seed is None:  # unseeded: a fresh seed from torch's global RNG (torch.manual_seed still repeats runs)
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device).manual_seed(seed)
