"""``loop-train --dry-run`` under an `accelerate launch` with a DeepSpeed config: the plan follows the launch's ZeRO
stage and where it keeps the optimizer state. Here because transformers builds accelerate's DeepSpeed plugin (which
needs DeepSpeed installed) for TrainingArguments as soon as the launch's variables say DeepSpeed."""

from __future__ import annotations

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
    assert "note: offload_param_device: the launch keeps ZeRO-3's weight partitions off the GPU" in both
