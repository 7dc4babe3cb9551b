"""The GPU battery's zero3 section in its CPU mode: the same code the GPU run takes (``accelerate
launch`` with recipes/accelerate/zero3.yaml on one process, LOOPTrainer with LoRA, two LOOP
iterations) on the tiny shape, fp32 and gloo, so the one-shot GPU run does not find its bugs.
.venv has no DeepSpeed (there the section says it is skipped); this venv has it.

DeepSpeed's CPU communication op is JIT-compiled once per venv by ``make vllm-venv`` (tools/ensure_vllm_venv.sh,
into ``$LOOP_CACHE_DIR/torch-extensions``); without it the first launch compiles it (~85 s)."""

from __future__ import annotations

import pytest

from support.gpu_check import run_cpu_mode, section_result


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check-zero3")
    return run_cpu_mode(out, ["zero3"], timeout=600), out


@pytest.mark.slow
def test_zero3_section_trains_two_iterations_on_partitioned_parameters(zero3_run):
    result = section_result(zero3_run, "zero3")

    # ZeRO-3 on one gloo process, the Trainer's torch AdamW, the model built inside zero.Init.
    partition = result["partition"]
    assert partition["zero_stage"] == 3 and partition["world_size"] == 1 and partition["backend"] == "gloo"
    assert partition["optimizer"] == "torch.optim.adamw.AdamW" and partition["bf16"] is False
    assert result["built_in_zero_init"]
    # Every parameter is DeepSpeed's; the large ones are partitioned (one rank holds all of their
    # elements) and invisible outside a forward.
    assert partition["num_zero_params"] == partition["num_params"] > 0
    assert 0 < partition["sharded_local_numel"] == partition["sharded_full_numel"]
    assert partition["sharded_visible_numel"] == 0
    largest = partition["largest"]
    assert largest["name"].endswith("embed_tokens.weight") and largest["ds_status"] == "NOT_AVAILABLE"
    assert largest["ds_numel"] == largest["local_numel"] == 151936 * 64 and largest["visible_numel"] == 0

    # Two LOOP iterations that updated the adapter and stayed finite.
    iterations = result["iterations"]
    assert len(iterations) == 2
    assert all(r["optimizer_steps"] > 0 and r["skipped_nonfinite_steps"] == 0 for r in iterations), iterations
    assert all(r["grad_norm"] > 0 and r["sampled_tokens"] > 0 for r in iterations), iterations
    assert result["adapter_tensors"] > 0 and result["adapter_finite"] and result["adapter_max_abs_change"] > 0

    # The plan for the same shape and tokens; no CUDA, so nothing measured against it.
    assert result["plan"]["training_gib"] > 0 and "ZeRO-3 gathered params" in result["plan"]["rows"]
    assert result["plan"]["training_gib"] > result["plan"]["training_gib_zero0"]
    assert "memory" not in result

    summary = (zero3_run[1] / "gpu-check.md").read_text()
    assert "## DeepSpeed ZeRO-3 on one process (tiny" in summary
