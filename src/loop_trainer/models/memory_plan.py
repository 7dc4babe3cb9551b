"""Per-GPU memory plan for a LOOP run (``loop-train --config RECIPE --dry-run``): arithmetic over
the model's config.json, no GPU and no weights (parameters are counted on a meta-device model).

Assumptions (estimates, not measurements; the start-up stress test measures the real thing):
  * DeepSpeed ZeRO stage 3 (1 and 2 shard less), bf16 mixed precision, AdamW. Full fine-tuning keeps
    18 bytes per parameter: bf16 weight 2 + fp32 master 4 + fp32 gradient 4 + Adam m 4 + Adam v 4.
  * ZeRO-Offload at stage 2 (``offload_optimizer``, accelerate's ``offload_optimizer_device: cpu``): the fp32
    master, gradient and Adam state live in CPU memory (a note gives its size); the GPU keeps the bf16 weights, the
    reduction bucket and the buffers of the gradients on their way there.
  * LoRA: the bf16 base is frozen (2 bytes/param, sharded by ZeRO-3); each adapter weight costs the
    same 18 bytes; lora_dropout 0 unless lora["dropout"] says otherwise (dropout copies each input).
  * No reference model (LOOP's beta is 0), but for ``kl_reference_copy`` (beta > 0 without an adapter: a frozen
    copy of the weights, whole on every GPU; an adapter's reference is its own base model). Flash/SDPA
    attention: no [T x T] scores.
  * Activations follow a Qwen2/Llama-style decoder layer (attention + gated MLP); parameter counts
    are exact for any architecture transformers can build.
  * Calibrated on one H100 (``make gpu-check``, 2026-11-23: Qwen2.5 0.5B-7B shapes, LoRA r=8, 8k-32k
    tokens, SDPA, transformers 5.17): the training-phase rows then came within 15% of the measured
    peak (max reserved + memory outside PyTorch's allocator). See docs/benchmarks.md.
  * The vLLM reservation is ``utilization x GPU memory``: weights / TP, and the KV cache takes the
    rest (vLLM's own activation/CUDA-graph workspace is ignored, so capacity is slightly optimistic).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from .model_shape import ModelShape

GIB = 2**30
CUDA_CONTEXT_GIB = 0.75  # CUDA context + cuBLAS workspaces outside PyTorch's allocator: 0.75 GiB measured on an H100
# NCCL's (and DeepSpeed's) buffers outside the allocator once a process group exists: 1.37 GiB outside it
# with one ZeRO-3 rank against 0.75 without DeepSpeed, on an H200 (benchmarks/results/gpu/h200-2026-11-26/)
NCCL_GIB = 0.62
FRAGMENTATION = 0.05  # the caching allocator reserves ~3-5% more than it hands out at the peak (measured: 3-6%)
# TRL's fused log-prob head (trl/kernels/chunked_logprob.py) projects 4096 tokens x 32768 vocabulary
# columns at a time into one buffer in the compute dtype, and accumulates the hidden states' gradient in fp32.
LOGPROB_TOKEN_TILE, LOGPROB_VOCAB_TILE = 4096, 32768
# In the backward of a recomputed layer its activations and their gradients coexist, but the gradients of
# the first ops are made after the last ops' activations are freed: 1.75 copies peak (measured 1.74).
RECOMPUTED_COPIES = 1.75


@dataclass
class MemoryRow:
    name: str
    gib: float
    explanation: str
    phases: tuple[str, ...]  # "train", "gen" or both: when the memory is held


@dataclass
class MemoryPlan:
    rows: list[MemoryRow]
    training_gib: float
    generation_gib: float
    peak_gib: float
    peak_rule: str
    budget_gib: float
    fits: bool
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    vllm_kv_tokens: int | None = None
    vllm_sequences: int | None = None
    fix: Fix | None = None
    """For a plan that does not fit: the changes that together make it fit, or the nearest miss."""

    def format(self, fix_line: str | None = None) -> str:
        """The table, the verdict and its reasons; ``fix_line`` words the fix (default: in plan_memory's
        parameter names)."""
        width = max(len(r.name) for r in self.rows)
        lines = [f"{'component':<{width}}  {'phase':<10}  {'GiB':>7}  formula", "-" * (width + 80)]
        for r in self.rows:
            lines.append(f"{r.name:<{width}}  {'+'.join(r.phases):<10}  {r.gib:7.2f}  {r.explanation}")
        lines.append("-" * (width + 80))
        for label, value in (
            ("training phase", self.training_gib),
            ("generation phase", self.generation_gib),
            ("peak", self.peak_gib),
            ("budget", self.budget_gib),
        ):
            lines.append(f"{label:<{width}}  {'':<10}  {value:7.2f}")
        lines.append(f"  peak = {self.peak_rule}")
        lines += [f"  note: {n}" for n in self.notes]
        lines.append("FITS" if self.fits else "DOES NOT FIT")
        lines += [f"  - {reason}" for reason in self.reasons]
        if self.fix is not None:
            lines.append(f"  {fix_line or self.fix.describe()}")
        return "\n".join(lines)


@dataclass
class Fix:
    """Settings to change together (``plan_memory``'s parameters -> values) and the plan re-made with them."""

    changes: dict[str, Any]
    plan: MemoryPlan

    def describe(self, changes: str | None = None) -> str:
        """One line: the changes (``changes``, or ``name: value`` each) and the re-made plan's verdict."""
        listed = changes or ", ".join(f"{name}: {_shown(value)}" for name, value in self.changes.items())
        peak, budget = self.plan.peak_gib, self.plan.budget_gib
        if self.plan.fits:
            return (
                f"fits with these changes together: {listed} "
                f"(re-planned: peak {peak:.1f} GiB <= budget {budget:.1f} GiB)"
            )
        return (
            "no combination of the settings the planner can change fits; the nearest, "
            f"{listed}, peaks at {peak:.1f} GiB > budget {budget:.1f} GiB"
        )


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):  # a LoRA adapter
        return f"r {value.get('r')}"
    return f"{value:g}" if isinstance(value, float) else str(value)


# DeepSpeed's reduce_bucket_size default (elements): ZeRO-2 allocates a bucket of it for the gradients' reduction.
ZERO_REDUCE_BUCKET = 500_000_000
# TRL's activation offloader keeps the tensors of the last 5 offloads on the GPU until their copies land.
OFFLOAD_STASH_LAYERS = 5


def _gib(n_bytes: float) -> float:
    return n_bytes / GIB


def plan_memory(
    shape: ModelShape,
    *,
    world_size: int = 1,
    gpu_memory_gib: float = 80.0,
    zero_stage: int = 3,
    offload_optimizer: bool = False,
    lora: dict | None = None,
    bf16: bool = True,
    activation_checkpointing: bool = True,
    checkpoint_every_n_layers: int = 1,
    activation_offloading: bool = False,
    max_training_tokens: int = 32000,
    per_device_train_batch_size: int = 1,
    use_vllm: bool = False,
    vllm_gpu_memory_utilization: float = 0.3,
    vllm_tensor_parallel_size: int = 1,
    vllm_sleep_mode: bool = False,
    generation_batch: int = 64,
    max_trajectory_tokens: int | None = None,
    vllm_server: bool = False,
    logprob_chunk_tokens: int = LOGPROB_TOKEN_TILE,
    headroom_fraction: float = 0.1,
    kl_reference_copy: bool = False,
    suggested_lora: dict | None = None,
    _suggest: bool = True,
) -> MemoryPlan:
    """The memory one GPU needs in the training phase (update) and the generation phase (rollouts).
    With ``vllm_server`` generation runs on a vLLM server's GPUs and only the training phase counts.
    A plan that does not fit carries a :class:`Fix` (:func:`find_fix`): the settings to change together;
    ``suggested_lora`` is the adapter it may propose for full fine-tuning (default: r 16, all linear layers).
    ``offload_optimizer``: DeepSpeed keeps the optimizer state in CPU memory (ZeRO-Offload, ``zero_stage`` >= 1)."""
    if world_size < 1 or zero_stage not in (0, 1, 2, 3) or not 0 < vllm_gpu_memory_utilization <= 1:
        raise ValueError("memory plan: need world_size >= 1, zero_stage in 0..3, 0 < vllm_gpu_memory_utilization <= 1")
    if use_vllm and vllm_server:
        raise ValueError("memory plan: use_vllm (a colocated engine) and vllm_server exclude each other")
    if offload_optimizer and zero_stage != 2:
        raise ValueError(
            "memory plan: offload_optimizer (ZeRO-Offload) is planned for zero_stage 2 only "
            "(recipes/accelerate/zero2-offload.yaml); stages 1 and 3 keep other buffers"
        )
    if (
        isinstance(checkpoint_every_n_layers, bool)
        or not isinstance(checkpoint_every_n_layers, int)
        or (checkpoint_every_n_layers < 1)
    ):
        raise ValueError(
            f"memory plan: checkpoint_every_n_layers must be a whole number >= 1, not {checkpoint_every_n_layers!r}"
        )
    if use_vllm and world_size % vllm_tensor_parallel_size:
        raise ValueError(
            f"memory plan: vllm_tensor_parallel_size {vllm_tensor_parallel_size} must divide world_size {world_size}"
        )
    max_trajectory_tokens = max_trajectory_tokens or max_training_tokens
    args = {k: v for k, v in locals().items() if k not in ("_suggest", "suggested_lora")}  # for the fix's what-ifs
    h, i, layers, kv = shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers, shape.kv_dim
    n, wb = shape.num_params, (2 if bf16 else 4)  # wb: bytes of a weight / activation element
    shard_w = world_size if zero_stage >= 3 else 1  # ZeRO-3 shards weights, >=2 gradients, >=1 optimizer
    shard_g = world_size if zero_stage >= 2 else 1
    shard_o = world_size if zero_stage >= 1 else 1
    rows: list[MemoryRow] = []
    both, train, gen = ("train", "gen"), ("train",), ("gen",)
    process_group = world_size > 1 or zero_stage > 0  # DDP, or a DeepSpeed engine (even on one GPU)
    context = CUDA_CONTEXT_GIB + (NCCL_GIB if process_group else 0)
    rows.append(
        MemoryRow(
            "CUDA context",
            context,
            "CUDA context + library workspaces" + (" + NCCL buffers" if process_group else ""),
            both,
        )
    )

    # --- weights and optimizer state -------------------------------------------------------------
    master = 4 if bf16 else 0
    rows.append(
        MemoryRow(
            "model weights" + (" (frozen)" if lora else ""),
            _gib(n * wb / shard_w),
            f"{n / 1e9:.2f}e9 params x {wb} B / {shard_w}"
            + (" (ZeRO-3 shards)" if zero_stage == 3 else " (replicated)"),
            both,
        )
    )
    if kl_reference_copy and not lora:
        rows.append(MemoryRow("KL reference (frozen copy)", _gib(n * wb), f"{n / 1e9:.2f}e9 params x {wb} B", both))
    trainable = shape.lora_params(lora["r"], lora.get("target_modules", "all-linear")) if lora else n
    # fp32 master, fp32 gradient and Adam's moments: on the GPU, or in CPU memory under ZeRO-Offload
    host_state = trainable * ((master + 8) / shard_o + 4 / shard_g)
    state = trainable * (wb if lora else 0) / shard_w + (0 if offload_optimizer else host_state)
    if offload_optimizer:
        label = (
            f"LoRA r={lora['r']}: {trainable / 1e6:.1f}e6 params x 2 bf16 (master, grad, Adam: CPU)"
            if lora
            else "the bf16 weights above (master, grad, Adam: CPU)"
        )
    else:
        label = (
            f"LoRA r={lora['r']}: {trainable / 1e6:.1f}e6 params x (2 bf16 + 4 master + 4 grad + 8 Adam)"
            if lora
            else f"{n / 1e9:.2f}e9 params x ({master} fp32 master + 4 fp32 grad + 8 Adam m,v)"
        )
    rows.append(MemoryRow("trainable state", _gib(state), f"{label} / {world_size if zero_stage else 1}", both))
    if offload_optimizer:
        # Gradients on their way to the CPU (DeepSpeed 0.19's ZeRO-2): the reduction bucket (reduce_bucket_size, whose
        # default an accelerate yaml leaves), a buffer the size of the largest trainable parameter for accumulating
        # micro-batches, and at the accumulation boundary each gradient's fp64 copy for its norm, a parameter larger
        # than the bucket also cloned: counted for the largest (the embedding or an MLP matrix; an adapter's whole
        # size bounds its largest).
        largest = trainable if lora else max(shape.embedding_params, h * i)
        staged = ZERO_REDUCE_BUCKET * wb + largest * (wb + 8) + (largest * wb if largest > ZERO_REDUCE_BUCKET else 0)
        rows.append(
            MemoryRow(
                "gradients on their way to the CPU",
                _gib(staged),
                f"bucket {ZERO_REDUCE_BUCKET:.0e} x {wb} B + largest trainable parameter {largest / 1e6:.1f}e6 x "
                f"({wb} B + 8 B fp64 norm copy)" + (f" + its clone x {wb} B" if largest > ZERO_REDUCE_BUCKET else ""),
                train,
            )
        )
    if zero_stage == 3:
        # At most ~2 layers are gathered at once (current + prefetched; stage3_prefetch_bucket_size) plus
        # the largest single tensor (embedding / lm_head); full FT also holds those layers' bf16 grads
        # before reduce-scatter.
        gathered = (2 * shape.layer_params + shape.embedding_params) * wb
        grads = 0 if lora else 2 * shape.layer_params * wb
        rows.append(
            MemoryRow(
                "ZeRO-3 gathered params",
                _gib(gathered + grads),
                f"(2 layers x {shape.layer_params / 1e6:.0f}e6 + embed {shape.embedding_params / 1e6:.0f}e6) x {wb} B"
                + ("" if lora else " + 2 layers' bf16 grads"),
                train if use_vllm else both,
            )
        )

    # --- activations (T tokens per micro-batch) --------------------------------------------------
    tokens = max_training_tokens * per_device_train_batch_size
    # Per token, one layer keeps: input-norm out h, q h, roped q h, k kv, roped k kv, v kv, attention out h,
    # o_proj out h, residual h, post-norm out h, gate I, up I, act(gate) I, act*up (down input) I,
    # down out h  =>  8h + 3kv + 4I elements (+ LoRA dropout copies of each targeted input).
    per_token = 8 * h + 3 * kv + 4 * i
    if lora and lora.get("dropout", lora.get("lora_dropout", 0)) > 0:
        shapes = shape.linear_shapes()
        targets = shapes if lora.get("target_modules", "all-linear") == "all-linear" else lora["target_modules"]
        per_token += sum(shapes[t.split(".")[-1]][0] for t in targets)
    if activation_checkpointing:
        # transformers checkpoints the decoder layers whose index is a multiple of every_n_layers; the others
        # keep all their activations, as without checkpointing.
        checkpointed = -(-layers // checkpoint_every_n_layers)
        # Offloaded (TRL's offloader), a layer input stays on the GPU only while the forward's stash of the
        # last OFFLOAD_STASH_LAYERS holds it, or once the backward has brought it back for its layer.
        resident = min(checkpointed, OFFLOAD_STASH_LAYERS + 1) if activation_offloading else checkpointed
        rows.append(
            MemoryRow(
                "checkpointed layer inputs" + (" (offloaded to CPU but the stash)" if activation_offloading else ""),
                _gib(resident * tokens * h * wb),
                f"{resident} layers x T={tokens} x {h} x {wb} B",
                train,
            )
        )
        if checkpointed < layers:
            # Counted on the GPU even when offloading moves some of them: the plan errs high.
            rows.append(
                MemoryRow(
                    "activations of the layers not checkpointed",
                    _gib((layers - checkpointed) * tokens * per_token * wb),
                    f"{layers - checkpointed} layers (every_n_layers {checkpoint_every_n_layers}) x T={tokens} "
                    f"x (8h+3kv+4I={per_token}) x {wb} B",
                    train,
                )
            )
        rows.append(
            MemoryRow(
                "recomputed layer (backward)",
                _gib(tokens * per_token * wb * RECOMPUTED_COPIES),
                f"T x (8h+3kv+4I={per_token}) x {wb} B x {RECOMPUTED_COPIES} (activations + grads)",
                train,
            )
        )
    else:
        rows.append(
            MemoryRow(
                "activations (all layers)",
                _gib(layers * tokens * per_token * wb + tokens * per_token * wb),
                f"({layers}+1 for grads) layers x T={tokens} x (8h+3kv+4I={per_token}) x {wb} B",
                train,
            )
        )
    tile = min(logprob_chunk_tokens, tokens) * min(LOGPROB_VOCAB_TILE, shape.vocab_size)
    # TRL's fused LM head: no [T x V] logits. One projection tile in the compute dtype, the scored tokens'
    # hidden states (a copy, wb) and their fp32 gradient, ~10 fp32 running values per token; full
    # fine-tuning also accumulates the head's weight gradient in fp32.
    head_grad = 0 if lora else shape.vocab_size * h * 4
    rows.append(
        MemoryRow(
            "log-prob working memory",
            _gib(tile * wb + tokens * (h * (4 + wb) + 40) + head_grad),
            f"tile {min(logprob_chunk_tokens, tokens)} x {min(LOGPROB_VOCAB_TILE, shape.vocab_size)} x {wb} B "
            f"+ T x ({h} x {4 + wb} B + 40 B)" + ("" if lora else f" + head grad V x {h} x 4 B"),
            train,
        )
    )

    # --- generation ------------------------------------------------------------------------------
    kv_tokens: int | None = None
    sequences: int | None = None
    vllm_weights_gib: float = 0
    kv_per_token = 0
    if vllm_server:
        pass
    elif use_vllm:
        tp = vllm_tensor_parallel_size
        reserved = vllm_gpu_memory_utilization * gpu_memory_gib
        vllm_weights_gib = _gib(n * 2 / tp)
        kv_per_token = shape.kv_bytes_per_token(tp)
        kv_tokens = max(0, int((reserved - vllm_weights_gib) * GIB // kv_per_token))
        sequences = kv_tokens // max_trajectory_tokens
        rows.append(
            MemoryRow(
                "vLLM reservation",
                reserved,
                f"{vllm_gpu_memory_utilization} x {gpu_memory_gib} GiB = weights {vllm_weights_gib:.1f} "
                f"(bf16 / TP {tp}) + KV {max(0.0, reserved - vllm_weights_gib):.1f}",
                gen,
            )
        )
    else:
        kv_bytes = generation_batch * max_trajectory_tokens * shape.kv_bytes_per_token(1, wb)
        rows.append(
            MemoryRow(
                "generation KV cache",
                _gib(kv_bytes),
                f"{generation_batch} seqs x {max_trajectory_tokens} tokens x {shape.kv_bytes_per_token(1, wb)} B",
                gen,
            )
        )
        # Each turn prefills the whole conversation: hidden stream + residual (2h) and the MLP's
        # gate, up, act (3I) for every prompt token, one layer at a time, no gradients.
        prefill = generation_batch * max_trajectory_tokens * (2 * h + 3 * i) * wb
        rows.append(
            MemoryRow(
                "prefill working memory",
                _gib(prefill),
                f"{generation_batch} x {max_trajectory_tokens} tokens x (2h+3I) x {wb} B",
                gen,
            )
        )

    allocated = sum(r.gib for r in rows if "train" in r.phases and r.name != "CUDA context")
    rows.append(
        MemoryRow(
            "allocator fragmentation",
            allocated * FRAGMENTATION,
            f"{FRAGMENTATION:.0%} of the training phase's allocations",
            train,
        )
    )
    training = sum(r.gib for r in rows if "train" in r.phases)
    generation = sum(r.gib for r in rows if "gen" in r.phases)
    gen_only = sum(r.gib for r in rows if r.phases == gen)
    if use_vllm and not vllm_sleep_mode:
        peak, rule = (
            training + gen_only,
            "training phase + vLLM reservation (colocated, no sleep mode: it stays reserved)",
        )
    else:
        peak = max(training, generation)
        rule = "max(training, generation)" + (" (vLLM sleep mode frees its memory)" if use_vllm else "")
    budget = (1 - headroom_fraction) * gpu_memory_gib
    notes, reasons = [], []
    if offload_optimizer:
        # DeepSpeed also keeps a bf16 copy of the partition in host memory, and the gradients summed over the
        # micro-batches of a step there
        host = host_state + trainable * 2 * wb / shard_o
        notes.append(
            f"optimizer state off the GPU (ZeRO-Offload): {_gib(host):.2f} GiB of CPU memory (or NVMe) per process "
            f"(this process's share of {trainable / 1e6:.1f}e6 params x ({master} master + 4 grad + 8 Adam + "
            f"{wb} bf16 copy + {wb} accumulated grad) B)"
        )
    if use_vllm:
        assert sequences is not None  # computed above for a colocated engine
        notes.append(
            f"vLLM KV cache: {kv_tokens} tokens = {sequences} sequence(s) of {max_trajectory_tokens} tokens "
            f"({kv_per_token} B/token/GPU at TP {vllm_tensor_parallel_size})"
        )
        reserved = vllm_gpu_memory_utilization * gpu_memory_gib
        if vllm_weights_gib >= reserved or sequences < 1:
            what = (
                f"vLLM weights {vllm_weights_gib:.1f} GiB (bf16 / TP {vllm_tensor_parallel_size}) "
                f"exceed its reservation {reserved:.1f} GiB"
                if vllm_weights_gib >= reserved
                else f"vLLM KV cache holds {kv_tokens} tokens, less than one {max_trajectory_tokens}-token sequence"
            )
            # the utilization that holds the weights and one max_trajectory_tokens sequence (a diagnosis: what
            # to change, and to what, is the fix below, which weighs it against the peak)
            need = (
                math.ceil(_gib(vllm_weights_gib * GIB + max_trajectory_tokens * kv_per_token) / gpu_memory_gib * 100)
                / 100
            )
            holds = (
                f"it needs vllm_gpu_memory_utilization >= {need:.2f} for the weights and one sequence"
                if need <= 1
                else f"the weights and one sequence need {need * gpu_memory_gib:.1f} GiB, more than the GPU"
            )
            reasons.append(f"{what}: {holds}")
    if shape.max_position_embeddings and max_trajectory_tokens > shape.max_position_embeddings:
        notes.append(
            f"max_trajectory_tokens {max_trajectory_tokens} > the model's max_position_embeddings "
            f"{shape.max_position_embeddings} (needs RoPE scaling, e.g. YaRN)"
        )
    fits = peak <= budget and not reasons
    if peak > budget:
        reasons.append(
            f"peak {peak:.1f} GiB > budget {budget:.1f} GiB ({1 - headroom_fraction:.0%} of {gpu_memory_gib} GiB)"
        )
    plan = MemoryPlan(rows, training, generation, peak, rule, budget, fits, reasons, notes, kv_tokens, sequences)
    if not fits and _suggest:
        plan.fix = find_fix(args, suggested_lora)
    return plan


# --- the fix: settings that together make a plan fit -------------------------------------------------------
# What each change costs the run, the cheapest fix first: 1 only speed or where memory lives; 2 how much of
# a trajectory trains, or a generation engine in these GPUs; 3 what is trained (an adapter, not the weights),
# or GPUs of their own for generation; 4 more GPUs. Raising the vLLM share of a colocated engine costs nothing: it
# is set, within what fits, as close to the recipe's as possible; below the recipe's it holds fewer sequences
# at once (slower rollouts), which costs a little more than sleep mode's reloads.
SMALLER_VLLM_SHARE_COST = 1.5
MORE_GPUS = (2, 4, 8, 16, 32, 64)
MIN_TRAINING_TOKENS = 1024  # below this, training on a prefix of each trajectory is not a fix
TRAINING_TOKENS_STEP = 256
DEFAULT_SUGGESTED_LORA = {"r": 16, "alpha": 32, "target_modules": "all-linear"}


@dataclass(frozen=True)
class _Lever:
    name: str
    cost: int
    changes: dict[str, Any]  # discrete levers: the values they set; searched ones: {} (found by _solve)
    group: str = ""  # at most one lever of a group (the generation engine)


def _levers(args: dict, lora: dict) -> list[_Lever]:
    colocated, server = args["use_vllm"], args["vllm_server"]
    levers = []
    if colocated and not args["vllm_sleep_mode"]:
        levers.append(_Lever("sleep", 1, {"vllm_sleep_mode": True}))
    every_layer = {"activation_checkpointing": True, "checkpoint_every_n_layers": 1}
    if not args["activation_checkpointing"]:
        levers.append(_Lever("checkpointing", 1, every_layer))
    elif args["checkpoint_every_n_layers"] > 1:
        levers.append(_Lever("checkpointing", 1, {"checkpoint_every_n_layers": 1}))
    if not args["activation_offloading"]:  # offloading moves what checkpointing keeps, so it brings it along
        levers.append(_Lever("offloading", 1, {"activation_offloading": True, **every_layer}))
    if args["per_device_train_batch_size"] > 1:
        levers.append(_Lever("batch", 1, {"per_device_train_batch_size": 1}))
    if not colocated and not server:
        levers.append(_Lever("generation_batch", 1, {}))
        levers.append(_Lever("colocate", 2, {"use_vllm": True, "vllm_tensor_parallel_size": 1}, "engine"))
    levers.append(_Lever("max_training_tokens", 2, {}))
    if not args["lora"]:
        levers.append(_Lever("lora", 3, {"lora": lora}))
    if not server:
        levers.append(_Lever("server", 3, {"use_vllm": False, "vllm_server": True}, "engine"))
    if args["world_size"] < MORE_GPUS[-1]:
        levers.append(_Lever("world_size", 4, {}))
    return levers


def _plan(config: dict) -> MemoryPlan:
    return plan_memory(**config, _suggest=False)


def _with_world(config: dict, world: int) -> dict:
    # More GPUs than one run ZeRO-3 where one GPU ran without DeepSpeed (the dry run's rule, documented setup).
    stage = 3 if config["zero_stage"] == 0 and config["world_size"] == 1 else config["zero_stage"]
    return {**config, "world_size": world, "zero_stage": stage}


def _fit_utilization(config: dict) -> dict | None:
    """A colocated engine's share that fits (the recipe's if it does, else the nearest), or None. A larger share
    holds more of the KV cache (fits it from some share on) and adds to the peak (fits up to some share)."""
    if not config["use_vllm"]:
        return {} if _plan(config).fits else None
    if _plan(config).fits:
        return {}

    def at(hundredths: int) -> MemoryPlan:
        return _plan({**config, "vllm_gpu_memory_utilization": hundredths / 100})

    def holds(hundredths: int) -> bool:
        return (at(hundredths).vllm_sequences or 0) >= 1

    def under_budget(hundredths: int) -> bool:
        plan = at(hundredths)
        return plan.peak_gib <= plan.budget_gib

    if not holds(100):
        return None
    lowest = _first_true(1, 100, holds)
    if not under_budget(lowest):
        return None
    highest = _last_true(lowest, 100, under_budget)
    current = round(config["vllm_gpu_memory_utilization"] * 100)
    chosen = min(max(current, lowest), highest) / 100
    return (
        {"vllm_gpu_memory_utilization": chosen}
        if _plan({**config, "vllm_gpu_memory_utilization": chosen}).fits
        else None
    )


def _first_true(lo: int, hi: int, test: Callable[[int], bool]) -> int:
    """The smallest n in [lo, hi] with test(n), test monotone (False then True) and test(hi) true."""
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if test(mid) else (mid + 1, hi)
    return lo


def _last_true(lo: int, hi: int, test: Callable[[int], bool]) -> int:
    """The largest n in [lo, hi] with test(n), test monotone (True then False) and test(lo) true."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if test(mid) else (lo, mid - 1)
    return lo


def _solve(config: dict, searched: set[str]) -> dict | None:
    """Values of the searched settings that make ``config`` fit, closest to the recipe's: the fewest extra GPUs,
    then the most training tokens, then the largest generation batch, then the vLLM share; None if none does."""
    if "world_size" in searched:
        for world in (w for w in MORE_GPUS if w > config["world_size"]):
            found = _solve(_with_world(config, world), searched - {"world_size"})
            if found is not None:
                return {"world_size": world, **found}
        return None
    name = next((name for name in ("max_training_tokens", "generation_batch") if name in searched), None)
    if name is None:
        return _fit_utilization(config)
    rest = searched - {name}
    floor, step = (MIN_TRAINING_TOKENS, TRAINING_TOKENS_STEP) if name == "max_training_tokens" else (1, 1)
    top = (config[name] - 1) // step  # strictly below the recipe's value, in steps
    if top * step < floor or _solve({**config, name: floor}, rest) is None:
        return None
    best = _last_true(-(-floor // step), top, lambda n: _solve({**config, name: n * step}, rest) is not None)
    value = max(best * step, floor)
    return {name: value, **(_solve({**config, name: value}, rest) or {})}


def find_fix(args: dict, lora: dict | None = None) -> Fix:
    """The cheapest set of changes to ``plan_memory``'s arguments ``args`` that together make the plan fit
    (re-planned with them all applied); if no combination of the planner's levers fits, the one with every
    lever pulled (the lowest peak), whose plan does not fit. ``lora``: the adapter proposed instead of full
    fine-tuning."""
    levers = _levers(args, lora or DEFAULT_SUGGESTED_LORA)
    subsets = [
        chosen
        for size in range(len(levers) + 1)
        for chosen in combinations(levers, size)
        if len({lever.group for lever in chosen if lever.group}) == sum(1 for lever in chosen if lever.group)
    ]
    subsets.sort(key=lambda chosen: (sum(lever.cost for lever in chosen), len(chosen)))
    # Every lever only lowers the peak (the server frees these GPUs of the engine): if all together do not fit,
    # no combination does.
    names = {lever.name for lever in levers}
    dropped = ({"colocate", "sleep", "generation_batch"} if "server" in names else set()) | (
        {"checkpointing"} if "offloading" in names else set()
    )
    everything = tuple(lever for lever in levers if lever.name not in dropped)
    if _try(args, everything) is None:
        return _nearest(args, everything)
    best: tuple[float, int, Fix] | None = None
    for chosen in subsets:
        cost: float = sum(lever.cost for lever in chosen)
        if best is not None and cost > best[0]:
            break
        found = _try(args, chosen)
        if found is None:
            continue
        if found.changes.get("vllm_gpu_memory_utilization", 1.0) < args["vllm_gpu_memory_utilization"]:
            cost += SMALLER_VLLM_SHARE_COST
        if best is None or (cost, len(found.changes)) < best[:2]:
            best = (cost, len(found.changes), found)
    assert best is not None  # everything together fits
    return best[2]


def _applied(args: dict, chosen: tuple[_Lever, ...]) -> tuple[dict, set[str]] | None:
    """``args`` with the discrete levers set, and the names of the searched ones; None if a lever in ``chosen``
    would change nothing (its subset without it comes first)."""
    config = dict(args)
    for lever in chosen:
        config.update(lever.changes)
    names = {lever.name for lever in chosen}
    colocated, transformers = config["use_vllm"], not config["use_vllm"] and not config["vllm_server"]
    if ("sleep" in names and not colocated) or ("generation_batch" in names and not transformers):
        return None
    if {"checkpointing", "offloading"} <= names:
        return None
    return config, names & {"world_size", "max_training_tokens", "generation_batch"}


def _try(args: dict, chosen: tuple[_Lever, ...]) -> Fix | None:
    applied = _applied(args, chosen)
    if applied is None:
        return None
    config, searched = applied
    found = _solve(config, searched)
    if found is None:
        return None
    config = _with_world(config, found.pop("world_size")) if "world_size" in found else config
    config.update(found)
    changes = {key: value for key, value in config.items() if value != args[key] and key != "zero_stage"}
    return Fix(changes, _plan(config))


def _nearest(args: dict, everything: tuple[_Lever, ...]) -> Fix:
    applied = _applied(args, everything)
    assert applied is not None
    config, searched = applied
    if "world_size" in searched:
        config = _with_world(config, MORE_GPUS[-1])
    for name, floor in (("max_training_tokens", MIN_TRAINING_TOKENS), ("generation_batch", 1)):
        if name in searched:
            config[name] = min(floor, config[name])
    changes = {key: value for key, value in config.items() if value != args[key] and key != "zero_stage"}
    return Fix(changes, _plan(config))
