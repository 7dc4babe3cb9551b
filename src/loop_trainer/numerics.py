"""Which machine a float-exact result belongs to.

torch picks its CPU kernels by instruction set (AVX2, AVX-512, AMX, ...), and a difference in the last bit of one
logit changes a sampled token, then a whole trajectory. So what is exact on one kind of CPU is kept under that
kind's fingerprint: the demo's recorded numerics (tests/data/demo-seed0/) and the warmed-up tiny models
(:mod:`loop_trainer.models.warm_up_cache`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# The instruction-set flags torch's and oneDNN's kernel choice depends on.
KERNEL_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "vnni", "bf16")


def cpu_kernel_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return sorted(flag for flag in line.split(":", 1)[-1].split() if flag.startswith(KERNEL_FLAG_PREFIXES))


def numerics_fingerprint() -> str:
    """``torch<version>-<cpu capability>-<hash of the CPU's kernel-relevant flags>``."""
    import torch

    digest = hashlib.sha256(" ".join(cpu_kernel_flags()).encode()).hexdigest()[:10]
    return f"torch{torch.__version__}-{torch.backends.cpu.get_cpu_capability().lower()}-{digest}"
