"""``loop-train --dry-run`` under an `accelerate launch` with a DeepSpeed config: the plan follows the launch's ZeRO
stage and where it keeps the optimizer state. Here because transformers builds accelerate's DeepSpeed plugin (which
needs DeepSpeed installed) for TrainingArguments as soon as the launch's variables say DeepSpeed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loop_trainer.cli.train import cli

ROOT = Path(__file__).resolve().parents[2]
R7B = ["--config", "recipes/appworld/qwen2.5-7b-instruct.yaml"]


@pytest.fixture(autouse=True)
def _at_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    for variable in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(variable, raising=False)


def dry_run(capsys, *flags: str) -> tuple[int, str]:
    status = cli([*flags, "--dry-run"])
    return status, capsys.readouterr().out


def test_a_launch_that_offloads_the_optimizer_is_planned_with_it(capsys, monkeypatch):
    """Under `accelerate launch --config_file recipes/accelerate/zero2-offload.yaml` (the variables accelerate sets for
    its DeepSpeed config) the plan has the optimizer state in CPU memory, not on the GPU."""
    flags = [*R7B, "--use_peft", "false", "--plan_gpus", "1", "--plan_gpu_memory_gib", "141"]
    _, on_gpu = dry_run(capsys, *flags)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    _, zero2 = dry_run(capsys, *flags)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    _, offloaded = dry_run(capsys, *flags)

    def trainable_state(out: str) -> float:
        [line] = [line for line in out.splitlines() if line.startswith("trainable state")]
        return float(line.split()[3])

    assert "1 GPUs x 141 GiB, no DeepSpeed" in on_gpu and "1 GPUs x 141 GiB, ZeRO-2 (estimates" in zero2
    assert "1 GPUs x 141 GiB, ZeRO-2, optimizer state on the CPU (estimates" in offloaded
    assert trainable_state(zero2) > 100 and trainable_state(offloaded) == 0  # the 7B's 16 B a parameter
    assert "gradients on their way to the CPU" in offloaded and "of CPU memory (or NVMe) per process" in offloaded
    assert "offload_param_device" not in offloaded
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "cpu")
    _, both = dry_run(capsys, *flags)
    assert "note: the launch's offload_param_device keeps ZeRO-3's weight partitions off the GPU" in both


def test_a_deepspeed_json_is_read_for_the_stage_and_the_offload(capsys, monkeypatch, tmp_path):
    """An accelerate config that names a DeepSpeed JSON (``deepspeed_config_file``) passes no stage or offload
    variables: the plan reads them from the JSON. Offload at another stage than 2 is noted, not planned. Under
    ZeRO-3 the plan's meta-device count stays outside DeepSpeed's zero.Init (which would start a process group)."""
    flags = [*R7B, "--use_peft", "false", "--plan_gpus", "1", "--plan_gpu_memory_gib", "141"]
    config = tmp_path / "ds.json"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(config))
    settings = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    config.write_text(json.dumps(settings))
    _, zero2 = dry_run(capsys, *flags)
    assert "1 GPUs x 141 GiB, ZeRO-2, optimizer state on the CPU (estimates" in zero2
    assert "gradients on their way to the CPU" in zero2
    settings["zero_optimization"]["stage"] = 3
    config.write_text(json.dumps(settings))
    _, zero3 = dry_run(capsys, *flags)
    assert "1 GPUs x 141 GiB, ZeRO-3 (estimates" in zero3 and "gradients on their way to the CPU" not in zero3
    assert "note: offload_optimizer_device at ZeRO-3: the plan counts the optimizer state on the GPU" in zero3
