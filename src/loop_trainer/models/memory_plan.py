"""Per-GPU memory plan for a LOOP run (``loop-train --config RECIPE --dry-run``): arithmetic over
the model's config.json, no GPU and no weights (parameters are counted on a meta-device model).

Assumptions (estimates, not measurements; the start-up stress test measures the real thing):
  * DeepSpeed ZeRO stage 3 (1 and 2 shard less), bf16 mixed precision, AdamW. Full fine-tuning keeps
    18 bytes per parameter: bf16 weight 2 + fp32 master 4 + fp32 gradient 4 + Adam m 4 + Adam v 4.
  * LoRA: the bf16 base is frozen (2 bytes/param, sharded by ZeRO-3); each adapter weight costs the
    same 18 bytes; lora_dropout 0 unless lora["dropout"] says otherwise (dropout copies each input).
  * No reference model (LOOP's beta is 0). Flash/SDPA attention: no [T x T] scores.
  * Activations follow a Qwen2/Llama-style decoder layer (attention + gated MLP); parameter counts
    are exact for any architecture transformers can build.
  * Calibrated on one H100 (``make gpu-check``, 2026-11-23: Qwen2.5 0.5B-7B shapes, LoRA r=8, 8k-32k
    tokens, SDPA, transformers 5.17): the training-phase rows then came within 15% of the measured
    peak (max reserved + memory outside PyTorch's allocator). See docs/benchmarks.md.
  * The vLLM reservation is ``utilization x GPU memory``: weights / TP, and the KV cache takes the
    rest (vLLM's own activation/CUDA-graph workspace is ignored, so capacity is slightly optimistic).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def format(self) -> str:
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
        return "\n".join(lines)


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
    lora: dict | None = None,
    bf16: bool = True,
    activation_checkpointing: bool = True,
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
    _suggest: bool = True,
) -> MemoryPlan:
    """The memory one GPU needs in the training phase (update) and the generation phase (rollouts).
    With ``vllm_server`` generation runs on a vLLM server's GPUs and only the training phase counts."""
    if world_size < 1 or zero_stage not in (0, 1, 2, 3) or not 0 < vllm_gpu_memory_utilization <= 1:
        raise ValueError("memory plan: need world_size >= 1, zero_stage in 0..3, 0 < vllm_gpu_memory_utilization <= 1")
    if use_vllm and vllm_server:
        raise ValueError("memory plan: use_vllm (a colocated engine) and vllm_server exclude each other")
    if use_vllm and world_size % vllm_tensor_parallel_size:
        raise ValueError(
            f"memory plan: vllm_tensor_parallel_size {vllm_tensor_parallel_size} must divide world_size {world_size}"
        )
    max_trajectory_tokens = max_trajectory_tokens or max_training_tokens
    args = {k: v for k, v in locals().items() if k != "_suggest"}  # for the what-if suggestions
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
    trainable = shape.lora_params(lora["r"], lora.get("target_modules", "all-linear")) if lora else n
    state = trainable * ((wb if lora else 0) / shard_w + (master + 8) / shard_o + 4 / shard_g)
    label = (
        f"LoRA r={lora['r']}: {trainable / 1e6:.1f}e6 params x (2 bf16 + 4 master + 4 grad + 8 Adam)"
        if lora
        else f"{n / 1e9:.2f}e9 params x ({master} fp32 master + 4 fp32 grad + 8 Adam m,v)"
    )
    rows.append(MemoryRow("trainable state", _gib(state), f"{label} / {world_size if zero_stage else 1}", both))
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
        # Offloaded (TRL's offloader), a layer input stays on the GPU only while the forward's stash of the
        # last OFFLOAD_STASH_LAYERS holds it, or once the backward has brought it back for its layer.
        resident = min(layers, OFFLOAD_STASH_LAYERS + 1) if activation_offloading else layers
        rows.append(
            MemoryRow(
                "checkpointed layer inputs" + (" (offloaded to CPU but the stash)" if activation_offloading else ""),
                _gib(resident * tokens * h * wb),
                f"{resident} layers x T={tokens} x {h} x {wb} B",
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
    if use_vllm:
        assert sequences is not None  # computed above for a colocated engine
        notes.append(
            f"vLLM KV cache: {kv_tokens} tokens = {sequences} sequence(s) of {max_trajectory_tokens} tokens "
            f"({kv_per_token} B/token/GPU at TP {vllm_tensor_parallel_size})"
        )
        reserved = vllm_gpu_memory_utilization * gpu_memory_gib
        # utilization that holds the weights and one max_trajectory_tokens sequence, per TP size
        need = {
            tp: (_gib(n * 2 / tp + max_trajectory_tokens * shape.kv_bytes_per_token(tp))) / gpu_memory_gib
            for tp in (1, 2, 4, 8, 16)
            if tp <= world_size and world_size % tp == 0
        }
        # Colocated engines run at TP 1 (each process samples its own episodes); a model whose
        # weights need more than one GPU generates on a vLLM server of its own.
        options = ", ".join(f"TP {tp}: >= {u:.2f}" for tp, u in need.items() if u <= 1 and tp == 1)
        if vllm_weights_gib >= reserved or sequences < 1:
            what = (
                f"vLLM weights {vllm_weights_gib:.1f} GiB (bf16 / TP {vllm_tensor_parallel_size}) "
                f"exceed its reservation {reserved:.1f} GiB"
                if vllm_weights_gib >= reserved
                else f"vLLM KV cache holds {kv_tokens} tokens, less than one {max_trajectory_tokens}-token sequence"
            )
            reasons.append(
                f"{what}: raise vllm_gpu_memory_utilization ({options or 'no utilization fits at TP 1'}), "
                "lower max_trajectory_tokens, or generate on a vLLM server of its own (vllm_mode: server)"
            )
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
        reasons += _knobs(args, training, generation, rows, _suggest)
    return MemoryPlan(rows, training, generation, peak, rule, budget, fits, reasons, notes, kv_tokens, sequences)


def _fits(args: dict, **changes) -> bool:
    return plan_memory(**{**args, **changes, "_suggest": False}).fits


def _knobs(args: dict, training: float, generation: float, rows: list[MemoryRow], suggest: bool) -> list[str]:
    """Which settings to turn, largest lever first, with the value that would fit where one exists."""
    knobs = []
    activations = sum(r.gib for r in rows if r.phases == ("train",) and "ZeRO" not in r.name)
    states = sum(r.gib for r in rows if r.name.startswith(("model weights", "trainable state")))
    if args["use_vllm"] and not args["vllm_sleep_mode"]:
        knobs.append(
            "vLLM stays reserved during the update: lower vllm_gpu_memory_utilization or set vllm_sleep_mode: true"
        )
    elif args["use_vllm"] and generation > training:
        knobs.append("the vLLM reservation dominates: lower vllm_gpu_memory_utilization")
    if not args["use_vllm"] and generation >= training:
        knobs.append(
            f"generation KV cache/prefill dominate: lower generation_batch ({args['generation_batch']}) "
            "or use_vllm: true"
        )
    if not args["lora"]:
        knobs.append(
            f"full fine-tuning keeps {states:.1f} GiB of weights/optimizer state per GPU: train a LoRA adapter (lora)"
        )
    if args["world_size"] < 64 and states > 2 and args["zero_stage"] == 3:
        more = [w for w in (2, 4, 8, 16, 32, 64) if w > args["world_size"]]
        enough = next((w for w in more if suggest and _fits(args, world_size=w)), None)
        hint = f" (world_size {enough} would fit)" if enough else ""
        knobs.append(
            f"more GPUs (world_size {args['world_size']}) shard the {states:.1f} GiB of weights/optimizer state{hint}"
        )
    if not args["activation_checkpointing"]:
        knobs.append(f"activations take {activations:.1f} GiB: set activation_checkpointing: true")
    checkpointed = sum(r.gib for r in rows if r.name == "checkpointed layer inputs")
    if checkpointed > 1:  # not offloaded yet (the offloaded row has another name)
        knobs.append(
            f"activation_offloading: true moves most of the {checkpointed:.1f} GiB of checkpointed layer inputs "
            "to CPU memory"
        )
    if args["per_device_train_batch_size"] > 1:
        knobs.append(f"per_device_train_batch_size: 1 (now {args['per_device_train_batch_size']}) divides activations")
    if activations > 1:
        hint = ""
        if suggest:
            lo, hi = 0, args["max_training_tokens"]
            while hi - lo > 256:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if _fits(args, max_training_tokens=mid) else (lo, mid)
            hint = f" (<= {lo} would fit)" if lo >= 1024 else " (no value fits alone)"
        knobs.append(
            f"lower max_training_tokens ({args['max_training_tokens']}){hint}; "
            "longer trajectories train on their prefix"
        )
    return knobs
