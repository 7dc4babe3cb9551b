"""Overlapped LOOP (``max_staleness: 1``) on 2 DeepSpeed ZeRO-3 processes equals it on 1 plain process.

tests/support/fault_driver.py trains 3 iterations on a generator holding its own weights (tests/support/apart.py),
once alone and once under ``accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 2``
(fp32 on CPU, gloo). Each process collects its share of the next batch on its own thread while the ZeRO-3 update
runs its collectives on the main thread; the weight sync gathers the partitioned layers on the main thread between
the update and the next collection. The trajectories must be the same and the final weights agree to fp32
precision."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loop_trainer.net import free_local_port

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "support" / "fault_driver.py"
ZERO3_CONFIG = ROOT / "recipes" / "accelerate" / "zero3.yaml"
OVERLAPPED = ("--max-staleness", "1", "--iterations", "3")


def drive(model: Path, output_dir: Path, zero3: bool) -> None:
    cache = Path(os.environ.get("LOOP_CACHE_DIR", Path.home() / ".cache" / "loop_trainer"))
    environment = {
        **os.environ,
        "PYTHONPATH": str(DRIVER.parent),
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(cache / "torch-extensions")),
    }
    # The colocated vLLM tests before this one leave a distributed environment in this process's variables.
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_DEEPSPEED"):
        environment.pop(name, None)
    launcher = [sys.executable]
    if zero3:
        launcher += ["-m", "accelerate.commands.launch", "--config_file", str(ZERO3_CONFIG), "--num_processes", "2"]
        launcher += ["--mixed_precision", "no", "--main_process_port", str(free_local_port())]
    result = subprocess.run(
        [*launcher, str(DRIVER), str(model), str(output_dir), *OVERLAPPED],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-6000:]


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_overlap_on_two_zero3_processes_matches_one_process(tmp_path):
    from loop_trainer.envs import VaultEnv
    from loop_trainer.models.tiny import build_tiny_from_spec

    model, tokenizer = build_tiny_from_spec("tiny-instruct:vault", VaultEnv(num_tasks=16), seed=0, warm_up_steps=400)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    drive(model_dir, tmp_path / "one", zero3=False)
    drive(model_dir, tmp_path / "zero3", zero3=True)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "zero3")
    keys = ("reward_mean", "num_rollouts", "num_kept", "optimizer_steps", "policy_staleness", "sampled_tokens")
    assert [[m[k] for k in keys] for m in two] == [[m[k] for k in keys] for m in one]
    assert [m["policy_staleness"] for m in two] == [0.0, 1.0, 1.0]
    assert all(m["weight_sync_logprob_diff_max"] < 1e-4 for m in two)  # the gathered layers reached the generator
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], abs=1e-5)
    want = load_file(tmp_path / "one" / "final" / "model.safetensors")
    have = load_file(tmp_path / "zero3" / "final" / "model.safetensors")
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=1e-5, msg=name)
