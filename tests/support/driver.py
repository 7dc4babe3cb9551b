"""Launching tests/support/ddp_driver.py (1 process, torchrun, or accelerate + DeepSpeed) and reading its
per-case results: shared by the DDP and ZeRO-3 equivalence tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from support.launch_env import launch_environment

ROOT = Path(__file__).resolve().parents[2]  # tests/support/ -> the repository
DRIVER = ROOT / "tests" / "support" / "ddp_driver.py"
PYTHON = [sys.executable]
# update_policy's metrics that must agree between the same update on one process and on several
COMPARED_METRICS = (
    "loss",
    "grad_norm",
    "kl",
    "clip_frac",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "sampler_logprob_diff",
    "sampler_logprob_diff_max",
)


def run_driver(
    launcher: Sequence[str],
    output_dir: Path,
    cases: Mapping[str, dict],
    *,
    label: str,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> dict[str, tuple[dict, dict[str, torch.Tensor]]]:
    """Run every case under ``launcher`` (e.g. ``[sys.executable]``); returns case -> (metrics, weights).
    Raises AssertionError with the driver's output if it fails or does not finish in ``timeout`` s."""
    quiet = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    environment = launch_environment(**{**quiet, **(env or {})})
    command = [*launcher, str(DRIVER), str(output_dir), json.dumps(dict(cases))]
    # Its own session, so that a hang (e.g. unmatched collectives) ends with all its processes.
    process = subprocess.Popen(
        command,
        env=environment,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{label} did not finish in {timeout} s:\n{stdout[-4000:]}\n{stderr[-8000:]}") from None
    assert process.returncode == 0, f"{label} failed:\n{stdout[-4000:]}\n{stderr[-8000:]}"
    return {
        name: (
            json.loads((output_dir / name / "result.json").read_text()),
            torch.load(output_dir / name / "weights.pt", weights_only=True),
        )
        for name in cases
    }
