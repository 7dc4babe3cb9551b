"""The start-up memory stress test: one forward and backward at the longest trajectory the run
allows, before the first iteration, so an out-of-memory error shows in the first minutes (with the
knobs to turn) rather than hours later when a long episode first happens."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from ..objective import loop_policy_loss
from .adapter_casts import adapter_input_casts_off
from .batching import TrainingSample, collate
from .distribution import DistributionStrategy
from .logprobs import token_logprobs

logger = logging.getLogger(__name__)


class MemoryStressTestFailed(RuntimeError):
    """The longest allowed trajectory does not fit in memory for training."""


def stress_samples(num_tokens: int, vocab_size: int, count: int) -> list[TrainingSample]:
    """``count`` trajectories of ``num_tokens`` tokens, every token but the first trained on: the
    largest micro-batch the update can ever see."""
    ids = [1 + (i * 7919) % (vocab_size - 1) for i in range(num_tokens)]
    sample = TrainingSample(ids, [0] + [1] * (num_tokens - 1), [0.0] * num_tokens, 1.0, False)
    return [sample] * count


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error).lower()
    return type(error).__name__ == "OutOfMemoryError" or "out of memory" in text or "can't allocate memory" in text


def advice(num_tokens: int, batch_size: int, device: str, error: BaseException) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"memory stress test: a forward+backward of {batch_size} trajectory(ies) of {num_tokens} tokens ran out "
        f"of memory on {device} ({first[:200]}). Lower max_training_tokens (longer trajectories are then trained "
        "on their prefix), set per_device_train_batch_size: 1, keep activation_checkpointing: true, train a LoRA "
        "adapter (use_peft: true), shard with ZeRO-3 over more GPUs, or lower vllm_gpu_memory_utilization; "
        "`loop-train --dry-run` shows the memory plan. (memory_stress_test: false skips this check.)"
    )


def run_memory_stress_test(
    strategy: DistributionStrategy,
    autocast: Callable[[], contextlib.AbstractContextManager],
    *,
    num_tokens: int,
    micro_batch_size: int,
    vocab_size: int,
    pad_token_id: int,
    epsilon: float,
    divisor: float,
    activation_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> float:
    """Forward and backward the largest micro-batch the run allows (no optimizer step; the
    gradients are discarded). Raises :class:`MemoryStressTestFailed` with the knobs to turn if it
    does not fit; returns the seconds it took."""
    samples = stress_samples(num_tokens, vocab_size, micro_batch_size)
    started = time.perf_counter()
    strategy.model.train()
    with adapter_input_casts_off(strategy.model, autocast):  # as in the update, so the same peak
        try:
            batch = collate(samples, pad_token_id).to(strategy.device)
            # Not the last micro-batch of a step: under DeepSpeed a boundary would reduce (and
            # accelerate's backward would even step) on this synthetic sample.
            with strategy.accumulating(last=strategy.deepspeed_engine is None):
                with autocast(), activation_context():  # as the update's forward, so the same peak
                    logprobs = token_logprobs(strategy.model, batch)
                out = loop_policy_loss(
                    logprobs, logprobs.detach(), batch.advantages, batch.loss_mask, epsilon=epsilon, divisor=divisor
                )
                strategy.backward(out.loss)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            raise MemoryStressTestFailed(advice(num_tokens, len(samples), str(strategy.device), error)) from None
        finally:
            strategy.discard_gradients()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    seconds = time.perf_counter() - started
    logger.info(
        "memory stress test passed: forward+backward of %d x %d tokens in %.1fs", len(samples), num_tokens, seconds
    )
    return seconds
