"""LOOP policy updates on fixed trajectories, on however many processes it is launched with.

``python ddp_driver.py OUTPUT_DIR CASES_JSON`` runs on one process; under ``torchrun
--nproc_per_node 2`` the same command runs data-parallel (gloo, DDP through accelerate). Under
``accelerate launch`` with a DeepSpeed config (``ACCELERATE_USE_DEEPSPEED=true``, e.g.
recipes/accelerate/zero3.yaml) it runs through DeepSpeed (gloo on CPU). For each case (a fresh
tiny model and trainer, ``update_policy`` once or ``updates`` times) rank 0 writes ``OUTPUT_DIR/<case>/result.json``
(``update_policy``'s metrics, each optimizer step's loss and pre-clip gradient norm, the world
size; under DeepSpeed the engine's settings and how it partitioned the parameters) and
``OUTPUT_DIR/<case>/weights.pt`` (every parameter after the update, gathered under ZeRO-3), and
prints the JSON. tests/integration/test_distributed.py compares 1 and 2 processes (DDP),
tests/vllm_deepspeed/test_zero_updates.py 1 process and 2 DeepSpeed processes (ZeRO-3; ZeRO-2 with
the optimizer state on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.envs import VaultEnv
from loop_trainer.models.tiny import build_tiny_for_environment
from loop_trainer.training.batching import TrainingSample


def make_samples(tokenizer, count: int, seed: int = 1234) -> list[TrainingSample]:
    """``count`` trajectories of 20-60 tokens: a masked prompt, then alternating sampled (mask 1)
    and environment (mask 0) spans; advantages of both signs; the same on every process."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    words = [i for i in range(len(tokenizer)) if i not in special]
    samples = []
    for k in range(count):
        length = 20 + (k * 37) % 41  # 20..60, all different for count <= 41
        prompt = rng.randint(5, 10)
        mask = [0] * prompt
        sampled = True
        while len(mask) < length:
            span = min(rng.randint(3, 8), length - len(mask))
            mask += [int(sampled)] * span
            sampled = not sampled
        if not any(mask):
            mask[-1] = 1
        token_ids = [rng.choice(words) for _ in range(length)]
        samples.append(
            TrainingSample(
                token_ids=token_ids,
                loss_mask=mask,
                sampler_logprobs=[-rng.uniform(0.5, 5.0) if m else 0.0 for m in mask],
                advantage=(-1.0) ** k * (0.25 + 0.5 * rng.random()),
                truncated=False,
            )
        )
    return samples


CASE_DEFAULTS = {
    "samples": 8,
    "minibatch_size": 4,
    "per_device_train_batch_size": 1,
    "ppo_epochs": 1,
    "max_grad_norm": 1e-3,
    "learning_rate": 1e-2,
    "lr_scheduler_type": "constant",
    "activation_checkpointing": False,
    "kl_abort_threshold": 1e9,
    "peft": False,  # a LoRA adapter (r 4 on q/v projections) is what gets trained
    "nan_advantage": None,  # index of a sample whose advantage is NaN: its minibatches are skipped
    "stress_test": False,  # run the start-up memory stress test first: it must not change any weight
    "updates": 1,  # update_policy calls on the same samples, one after the other (as iterations follow)
}
DEEPSPEED = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def full_parameters(parameters):
    """Full parameters inside the block (ZeRO-3 keeps only a partition on each rank)."""
    parameters = list(parameters)
    if DEEPSPEED and any(hasattr(p, "ds_id") for p in parameters):
        import deepspeed

        return deepspeed.zero.GatheredParameters(parameters, modifier_rank=None)
    return contextlib.nullcontext()


def _device(offload: object) -> str:
    """An offload setting's device ("none", "cpu", "nvme"), whether DeepSpeed holds it as its enum or its value."""
    device = getattr(offload, "device", "none")
    return str(getattr(device, "value", device))


def deepspeed_facts(trainer, wrapped) -> dict:
    """What DeepSpeed was configured with and how ZeRO-3 split the parameters on this rank."""
    import deepspeed

    assert trainer.accelerator.distributed_type == DistributedType.DEEPSPEED, trainer.accelerator.state
    assert isinstance(wrapped, deepspeed.DeepSpeedEngine), type(wrapped)
    params = list(wrapped.module.parameters())
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    optimizer = wrapped.basic_optimizer
    # ZeRO-1/2 keep this rank's fp32 master partition (what the optimizer steps) in single_partition_of_fp32_groups.
    masters = getattr(wrapped.optimizer, "single_partition_of_fp32_groups", [])
    return {
        "zero_stage": wrapped.zero_optimization_stage(),
        "optimizer": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "offload_optimizer": wrapped.zero_cpu_offload(),
        "offload_param": _device(wrapped.zero_offload_param()) == "cpu",
        "master_devices": sorted({str(m.device) for m in masters}),
        "master_numel": sum(m.numel() for m in masters),
        "gradient_clipping": wrapped.gradient_clipping(),
        "gradient_accumulation_steps": wrapped.gradient_accumulation_steps(),
        "micro_batch_size": wrapped.train_micro_batch_size_per_gpu(),
        "num_params": len(params),
        "num_partitioned": len(partitioned),
        "full_numel": sum(p.ds_numel for p in partitioned),
        "local_numel": sum(p.ds_tensor.numel() for p in partitioned),
        "visible_numel": sum(p.numel() for p in partitioned),  # 0 outside a gather
    }


def run_case(name: str, case: dict, output_dir: Path, state: PartialState, expected_world: int) -> dict:
    """Build a fresh model and trainer, run one ``update_policy`` on fixed samples, return its metrics."""
    case = {**CASE_DEFAULTS, **case}
    torch.manual_seed(0)
    env = VaultEnv(num_tasks=16)
    model, tokenizer = build_tiny_for_environment(env.vocabulary(), seed=0)
    peft_config = None
    if case["peft"]:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        )
    args = LOOPConfig(
        output_dir=str(output_dir / name),
        iterations=1,
        tasks_per_iteration=4,
        rollouts_per_task=2,
        minibatch_size=case["minibatch_size"],
        ppo_epochs=case["ppo_epochs"],
        per_device_train_batch_size=case["per_device_train_batch_size"],
        max_grad_norm=case["max_grad_norm"],
        learning_rate=case["learning_rate"],
        lr_scheduler_type=case["lr_scheduler_type"],
        activation_checkpointing=case["activation_checkpointing"],
        kl_abort_threshold=case["kl_abort_threshold"],
        max_trajectory_tokens=256,  # bounds the stress test's synthetic trajectory (samples are <= 60)
        bf16=False,
        seed=0,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        plot_curves=False,
        viewer_rollouts_per_iteration=0,
        accelerator_config={"use_configured_state": True},
    )
    trainer = LOOPTrainer(
        model, env, args, processing_class=tokenizer, generation_backend=object(), peft_config=peft_config
    )
    assert trainer.accelerator.num_processes == expected_world, trainer.accelerator.state
    with full_parameters(trainer.model.parameters()):  # the PEFT-wrapped model when peft; not partitioned yet
        initial = {name: p.detach().cpu().clone() for name, p in trainer.model.named_parameters()}
    wrapped = trainer.prepare_for_iterations()
    facts = {}
    if DEEPSPEED:
        facts = deepspeed_facts(trainer, wrapped)
    elif expected_world > 1:
        assert trainer.accelerator.distributed_type == DistributedType.MULTI_CPU, trainer.accelerator.state
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel), type(wrapped)

    if case["stress_test"]:
        trainer.run_memory_stress_test()
    # Record every optimizer step (loss, pre-clip gradient norm) and this rank's share of each minibatch.
    steps, shares = [], []
    update = trainer.policy_update
    minibatch_step = update.minibatch_step

    def recording_step(samples, old_logprobs, minibatch):
        shares.append(len(update.strategy.share(minibatch)))
        step = minibatch_step(samples, old_logprobs, minibatch)
        keys = ("loss", "grad_norm", "num_tokens", "stepped", "kl")
        steps.append(None if step is None else {k: getattr(step, k) for k in keys})
        return step

    update.minibatch_step = recording_step
    samples = make_samples(tokenizer, case["samples"])
    if case["nan_advantage"] is not None:
        samples[case["nan_advantage"]].advantage = math.nan
    for _ in range(case["updates"]):
        metrics = trainer.update_policy(samples)
    metrics["world_size"] = trainer.accelerator.num_processes
    metrics["learning_rate_after"] = trainer.optimizer.param_groups[0]["lr"]
    metrics["steps"] = steps
    unwrapped = trainer.accelerator.unwrap_model(wrapped)
    with full_parameters(unwrapped.parameters()):
        weights = {name: p.detach().cpu().clone() for name, p in unwrapped.named_parameters()}
        trainable = {name for name, p in unwrapped.named_parameters() if p.requires_grad}
    assert weights.keys() == initial.keys(), (sorted(weights)[:3], sorted(initial)[:3])
    metrics["max_update"] = max(float((weights[k] - initial[k]).abs().max()) for k in weights)
    metrics["update_norm"] = math.sqrt(sum(float(((weights[k] - initial[k]).double() ** 2).sum()) for k in weights))
    metrics["max_frozen_update"] = max(
        (float((weights[k] - initial[k]).abs().max()) for k in weights if k not in trainable), default=0.0
    )
    metrics["num_trainable"] = len(trainable)
    if DEEPSPEED:
        facts["visible_numel_after"] = sum(p.numel() for p in unwrapped.parameters() if hasattr(p, "ds_id"))
    if expected_world > 1:
        # Every rank must end with the same weights: gather each rank's per-parameter checksums.
        checksum = torch.stack([w.double().sum() for w in weights.values()])
        gathered = [torch.zeros_like(checksum) for _ in range(expected_world)]
        torch.distributed.all_gather(gathered, checksum)
        metrics["ranks_agree"] = all(torch.equal(gathered[0], g) for g in gathered)
        all_shares = [None] * expected_world
        torch.distributed.all_gather_object(all_shares, shares)
        metrics["shares"] = all_shares  # [rank][step] trajectories of each minibatch on that rank
        if DEEPSPEED:
            all_facts = [None] * expected_world
            torch.distributed.all_gather_object(all_facts, facts)
            facts = {"ranks": all_facts}
    metrics["deepspeed"] = facts
    if state.is_main_process:
        folder = output_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(weights, folder / "weights.pt")
        (folder / "result.json").write_text(json.dumps(metrics))
    if DEEPSPEED:
        # accelerate allows one DeepSpeed Accelerator per process; the next case's trainer makes a
        # new one on the same process group.
        wrapped.destroy()
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("cases", help="JSON object {name: {option: value}}; options as in CASE_DEFAULTS")
    options = parser.parse_args()

    torch.use_deterministic_algorithms(True)
    # Deterministic kernels, but no NaN fill of every torch.empty: ZeRO-1/2 takes a fresh reduction bucket of
    # reduce_bucket_size (5e8 fp32 elements, 2 GB) per micro-batch, and filling it on the CPU cost each ZeRO-2
    # launch ~45 of its ~60 s in page faults. A read of memory nobody wrote still shows: the ranks' results are
    # compared with one plain process's.
    torch.utils.deterministic.fill_uninitialized_memory = False
    # The process group must exist before the training arguments: accelerate on a machine without
    # GPUs would otherwise count one process. For DDP, cpu=True is what makes it MULTI_CPU
    # (DDP-wrapped) rather than DistributedType.NO with two unsynchronised processes; for
    # DeepSpeed it must be left out (accelerate only picks DeepSpeed when cpu is False; the
    # backend then has to be named, as none is found without GPUs). use_configured_state makes the
    # Trainer adopt this state.
    distributed = "WORLD_SIZE" in os.environ  # launched by torchrun / accelerate launch
    if distributed:
        state = PartialState(backend="gloo") if DEEPSPEED else PartialState(cpu=True, backend="gloo")
    else:
        state = PartialState()
    expected_world = int(os.environ.get("WORLD_SIZE", "1"))
    output_dir = Path(options.output_dir)
    for name, case in json.loads(options.cases).items():
        metrics = run_case(name, case, output_dir, state, expected_world)
        if state.is_main_process:
            print(json.dumps({"case": name, **metrics}), flush=True)
    if state.num_processes > 1:
        state.wait_for_everyone()
        state.destroy_process_group()
        # Everything is written. Interpreter shutdown of a gloo/DDP process now and then aborts
        # ("terminate called without an active exception", SIGABRT) while destroying a native
        # thread; skip it so the exit status reflects the run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
