"""Generation backends: token ids in, sampled token ids and their log-probs out.

The rollout engine awaits ``backend.generate(prompt_ids, max_new_tokens)`` once per turn of each
episode. A backend batches whatever requests are waiting (continuous batching across episodes):
an episode whose environment step has returned joins the next batch without waiting for the
others, so no episode waits for the slowest one each turn.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    """Sampled ids, ending with the stop token if one was sampled."""
    logprobs: list[float]
    """Log-prob of each sampled id under the sampling distribution (temperature applied)."""
    stopped: bool
    """True if the reply ended with a stop token, False if it hit ``max_new_tokens``."""


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


@dataclass
class _Request:
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int | None
    future: asyncio.Future[Completion]


class TransformersBackend:
    """Samples with the training model itself (no second copy), batching waiting requests.

    Sampling is temperature-only (no top-k/top-p, no repetition penalty): LOOP's importance ratio
    assumes the trainer and the sampler define the same distribution, so the model's
    ``generation_config`` defaults must not leak in. The decode loop is our own rather than
    ``model.generate`` so that log-probs are gathered step by step (never ``[steps x vocab]``
    logits per sequence) and each request stops at its own limit.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        stop_token_ids: Sequence[int],
        pad_token_id: int,
        temperature: float = 1.0,
        max_batch_size: int = 64,
    ):
        if temperature < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy, for evaluation only)")
        self.model = model
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long)
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.max_batch_size = max_batch_size
        self._pending: list[_Request] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        self.num_batches = 0
        self.num_sequences = 0

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._pending = []
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._serve(), name="transformers-backend")
        request = _Request(list(prompt_ids), max_new_tokens, seed, loop.create_future())
        self._pending.append(request)
        self._wakeup.set()
        return await request.future

    async def _serve(self) -> None:
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            # Let every episode that is ready this instant enqueue before the batch is cut.
            await asyncio.sleep(0)
            while self._pending:
                live = [r for r in self._pending if not r.future.done()]
                batch, self._pending = live[: self.max_batch_size], live[self.max_batch_size :]
                if not batch:
                    continue
                try:
                    results = await asyncio.to_thread(self.sample, [r.prompt_ids for r in batch],
                                                      [r.max_new_tokens for r in batch], [r.seed for r in batch])
                except Exception as error:  # noqa: BLE001 - surfaced to each waiting episode
                    for request in batch:
                        if not request.future.done():
                            request.future.set_exception(error)
                    continue
                for request, result in zip(batch, results, strict=True):
                    if not request.future.done():
                        request.future.set_result(result)

    @torch.no_grad()
    def sample(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
               seeds: Sequence[int | None] | None = None) -> list[Completion]:
        """Sample a batch synchronously (left-padded prompts, KV cache, per-request limits). A row
        with a seed draws from its own generator, so its reply does not depend on its batch."""
        with self._lock:
            return self._sample(prompts, max_new_tokens, seeds or [None] * len(prompts))

    def _sample(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                seeds: Sequence[int | None]) -> list[Completion]:
        model = self.model
        was_training = model.training
        model.eval()
        try:
            device = next(model.parameters()).device
            batch = len(prompts)
            width = max(len(p) for p in prompts)
            input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((batch, width), dtype=torch.long)
            for row, prompt in enumerate(prompts):
                input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
                attention_mask[row, width - len(prompt) :] = 1
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            limits = torch.tensor(list(max_new_tokens), device=device)
            stop_ids = self.stop_token_ids.to(device)
            generators = [None if seed is None else torch.Generator(device).manual_seed(seed) for seed in seeds]

            cache = DynamicCache()
            tokens: list[torch.Tensor] = []
            logprobs: list[torch.Tensor] = []
            finished = torch.zeros(batch, dtype=torch.bool, device=device)
            stopped = torch.zeros(batch, dtype=torch.bool, device=device)
            step_input, step_positions = input_ids, position_ids
            for step in range(int(limits.max())):
                out = model(
                    input_ids=step_input,
                    attention_mask=attention_mask,
                    position_ids=step_positions,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                step_logprobs = torch.log_softmax(out.logits[:, -1, :].float() / (self.temperature or 1.0), dim=-1)
                if self.temperature == 0:  # greedy, for evaluation; log-probs are then at temperature 1
                    token = step_logprobs.argmax(dim=-1)
                elif any(g is not None for g in generators):
                    probs = step_logprobs.exp()
                    token = torch.cat([torch.multinomial(probs[row], 1, generator=g) for row, g in enumerate(generators)])
                else:
                    token = torch.multinomial(step_logprobs.exp(), 1).squeeze(1)
                token = torch.where(finished, self.pad_token_id, token)
                tokens.append(token)
                logprobs.append(step_logprobs.gather(1, token[:, None]).squeeze(1))
                is_stop = torch.isin(token, stop_ids) & ~finished
                stopped |= is_stop
                finished |= is_stop | (step + 1 >= limits)
                if bool(finished.all()):
                    break
                step_input = token[:, None]
                step_positions = step_positions[:, -1:] + 1
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=1)
            sampled = torch.stack(tokens, dim=1).cpu()
            sampled_logprobs = torch.stack(logprobs, dim=1).cpu()
            self.num_batches += 1
            self.num_sequences += batch
            stop_set = set(self.stop_token_ids.tolist())
            results = []
            for row in range(batch):
                length = int(limits[row])
                ids = sampled[row, :length].tolist()
                for position, token in enumerate(ids):
                    if token in stop_set:
                        length = position + 1
                        break
                results.append(
                    Completion(
                        token_ids=ids[:length],
                        logprobs=sampled_logprobs[row, :length].tolist(),
                        stopped=bool(stopped[row]),
                    )
                )
            return results
        finally:
            model.train(was_training)
