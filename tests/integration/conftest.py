"""Fixtures the integration tests share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def gpu_check_cpu_run(tmp_path_factory):
    """One run of the GPU battery in CPU mode, every section (those that need DeepSpeed or vLLM say they
    are skipped in .venv; tests/vllm_deepspeed runs them in .vllm-venv): (completed process, out dir).
    Shared so the sections run once per session, whichever test reads them."""
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    return done, out
