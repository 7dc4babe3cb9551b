"""The decode loop's state for :class:`~loop_trainer.rollout.backend.TransformersBackend`: the rows
being decoded with their KV cache (rows join and leave between decode steps). A joining prompt is
prefilled only from where the longest cached prefix it extends ends: its episode's previous turn,
or an opening it shares with other prompts (:mod:`.prefix_cache`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from .prefix_cache import KV, Anchor, PrefixCache, PrefixNode, SharedPrefixes, plan
from .records import Completion
from .slot_decode import SlotDecoder
from .token_draws import draw_tokens

if TYPE_CHECKING:  # the backend owns the batch; the batch only reads its settings and counts
    from .backend import TransformersBackend


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int | None
    deliver: Callable[[Completion | BaseException], None]
    """Hands the reply (or the error) to whoever waits for it; called from the decode thread."""
    abandoned: Callable[[], bool] = lambda: False
    """True once nobody waits for the reply any more (the episode was cancelled)."""


@dataclass
class Row:
    """A request being decoded: its sampler and its reply so far."""

    request: Request
    generator: torch.Generator | None
    cache_length: int
    """Tokens of this row in the KV cache; also the position id of the next token it feeds."""
    next_token: int = -1
    """The last token sampled: fed at the next step."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False
    slot: int = -1
    """Its slot in the fixed-shape decode state (``static_decode``), else -1."""


class DecodeBatch:
    """The rows being decoded and their KV cache, one column per position: ``mask[r]`` marks row
    r's ``rows[r].cache_length`` tokens (left padding, and holes where a cached prefix and its new
    tokens were padded separately, are zeros)."""

    def __init__(
        self,
        backend: TransformersBackend,
        device: torch.device,
        pool: ThreadPoolExecutor | None,
        prefixes: PrefixCache | None,
        shared: SharedPrefixes | None = None,
    ):
        self.backend, self.device, self.pool, self.prefixes, self.shared = backend, device, pool, prefixes, shared
        self.rows: list[Row] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        self.stop_ids = set(backend.stop_token_ids.tolist())
        # Rows can join a running batch, and leave it, only if its cache is plain [batch, heads,
        # length, dim] key/value tensors; otherwise a batch runs until all its rows are done.
        self.mergeable = True
        # static_decode: the running rows' keys and values live in fixed-shape slots (one CUDA graph
        # per step on a GPU) instead of self.cache, which then only ever holds nothing.
        self.slots: SlotDecoder | None = backend.slot_decoder(device) if backend.static_decode else None

    def can_join(self) -> bool:
        return self.mergeable or not self.rows

    def step(self, joining: list[Request]) -> None:
        backend, model, device = self.backend, self.backend.sampling_model, self.device
        logits, rows = [], []
        if self.rows and self.slots is not None:
            logits.append(
                self.slots.step(
                    [row.slot for row in self.rows],
                    [row.next_token for row in self.rows],
                    [row.cache_length for row in self.rows],
                )
            )
            for row in self.rows:
                row.cache_length += 1
        elif self.rows:  # every running row feeds its last sampled token
            assert self.mask is not None
            self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
            out = model(
                input_ids=torch.tensor([[row.next_token] for row in self.rows], device=device),
                attention_mask=self.mask,
                position_ids=torch.tensor([[row.cache_length] for row in self.rows], device=device),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits.append(out.logits[:, -1, :])
            for row in self.rows:
                row.cache_length += 1
        # The joining rows: a prefill of their prompts, or of what a prompt adds to a cached prefix
        # (computed with these weights: they may have changed since the decode loop started).
        version = weights_version(backend.model) if joining else 0  # 0: nothing joins, no prefix is looked up
        if self.prefixes is not None and joining and self.prefixes.weights_version != version:
            self.prefixes.clear(version)
        cached = (
            [(r, None) for r in joining]
            if self.prefixes is None or not self.mergeable
            else [(r, self.prefixes.pop(r.prompt_ids)) for r in joining]
        )
        backend.num_reused_tokens += sum(hit[0] for _, hit in cached if hit)
        shared = self._shared_prefixes([r for r, hit in cached if hit is None], version)
        cached = [(r, hit or shared.get(id(r))) for r, hit in cached]
        groups: list[list[tuple[Request, Any]]] = [  # the requests to prefill whole, then those extending a prefix
            [(r, hit) for r, hit in cached if hit is None],
            [(r, hit) for r, hit in cached if hit],
        ]
        for group in groups:
            if not group:
                continue
            cache, mask, out = self._prefill([(r.prompt_ids, hit) for r, hit in group])
            logits.append(out.logits[:, -1, :])
            slots = self._admit(cache, mask, len(group))
            greedy = backend.temperature == 0
            rows += [
                Row(request, None if greedy else _generator(request.seed, device), len(request.prompt_ids), slot=slot)
                for (request, _), slot in zip(group, slots, strict=True)
            ]
            backend.num_batches += 1
            backend.num_sequences += len(group)
        self.rows += rows
        backend.num_steps += 1
        backend.num_step_rows += len(self.rows)
        backend.max_running = max(backend.max_running, len(self.rows))
        self._sample(torch.cat(logits) if len(logits) > 1 else logits[0])

    def _prefill(self, items: list[tuple[list[int], Any]]) -> tuple[DynamicCache, torch.Tensor, Any]:
        """One forward pass over prompts, each whole (``(prompt, None)``) or as what it adds to a
        cached prefix (``(prompt, (length, states))``; all items alike): the new cache, its mask and
        the model's output (the last position's logits)."""
        if items[0][1] is None:
            cache, mask, positions, input_ids = DynamicCache(), *self._prompts([prompt for prompt, _ in items])
        else:
            cache, mask, positions, input_ids = self._extensions(items)
        out = self.backend.sampling_model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return cache, mask, out

    def _shared_prefixes(self, requests: list[Request], version: int) -> dict[int, tuple[int, KV]]:
        """Per request (by id), the shared prefix it extends, its KV cache computed now or earlier
        in the collection: the prefixes ``requests`` share are prefilled once, level by level."""
        if self.shared is None or not self.mergeable or len(requests) == 0:
            return {}
        if self.shared.weights_version != version:
            self.shared.clear(version)
        nodes, anchors = plan([r.prompt_ids for r in requests], self.shared)
        for level in sorted({node.level for node in nodes}):
            batch = [node for node in nodes if node.level == level]
            for with_parent in (False, True):
                part = [node for node in batch if (node.parent is not None) is with_parent]
                if not part:
                    continue
                cache, mask, _ = self._prefill([(list(node.tokens), self._anchor_hit(node.parent)) for node in part])
                if not _plain(cache):  # states that cannot be cut per row (e.g. sliding windows): prefill whole
                    self.shared = None
                    return {}
                for index, node in enumerate(part):
                    node.states = _row_states(cache, mask, index)
                    self.shared.put(node.tokens, node.states)
                self.backend.num_batches += 1
        hits = {id(r): self._anchor_hit(anchor) for r, anchor in zip(requests, anchors, strict=True) if anchor}
        self.backend.num_shared_tokens += sum(hit[0] for hit in hits.values() if hit)
        return {key: hit for key, hit in hits.items() if hit}

    def _anchor_hit(self, anchor: Anchor) -> tuple[int, KV] | None:
        if anchor is None:
            return None
        if isinstance(anchor, PrefixNode):
            assert anchor.states is not None, "a node is prefilled before what extends it"
            return len(anchor.tokens), anchor.states
        assert self.shared is not None
        return len(anchor), self.shared.entries[anchor]

    def _prompts(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention mask, position ids and input ids of whole prompts, left-padded."""
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), self.backend.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for index, prompt in enumerate(prompts):
            input_ids[index, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[index, width - len(prompt) :] = 1
        mask = mask.to(self.device)
        return mask, (mask.cumsum(-1) - 1).clamp(min=0), input_ids.to(self.device)

    def _extensions(
        self, hits: list[tuple[list[int], Any]]
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A cache of the cached prefixes (left-padded) and the mask, position ids and input ids of
        what each prompt adds to its prefix (left-padded after the prefixes)."""
        past = max(length for _, (length, _) in hits)
        width = max(len(prompt) - length for prompt, (length, _) in hits)
        input_ids = torch.full((len(hits), width), self.backend.pad_token_id, dtype=torch.long)
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
                torch.stack([_left_pad(states[layer][kv], past - length) for _, (length, states) in hits])
                for kv in (0, 1)
            )
            cache.update(keys, values, layer)
        return cache, mask.to(self.device), positions.to(self.device), input_ids.to(self.device)

    def _sample(self, logits: torch.Tensor) -> None:
        temperature = self.backend.temperature
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
            stopped = token in self.stop_ids
            if stopped or len(row.token_ids) >= row.request.max_new_tokens or row.request.abandoned():
                row.done = True
                if not row.request.abandoned():
                    if self.prefixes is not None and self.mergeable:
                        self._keep_prefix(index, row)
                    row.request.deliver(Completion(token_ids=row.token_ids, logprobs=row.logprobs, stopped=stopped))
            if not row.done or not self.mergeable:
                keep.append(index)
        if all(self.rows[index].done for index in keep):
            keep = []
        if len(keep) < len(self.rows):
            self._select(keep)

    def _keep_prefix(self, index: int, row: Row) -> None:
        """Hand row ``index``'s KV cache (its prompt and its reply but the last token) to the
        prefix cache."""
        assert self.prefixes is not None
        if self.slots is not None:
            states = self.slots.states(row.slot, row.cache_length)
        else:
            assert self.cache is not None and self.mask is not None
            states = _row_states(self.cache, self.mask, index)
        self.prefixes.put((*row.request.prompt_ids, *row.token_ids[:-1]), states)

    def _admit(self, cache: DynamicCache, mask: torch.Tensor, count: int) -> list[int]:
        """Take in the ``count`` rows just prefilled: into free slots (``static_decode``; their
        states without padding), else merged into the batch's cache. Their slots, or -1 each."""
        if self.slots is not None and not self.rows and not _plain(cache):
            self.slots = None  # states that cannot be cut per row (e.g. sliding windows): the dynamic batch
        if self.slots is None:
            self._merge(cache, mask)
            return [-1] * count
        return self.slots.put_batch([_states(layer) for layer in _kv_layers(cache)], mask)

    def _merge(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Add the joining rows' cache (and attention mask) under the running rows', left-padding
        whichever is shorter."""
        if self.cache is None:
            self.cache, self.mask = cache, mask
            self.mergeable = all(
                type(layer) is DynamicLayer and (not layer.is_initialized or _states(layer)[0].dim() == 4)
                for layer in _kv_layers(cache)
            )
            if not _plain(cache):  # layers sharing another's cache
                self.prefixes = self.shared = None
            return
        assert self.mask is not None
        old, new = self.mask.shape[1], mask.shape[1]
        width = max(old, new)
        for running, joining in zip(_kv_layers(self.cache), _kv_layers(cache), strict=True):
            if running.is_initialized:
                (keys, values), (new_keys, new_values) = _states(running), _states(joining)
                running.keys = torch.cat([_left_pad(keys, width - old), _left_pad(new_keys, width - new)])
                running.values = torch.cat([_left_pad(values, width - old), _left_pad(new_values, width - new)])
        self.mask = torch.cat([F.pad(self.mask, (width - old, 0)), F.pad(mask, (width - new, 0))])

    def _select(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (the others are done), and drop the columns no row uses."""
        if self.slots is not None:
            kept = set(keep)
            for position, row in enumerate(self.rows):
                if position not in kept:
                    self.slots.release(row.slot)
            self.rows = [self.rows[index] for index in keep]
            return
        self.rows = [self.rows[index] for index in keep]
        if not self.rows:
            self.cache, self.mask = None, None
            return
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(keep, device=self.device)
        self.mask = self.mask[index]
        unused = int(self.mask.any(0).int().argmax())  # leading columns no row uses
        self.mask = self.mask[:, unused:]
        for layer in _kv_layers(self.cache):
            if layer.is_initialized:
                keys, values = _states(layer)
                layer.keys = keys[index, :, unused:]
                layer.values = values[index, :, unused:]


def _plain(cache: DynamicCache) -> bool:
    """Every layer holds its own plain ``[batch, heads, length, dim]`` key/value states, which can be
    cut per row, kept, and stacked again as a prefix."""
    return all(
        type(layer) is DynamicLayer and layer.is_initialized and _states(layer)[0].dim() == 4
        for layer in _kv_layers(cache)
    )


def _row_states(cache: DynamicCache, mask: torch.Tensor, index: int) -> KV:
    """Row ``index``'s key and value states per layer, without its padding columns."""
    columns = mask[index].nonzero().squeeze(1)
    return [
        (keys[index].index_select(1, columns), values[index].index_select(1, columns))
        for keys, values in map(_states, _kv_layers(cache))
    ]


def _kv_layers(cache: DynamicCache) -> list[CacheLayerMixin]:
    """The cache's layers. transformers' annotation admits linear-attention layers too, which hold no
    key/value states; the caches built here, by decoder-only attention models, have none of them."""
    return cast("list[CacheLayerMixin]", cache.layers)


def _states(layer: CacheLayerMixin) -> tuple[torch.Tensor, torch.Tensor]:
    """An initialized layer's key and value states."""
    assert layer.keys is not None and layer.values is not None, "the layer holds no states yet"
    return layer.keys, layer.values


def _left_pad(states: torch.Tensor, columns: int) -> torch.Tensor:
    """Key or value states (``[..., length, dim]``) with ``columns`` zero positions in front."""
    return F.pad(states, (0, 0, columns, 0)) if columns else states


def weights_version(model: torch.nn.Module) -> int:
    """Changes whenever a parameter is modified in place (an optimizer step, a loaded state dict)."""
    return sum(parameter._version for parameter in model.parameters())


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    if seed is None:  # unseeded: a fresh seed from torch's global RNG (torch.manual_seed still repeats runs)
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device).manual_seed(seed)
