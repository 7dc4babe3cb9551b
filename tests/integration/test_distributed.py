"""Data-parallel LOOP updates equal single-process ones.

tests/support/ddp_driver.py runs ``LOOPTrainer.update_policy`` on fixed trajectories once on one process
and once on two CPU processes (torchrun, gloo, DDP through accelerate). Each optimizer step's
loss and gradient norm (the global, pre-clip norm that clipping uses) and the weights after the
update must agree. The cases cover per-device batches of 1 and 2 (gradient accumulation under
``no_sync``), two PPO epochs, minibatches that split unevenly over the ranks (3 = 2 + 1) or leave
a rank with no trajectory at all (the zero stand-in), activation checkpointing (DDP without
``find_unused_parameters``), a decaying learning-rate schedule and a LoRA adapter. The same driver
runs the DeepSpeed comparisons (tests/vllm_deepspeed/test_zero_updates.py, in the DeepSpeed venv).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from loop_trainer.net import free_local_port
from support.driver import COMPARED_METRICS, PYTHON, run_driver

TIMEOUT = 240

CASES = {
    # 8 trajectories, minibatches of 4 -> 2 optimizer steps, each rank 2 trajectories a step.
    "batch1": {},
    # Per-device batches of 2 (one micro-batch a rank, two on one process), 2 epochs -> 4 steps.
    "batch2_epochs2": {"per_device_train_batch_size": 2, "ppo_epochs": 2},
    # 7 trajectories, minibatches of 3 -> 3, 3, 1 per epoch: shares 2+1, then 1+0 (rank 1 stands in).
    "uneven_and_empty": {"samples": 7, "minibatch_size": 3, "per_device_train_batch_size": 2, "ppo_epochs": 2},
    # The same split with activation checkpointing (DDP then has find_unused_parameters=False) and a
    # linear schedule (a scheduler stepped once per process would reach lr 0 early).
    "checkpointed_linear": {
        "samples": 7,
        "minibatch_size": 3,
        "activation_checkpointing": True,
        "lr_scheduler_type": "linear",
    },
    # A LoRA adapter (q/v projections) is what trains; the base weights must not move.
    "lora": {"peft": True, "samples": 7, "minibatch_size": 3, "per_device_train_batch_size": 2},
}
MAX_GRAD_NORM = 1e-3  # the driver's default: every step below clips


def _run(output_dir: Path, processes: int) -> dict[str, tuple[dict, dict[str, torch.Tensor]]]:
    launcher = (
        PYTHON
        if processes == 1
        else [
            *PYTHON,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_local_port()),
        ]
    )
    return run_driver(launcher, output_dir, CASES, label=f"{processes} process(es)", timeout=TIMEOUT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {n: _run(tmp_path_factory.mktemp(f"ddp{n}"), n) for n in (1, 2)}


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_match_one(runs, case):
    single, single_weights = runs[1][case]
    double, double_weights = runs[2][case]
    assert single["world_size"] == 1 and double["world_size"] == 2
    assert double["ranks_agree"], "the two ranks ended with different weights"

    # The schedule is the one intended: every step stepped, the split over ranks as described.
    assert single["optimizer_steps"] == double["optimizer_steps"] == len(single["steps"]) >= 2
    assert single["skipped_nonfinite_steps"] == double["skipped_nonfinite_steps"] == 0
    shares = double["shares"]
    if case == "uneven_and_empty":
        assert 0 in shares[1] and any(a != b for a, b in zip(*shares, strict=True))

    # Step by step: the same loss, the same global gradient norm (above the clip, so clipping acts).
    for k, (one, two) in enumerate(zip(single["steps"], double["steps"], strict=True)):
        assert one["stepped"] and two["stepped"]
        assert one["num_tokens"] == two["num_tokens"], k
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-6), (k, one, two)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5), (k, one, two)
        assert one["grad_norm"] > 10 * MAX_GRAD_NORM, (k, one)
    for key in COMPARED_METRICS:
        assert double[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key
    assert double["learning_rate_after"] == pytest.approx(single["learning_rate_after"])

    # The same weights after the update; the update itself is ~1000x larger than the tolerance.
    assert single_weights.keys() == double_weights.keys()
    assert min(single["max_update"], double["max_update"]) > 1e-3
    worst = max(float((single_weights[k] - double_weights[k]).abs().max()) for k in single_weights)
    assert worst < 1e-5, worst
    for k in single_weights:
        torch.testing.assert_close(double_weights[k], single_weights[k], rtol=1e-4, atol=1e-5, msg=k)
    if case == "lora":
        assert single["num_trainable"] == double["num_trainable"] == 8  # lora_A/B of q, v in 2 layers
        assert single["max_frozen_update"] == double["max_frozen_update"] == 0.0
    assert all(math.isfinite(v) for v in (single["loss"], double["loss"]))
