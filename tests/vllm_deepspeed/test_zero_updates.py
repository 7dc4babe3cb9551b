"""A LOOP update on 2 DeepSpeed processes equals the update on 1 plain process: ZeRO-3, ZeRO-3 with the optimizer
state on the CPU and with the parameters there too, ZeRO-2, ZeRO-2 with the optimizer state on the CPU
(ZeRO-Offload), and ZeRO-1.

tests/support/ddp_driver.py runs ``LOOPTrainer.update_policy`` on fixed trajectories once on one process without
DeepSpeed and once under ``accelerate launch --config_file <recipe> --num_processes 2 --mixed_precision no`` for
each launch: the repository's accelerate recipes recipes/accelerate/zero3.yaml and zero2-offload.yaml, and each
with the offload devices or the stage changed (``LAUNCHES``; fp32 on CPU, gloo; accelerate swaps the Trainer's
AdamW for DeepSpeed's CPU Adam under optimizer offload). Each optimizer step's loss and gradient norm (the global
pre-clip norm), the metrics and the weights after the update must agree to fp32 precision, and the two ranks must
really split what the stage shards: ZeRO-3 half of the parameters each, ZeRO-1/2 half of the fp32 master weights
each. The cases cover full
fine-tuning and LoRA, per-device batches of 1 (two micro-batches accumulated into one ZeRO step) and 2, minibatches
that split unevenly (3 = 2 + 1: the rank with less work runs zero stand-ins so every collective forward/backward is
matched) or leave a rank without a trajectory, activation checkpointing, a decaying learning rate, and the skip
rules: a minibatch with a non-finite loss and one over the KL threshold change no weight, and their gradients do not
leak into the next step, within the update or the next one. (Before the update drove the DeepSpeed engine itself,
accelerate's backward took a ZeRO step per micro-batch, ``batch1`` made 4 steps instead of 2, and the uneven cases
hung on unmatched collectives. Before a discarded step cleared ZeRO-2's accumulated gradients, the start-up stress
test's reached the first step; under offload the NaN minibatch's flag skipped the next step too, and a minibatch
aborted on KL added its gradients to the next update's first step.)

DeepSpeed's CPU communication op and its CPU Adam are JIT-compiled once per venv by ``make vllm-venv``
(tools/ensure_vllm_venv.sh, into ``$LOOP_CACHE_DIR/torch-extensions``); without them the first launch compiles them
(~85 s and ~60 s).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import yaml

from loop_trainer.net import free_local_port
from support.driver import COMPARED_METRICS, PYTHON, run_driver

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = ROOT / "recipes" / "accelerate"
LAUNCHES = {  # the accelerate recipe each DeepSpeed run launches with, and what it changes there
    "zero3": (ACCELERATE / "zero3.yaml", {}),
    # ZeRO-3 with the optimizer state on the CPU, and with the parameters there too (ZeRO-Infinity's CPU tier)
    "zero3_offload": (ACCELERATE / "zero3.yaml", {"offload_optimizer_device": "cpu"}),
    "zero3_offload_params": (
        ACCELERATE / "zero3.yaml",
        {"offload_optimizer_device": "cpu", "offload_param_device": "cpu"},
    ),
    "zero2": (ACCELERATE / "zero2-offload.yaml", {"offload_optimizer_device": "none"}),  # the optimizer on the GPU
    "zero2_offload": (ACCELERATE / "zero2-offload.yaml", {}),
    "zero1": (ACCELERATE / "zero2-offload.yaml", {"zero_stage": 1, "offload_optimizer_device": "none"}),
}
# Relative agreement of losses, gradient norms and the update: fp32 summed in another order on 2 ranks. DeepSpeed's
# CPU Adam (under offload) also rounds each element's update its own way, a weight ulp or two from torch's AdamW a
# step (about 1e-6 of the update), which the next steps' losses carry at up to ~1e-5.
RELATIVE = {launch: 1e-4 if "offload" in launch else 1e-5 for launch in LAUNCHES}
TIMEOUT = 400  # ~40 s warm; the first run also compiles (~85 s, and ~60 s for CPU Adam under offload)
MAX_GRAD_NORM = 1e-3  # the driver's default: every step below clips
KL_ABORT = 0.01  # above the KL of a minibatch before any update (0), below the KL after one (~0.03)

CASES = {
    # 8 trajectories, minibatches of 4 -> 2 steps; each rank 2 micro-batches of 1 per step.
    "batch1": {},
    # Per-device batches of 2, 2 epochs -> 4 steps.
    "batch2_epochs2": {"per_device_train_batch_size": 2, "ppo_epochs": 2},
    # 7 trajectories, minibatches of 3 -> 3, 3, 1 per epoch: shares 2+1 (rank 1 pads with a
    # stand-in micro-batch), then 1+0 (rank 1 only stands in); old log-probs of 6 vs 3 trajectories
    # (rank 1 pads with dropped forwards); activation checkpointing; a linear schedule.
    "uneven_and_empty": {
        "samples": 7,
        "minibatch_size": 3,
        "ppo_epochs": 2,
        "activation_checkpointing": True,
        "lr_scheduler_type": "linear",
    },
    # LoRA on q/v: only the adapter trains; uneven split with per-device batches of 2; checkpointing.
    "lora": {
        "peft": True,
        "samples": 7,
        "minibatch_size": 3,
        "per_device_train_batch_size": 2,
        "activation_checkpointing": True,
    },
    # Sample 0 has a NaN advantage: the first minibatch ([4, 0, 7, 3]) is skipped, the second steps
    # (from unchanged weights: KL 0), the third is over the KL threshold: skipped, update aborted.
    "skips": {"nan_advantage": 0, "ppo_epochs": 2, "kl_abort_threshold": KL_ABORT},
    # The start-up memory stress test's backward must not become a DeepSpeed optimizer step.
    "stress_test_first": {"stress_test": True},
    # Two updates (as two iterations): each steps once and aborts on KL at its second minibatch; the aborted
    # minibatch's gradients must not reach the next update's first step.
    "abort_then_update": {"updates": 2, "kl_abort_threshold": KL_ABORT},
}


def _run(output_dir: Path, launch: str | None) -> dict[str, tuple[dict, dict[str, torch.Tensor]]]:
    """Every case on one plain process (``launch`` None) or on 2 processes under ``LAUNCHES[launch]``."""
    config = None
    if launch:
        recipe, changes = LAUNCHES[launch]
        settings = yaml.safe_load(recipe.read_text())
        settings["deepspeed_config"].update(changes)
        config = output_dir / recipe.name
        config.write_text(yaml.safe_dump(settings))
    cache = Path(os.environ.get("LOOP_CACHE_DIR", Path.home() / ".cache" / "loop_trainer"))
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(cache / "torch-extensions"))}
    launcher = (
        [
            *PYTHON,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            "--num_processes",
            "2",
            "--mixed_precision",
            "no",
            "--main_process_port",
            str(free_local_port()),
        ]
        if launch
        else PYTHON
    )
    label = f"{launch} on 2 processes" if launch else "1 process"
    return run_driver(launcher, output_dir, CASES, label=label, timeout=TIMEOUT, env=env)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), None)


@pytest.fixture(scope="module", params=list(LAUNCHES))
def launched(request, tmp_path_factory):
    """(launch name, its runs): one DeepSpeed launch of every case at a time (module-scoped: run once)."""
    return request.param, _run(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("case", list(CASES))
def test_deepspeed_on_two_processes_matches_one_process(single, launched, case):
    launch, runs = launched
    single, single_weights = single[case]
    double, double_weights = runs[case]
    assert single["world_size"] == 1 and double["world_size"] == 2
    assert single["deepspeed"] == {}
    assert double["ranks_agree"], "the two ranks ended with different weights"

    # DeepSpeed got max_grad_norm as its clip and accumulates nothing itself; each stage really shards.
    for rank, facts in enumerate(double["deepspeed"]["ranks"]):
        assert facts["gradient_clipping"] == MAX_GRAD_NORM, (rank, facts)
        assert facts["gradient_accumulation_steps"] == 1, (rank, facts)
        offload = launch.startswith(("zero2_offload", "zero3_offload"))
        adam = "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam" if offload else "torch.optim.adamw.AdamW"
        if launch.startswith("zero3"):
            # every parameter is split, each rank holds half of the elements and none outside a gather
            assert facts["zero_stage"] == 3 and facts["offload_optimizer"] == offload, (rank, facts)
            assert facts["num_partitioned"] == facts["num_params"] > 0, (rank, facts)
            assert facts["local_numel"] * 2 == pytest.approx(facts["full_numel"], rel=1e-3), (rank, facts)
            assert facts["visible_numel"] == facts["visible_numel_after"] == 0, (rank, facts)
            assert facts["optimizer"] == adam, (rank, facts)
            assert facts["offload_param"] == (launch == "zero3_offload_params"), (rank, facts)
        else:
            # whole parameters on each rank and half of the trainable ones' fp32 masters each; under offload on
            # the CPU, stepped by DeepSpeed's CPU Adam (accelerate's swap for the Trainer's AdamW)
            assert facts["zero_stage"] == (1 if launch == "zero1" else 2), (rank, facts)
            assert facts["offload_optimizer"] == offload, (rank, facts)
            assert facts["num_partitioned"] == 0, (rank, facts)
            assert facts["master_devices"] == ["cpu"], (rank, facts)  # the CPU is this test's device either way
            assert facts["optimizer"] == adam, (rank, facts)
    if not launch.startswith("zero3") and case != "lora":
        masters = [facts["master_numel"] for facts in double["deepspeed"]["ranks"]]
        total = sum(w.numel() for w in double_weights.values())
        assert sum(masters) == pytest.approx(total, rel=1e-3) and masters[0] == pytest.approx(masters[1], rel=1e-3)

    # The same schedule, step by step: the same skips, loss and global pre-clip gradient norm.
    assert len(single["steps"]) == len(double["steps"]) >= 2
    for key in ("optimizer_steps", "skipped_nonfinite_steps", "aborted_on_kl"):
        assert double[key] == single[key], key
    for k, (one, two) in enumerate(zip(single["steps"], double["steps"], strict=True)):
        assert (one is None) == (two is None), (k, one, two)
        if one is None:
            continue
        assert one["stepped"] == two["stepped"], (k, one, two)
        assert one["num_tokens"] == two["num_tokens"], k
        assert two["loss"] == pytest.approx(one["loss"], rel=RELATIVE[launch], abs=1e-6), (k, one, two)
        assert two["kl"] == pytest.approx(one["kl"], rel=1e-4, abs=1e-6), (k, one, two)
        if one["stepped"]:
            assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=RELATIVE[launch]), (k, one, two)
            assert one["grad_norm"] > 10 * MAX_GRAD_NORM, (k, one)
        else:
            assert math.isnan(one["grad_norm"]) and math.isnan(two["grad_norm"])
    for key in COMPARED_METRICS:
        assert double[key] == pytest.approx(single[key], rel=RELATIVE[launch], abs=1e-6), key
    assert double["learning_rate_after"] == pytest.approx(single["learning_rate_after"], rel=1e-6)

    # The same weights after the update: as a whole to RELATIVE of the update, element by element to
    # 5e-6 (the update moves elements by ~1e-2). A few elements differ by ~1e-6: those whose
    # gradient is rounding noise (~1e-12, summed in another order on 2 ranks) still move by
    # Adam's lr * g / (|g| + eps).
    assert single_weights.keys() == double_weights.keys()
    assert min(single["max_update"], double["max_update"]) > 1e-3
    difference = math.sqrt(
        sum(float(((single_weights[k] - double_weights[k]).double() ** 2).sum()) for k in single_weights)
    )
    assert difference < RELATIVE[launch] * single["update_norm"], (difference, single["update_norm"])
    assert double["update_norm"] == pytest.approx(single["update_norm"], rel=RELATIVE[launch])
    for k in single_weights:
        torch.testing.assert_close(double_weights[k], single_weights[k], rtol=1e-5, atol=5e-6, msg=k)

    # What each case is about.
    if case == "uneven_and_empty":
        shares = double["shares"]
        assert 0 in shares[1] and any(a != b for a, b in zip(*shares, strict=True))
        assert single["learning_rate_after"] < 1e-2  # the linear schedule moved
    if case == "lora":
        assert single["num_trainable"] == double["num_trainable"] == 8  # lora_A/B of q, v in 2 layers
        assert single["max_frozen_update"] == double["max_frozen_update"] == 0.0
    else:
        assert double["num_trainable"] == len(double_weights)
    if case == "abort_then_update":
        for run in (single, double):
            steps = run["steps"]  # both updates': stepped, aborted on KL; stepped, aborted
            assert [s["stepped"] for s in steps] == [True, False, True, False], steps
            assert steps[2]["kl"] == 0.0 and run["optimizer_steps"] == run["aborted_on_kl"] == 1, steps
    if case == "skips":
        for run in (single, double):
            steps = run["steps"]
            assert steps[0] is None and steps[1]["stepped"] and not steps[2]["stepped"], steps
            assert len(steps) == 3 and steps[2]["kl"] > KL_ABORT > abs(steps[1]["kl"]), steps
            assert run["optimizer_steps"] == run["skipped_nonfinite_steps"] == run["aborted_on_kl"] == 1
    elif case != "abort_then_update":
        assert all(s is not None and s["stepped"] for s in single["steps"])
