"""The GPU battery (`make gpu-check`) in its CPU mode, so its code keeps working between the rare GPU
runs: every section runs on tiny shapes, and the result says it is not a GPU result."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from support.gpu_check import run_cpu_mode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root, for the benchmarks package


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One run of the battery in CPU mode, every section (those that need DeepSpeed or vLLM say they are skipped
    in .venv; tests/vllm_deepspeed runs them in .vllm-venv): (completed process, out dir). Every test that reads it
    lives in this file: `make test` deals test files to its workers whole, and a fixture shared across files would
    run the battery (over two minutes) once on each worker that needs it."""
    out = tmp_path_factory.mktemp("gpu-check")
    return run_cpu_mode(out, timeout=1500), out


@pytest.mark.slow
def test_without_cuda_the_battery_runs_every_section_in_cpu_mode_and_says_so(cpu_run):
    done, out = cpu_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[0].startswith("gpu-check: CPU MODE (no CUDA device)")
    results = json.loads((out / "gpu-check.json").read_text())
    assert results["mode"] == "cpu" and results["gpu_result"] is False and results["device"] == "cpu"
    assert (out / "gpu-check.md").read_text().startswith("# gpu-check: CPU MODE (no CUDA device): not a GPU result")
    assert {name: record["status"] for name, record in results["sections"].items()} == {
        "memory": "ok",
        "update": "ok",
        "loop_bf16": "ok",
        "decode": "ok",
        "profile": "ok",
        "offload": "ok",
        "zero3": "ok",
        "vllm": "ok",
        "real_model": "ok",
        "long_horizon": "ok",
        "long_horizon_english": "ok",
    }
    # no DeepSpeed, no vLLM, no GPU: they say so, in the summary too
    for name in ("offload", "zero3", "vllm", "real_model"):
        assert "skipped" in results["sections"][name]["result"]
        assert f"**{name}: skipped**" in (out / "gpu-check.md").read_text()


@pytest.mark.slow
def test_each_section_measured_what_it_claims(cpu_run):
    _, out = cpu_run
    sections = {
        name: record["result"] for name, record in json.loads((out / "gpu-check.json").read_text())["sections"].items()
    }
    memory = sections["memory"]
    assert [row["tokens"] for row in memory["memory"]] == [128, 256]
    assert all(row["plan_training_gib"] > 0 and "measured_gib" not in row for row in memory["memory"])  # no CUDA: none
    assert memory["mfu"]["model_flops"] < memory["mfu"]["hardware_flops"] and memory["mfu"]["mfu_model"] is None
    update = sections["update"]
    for row in update["rows"]:  # the first step's loss is fixed by the advantages at ratio 1
        assert row["first_loss"] == pytest.approx(row["first_loss_expected"], abs=1e-4)
    bf16 = sections["loop_bf16"]["bf16"]
    assert len(bf16["iterations"]) == 2 and bf16["adapter_finite"] and bf16["adapter_max_abs_change"] > 0
    assert bf16["activation_checkpointing"] and bf16["attention"] == "sdpa"
    assert all(r["skipped_nonfinite_steps"] == 0 and r["sampler_logprob_diff"] < 1e-3 for r in bf16["iterations"])
    rows = sections["loop_bf16"]["generation"]["rows"]
    assert [r["concurrency"] for r in rows] == [2, 4] and all(r["sampled_tokens"] > 0 for r in rows)
    decode = sections["decode"]
    # no CUDA: the dynamic loop (unmerged and merged) and the eager slots, at the smallest and largest concurrency
    assert [(r["variant"], r["concurrency"]) for r in decode["rows"]] == [
        ("dynamic", 2),
        ("dynamic, merged adapter", 2),
        ("static eager", 2),
        ("dynamic", 4),
        ("dynamic, merged adapter", 4),
        ("static eager", 4),
    ]
    for row in decode["rows"]:
        assert row["failed_episodes"] == 0 and row["episodes"] == row["concurrency"] and row["sampled_tokens"] > 0
        if row["variant"] != "dynamic":  # fp32 on the CPU: slots and merged weights sample what the dynamic loop does
            assert row["identical_episodes"] == 1.0 and row["logprob_diff_max"] < 1e-5
    assert decode["draw_check"]["equal"] == decode["draw_check"]["rows"] * decode["draw_check"]["steps"]
    assert [p["variant"] for p in decode["profiles"]] == ["dynamic"] and decode["profiles"][0]["steps"] > 0
    errands = sections["long_horizon"]  # one small iteration of the long-horizon recipe, beside its CPU reference
    assert errands["this_run"]["iterations"] == 1 and errands["curve"][0]["turns_mean"] > 1
    assert errands["cpu_reference"]["iterations"] == 40 and not errands["stopped_at_time_limit"]
    english = sections["long_horizon_english"]  # the English form: a warm-up by SFTTrainer, then one LOOP iteration
    warmed = english["warm_up"]
    assert warmed["steps"] == 2 and warmed["cut_to_tokens"] == 768 and warmed["demonstration_tokens"]["min"] > 768
    assert len(warmed["loss_log"]) == 2 and all(math.isfinite(loss) for loss in warmed["loss_log"])
    assert english["settings"]["environment_kwargs"]["form"] == "english" and english["settings"]["use_peft"]
    assert english["loop_train_error"] is None and english["this_run"]["iterations"] == 1
    assert english["curve"][0]["turns_mean"] > 1
    assert not english["stopped_at_time_limit"]


@pytest.mark.slow
def test_profile_section_in_cpu_mode_accounts_for_all_the_time_and_orders_the_memory_stages(cpu_run):
    done, out = cpu_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "gpu-check.json").read_text())["sections"]["profile"]
    assert record["status"] == "ok"
    kernels, memory = record["result"]["kernels"], record["result"]["memory"]
    every_other = kernels["every_other_layer_checkpointed"]
    for part in (kernels, every_other, kernels["without_checkpointing"], memory, memory["loop"], memory["grpo"]):
        assert "error" not in part and "skipped" not in part, part

    total = kernels["timed_seconds"]
    seconds = {c["category"]: c["seconds"] for c in kernels["categories"]}
    assert sum(seconds.values()) == pytest.approx(total, rel=1e-6)
    assert sum(p["seconds"] for p in kernels["phases"]) == pytest.approx(total, rel=1e-6)
    assert sum(c["share"] for c in kernels["categories"]) == pytest.approx(1.0, abs=1e-6)
    # CPU ops' self times tile the profiled update's wall time
    assert total == pytest.approx(kernels["wall_seconds"], rel=0.02)
    for category in ("base GEMMs", "LoRA GEMMs", "attention", "log-prob head", "optimizer"):
        assert seconds[category] > 0, category
    assert 0 < kernels["recompute_seconds"] < total  # checkpointing on: layers ran again in the backward
    assert kernels["mfu"] is None  # no GPU: no MFU
    assert kernels["without_checkpointing"]["ran"]
    # transformers' every_n_layers 2 checkpoints layers 0, 2, ...; the plan counts the others' activations
    assert every_other["ran"] and every_other["layers"] >= 2
    assert every_other["checkpointed_layers"] == -(-every_other["layers"] // 2)

    loop = memory["loop"]
    stages = [s["stage"] for s in loop["stages"]]
    assert [s["seq"] for s in loop["stages"]] == list(range(len(stages)))
    points = [s for s in stages if s in ("model built", "optimizer created", "after the first optimizer step")]
    assert points == ["model built", "optimizer created", "after the first optimizer step"]
    assert stages.index("old_logprobs") < stages.index("forward") < stages.index("backward")
    first_step = stages.index("optimizer")
    assert stages[first_step + 1] == "after the first optimizer step"
    spans = [s for s in stages if s in ("forward", "backward")]
    assert spans == ["forward", "backward"] * (len(spans) // 2)  # each micro-batch: its forward, then its backward
    assert stages.count("optimizer") == loop["optimizer_steps"]
    after = loop["stages"][first_step + 1]
    assert after["optimizer_state_gib"] > 0 and loop["stages"][0]["optimizer_state_gib"] == 0
    assert loop["breakdown"] is None  # the allocator history is CUDA's
    grpo = memory["grpo"]
    assert [s["stage"] for s in grpo["stages"]][:3] == ["model built", "trainer built", "optimizer created"]
    assert "after the first optimizer step" in [s["stage"] for s in grpo["stages"]]


def test_update_flops_follow_the_formula_in_its_docstring():
    from benchmarks.gpu_battery.memory import update_flops
    from loop_trainer.models.model_shape import LinearLayer, ModelShape

    linears = (LinearLayer("q_proj", 8, 8), LinearLayer("down_proj", 16, 8))
    shape = ModelShape(
        name="t",
        model_type="qwen2",
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=100,
        head_dim=4,
        max_position_embeddings=None,
        num_params=0,
        embedding_params=0,
        layer_params=0,
        linear_layers=linears,
    )
    p, lora, t, s = 8 * 8 + 16 * 8, 2 * (16 + 24), 10, 4  # weights, r=2 adapters, tokens, scored
    layers = 2 * t * (p + lora) + 2 * 1 * 8 * t * t
    head = 2 * s * 8 * 100
    backward = 2 * t * p + 4 * t * lora + 4 * 8 * t * t + head
    flops = update_flops(shape, [t], [s], lora_r=2, epochs=2)
    assert flops["model_flops"] == (layers + head) + 2 * (layers + head + backward)
    assert flops["hardware_flops"] == flops["model_flops"] + 2 * layers


def test_the_real_model_section_reports_a_gpu_run_against_the_committed_cpu_run(monkeypatch, tmp_path):
    """The section's GPU path up to the training run (which needs the GPU): without the carried GGUF it
    says where to get it; with a run's metrics it renders the curve beside the committed CPU run."""
    from benchmarks.gpu_battery import real_model
    from benchmarks.gpu_battery.common import read_jsonl

    monkeypatch.setenv("LOOP_SMOLLM2_GGUF", str(tmp_path / "absent.gguf"))
    assert "tools/gpu_gguf_unpack.sh" in real_model.run("gpu")["skipped"]
    assert "GPU mode only" in real_model.run("cpu")["skipped"]
    cpu = read_jsonl(real_model.CPU_REFERENCE)
    fake = [{**record, "seconds": record["seconds"] / 10} for record in cpu[:3]]
    result = {
        "convert_seconds": 3.0,
        "settings": real_model.GPU_KEYS,
        "wall_seconds": 30.0,
        "curve": [{"iteration": r["iteration"], **{k: r.get(k) for k in real_model.CURVE_KEYS}} for r in fake],
        "gpu": real_model._summary(fake),
        "cpu_reference": real_model._summary(cpu),
    }
    text = "\n".join(real_model.render(result))
    assert real_model._summary(cpu)["iterations"] == 20 and "| 2-core CPU (committed seed 0, float32) | 20 |" in text
    assert real_model._summary(fake)["iterations_per_minute"] == pytest.approx(
        10 * real_model._summary(cpu[:3])["iterations_per_minute"]
    )
    assert text.count("\n| 1 |") == 1 and "compile_decode_step: true" in text


def test_a_training_run_stopped_at_its_time_limit_keeps_the_iterations_it_logged(tmp_path):
    """The real-model and long-horizon sections train in a child process with a time limit: the iterations
    logged before the limit are what the section reports."""
    from benchmarks.gpu_battery.common import train_in_a_child

    out = tmp_path / "run"
    argv = ["--config", str(ROOT / "recipes" / "demo.yaml"), "--output_dir", str(out), "--iterations", "1000"]
    argv += ["--save_strategy", "no", "--disable_tqdm", "true", "--tiny_instruct_steps", "2"]
    argv += ["--tasks_per_iteration", "2", "--rollouts_per_task", "2", "--minibatch_size", "4"]
    run = train_in_a_child(argv, out, time_limit_s=60)
    assert run.status is None  # stopped at its limit (1,000 iterations do not fit in it)
    assert 1 <= len(run.records) < 1000 and [r["iteration"] for r in run.records] == list(
        range(1, len(run.records) + 1)
    )


def test_generation_concurrency_names_the_counts_the_generation_sections_collect_at(monkeypatch):
    from benchmarks.gpu_battery.common import GPU_SIZES, sizes_for

    monkeypatch.setenv("GENERATION_CONCURRENCY", "256, 64")
    assert sizes_for("gpu").generation_concurrency == [64, 256]
    assert sizes_for("gpu").loop_shape == GPU_SIZES.loop_shape  # only the counts change
    monkeypatch.setenv("GENERATION_CONCURRENCY", "64 many")
    with pytest.raises(ValueError, match="GENERATION_CONCURRENCY: whole numbers"):
        sizes_for("gpu")
    monkeypatch.delenv("GENERATION_CONCURRENCY")
    assert sizes_for("gpu").generation_concurrency == GPU_SIZES.generation_concurrency


def test_the_full_weight_engine_is_built_without_lora_layers(monkeypatch):
    from benchmarks.gpu_battery.vllm_generation import FULL_WEIGHTS, engine_variants

    assert all(not name.endswith(FULL_WEIGHTS) for name, _, _ in engine_variants("gpu", 64))
    monkeypatch.setenv("VLLM_BATTERY_FULL_WEIGHTS", "1")
    names = [name for name, _, _ in engine_variants("gpu", 64)] + [name for name, _, _ in engine_variants("cpu", 8)]
    assert names and all(name.endswith(FULL_WEIGHTS) for name in names)


def test_stopping_a_launched_child_ends_the_worker_it_started_in_a_session_of_its_own():
    """Under `accelerate launch`, torchrun starts its worker in a session of its own: a section that stops the
    launcher at its deadline must end the worker too (else it holds the GPU, and the pipes the section reads)."""
    import subprocess

    import psutil

    from benchmarks.gpu_battery.common import stop_process_tree

    # a launcher that starts a sleeping worker in a new session, as torchrun does, and waits on it
    launcher = (
        "import subprocess, sys, time; "
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
        "print(w.pid, flush=True); w.wait()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert child.stdout is not None
    worker = psutil.Process(int(child.stdout.readline()))
    assert worker.is_running() and os.getsid(worker.pid) != os.getsid(child.pid)
    stop_process_tree(child)
    child.wait(timeout=10)  # ended (killed, or returned once its worker was)
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


def test_the_english_warm_up_trains_on_the_replies_only(tmp_path):
    """The long_horizon_english section's data, prepared by TRL's SFTTrainer as the warm-up prepares it: each label is
    the token on a reply (or its end-of-turn) and -100 everywhere else, nothing cut."""
    from trl import SFTConfig, SFTTrainer

    from benchmarks.gpu_battery.common import build_model, qwen_tokenizer
    from benchmarks.gpu_battery.long_horizon_english import demonstrations_dataset

    tokenizer = qwen_tokenizer()
    dataset = demonstrations_dataset(tokenizer, 2)
    config = SFTConfig(output_dir=str(tmp_path), max_length=None, use_cpu=True, report_to="none", max_steps=1)
    trainer = SFTTrainer(build_model("tiny", "cpu"), args=config, train_dataset=dataset, processing_class=tokenizer)
    prepared = trainer.train_dataset
    assert prepared["input_ids"] == dataset["input_ids"]
    for ids, masks, labels in zip(dataset["input_ids"], dataset["assistant_masks"], prepared["labels"], strict=True):
        assert labels == [token if mask else -100 for token, mask in zip(ids, masks, strict=True)]
        assert 0 < sum(masks) < len(ids) / 4  # replies are a small share of an English episode's tokens
        assert tokenizer.decode([t for t, m in zip(ids, masks, strict=True) if m]).count("<|im_end|>") >= 10
