"""Generation backends: token ids in, sampled token ids and their log-probs out.

The rollout engine awaits ``backend.generate(prompt_ids, max_new_tokens)`` once per turn of each
episode. A backend batches requests across episodes as they come (continuous batching): an episode
whose environment step has returned joins the running batch at its next decode step, without
waiting for the others or for the batch to end, so no episode waits for the slowest one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext, suppress
from typing import Any

import torch

from .continuous_batch import DecodeBatch, DecodeSettings, Request
from .kv_layout import KVLayout
from .merged_adapter import MergedAdapter, merge_problem
from .prefix_cache import PrefixCache, PrefixReuse, SharedPrefixes
from .records import Completion, DecodeCounters, GenerationBackend, settle
from .row_storage import PaddedRows, SlotRows
from .sampled_policy import SampledPolicy
from .sampling_parts import COMPILE_NEEDS_STATIC, TransformersSamplingSettings, compile_problem, resolve_sampling_parts
from .slot_decode import SlotDecoder

__all__ = [
    "COMPILE_NEEDS_STATIC",
    "Completion",
    "GenerationBackend",
    "TemperatureView",
    "TransformersBackend",
    "build_transformers_backend",
]

logger = logging.getLogger(__name__)


class TemperatureView:
    """An engine-backed backend sampling at another temperature (evaluation: 0 is greedy). It
    shares the engine, its queue and its weights: nothing is copied. ``backend`` submits requests
    with ``_submit(prompt_ids, max_new_tokens, seed, temperature)`` (the vLLM backends do)."""

    def __init__(self, backend: Any, temperature: float):
        self.backend, self.temperature = backend, temperature

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        return await self.backend._submit(prompt_ids, max_new_tokens, seed, self.temperature)


def _deliver_to(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Completion]) -> Callable[[Any], None]:
    def deliver(result: Completion | BaseException) -> None:
        with suppress(RuntimeError):  # RuntimeError: the loop has closed, nobody waits for this reply
            loop.call_soon_threadsafe(settle, future, result)

    return deliver


class TransformersBackend:
    """Samples with the training model itself (no second copy), batching requests continuously.
    Build one with :func:`build_transformers_backend`, which decides the decode loop's parts (fast by
    default on a GPU); the constructor takes them decided.

    Sampling is temperature-only (no top-k/top-p, no repetition penalty): LOOP's importance ratio
    assumes the trainer and the sampler define the same distribution, so the model's
    ``generation_config`` defaults must not leak in. The decode loop is our own rather than
    ``model.generate`` so that log-probs are gathered step by step (never ``[steps x vocab]``
    logits per sequence), each request stops at its own limit and leaves the batch at once, and a
    request that arrives while a batch is decoding joins it at the next step: its prompt is
    prefilled and its keys and values join the batch's, so the batch stays full while episodes come
    back from their environments at different times.

    Every row samples from its own ``torch.Generator`` (seeded with the request's seed, or from
    torch's global RNG without one), so a seeded reply does not depend on what it is batched with.
    On a CPU the rows' draws run on ``torch.get_num_threads()`` threads: drawing one token from a
    151k vocabulary costs as much as the rest of a small model's decode step, and the generator's
    exponential draws use one core.

    The decode loop (:class:`~.continuous_batch.DecodeBatch`) is made of parts, configured once per
    backend from its settings and from what the model's KV cache allows (:class:`~.kv_layout.KVLayout`,
    probed at the first decode loop; what it turns off is logged once):

    - ``static_decode=True``: the running rows' one-token steps on fixed-shape slots, replayed as one CUDA
      graph per step on a GPU (:mod:`.slot_decode`, :class:`~.row_storage.SlotRows`; a small model's eager
      step is bound by kernel launches, not by the GPU); ``compile_decode_step=True`` compiles that step
      first. Otherwise one padded cache (:class:`~.row_storage.PaddedRows`).
    - the prefix caches (:class:`~.prefix_cache.PrefixReuse`): an episode's previous turn, and openings
      several prompts share (``share_prefixes``), kept for one collection and one weights version.
    - ``merged_adapter`` (:mod:`.merged_adapter`): the decode loop runs that view of the policy, with its
      LoRA adapter merged, instead of the policy itself.

    Prefills, sampling and what is sampled are the same whichever parts run. The weights version
    (:attr:`weights_version`) is bumped by whoever changes the weights: ``RolloutGenerator.sync`` at every
    new iteration, or :meth:`weights_changed`; the caches are keyed by it. What the decode loops did is
    summed in :attr:`counters` (also readable as ``num_batches``, ``num_steps``, ... on the backend).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        stop_token_ids: Sequence[int],
        pad_token_id: int,
        temperature: float = 1.0,
        max_batch_size: int = 64,
        share_prefixes: bool = True,
        static_decode: bool = False,
        compile_decode_step: bool = False,
        merged_adapter: MergedAdapter | None = None,
        compile_falls_back: bool = False,
        policy: SampledPolicy | None = None,
    ):
        """``policy``: the sampled policy of another backend on the same model (:meth:`with_temperature`),
        whose weights version, merged adapter and KV layout this one shares; by default its own.
        ``compile_falls_back``: a failing ``torch.compile`` leaves the step uncompiled instead of failing
        the rows (``compile_decode_step`` on by default rather than asked for)."""
        if temperature < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy, for evaluation only)")
        if compile_decode_step and not static_decode:
            raise ValueError(COMPILE_NEEDS_STATIC)
        if policy is None:
            policy = SampledPolicy(model, merged_adapter)
        elif policy.model is not model or policy.merged_adapter is not merged_adapter:
            raise ValueError("a shared policy must be of the same model and merged adapter")
        self.model = model
        self.policy = policy
        self.settings = TransformersSamplingSettings(
            temperature=temperature,
            max_batch_size=max_batch_size,
            share_prefixes=share_prefixes,
            static_decode=bool(static_decode),
            compile_decode_step=bool(compile_decode_step),
            merge_adapter=merged_adapter is not None,
        )
        self.compile_falls_back = compile_falls_back
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long)
        self.pad_token_id = pad_token_id
        self._decoding = DecodeSettings(temperature, frozenset(self.stop_token_ids.tolist()), pad_token_id)
        self.counters = DecodeCounters()
        self._slot_decoder: SlotDecoder | None = None
        self._slot_pointers: tuple[int, ...] = ()
        self._pending: list[Request] = []
        self._pending_lock = threading.Lock()
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._lock = threading.Lock()  # one decode loop at a time

    # --- settings ---
    @property
    def temperature(self) -> float:
        return self.settings.temperature

    @property
    def max_batch_size(self) -> int:
        return self.settings.max_batch_size

    @property
    def share_prefixes(self) -> bool:
        return self.settings.share_prefixes

    @property
    def static_decode(self) -> bool:
        return bool(self.settings.static_decode)

    @property
    def compile_decode_step(self) -> bool:
        return bool(self.settings.compile_decode_step)

    @property
    def merged_adapter(self) -> MergedAdapter | None:
        return self.policy.merged_adapter

    # --- the weights ---
    @property
    def weights_version(self) -> int:
        """The version of the weights sampled, shared with :meth:`with_temperature`'s backends."""
        return self.policy.version

    def weights_changed(self) -> None:
        """Tell the backend its weights were changed (by code that changes them itself; the generator's
        ``sync`` does it for the trainer): the cached prefixes computed with the old ones are not used
        again, and the merged adapter is merged again at the next decode loop."""
        self.policy.weights_changed()

    # --- the counters (the decode loop adds to :attr:`counters`) ---
    @property
    def num_batches(self) -> int:
        """Prefills: groups of requests that joined the decode loop together."""
        return self.counters.num_batches

    @property
    def num_sequences(self) -> int:
        return self.counters.num_sequences

    @property
    def num_steps(self) -> int:
        """Decode steps (a step feeds every running row one token, and prefills the rows joining)."""
        return self.counters.num_steps

    @property
    def num_step_rows(self) -> int:
        """Rows summed over decode steps: ``num_step_rows / num_steps`` is the mean batch."""
        return self.counters.num_step_rows

    @property
    def max_running(self) -> int:
        return self.counters.max_running

    @property
    def num_reused_tokens(self) -> int:
        """Prompt tokens not prefilled again: their KV cache was kept from the episode's previous turn."""
        return self.counters.num_reused_tokens

    @property
    def num_shared_tokens(self) -> int:
        """Prompt tokens not prefilled again: a prefix shared with other prompts was prefilled once."""
        return self.counters.num_shared_tokens

    @property
    def busy_seconds(self) -> float:
        """Wall seconds the decode loop ran."""
        return self.counters.busy_seconds

    def with_temperature(self, temperature: float) -> TransformersBackend:
        """The same model sampling at another temperature (evaluation: 0 is greedy), with the same
        parts. The weights, their version and the merged adapter are shared, not copied; the decode
        loop and its counters are the new backend's own."""
        return TransformersBackend(
            self.model,
            stop_token_ids=self.stop_token_ids.tolist(),
            pad_token_id=self.pad_token_id,
            temperature=temperature,
            max_batch_size=self.max_batch_size,
            share_prefixes=self.share_prefixes,
            static_decode=self.static_decode,
            compile_decode_step=self.compile_decode_step,
            merged_adapter=self.merged_adapter,
            compile_falls_back=self.compile_falls_back,
            policy=self.policy,
        )

    @property
    def sampling_model(self) -> torch.nn.Module:
        """The module the decode loop runs: the policy itself, or its view with the LoRA adapter merged
        (``merged_adapter``; refreshed at the start of every decode loop)."""
        return self.policy.module

    def slot_decoder(self, device: torch.device) -> SlotDecoder:
        """The fixed-shape decode state (``static_decode``), kept across collections so its CUDA
        graph is captured once: optimizer steps update the weights in place, where the graph reads
        them. Built anew if any parameter was replaced (its storage moved), with every slot free."""
        model = self.sampling_model
        pointers = tuple(parameter.data_ptr() for parameter in model.parameters())
        if self._slot_decoder is None or self._slot_decoder.device != device or pointers != self._slot_pointers:
            self._slot_decoder = SlotDecoder(model, self.max_batch_size, device, cuda_graphs=True)
            self._slot_decoder.compile_step = self.compile_decode_step
            self._slot_decoder.compile_falls_back = self.compile_falls_back
            self._slot_pointers = pointers
        self._slot_decoder.free = list(range(self.max_batch_size))
        return self._slot_decoder

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._wakeup = asyncio.Event()
            # Cached prefixes live as long as this event loop (one collection), each for one weights version.
            turns = PrefixCache(self.max_batch_size, self.weights_version)
            shared = SharedPrefixes(self.weights_version) if self.share_prefixes else None
            self._worker = loop.create_task(self._serve(turns, shared), name="transformers-backend")
        future: asyncio.Future[Completion] = loop.create_future()
        with self._pending_lock:
            self._pending.append(
                Request(
                    list(prompt_ids),
                    max_new_tokens,
                    seed,
                    _deliver_to(loop, future),
                    lambda: future.done() or loop.is_closed(),
                )
            )
        assert self._wakeup is not None
        self._wakeup.set()
        return await future

    def _take(self, most: int) -> list[Request]:
        """Up to ``most`` waiting requests, oldest first (the decode thread calls this every step)."""
        with self._pending_lock:
            live = [r for r in self._pending if not r.abandoned()]
            taken, self._pending = live[:most], live[most:]
        return taken

    async def _serve(self, turns: PrefixCache, shared: SharedPrefixes | None) -> None:
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            # Let every episode that is ready this instant enqueue before the first prefill.
            await asyncio.sleep(0)
            with self._pending_lock:
                waiting = bool(self._pending)
            if not waiting:
                continue
            try:
                await asyncio.to_thread(self._decode, self._take, turns, shared)
            except Exception as error:  # noqa: BLE001 - not one step's failure (those reach their rows)
                for request in self._take(len(self._pending)):
                    request.deliver(error)

    def sample(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], seeds: Sequence[int | None] | None = None
    ) -> list[Completion]:
        """Sample a batch synchronously (left-padded prompts, KV cache, per-request limits). A row
        with a seed draws from its own generator, so its reply does not depend on its batch."""
        if any(limit < 1 for limit in max_new_tokens):
            raise ValueError("max_new_tokens must be >= 1")
        results: list[Completion | BaseException | None] = [None] * len(prompts)

        def deliver_to(index: int) -> Callable[[Completion | BaseException], None]:
            return lambda result: results.__setitem__(index, result)

        queue = [
            Request(list(prompt), limit, seed, deliver_to(index))
            for index, (prompt, limit, seed) in enumerate(
                zip(prompts, max_new_tokens, seeds or [None] * len(prompts), strict=True)
            )
        ]

        def take(most: int) -> list[Request]:
            taken, queue[:] = queue[:most], queue[most:]
            return taken

        self._decode(take, None, SharedPrefixes(self.weights_version) if self.share_prefixes else None)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _decode(
        self,
        take: Callable[[int], list[Request]],
        turns: PrefixCache | None = None,
        shared: SharedPrefixes | None = None,
    ) -> None:
        """Decode until no row is running and ``take`` has nothing more; before every step, up to
        ``max_batch_size`` running rows are topped up with ``take``. Finished rows leave their KV
        cache in ``turns`` for their episode's next turn; prefixes that joining prompts share
        are prefilled once and kept in ``shared``."""
        with self._lock:
            model = self.model
            was_training = model.training
            model.eval()
            started = time.perf_counter()
            try:
                module = self.policy.refreshed_module()  # the merged adapter: the weights of now (a no-op if unchanged)
                device = next(model.parameters()).device
                layout = self.policy.kv_layout(
                    device, self.pad_token_id, static_decode=self.static_decode, share_prefixes=self.share_prefixes
                )
                prefixes = PrefixReuse(turns, shared) if layout.rows_can_be_cut else PrefixReuse()
                threads = torch.get_num_threads() if device.type == "cpu" else 1
                with (
                    ThreadPoolExecutor(threads, thread_name_prefix="transformers-sampler")
                    if threads > 1
                    else nullcontext()
                ) as pool:
                    batch = self._batch(module, device, layout, prefixes, pool)
                    while True:
                        joining = take(self.max_batch_size - len(batch.rows)) if batch.can_join() else []
                        if not batch.rows and not joining:
                            return
                        try:
                            batch.step(joining)
                        except Exception as error:  # noqa: BLE001 - surfaced to each waiting episode
                            for request in {
                                id(r): r for r in [*(row.request for row in batch.rows), *joining]
                            }.values():
                                request.deliver(error)
                            batch = self._batch(module, device, layout, prefixes, pool)
            finally:
                self.counters.busy_seconds += time.perf_counter() - started
                model.train(was_training)

    def _batch(
        self,
        module: torch.nn.Module,
        device: torch.device,
        layout: KVLayout,
        prefixes: PrefixReuse,
        pool: ThreadPoolExecutor | None,
    ) -> DecodeBatch:
        """An empty decode batch, its parts configured from this backend's settings and the layout."""
        static = self.static_decode and layout.rows_can_be_cut
        return DecodeBatch(
            module,
            device,
            self._decoding,
            storage=SlotRows(self.slot_decoder(device)) if static else PaddedRows(module, device),
            prefixes=prefixes,
            rows_can_leave=layout.rows_can_leave,
            counters=self.counters,
            weights_version=lambda: self.policy.version,
            pool=pool,
        )


def build_transformers_backend(
    model: torch.nn.Module,
    settings: TransformersSamplingSettings | None = None,
    *,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    zero3: bool = False,
    device: torch.device | None = None,
) -> TransformersBackend:
    """The transformers backend sampling ``model`` with ``settings`` (default: every part auto), its
    parts resolved by :func:`~.sampling_parts.resolve_sampling_parts`: on a CUDA ``device`` (default: the
    model's) static slots with CUDA graphs, a compiled decode step and the merged LoRA adapter, each
    unless its setting is False or it cannot apply (one log line each); on a CPU none of them unless
    set True. ``zero3``: the weights are ZeRO-3 partitioned. Raises
    :class:`~.sampling_parts.SamplingPartsError` for a part set True that cannot apply."""
    settings = settings or TransformersSamplingSettings()
    if device is None:
        device = next(model.parameters()).device
    cuda = device.type == "cuda"
    wants_merge = settings.merge_adapter is True or (settings.merge_adapter is None and cuda)
    resolved = resolve_sampling_parts(
        settings,
        device_is_cuda=cuda,
        merge_problem=merge_problem(model) if wants_merge and not zero3 else None,
        zero3=zero3,
        compile_problem=compile_problem(cuda),
    )
    for note in resolved.notes:  # a part left unset that does not apply here: the default, not a problem
        logger.info(note)
    parts = resolved.settings
    return TransformersBackend(
        model,
        stop_token_ids=stop_token_ids,
        pad_token_id=pad_token_id,
        temperature=parts.temperature,
        max_batch_size=parts.max_batch_size,
        share_prefixes=parts.share_prefixes,
        static_decode=bool(parts.static_decode),
        compile_decode_step=bool(parts.compile_decode_step),
        merged_adapter=MergedAdapter(model) if parts.merge_adapter else None,
        compile_falls_back=resolved.compile_falls_back,
    )
