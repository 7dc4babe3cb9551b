from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

# Test modules in every folder import the shared helpers as `support.*` (tests/support/).
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
# A test run started in the background by a shell without job control ignores SIGINT, as would every process it
# starts. The tests of Ctrl-C send SIGINT to loop-train and to themselves: they get Python's own handling, as in a
# terminal (and the processes they start the default one, which Python replaces with its own).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Warmed-up tiny models (loop_trainer.models.warm_up_cache) are kept for this test run only, in a folder named
# here, in the process that starts the run: its pytest-xdist workers and every subprocess inherit the variable, so
# they share the folder, which goes when the run ends. A run reuses its own warm-ups and never reads the user's or
# an earlier run's (unless LOOP_WARM_UP_CACHE is set already). A test that watches a warm-up itself sets it to 0.
WARM_UPS = Path(tempfile.gettempdir()) / f"loop-test-warm-ups-{os.getpid()}"
os.environ.setdefault("LOOP_WARM_UP_CACHE", str(WARM_UPS))


def pytest_sessionfinish(session):
    if "PYTEST_XDIST_WORKER" not in os.environ and os.environ.get("LOOP_WARM_UP_CACHE") == str(WARM_UPS):
        shutil.rmtree(WARM_UPS, ignore_errors=True)


@pytest.fixture()
def python_sigint():
    """Python's own SIGINT handler for one test that sends itself SIGINT (asyncio's runner replaces it for a while,
    and a test before it in the same process may have left another), and the one before put back after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


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
