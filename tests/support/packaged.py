"""Whether the packaged SmolLM2 model can be used here (``needs_packaged_model``), for the tests that
convert or train it. ``make test``'s virtualenv has everything; a bare checkout skips them, saying why."""

from __future__ import annotations

import importlib.util

import pytest

from loop_trainer.models.packaged import PACKAGED, PackagedModelError, locate_gguf

SMOLLM2 = PACKAGED["smollm2-135m-instruct"]


def unavailable() -> str | None:
    """Why the packaged model cannot be used here, or None."""
    if importlib.util.find_spec("gguf") is None:
        return "gguf is not installed (make venv installs it: requirements/cpu.lock)"
    try:
        locate_gguf(SMOLLM2)
    except PackagedModelError as error:
        return str(error)
    return None


needs_packaged_model = pytest.mark.skipif(
    unavailable() is not None, reason=f"packaged model unavailable: {unavailable()}"
)
