"""Settings whose value is a mapping: a recipe gives a mapping, a command-line flag JSON text."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def mapping_setting(value: Mapping[str, Any] | str | None, name: str) -> dict[str, Any]:
    """A copy of the mapping-valued setting ``name`` (``{}`` when unset), once its dataclass's
    ``__post_init__`` has parsed JSON text into a mapping; text it left unparsed is refused."""
    if isinstance(value, str):
        raise ValueError(f"{name} must be a mapping (a JSON object on the command line), got {value!r}")
    return dict(value or {})
