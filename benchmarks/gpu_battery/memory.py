"""Memory plan vs measured, and MFU.

**Memory.** For each model shape (random init, bf16, LoRA r=8 on every linear layer, activation
checkpointing, SDPA) a real ``LOOPTrainer`` runs its start-up stress test (one forward and backward
of a trajectory of ``max_training_tokens`` tokens, every token but the first trained on) at each
length. Measured: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the pass, and
the device memory outside PyTorch's allocator (CUDA context, cuBLAS/cuDNN handles) read from
``cudaMemGetInfo`` once. Predicted: ``memory_plan.plan_memory`` with the same settings, world size 1,
training phase. The trainer runs without DeepSpeed here, so the matched plan is ``zero_stage=0``.

**MFU.** A LoRA update (``PolicyUpdate``: old log-probs, one epoch, one optimizer step) of the MFU
shape on trajectories of ``mfu_tokens`` tokens, timed after a warm-up update. FLOPs are counted
explicitly from the shape (:func:`update_flops`), both without the recomputation (model FLOPs) and
with it (hardware FLOPs), and divided by the seconds; then by the GPU's bf16 dense peak and by a
measured 8192^3 bf16 matmul.
"""

from __future__ import annotations

import gc
import time
from typing import Any, TypedDict

from benchmarks.gpu_battery.common import (
    GIB,
    bf16_peak,
    build_model,
    device_for,
    gpu_name,
    loop_config,
    lora_config,
    qwen_tokenizer,
    scratch,
    shape_config,
    sizes_for,
)

LORA_R = 8


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


class MatmulRate(TypedDict):
    n: int
    dtype: str
    seconds: float
    flops_per_s: float


def matmul_flops_per_s(device: str) -> MatmulRate:
    """A square bf16 matmul (8192^3 on CUDA; 1024^3 float32 on CPU): 3 warm-ups, 10 timed."""
    import torch

    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    _sync(device)
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    seconds = (time.perf_counter() - started) / 10
    return {"n": n, "dtype": str(dtype), "seconds": seconds, "flops_per_s": 2 * n**3 / seconds}


def update_flops(shape: Any, lengths: list[int], scored: list[int], *, lora_r: int, epochs: int) -> dict[str, float]:
    """FLOPs of one LoRA policy update over trajectories of ``lengths`` tokens with ``scored`` sampled
    (labelled) tokens each, counted from the shape, not measured:

    * forward, per trajectory of T tokens with S scored: linear 2·T·(P + L) (P: the decoder's linear
      weights, L: the LoRA adapters' r·(in+out) per targeted layer), causal attention
      2·layers·(heads·head_dim)·T² (QKᵀ and AV, half of each masked), LM head 2·S·hidden·vocab (the
      fused head projects only labelled positions on CUDA);
    * backward with a frozen base: input gradients through every linear 2·T·P, the adapters' input and
      weight gradients 4·T·L, attention 2x its forward, the LM head's input gradient 2·S·hidden·vocab;
    * recomputation (activation checkpointing): the decoder layers' forward again, not the head.

    An update = an old-log-prob forward + ``epochs`` x (forward + backward). Model FLOPs leave the
    recomputation out; hardware FLOPs include it."""
    linear = sum(layer.in_features * layer.out_features for layer in shape.linear_layers)
    lora = shape.lora_params(lora_r, "all-linear")
    attention_width = shape.num_attention_heads * shape.head_dim
    model = hardware = 0.0
    for tokens, labelled in zip(lengths, scored, strict=True):
        layers_forward = 2 * tokens * (linear + lora) + 2 * shape.num_hidden_layers * attention_width * tokens**2
        head = 2 * labelled * shape.hidden_size * shape.vocab_size
        forward = layers_forward + head
        backward = (
            2 * tokens * linear + 4 * tokens * lora + 4 * shape.num_hidden_layers * attention_width * tokens**2 + head
        )
        model += forward + epochs * (forward + backward)
        hardware += forward + epochs * (forward + backward + layers_forward)
    return {"model_flops": model, "hardware_flops": hardware}


def _trajectory(tokens: int, vocab: int, seed: int) -> Any:
    """A multi-turn-looking sample: a 10% prompt, then 400-token replies between 800-token observations."""
    import random

    from loop_trainer.training.batching import TrainingSample

    rng = random.Random(seed)
    prompt = tokens // 10
    mask = [0] * prompt
    while len(mask) < tokens:
        mask += [1] * 400 + [0] * 800
    mask = mask[:tokens]
    ids = [rng.randrange(16, vocab) for _ in range(tokens)]
    return TrainingSample(ids, mask, [0.0] * tokens, 0.5 if seed % 2 else -0.5, False)


def _build_trainer(shape_name: str, device: str, max_tokens: int, output_dir: str, tokenizer: Any) -> Any:
    from loop_trainer import LOOPTrainer
    from loop_trainer.envs import VaultEnv

    args = loop_config(
        output_dir, device, max_trajectory_tokens=max_tokens, max_training_tokens=max_tokens, ppo_epochs=1
    )
    return LOOPTrainer(
        build_model(shape_name, device),
        VaultEnv(num_tasks=4),
        args,
        processing_class=tokenizer,
        peft_config=lora_config(LORA_R),
    )


def _plan(shape: Any, tokens: int, gpu_gib: float, zero_stage: int) -> Any:
    from loop_trainer.models.memory_plan import plan_memory

    return plan_memory(
        shape,
        world_size=1,
        gpu_memory_gib=gpu_gib,
        zero_stage=zero_stage,
        lora={"r": LORA_R, "target_modules": "all-linear", "dropout": 0.0},
        bf16=True,
        activation_checkpointing=True,
        max_training_tokens=tokens,
        per_device_train_batch_size=1,
    )


def _outside_allocator(device: str) -> int:
    """Device memory in use that PyTorch's caching allocator does not hold (context, library handles)."""
    import torch

    if device != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def measure_memory(trainer: Any, shape: Any, tokens: int, device: str, gpu_gib: float, leftover: int) -> dict[str, Any]:
    import torch

    trainer.args.max_training_tokens = tokens
    gc.collect()
    row: dict[str, Any] = {"shape": shape.name, "tokens": tokens}
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row["before_gib"] = (torch.cuda.memory_allocated() - leftover) / GIB
    _sync(device)
    started = time.perf_counter()
    trainer.run_memory_stress_test()
    _sync(device)
    row["seconds"] = time.perf_counter() - started
    plan = _plan(shape, tokens, gpu_gib, zero_stage=0)
    row["plan_training_gib"] = plan.training_gib
    row["plan_rows"] = {r.name: round(r.gib, 3) for r in plan.rows if "train" in r.phases}
    row["plan_training_gib_zero3"] = _plan(shape, tokens, gpu_gib, zero_stage=3).training_gib
    if device == "cuda":
        outside = _outside_allocator(device)
        row.update(
            peak_allocated_gib=(torch.cuda.max_memory_allocated() - leftover) / GIB,
            peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
            outside_allocator_gib=outside / GIB,
        )
        row["measured_gib"] = row["peak_reserved_gib"] + row["outside_allocator_gib"]
        row["measured_over_plan"] = row["measured_gib"] / plan.training_gib
        # The plan's fixed 1.5 GiB context row against what the allocator itself peaked at:
        context = next(r.gib for r in plan.rows if r.name.startswith("CUDA context"))
        row["allocated_over_plan_without_context"] = row["peak_allocated_gib"] / (plan.training_gib - context)
    return row


def scored_tokens(samples: list[Any]) -> list[int]:
    """Each sample's labelled tokens, as the update scores them (a loss-masked first token has no prefix to score)."""
    return [sum(s.loss_mask) - (1 if s.loss_mask[0] else 0) for s in samples]


def measure_mfu(trainer: Any, shape: Any, tokens: int, count: int, device: str) -> dict[str, Any]:
    samples = [_trajectory(tokens, shape.vocab_size, seed) for seed in range(count)]
    scored = scored_tokens(samples)
    trainer.args.max_training_tokens = tokens
    trainer.update_policy(samples)  # warm-up: kernels, cuBLAS heuristics, Adam state
    seconds = []
    for _ in range(2):
        _sync(device)
        started = time.perf_counter()
        trainer.update_policy(samples)
        _sync(device)
        seconds.append(time.perf_counter() - started)
    flops = update_flops(shape, [tokens] * count, scored, lora_r=LORA_R, epochs=trainer.args.ppo_epochs)
    best = min(seconds)
    matmul = matmul_flops_per_s(device)
    result: dict[str, Any] = {
        "shape": shape.name,
        "tokens_per_trajectory": tokens,
        "trajectories": count,
        "scored_tokens": scored,
        "ppo_epochs": trainer.args.ppo_epochs,
        "update_seconds": seconds,
        "tokens_per_s": count * tokens / best,
        **flops,
        "model_flops_per_s": flops["model_flops"] / best,
        "hardware_flops_per_s": flops["hardware_flops"] / best,
        "matmul": matmul,
    }
    peak = bf16_peak(gpu_name()) if device == "cuda" else None
    result["bf16_dense_peak"] = peak
    for kind in ("model", "hardware"):
        achieved = result[f"{kind}_flops_per_s"]
        result[f"{kind}_flops_over_matmul"] = achieved / matmul["flops_per_s"]
        result[f"mfu_{kind}"] = achieved / peak if peak else None
    return result


def run(mode: str) -> dict[str, Any]:
    import torch

    from loop_trainer.models.model_shape import ModelShape

    sizes = sizes_for(mode)
    device = device_for(mode)
    tokenizer = qwen_tokenizer()
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB if device == "cuda" else 80.0
    rows, mfu = [], None
    for name in sizes.memory_shapes:
        shape = ModelShape.from_config(shape_config(name), name)
        gc.collect()
        leftover = torch.cuda.memory_allocated() if device == "cuda" else 0
        with scratch() as output_dir:
            trainer = _build_trainer(
                name, device, max(sizes.memory_lengths + [sizes.mfu_tokens]), output_dir, tokenizer
            )
            trainer.prepare_for_iterations()
            for tokens in sizes.memory_lengths:
                rows.append(measure_memory(trainer, shape, tokens, device, gpu_gib, leftover))
                print(f"memory {name} {tokens}: {rows[-1]}", flush=True)
            if name == sizes.mfu_shape:
                mfu = measure_mfu(trainer, shape, sizes.mfu_tokens, sizes.mfu_trajectories, device)
                print(f"mfu: {mfu}", flush=True)
            trainer.close()
            del trainer
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"memory": rows, "mfu": mfu, "gpu_memory_gib": gpu_gib, "lora_r": LORA_R}
