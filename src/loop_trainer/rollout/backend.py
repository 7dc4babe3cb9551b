"""Generation backends: token ids in, sampled token ids and their log-probs out.

The rollout engine awaits ``backend.generate(prompt_ids, max_new_tokens)`` once per turn of each
episode. A backend batches requests across episodes as they come (continuous batching): an episode
whose environment step has returned joins the running batch at its next decode step, without
waiting for the others or for the batch to end, so no episode waits for the slowest one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext, suppress
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import PreTrainedModel

from .continuous_batch import DecodeBatch, Request, weights_version
from .merged_adapter import MergedAdapter
from .prefix_cache import PrefixCache, SharedPrefixes
from .records import Completion, settle
from .slot_decode import SlotDecoder

__all__ = ["Completion", "GenerationBackend", "TemperatureView", "TransformersBackend"]


COMPILE_NEEDS_STATIC = (
    "compile_decode_step compiles the fixed-shape decode step of static_decode: set static_decode: true, or remove "
    "compile_decode_step"
)


@runtime_checkable
class GenerationBackend(Protocol):
    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        """Sample one reply. With a ``seed``, the reply must depend only on the prompt, the weights
        and the seed -- not on what else is batched with it -- so runs (and resumed runs) repeat."""
        ...


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

    Sampling is temperature-only (no top-k/top-p, no repetition penalty): LOOP's importance ratio
    assumes the trainer and the sampler define the same distribution, so the model's
    ``generation_config`` defaults must not leak in. The decode loop is our own rather than
    ``model.generate`` so that log-probs are gathered step by step (never ``[steps x vocab]``
    logits per sequence), each request stops at its own limit and leaves the batch at once, and a
    request that arrives while a batch is decoding joins it at the next step: its prompt is
    prefilled and its KV cache merged into the batch's (left-padded), so the batch stays full
    while episodes come back from their environments at different times.

    Every row samples from its own ``torch.Generator`` (seeded with the request's seed, or from
    torch's global RNG without one), so a seeded reply does not depend on what it is batched with.
    On a CPU the rows' draws run on ``torch.get_num_threads()`` threads: drawing one token from a
    151k vocabulary costs as much as the rest of a small model's decode step, and the generator's
    exponential draws use one core.

    ``static_decode=True`` runs the running rows' one-token steps on fixed-shape state, replayed as
    one CUDA graph per step on a GPU (:mod:`.slot_decode`): a small model's eager step is bound by
    kernel launches, not by the GPU; ``compile_decode_step=True`` compiles that step first. Both off
    by default; prefills, sampling and the prefix caches are the same either way.
    ``merged_adapter`` (:mod:`.merged_adapter`): the decode loop runs that view of the policy, with
    its LoRA adapter merged, instead of the policy itself.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        stop_token_ids: Sequence[int],
        pad_token_id: int,
        temperature: float = 1.0,
        max_batch_size: int = 64,
        share_prefixes: bool = True,
        static_decode: bool = False,
        compile_decode_step: bool = False,
        merged_adapter: MergedAdapter | None = None,
    ):
        if temperature < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy, for evaluation only)")
        self.model = model
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long)
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.max_batch_size = max_batch_size
        self.share_prefixes = share_prefixes
        if compile_decode_step and not static_decode:
            raise ValueError(COMPILE_NEEDS_STATIC)
        self.static_decode = static_decode
        self.compile_decode_step = compile_decode_step
        self.merged_adapter = merged_adapter
        self._slot_decoder: SlotDecoder | None = None
        self._slot_pointers: tuple[int, ...] = ()
        self._pending: list[Request] = []
        self._pending_lock = threading.Lock()
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._lock = threading.Lock()  # one decode loop at a time
        self.num_batches = 0
        """Prefills: groups of requests that joined the decode loop together."""
        self.num_sequences = 0
        self.num_steps = 0
        """Decode steps (a step feeds every running row one token, and prefills the rows joining)."""
        self.num_step_rows = 0
        """Rows summed over decode steps: ``num_step_rows / num_steps`` is the mean batch."""
        self.max_running = 0
        self.num_reused_tokens = 0
        """Prompt tokens not prefilled again: their KV cache was kept from the episode's previous turn."""
        self.num_shared_tokens = 0
        """Prompt tokens not prefilled again: a prefix shared with other prompts was prefilled once."""
        self.busy_seconds = 0.0
        """Wall seconds the decode loop ran."""

    def with_temperature(self, temperature: float) -> TransformersBackend:
        """The same model sampling at another temperature (evaluation: 0 is greedy). The weights are
        shared, not copied; the decode loop and its counters are the new backend's own."""
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
        )

    @property
    def sampling_model(self) -> torch.nn.Module:
        """The module the decode loop runs: the policy itself, or its view with the LoRA adapter merged
        (``merged_adapter``; refreshed at the start of every decode loop)."""
        return self.model if self.merged_adapter is None else self.merged_adapter.model

    def slot_decoder(self, device: torch.device) -> SlotDecoder:
        """The fixed-shape decode state (``static_decode``), kept across collections so its CUDA
        graph is captured once: optimizer steps update the weights in place, where the graph reads
        them. Built anew if any parameter was replaced (its storage moved), with every slot free."""
        model = self.sampling_model
        pointers = tuple(parameter.data_ptr() for parameter in model.parameters())
        if self._slot_decoder is None or self._slot_decoder.device != device or pointers != self._slot_pointers:
            self._slot_decoder = SlotDecoder(model, self.max_batch_size, device, cuda_graphs=True)
            self._slot_decoder.compile_step = self.compile_decode_step
            self._slot_pointers = pointers
        self._slot_decoder.free = list(range(self.max_batch_size))
        return self._slot_decoder

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._wakeup = asyncio.Event()
            # Cached prefixes live as long as this event loop (one collection): the weights may change after it.
            version = weights_version(self.model)
            prefixes = PrefixCache(self.max_batch_size, version)
            shared = SharedPrefixes(version) if self.share_prefixes else None
            self._worker = loop.create_task(self._serve(prefixes, shared), name="transformers-backend")
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

    async def _serve(self, prefixes: PrefixCache, shared: SharedPrefixes | None) -> None:
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
                await asyncio.to_thread(self._decode, self._take, prefixes, shared)
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

        self._decode(take, None, SharedPrefixes(weights_version(self.model)) if self.share_prefixes else None)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _decode(
        self,
        take: Callable[[int], list[Request]],
        prefixes: PrefixCache | None = None,
        shared: SharedPrefixes | None = None,
    ) -> None:
        """Decode until no row is running and ``take`` has nothing more; before every step, up to
        ``max_batch_size`` running rows are topped up with ``take``. Finished rows leave their KV
        cache in ``prefixes`` for their episode's next turn; prefixes that joining prompts share
        are prefilled once and kept in ``shared``."""
        with self._lock:
            model = self.model
            if prefixes is not None and prefixes.weights_version != (version := weights_version(model)):
                prefixes.clear(version)  # computed with other weights
            was_training = model.training
            model.eval()
            if self.merged_adapter is not None:
                self.merged_adapter.refresh()  # the policy's weights of now, merged (a no-op if unchanged)
            started = time.perf_counter()
            device = next(model.parameters()).device
            threads = torch.get_num_threads() if device.type == "cpu" else 1
            try:
                with (
                    ThreadPoolExecutor(threads, thread_name_prefix="transformers-sampler")
                    if threads > 1
                    else nullcontext()
                ) as pool:
                    batch = DecodeBatch(self, device, pool, prefixes, shared)
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
                            batch = DecodeBatch(self, device, pool, prefixes, shared)
            finally:
                self.busy_seconds += time.perf_counter() - started
                model.train(was_training)
