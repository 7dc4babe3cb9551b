"""bf16 correctness (two LOOP iterations) and generation throughput, on one model.

**bf16.** A Qwen2.5-0.5B-shaped model (random init, bf16, SDPA) with LoRA on every linear layer
runs two ``LOOPTrainer.run_iteration`` calls on ``vault`` episodes with the transformers backend and
activation checkpointing. A random policy never solves a vault task, so every reward would be 0 and
every advantage 0; :class:`ShapedVault` adds a small deterministic score from the reply's text so the
groups have a spread and the update really moves the adapter. Reported per iteration: the
sampler-vs-trainer log-prob gap (mean |Δ| and max |Δ| over sampled tokens, in bf16), loss, KL, clip
fraction, gradient norm, non-finite steps, and how far the adapter moved.

**Generation.** The same model samples multi-turn vault episodes through ``RolloutEngine`` +
``TransformersBackend`` at each concurrency (all episodes at once, ``max_batch_size`` = the
concurrency); sampled tokens/s = sampled tokens / wall seconds of the collection, after a warm-up.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from benchmarks.gpu_battery.common import (
    build_model,
    device_for,
    loop_config,
    lora_config,
    qwen_tokenizer,
    scratch,
    sizes_for,
)

GAP_METRICS = (
    "sampler_logprob_diff",
    "sampler_logprob_diff_max",
    "loss",
    "kl",
    "clip_frac",
    "ratio_min",
    "ratio_max",
    "grad_norm",
    "skipped_nonfinite_steps",
    "num_kept",
    "reward_mean",
    "reward_std",
    "sampled_tokens",
    "rollout_seconds",
    "update_seconds",
    "seconds",
)


def _shaped_vault(num_tasks: int) -> Any:
    from loop_trainer.envs import VaultEnv
    from loop_trainer.envs.base import Episode, Score, as_score
    from loop_trainer.envs.vault import VaultEpisode

    class ShapedEpisode(Episode):
        def __init__(self, inner: VaultEpisode):
            self.inner = inner
            self.replies: list[str] = []

        def start(self):
            return self.inner.start()

        def step(self, reply: str):
            self.replies.append(reply)
            return self.inner.step(reply)

        def score(self) -> Score:
            score = as_score(self.inner.score())
            digest = hashlib.sha256("".join(self.replies).encode()).digest()[0]
            return Score(
                reward=min(1.0, score.reward + 0.25 * (digest % 4) / 3), success=score.success, info=score.info
            )

        def close(self):
            return self.inner.close()

    class ShapedVault(VaultEnv):
        """vault, plus up to 0.25 from a hash of the replies: a spread of rewards for a random policy."""

        def episode(self, task):
            return ShapedEpisode(super().episode(task))

    return ShapedVault(num_tasks=num_tasks)


def _adapter_state(model: Any) -> dict[str, Any]:
    return {name: p.detach().float().clone() for name, p in model.named_parameters() if p.requires_grad}


def run_bf16(trainer: Any, iterations: int = 2) -> dict[str, Any]:
    import torch

    from loop_trainer.training.activation_checkpointing import is_checkpointing

    before = _adapter_state(trainer.model)
    records = []
    for _ in range(iterations):
        record = trainer.run_iteration()
        records.append({key: record.get(key) for key in GAP_METRICS if key in record})
        print(f"bf16 iteration: {records[-1]}", flush=True)
    after = _adapter_state(trainer.model)
    moved = max((after[name] - before[name]).abs().max().item() for name in before)
    finite = all(torch.isfinite(value).all().item() for value in after.values())
    dtypes = sorted({str(p.dtype) for p in trainer.model.parameters()})
    return {
        "iterations": records,
        "adapter_max_abs_change": moved,
        "adapter_finite": finite,
        "parameter_dtypes": dtypes,
        "attention": trainer.model.config._attn_implementation,
        "activation_checkpointing": is_checkpointing(trainer.model),
    }


def run_generation(trainer: Any, concurrency: list[int], turns: int, new_tokens: int) -> list[dict[str, Any]]:
    from loop_trainer.chat import stop_token_ids
    from loop_trainer.rollout import (
        EpisodeLimits,
        RolloutEngine,
        TransformersSamplingSettings,
        build_transformers_backend,
    )

    tokenizer = trainer.tokenizer
    rows = []
    tasks = list(trainer.env.tasks("train"))
    for n in concurrency:
        # the dynamic decode loop this section has always measured (decode.py measures the other parts)
        settings = TransformersSamplingSettings(
            max_batch_size=n, static_decode=False, compile_decode_step=False, merge_adapter=False
        )
        backend = build_transformers_backend(
            trainer.model,
            settings,
            stop_token_ids=stop_token_ids(trainer.model, tokenizer),
            pad_token_id=tokenizer.pad_token_id,
        )
        limits = EpisodeLimits(max_turns=turns, max_new_tokens_per_turn=new_tokens, max_trajectory_tokens=8192)
        with RolloutEngine(
            trainer.env, backend, trainer.formatter, limits, max_concurrent_episodes=n, show_progress=False
        ) as engine:
            chosen = [tasks[i % len(tasks)] for i in range(n)]
            backend.sample([[tokenizer.pad_token_id] * 8] * n, [2] * n)  # warm-up: kernels for this batch size
            started = time.perf_counter()
            batch = engine.collect(chosen, 1, seed=0)
            seconds = time.perf_counter() - started
        stats = batch.stats()
        first_prompts = [t.token_ids[: t.loss_mask.index(1)] for t in batch.trajectories if 1 in t.loss_mask]
        rows.append(
            {
                "concurrency": n,
                "episodes": len(batch.trajectories),
                "seconds": seconds,
                "sampled_tokens": stats["sampled_tokens"],
                "turns_mean": stats["turns_mean"],
                "sampled_tokens_per_s": stats["sampled_tokens"] / seconds,
                "mean_batch": backend.num_sequences / max(1, backend.num_batches),
                "hf_generate_tokens_per_s": hf_generate_rate(trainer.model, tokenizer, first_prompts, new_tokens),
            }
        )
        with trainer.model.disable_adapter():  # the same without PEFT's LoRA wrappers: what they cost per step
            rows[-1]["hf_generate_no_adapter_tokens_per_s"] = hf_generate_rate(
                trainer.model, tokenizer, first_prompts, new_tokens
            )
        print(f"generation: {rows[-1]}", flush=True)
    return rows


def hf_generate_rate(model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """A reference for the transformers path: ``model.generate`` (sampling, KV cache, EOS suppressed)
    on the episodes' first prompts as one left-padded batch, exactly ``new_tokens`` tokens each."""
    import torch

    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    kwargs = {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": True,
        "top_k": 0,
        "top_p": 1.0,
        "temperature": 1.0,
        "pad_token_id": pad,
    }
    with torch.no_grad():
        model.generate(
            input_ids=ids[:1], attention_mask=mask[:1], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2}
        )
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return len(prompts) * new_tokens / (time.perf_counter() - started)


def run(mode: str) -> dict[str, Any]:
    from loop_trainer import LOOPTrainer

    sizes = sizes_for(mode)
    device = device_for(mode)
    tokenizer = qwen_tokenizer()
    with scratch() as output_dir:
        args = loop_config(
            output_dir,
            device,
            tasks_per_iteration=sizes.loop_tasks,
            rollouts_per_task=sizes.loop_rollouts,
            minibatch_size=sizes.loop_tasks * sizes.loop_rollouts // 2,
            max_turns=sizes.loop_turns,
            max_new_tokens_per_turn=sizes.loop_new_tokens,
            max_trajectory_tokens=4096,
            advantage_threshold=0.0,
            learning_rate=1e-4,
        )
        env = _shaped_vault(num_tasks=max(64, max(sizes.generation_concurrency)))
        trainer = LOOPTrainer(
            build_model(sizes.loop_shape, device), env, args, processing_class=tokenizer, peft_config=lora_config(8)
        )
        try:
            bf16 = run_bf16(trainer)
            trainer.model.eval()
            generation = run_generation(
                trainer, sizes.generation_concurrency, sizes.generation_turns, sizes.generation_new_tokens
            )
        finally:
            trainer.close()
    return {
        "bf16": {"shape": sizes.loop_shape, **bf16},
        "generation": {
            "shape": sizes.loop_shape,
            "backend": "transformers",
            "turns": sizes.generation_turns,
            "new_tokens_per_turn": sizes.generation_new_tokens,
            "rows": generation,
        },
    }
