"""The GPU battery (``benchmarks/gpu_check.py``) run in its CPU mode by the tests that check its sections."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.launch_env import launch_environment

ROOT = Path(__file__).resolve().parents[2]


def run_cpu_mode(out: Path, sections: list[str] | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """``python -m benchmarks.gpu_check --mode cpu`` with this interpreter from the repository root, no
    CUDA device visible; every section unless ``sections`` names some. Results in ``out``."""
    env = launch_environment(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--mode", "cpu", "--out", str(out)]
    return subprocess.run(
        command + (["--sections", *sections] if sections else []),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def section_result(run: tuple[subprocess.CompletedProcess, Path], name: str) -> dict:
    """Section ``name``'s result from a :func:`run_cpu_mode` run (``(process, out)``), which must have
    run it, not skipped it."""
    done, out = run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "gpu-check.json").read_text())["sections"][name]
    assert record["status"] == "ok", record
    result = record["result"]
    assert "skipped" not in result, result
    return result
