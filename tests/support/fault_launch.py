"""Running tests/support/fault_driver.py (a LOOP training process that can SIGKILL itself at a named moment) alone,
as several DDP processes (torchrun, gloo), or under ``accelerate launch --config_file <a DeepSpeed recipe>`` (fp32 on
CPU, gloo): shared by the crash-and-resume tests of both test suites."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from loop_trainer.net import free_local_port
from support.launch_env import launch_environment

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "support" / "fault_driver.py"
ACCELERATE_RECIPES = ROOT / "recipes" / "accelerate"


def save_vault_model(path: Path) -> Path:
    """The demo's warm-started tiny model (400 steps), saved to ``path`` for the driver processes."""
    from loop_trainer.envs import VaultEnv
    from loop_trainer.models.tiny import build_tiny_from_spec

    model, tokenizer = build_tiny_from_spec("tiny-instruct:vault", VaultEnv(num_tasks=16), seed=0, warm_up_steps=400)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def launch_fault_driver(
    model: Path, output_dir: Path, *options: str, config: str | None = None, processes: int = 1
) -> subprocess.CompletedProcess[str]:
    """The fault driver on ``model`` into ``output_dir``, as ``processes`` processes: under
    ``recipes/accelerate/<config>`` where a config is named, else one plain process or torchrun's. Returns the
    finished process (a killed run's return code is not 0)."""
    # (the DeepSpeed suite's conftest has set TORCH_EXTENSIONS_DIR, the cache of DeepSpeed's compiled CPU ops)
    environment = launch_environment(PYTHONPATH=str(DRIVER.parent), OMP_NUM_THREADS="1")
    launcher = [sys.executable]
    if config is not None:
        launcher += ["-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_RECIPES / config)]
        launcher += ["--num_processes", str(processes), "--mixed_precision", "no"]
        launcher += ["--main_process_port", str(free_local_port())]
    elif processes > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
        launcher += ["--master_addr", "127.0.0.1", "--master_port", str(free_local_port())]
    return subprocess.run(
        [*launcher, str(DRIVER), str(model), str(output_dir), *options],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "final" / "model.safetensors")
