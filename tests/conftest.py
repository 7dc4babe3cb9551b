from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Test modules in every folder import the shared helpers as `support.*` (tests/support/).
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from support.qwen import build_qwen25_tokenizer

    cache = Path(os.environ.get("LOOP_CACHE_DIR", Path.home() / ".cache" / "loop_trainer")) / "test-assets"
    return build_qwen25_tokenizer(cache)


@pytest.fixture()
def vault_tiny():
    """(env, model, tokenizer): the built-in environment and a fresh tiny model for it."""
    from loop_trainer.envs import VaultEnv
    from loop_trainer.models.tiny import build_tiny_for_environment

    env = VaultEnv(num_tasks=16)
    model, tokenizer = build_tiny_for_environment(env.vocabulary(), seed=0)
    return env, model, tokenizer
