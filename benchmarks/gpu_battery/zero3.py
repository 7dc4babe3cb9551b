"""DeepSpeed ZeRO-3 on one process: two LOOP iterations, and the peak memory against the memory plan.

**Route.** The one a user takes (docs/scaling.md): ``accelerate launch --config_file
recipes/accelerate/zero3.yaml --num_processes 1`` (torchrun underneath: a one-rank NCCL group on
CUDA; on CPU ``--mixed_precision no`` and the gloo group the worker creates, as
tests/support/ddp_driver.py does) starts this module as the worker. The worker builds the
``LOOPConfig`` first, so the launch's DeepSpeed config is registered with transformers and the
model (random init, the shape's config, bf16 on CUDA, SDPA) is built inside ``deepspeed.zero.Init``;
then ``LOOPTrainer`` adds LoRA r=8 on every linear layer with activation checkpointing, and
accelerate wraps it in a ZeRO-3 engine around the Trainer's torch AdamW (no compiled DeepSpeed op).
The start-up stress test runs one forward and backward of ``micro_batch`` x ``tokens`` tokens, then two
``run_iteration`` calls sample ShapedVault episodes with the training model itself (every decode
step gathers the partitioned layers) and update the adapter.

**Measured.** Per iteration: loss, KL, gradient norm, clip fraction, non-finite steps, rollout and
update seconds. Memory: ``torch.cuda.max_memory_allocated``/``max_memory_reserved`` per phase (engine
set-up, stress test, iterations) plus the device memory outside PyTorch's allocator, as the memory
section measures it; the plan is ``plan_memory(zero_stage=3, world_size=1)`` for the same shape and
tokens (its training phase: the stress test is the run's longest update by far). Partitioning:
which parameters DeepSpeed took over, the status and sizes of the largest one outside a forward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_battery.common import (
    GIB,
    build_model,
    deepspeed_launch,
    deepspeed_missing,
    device_for,
    loop_config,
    lora_config,
    qwen_tokenizer,
    scratch,
    shape_config,
    stop_process_tree,
)
from benchmarks.gpu_battery.loop_bf16 import GAP_METRICS, _shaped_vault
from benchmarks.gpu_battery.report import _f, _table

ROOT = Path(__file__).resolve().parents[2]
ZERO3_CONFIG = ROOT / "recipes" / "accelerate" / "zero3.yaml"
LORA_R = 8
ITERATION_METRICS = (*GAP_METRICS, "optimizer_steps")


@dataclass(frozen=True)
class Zero3Sizes:
    shape: str
    tokens: int  # max_training_tokens: the stress test's trajectories (micro_batch of them), the plan's tokens
    micro_batch: int  # per_device_train_batch_size; minibatches are half the episodes
    tasks: int
    rollouts: int
    turns: int
    new_tokens: int
    worker_seconds: int  # the worker is killed after this; inside the section's limit (gpu_check.SECTIONS)


# Every forward under ZeRO-3 runs DeepSpeed's hooks on each of the ~1,200 modules of a 28-layer LoRA model,
# whatever the tokens, so the GPU sizes keep the passes few: ~18 decode steps and ~14 training passes per
# iteration (micro-batches of 4: no accumulation there; CPU mode accumulates 2 per step). A 28-layer stand-in
# of these sizes took 137 s on a loaded 2-core CPU: 78 s in the first iteration (while DeepSpeed traces the
# module order), 26 s in the second.
SIZES = {
    "gpu": Zero3Sizes("Qwen2.5-1.5B-Instruct", 2048, 4, tasks=4, rollouts=2, turns=2, new_tokens=8, worker_seconds=215),
    "quick": Zero3Sizes(
        "Qwen2.5-0.5B-Instruct", 2048, 2, tasks=2, rollouts=2, turns=2, new_tokens=8, worker_seconds=215
    ),
    # The first CPU run JIT-compiles DeepSpeed's CPU communication op (~85 s, cached; see run()).
    "cpu": Zero3Sizes("tiny", 128, 1, tasks=2, rollouts=2, turns=2, new_tokens=8, worker_seconds=450),
}


def run(mode: str) -> dict[str, Any]:
    """Launch the worker the way a user launches a ZeRO-3 run, wait for it (killing its whole
    process group past the time limit, so nothing is left holding the GPU), return its result."""
    missing = deepspeed_missing(mode)
    if missing:
        return {"skipped": missing}
    sizes = SIZES[mode]
    with scratch() as directory:
        out = Path(directory) / "zero3.json"
        command, env = deepspeed_launch(ZERO3_CONFIG, mode, ["benchmarks.gpu_battery.zero3", mode, str(out)])
        print(f"zero3: {' '.join(command[1:])}", flush=True)
        worker = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
        try:
            code = worker.wait(timeout=sizes.worker_seconds)
        except subprocess.TimeoutExpired:
            stop_process_tree(worker)
            raise RuntimeError(f"the ZeRO-3 worker did not finish in {sizes.worker_seconds} s (killed)") from None
        if code != 0 or not out.exists():
            raise RuntimeError(f"the ZeRO-3 worker exited with status {code} (its output is above)")
        return json.loads(out.read_text())


# --- the worker: one process under `accelerate launch` ---------------------------------------------------
def _peaks(device: str) -> dict[str, float]:
    import torch

    if device != "cuda":
        return {}
    torch.cuda.synchronize()
    peaks = {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
    }
    torch.cuda.reset_peak_memory_stats()
    return peaks


def _engine(trainer: Any) -> Any:
    from loop_trainer.training.distribution import deepspeed_engine

    engine = deepspeed_engine(trainer.accelerator)
    if engine is None:
        raise RuntimeError(f"accelerate did not wrap the model in a DeepSpeed engine: {trainer.accelerator.state}")
    return engine


def partition_facts(engine: Any) -> dict[str, Any]:
    """Which parameters ZeRO-3 took over, and the largest one outside a forward: NOT_AVAILABLE, an
    empty visible tensor, its elements in this rank's partition (all of them on one rank)."""
    import torch

    named = list(engine.module.named_parameters())
    zero = [(name, p) for name, p in named if hasattr(p, "ds_id")]
    # Parameters under param_persistence_threshold stay gathered (norms, biases, small adapters).
    sharded = [(name, p) for name, p in zero if not getattr(p, "ds_persist", False)]
    largest_name, largest = max(sharded, key=lambda item: item[1].ds_numel)
    optimizer = type(getattr(engine, "basic_optimizer", None) or engine.optimizer)
    return {
        "zero_stage": engine.zero_optimization_stage(),
        "world_size": torch.distributed.get_world_size(),
        "backend": torch.distributed.get_backend(),
        "bf16": engine.bfloat16_enabled(),
        "optimizer": f"{optimizer.__module__}.{optimizer.__qualname__}",
        "gradient_clipping": engine.gradient_clipping(),
        "num_params": len(named),
        "num_zero_params": len(zero),
        "num_persistent": len(zero) - len(sharded),
        "sharded_full_numel": sum(p.ds_numel for _, p in sharded),
        "sharded_local_numel": sum(p.ds_tensor.numel() for _, p in sharded),
        "sharded_visible_numel": sum(p.numel() for _, p in sharded),  # 0 outside a gather
        "largest": {
            "name": largest_name,
            "ds_status": largest.ds_status.name,
            "ds_shape": list(largest.ds_shape),
            "ds_numel": largest.ds_numel,
            "local_numel": largest.ds_tensor.numel(),
            "visible_numel": largest.numel(),
        },
    }


def _adapter(model: Any) -> dict[str, Any]:
    """The trainable (LoRA) weights, gathered whole, as float32 on the CPU."""
    import deepspeed

    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in trainable], modifier_rank=None):
        return {name: p.detach().float().cpu().clone() for name, p in trainable}


def _plan(sizes: Zero3Sizes, device: str, gpu_gib: float, episodes: int) -> dict[str, Any]:
    from loop_trainer.models.memory_plan import plan_memory
    from loop_trainer.models.model_shape import ModelShape

    shape = ModelShape.from_config(shape_config(sizes.shape), sizes.shape)
    settings: dict[str, Any] = {  # plan_memory's keyword arguments
        "world_size": 1,
        "gpu_memory_gib": gpu_gib,
        "lora": {"r": LORA_R, "target_modules": "all-linear", "dropout": 0.0},
        "bf16": device == "cuda",
        "activation_checkpointing": True,
        "max_training_tokens": sizes.tokens,
        "per_device_train_batch_size": sizes.micro_batch,
        "generation_batch": episodes,
    }
    plan = plan_memory(shape, zero_stage=3, **settings)
    return {
        "training_gib": plan.training_gib,
        "generation_gib": plan.generation_gib,
        "rows": {r.name: round(r.gib, 3) for r in plan.rows if "train" in r.phases},
        "training_gib_zero0": plan_memory(shape, zero_stage=0, **settings).training_gib,  # the memory section's
    }


def worker(mode: str, out: Path) -> None:
    import torch
    from accelerate import PartialState

    from loop_trainer import LOOPTrainer

    sizes, device = SIZES[mode], device_for(mode)
    # Ends this process even where the section's own timer died with it (its parent killed first).
    watchdog = threading.Timer(sizes.worker_seconds + 10, os._exit, args=(124,))
    watchdog.daemon = True  # never what keeps a failed worker alive
    watchdog.start()
    cpu = {}
    if device == "cpu":
        # On CPU accelerate sets up no process group for `accelerate launch`: create it (gloo) before the
        # LOOPConfig and let the Trainer adopt it; not use_cpu, with which accelerate never picks DeepSpeed.
        PartialState(backend="gloo")
        cpu = {"use_cpu": False, "accelerator_config": {"use_configured_state": True}}
    tokenizer = qwen_tokenizer()
    episodes = sizes.tasks * sizes.rollouts
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB if device == "cuda" else 80.0
    # Before the LOOPConfig registers the ZeRO-3 config: the plan counts parameters on a meta-device
    # model, which zero.Init would try to partition.
    plan = _plan(sizes, device, gpu_gib, episodes)
    with scratch() as output_dir:
        args = loop_config(
            output_dir,
            device,
            tasks_per_iteration=sizes.tasks,
            rollouts_per_task=sizes.rollouts,
            minibatch_size=episodes // 2,
            max_turns=sizes.turns,
            max_new_tokens_per_turn=sizes.new_tokens,
            per_device_train_batch_size=sizes.micro_batch,
            max_trajectory_tokens=sizes.tokens,
            max_training_tokens=sizes.tokens,
            advantage_threshold=0.0,
            learning_rate=1e-4,
            **cpu,
        )
        from transformers.integrations import is_deepspeed_zero3_enabled

        if not is_deepspeed_zero3_enabled():
            raise RuntimeError("the launch did not register a ZeRO-3 config with transformers")
        started = time.perf_counter()
        model = build_model(sizes.shape, device)  # inside deepspeed.zero.Init (registered by the LOOPConfig)
        built_in_zero_init = all(hasattr(p, "ds_id") for p in model.parameters())
        trainer = LOOPTrainer(
            model, _shaped_vault(num_tasks=64), args, processing_class=tokenizer, peft_config=lora_config(LORA_R)
        )
        phases: dict[str, dict[str, float]] = {}
        seconds: dict[str, float] = {"build": time.perf_counter() - started}
        _peaks(device)
        try:
            started = time.perf_counter()
            trainer.prepare_for_iterations()
            seconds["prepare"] = time.perf_counter() - started
            engine = _engine(trainer)
            partition = partition_facts(engine)
            print(f"zero3 partitioning: {partition}", flush=True)
            allocated_after_prepare = torch.cuda.memory_allocated() / GIB if device == "cuda" else None
            phases["prepare"] = _peaks(device)
            started = time.perf_counter()
            trainer.run_memory_stress_test()
            seconds["stress_test"] = time.perf_counter() - started
            phases["stress_test"] = _peaks(device)
            print(
                f"zero3 stress test, {sizes.micro_batch} x {sizes.tokens} tokens: {seconds['stress_test']:.1f} s",
                flush=True,
            )
            before = _adapter(trainer.model)
            records = []
            for _ in range(2):
                record = trainer.run_iteration()
                records.append({key: record.get(key) for key in ITERATION_METRICS if key in record})
                print(f"zero3 iteration: {records[-1]}", flush=True)
            phases["iterations"] = _peaks(device)
            after = _adapter(trainer.model)
        finally:
            trainer.close()
    result: dict[str, Any] = {
        "shape": sizes.shape,
        "sizes": asdict(sizes),
        "episodes_per_iteration": episodes,
        "built_in_zero_init": built_in_zero_init,
        "partition": partition,
        "iterations": records,
        "adapter_max_abs_change": max((after[k] - before[k]).abs().max().item() for k in before),
        "adapter_finite": all(torch.isfinite(v).all().item() for v in after.values()),
        "adapter_tensors": len(after),
        "seconds": seconds,
        "plan": plan,
        "gpu_memory_gib": gpu_gib if device == "cuda" else None,
    }
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        outside = (total - free - torch.cuda.memory_reserved()) / GIB  # context, NCCL, library handles
        peak_allocated = max(p["peak_allocated_gib"] for p in phases.values())
        peak_reserved = max(p["peak_reserved_gib"] for p in phases.values())
        result["memory"] = {
            "phases": phases,
            "allocated_after_prepare_gib": allocated_after_prepare,
            "peak_allocated_gib": peak_allocated,
            "peak_reserved_gib": peak_reserved,
            "outside_allocator_gib": outside,
            "measured_gib": peak_reserved + outside,
            "measured_over_plan": (peak_reserved + outside) / plan["training_gib"],
        }
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"zero3: wrote {out}", flush=True)


def render(result: dict) -> list[str]:
    partition, plan, memory = result["partition"], result["plan"], result.get("memory")
    largest, sizes = partition["largest"], result["sizes"]
    lines = [
        f"## DeepSpeed ZeRO-3 on one process ({result['shape']}, LoRA r={LORA_R} all-linear, "
        f"{partition['backend']}, bf16 {'on' if partition['bf16'] else 'off'})",
        "",
        "`accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 1`: the model built "
        f"inside `zero.Init` ({'yes' if result['built_in_zero_init'] else 'NO'}), the Trainer's "
        f"`{partition['optimizer']}` in a ZeRO-{partition['zero_stage']} engine, the start-up stress test "
        f"({sizes['micro_batch']} x {sizes['tokens']} tokens), then two LOOP iterations of "
        f"{result['episodes_per_iteration']} vault episodes ({sizes['turns']} turns of up to {sizes['new_tokens']} "
        "tokens) sampled by the training model. Memory: peaks per phase (reset between them) plus "
        "the device memory outside the allocator, against the plan's ZeRO-3 training phase for world size 1.",
        "",
    ]
    rows = [
        [
            i + 1,
            _f(r.get("loss"), 4),
            _f(r.get("kl"), 5),
            _f(r.get("grad_norm"), 3),
            _f(r.get("clip_frac"), 3),
            r.get("skipped_nonfinite_steps"),
            r.get("optimizer_steps"),
            _f(r.get("rollout_seconds"), 1),
            _f(r.get("update_seconds"), 1),
        ]
        for i, r in enumerate(result["iterations"])
    ]
    header = ["iteration", "loss", "KL", "grad norm", "clip frac", "non-finite steps", "steps", "rollout s", "update s"]
    lines += _table(header, rows)
    lines += _table(
        ["partitioned", "persistent", "largest", "its status", "full / local / visible elements", "adapter"],
        [
            [
                f"{partition['num_zero_params']} of {partition['num_params']}",
                partition["num_persistent"],
                f"`{largest['name']}`",
                largest["ds_status"],
                f"{largest['ds_numel']} / {largest['local_numel']} / {largest['visible_numel']}",
                f"moved {_f(result['adapter_max_abs_change'], 4)}, "
                + ("finite" if result["adapter_finite"] else "NOT FINITE"),
            ]
        ],
    )
    if memory is None:
        lines += [f"No CUDA: plan only, ZeRO-3 training phase {_f(plan['training_gib'])} GiB.", ""]
        return lines
    held = plan["rows"]["model weights (frozen)"] + plan["rows"]["trainable state"]
    lines += [
        f"Allocated after the engine's set-up: {_f(memory['allocated_after_prepare_gib'])} GiB "
        f"(plan: frozen weights + trainable state {_f(held)} GiB).",
        "",
    ]
    lines += _table(
        ["phase", "peak allocated GiB", "peak reserved GiB"],
        [[name, _f(p["peak_allocated_gib"]), _f(p["peak_reserved_gib"])] for name, p in memory["phases"].items()],
    )
    lines += _table(
        [
            "measured GiB (reserved + outside)",
            "outside allocator GiB",
            "plan ZeRO-3 GiB",
            "measured / plan",
            "plan without DeepSpeed GiB",
        ],
        [
            [
                _f(memory["measured_gib"]),
                _f(memory["outside_allocator_gib"]),
                _f(plan["training_gib"]),
                _f(memory["measured_over_plan"]),
                _f(plan["training_gib_zero0"]),
            ]
        ],
    )
    return lines


if __name__ == "__main__":  # the worker, as `accelerate launch ... -m benchmarks.gpu_battery.zero3 MODE OUT`
    worker(sys.argv[1], Path(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is written; skip a process-group teardown that could hang the launch
