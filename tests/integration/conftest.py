"""Fixtures the integration tests share."""

from __future__ import annotations

import pytest

from support.gpu_check import run_cpu_mode


@pytest.fixture(scope="session")
def gpu_check_cpu_run(tmp_path_factory):
    """One run of the GPU battery in CPU mode, every section (those that need DeepSpeed or vLLM say they
    are skipped in .venv; tests/vllm_deepspeed runs them in .vllm-venv): (completed process, out dir).
    Shared so the sections run once per session, whichever test reads them."""
    out = tmp_path_factory.mktemp("gpu-check")
    return run_cpu_mode(out, timeout=1500), out
