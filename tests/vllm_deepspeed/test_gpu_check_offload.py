"""The GPU battery's offload section in its CPU mode: the same code the GPU run takes (GRPOTrainer's update watched
in a child process; LOOP's under ``accelerate launch`` with recipes/accelerate/zero2-offload.yaml, ZeRO-2 with the
optimizer state on the CPU and DeepSpeed's CPU Adam) on the tiny shape, fp32 and gloo, so the one-shot GPU run does
not find its bugs. .venv has no DeepSpeed (there the section says it is skipped); this venv has it.

DeepSpeed's CPU communication op and its CPU Adam are JIT-compiled once per venv by ``make vllm-venv``
(tools/ensure_vllm_venv.sh, into ``$LOOP_CACHE_DIR/torch-extensions``); without them the first launch compiles them."""

from __future__ import annotations

import pytest

from support.gpu_check import run_cpu_mode, section_result


@pytest.fixture(scope="module")
def offload_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check-offload")
    return run_cpu_mode(out, ["offload"], timeout=900), out


@pytest.mark.slow
def test_offload_section_watches_loop_under_zero2_offload_and_grpo_on_the_same_workload(offload_run):
    result = section_result(offload_run, "offload")
    assert result["shape"] == "tiny" and result["spec"]["deepspeed"] is False  # the workload, as GRPOTrainer ran it
    loop, grpo = result["loop"], result["grpo"]
    for watched, trainer in ((loop, "loop"), (grpo, "grpo")):
        assert watched["trainer"] == trainer, watched
        stages = [s["stage"] for s in watched["stages"]]
        assert {"forward", "backward", "optimizer"} <= set(stages), stages
    # LOOP took its optimizer steps (1 epoch of 2 minibatches) in a ZeRO-2 engine whose CPU Adam steps in host memory
    assert loop["optimizer_steps"] == 2 and grpo["optimizer_steps"] > 0
    assert loop["deepspeed"] == {
        "zero_stage": 2,
        "offload_optimizer": True,
        "optimizer": "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam",
    }
    assert grpo["deepspeed"] is None
    assert "loop_activations_offloaded" not in result  # activation offloading needs a GPU
    assert result["loop_over_grpo_peak"] is None  # no allocator peaks on CPU

    summary = (offload_run[1] / "gpu-check.md").read_text()
    assert "## The update's peak with the optimizer state on the CPU (ZeRO-Offload)" in summary
