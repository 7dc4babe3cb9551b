"""vLLM generation, colocated: the engine lives in the training process.

One driver thread owns the engine. Episodes submit a turn the moment their environment step
returns; the driver adds it to the running engine between two decode steps, so the engine's
continuous batching mixes turns of every episode with no per-turn barrier. Token ids go in, and
the sampled ids and their log-probs come out: nothing is detokenised and retokenised.

Weights reach the engine through :class:`WeightLoadable` (``load_adapter`` for a LoRA hot-swap,
``load_weights`` for a layer-by-layer stream); :mod:`loop_trainer.rollout.weight_sync` drives them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..net import free_local_port
from .backend import TemperatureView
from .records import Completion, settle

logger = logging.getLogger(__name__)


class WeightLoadable(Protocol):
    """What weight sync needs from a generator (colocated engine or server)."""

    def load_adapter(self, adapter_dir: str, version: int) -> None:
        """Serve the PEFT adapter saved in ``adapter_dir`` from now on (replacing the previous one)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace base weights; ``weights`` yields checkpoint-format (name, tensor) pairs lazily."""

    def probe_logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Log-prob of ``token_ids[1:]`` each given the tokens before it, at the sampling temperature."""

    def sleep(self) -> None:
        """Free generation memory for the update (no-op where unsupported)."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep` (``tags``: "weights" first, then "kv_cache")."""


class HoldsVersions(Protocol):
    """A generator holding several policy versions at once (``max_staleness`` above 1): a batch queued under
    policy i-2 is still being sampled when policy i arrives. Loading a version (``load_adapter``/``load_weights``
    of :class:`WeightLoadable`) keeps the ones before it; each batch samples through the view of the version it
    was queued with; the trainer releases the versions no batch in flight needs any more. Full weights arrive as
    ``load_weights(weights, version=version)``, so the generator knows which version they are."""

    def at_version(self, version: int) -> Any:
        """A :class:`~loop_trainer.rollout.GenerationBackend` sampling policy ``version`` (loaded, not
        released), whatever is loaded after it."""

    def release_versions_below(self, version: int) -> None:
        """Forget every version below ``version`` (no batch will sample them again)."""


def holds_versions(backend: object) -> bool:
    """Whether ``backend`` implements :class:`HoldsVersions`."""
    return callable(getattr(backend, "at_version", None)) and callable(getattr(backend, "release_versions_below", None))


@dataclass
class _Submission:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int | None
    temperature: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Completion]


class VLLMBackend:
    """A :class:`~loop_trainer.rollout.GenerationBackend` on a colocated ``vllm.LLM``.

    Sampling is temperature-only: every request carries explicit neutral top-p/top-k/min-p and
    repetition penalty, the engine is built with ``generation_config="vllm"`` so the model's
    generation defaults cannot leak in, and log-probs are vLLM's ``processed_logprobs`` (after
    temperature), the distribution the trainer's importance ratio assumes.

    It owns the driver thread: :meth:`close` (or leaving ``with VLLMBackend(...) as backend:``)
    stops it. The engine (``llm``) is the caller's.
    """

    def __init__(self, llm: Any, *, stop_token_ids: Sequence[int], temperature: float = 1.0, sleep_mode: bool = False):
        if temperature < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy, for evaluation only)")
        self.llm = llm
        self.engine = llm.llm_engine
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.temperature = temperature
        self.sleep_mode = sleep_mode
        self.lora_request: Any | None = None
        self.num_sequences = 0
        self.num_engine_steps = 0
        self.max_running = 0
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[_Submission | None] = queue.SimpleQueue()  # None: stop the driver
        self._engine_lock = threading.Lock()
        self._driver: threading.Thread | None = None
        self._sleeping = False

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        return await self._submit(prompt_ids, max_new_tokens, seed, self.temperature)

    def with_temperature(self, temperature: float) -> TemperatureView:
        """The same engine sampling at another temperature (evaluation: 0 is greedy)."""
        return TemperatureView(self, temperature)

    async def _submit(
        self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None, temperature: float
    ) -> Completion:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        loop = asyncio.get_running_loop()
        submission = _Submission(
            f"loop-{next(self._ids)}", list(prompt_ids), max_new_tokens, seed, temperature, loop, loop.create_future()
        )
        self._inbox.put(submission)
        self._ensure_driver()
        return await submission.future

    def _ensure_driver(self) -> None:
        if self._driver is None or not self._driver.is_alive():
            self._driver = threading.Thread(target=self._drive, name="vllm-engine", daemon=True)
            self._driver.start()

    def _sampling_params(self, submission: _Submission) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=submission.temperature,
            top_p=1.0,
            top_k=0,
            min_p=0.0,
            repetition_penalty=1.0,
            max_tokens=submission.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=True,  # replies end at our stop ids only, exactly as with the transformers backend
            logprobs=0,
            seed=submission.seed,
            detokenize=False,
            skip_special_tokens=False,
        )

    def _drive(self) -> None:
        """The engine loop: admit waiting turns, one engine step, hand finished replies back."""
        from vllm.inputs import TokensPrompt

        running: dict[str, _Submission] = {}
        while True:
            # Block only while the engine is idle; while it runs, take whatever has arrived.
            waiting = [] if running else [self._inbox.get()]
            while True:
                try:
                    waiting.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            submissions = [s for s in waiting if s is not None]
            if len(submissions) < len(waiting):  # a None: close() stops the driver
                self._stop_driving(running, submissions)
                return
            with self._engine_lock:
                try:
                    for submission in submissions:
                        if submission.future.done():  # cancelled before it started
                            continue
                        self.engine.add_request(
                            submission.request_id,
                            TokensPrompt(prompt_token_ids=submission.prompt_ids),
                            self._sampling_params(submission),
                            lora_request=self.lora_request,
                        )
                        running[submission.request_id] = submission
                    cancelled = [rid for rid, s in running.items() if s.future.done()]
                    if cancelled:  # an episode stopped early (or timed out): free its slot now
                        self.engine.abort_request(cancelled)
                        for rid in cancelled:
                            running.pop(rid)
                    if not running:
                        continue
                    self.max_running = max(self.max_running, len(running))
                    outputs = self.engine.step()
                    self.num_engine_steps += 1
                except Exception as error:
                    logger.exception("vLLM engine step failed")
                    for submission in running.values():
                        submission.loop.call_soon_threadsafe(settle, submission.future, error)
                    running.clear()
                    continue
            for output in outputs:
                if not output.finished or output.request_id not in running:
                    continue
                submission = running.pop(output.request_id)
                self.num_sequences += 1
                submission.loop.call_soon_threadsafe(settle, submission.future, self._completion(output))

    def _stop_driving(self, running: dict[str, _Submission], waiting: list[_Submission]) -> None:
        """close() was called: abort what the engine runs and fail every reply still awaited."""
        with self._engine_lock:
            if running:
                self.engine.abort_request(list(running))
        error = RuntimeError("the vLLM backend was closed while this reply was being generated")
        for submission in [*running.values(), *waiting]:
            if not submission.loop.is_closed():
                submission.loop.call_soon_threadsafe(settle, submission.future, error)
        running.clear()

    def close(self) -> None:
        """Stop the driver thread (replies still awaited fail). Idempotent."""
        driver = self._driver
        if driver is not None and driver.is_alive():
            self._inbox.put(None)
            driver.join()
        self._driver = None

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _completion(self, output: Any) -> Completion:
        sample = output.outputs[0]
        token_ids = list(sample.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs or [], token_ids, strict=True)]
        stopped = bool(token_ids) and token_ids[-1] in self.stop_token_ids
        return Completion(token_ids=token_ids, logprobs=logprobs, stopped=stopped)

    # -- weights -------------------------------------------------------------------------------
    def load_adapter(self, adapter_dir: str, version: int) -> None:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"loop-policy-{version}", version + 1, adapter_dir)
        with self._engine_lock:
            previous = self.lora_request
            if not self.engine.add_lora(request):
                raise RuntimeError(f"vLLM refused the LoRA adapter in {adapter_dir}")
            self.lora_request = request
            if previous is not None and previous.lora_int_id != request.lora_int_id:
                self.engine.remove_lora(previous.lora_int_id)
            self.engine.reset_prefix_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # reload_weights consumes the iterator layer by layer (vLLM's layerwise reload), so the
        # caller's stream is never materialised whole. The model's own load_weights is not used:
        # on CPU vLLM repacks weights after loading and a plain load leaves them stale.
        with self._engine_lock:
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True}
            )
            self.engine.reset_prefix_cache()

    def probe_logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=self.temperature or 1.0, prompt_logprobs=0, detokenize=False)
        with self._engine_lock:
            if self.engine.has_unfinished_requests():
                raise RuntimeError("the weight-sync probe runs between iterations, not while episodes are generating")
            rid = f"probe-{next(self._ids)}"
            self.engine.add_request(
                rid, TokensPrompt(prompt_token_ids=list(token_ids)), params, lora_request=self.lora_request
            )
            result = None
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id == rid and output.finished:
                        result = output
        if result is None:
            raise RuntimeError("vLLM returned no output for the weight-sync probe")
        steps = result.prompt_logprobs
        return torch.tensor([steps[i][token].logprob for i, token in enumerate(token_ids) if i > 0])

    def sleep(self) -> None:
        if self.sleep_mode and not self._sleeping:
            with self._engine_lock:
                # A LoRA run keeps its base weights (level 1 offloads them to CPU); full fine-tuning
                # reloads every weight after the update anyway, so they are discarded (level 2).
                self.llm.sleep(level=1 if self.lora_request is not None else 2)
            self._sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.sleep_mode and self._sleeping:
            with self._engine_lock:
                self.llm.wake_up(tags=tags)
            if tags is None or "kv_cache" in tags:
                self._sleeping = False


def vllm_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` takes one of a few sizes: the smallest that fits ``rank``."""
    return next((size for size in (8, 16, 32, 64, 128, 256, 320, 512) if size >= rank), rank)


def sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def build_colocated_llm(
    model_path: str,
    *,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    gpu_memory_utilization: float,
    tensor_parallel_size: int = 1,
    seed: int = 0,
    lora_rank: int | None = None,
    enable_sleep_mode: bool = False,
    enable_prefix_caching: bool = True,
    **engine_kwargs: Any,
) -> Any:
    """A ``vllm.LLM`` inside this process (TRL's colocate mode: ``external_launcher``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # tensors must reach the engine in-process
    for name, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, default)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_local_port())
    from vllm import LLM

    lora = {}
    if lora_rank is not None:
        lora = {"enable_lora": True, "max_lora_rank": vllm_lora_rank(lora_rank), "max_loras": 1}
    on_cpu = not torch.cuda.is_available()
    return LLM(
        model=model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        distributed_executor_backend="external_launcher",
        seed=seed,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        enable_prefix_caching=enable_prefix_caching,
        enable_sleep_mode=enable_sleep_mode,
        enforce_eager=engine_kwargs.pop("enforce_eager", on_cpu),  # CUDA graphs buy nothing on CPU
        skip_tokenizer_init=True,  # token ids in and out: the engine never detokenises
        **lora,
        **engine_kwargs,
    )
