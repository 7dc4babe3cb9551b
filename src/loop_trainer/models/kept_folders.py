"""Folders loop_trainer keeps between runs (converted packaged models, the tiny chat model, warmed-up tiny models):
where they live, one builder at a time, and each written whole.

Every process of a distributed run may ask for the same folder at once, and a process may die half-way through
writing one. So a folder is built under its lock (the others wait, then find it), into a staging folder beside it
that is renamed into place: a folder at its path is always complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def cache_home() -> Path:
    """``$LOOP_CACHE_DIR``, default ``~/.cache/loop_trainer``."""
    return Path(os.environ.get("LOOP_CACHE_DIR") or Path.home() / ".cache" / "loop_trainer")


@contextlib.contextmanager
def one_builder(target: Path) -> Iterator[None]:
    """Hold ``target``'s lock (``<target>.lock`` beside it, its parent folder made if missing): one build at a
    time, however many processes ask."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write_whole(target: Path, write: Callable[[Path], None]) -> None:
    """``write(folder)`` into a staging folder beside ``target``, then renamed to ``target`` (replacing what is
    there)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        staging.chmod(0o755)  # as a folder made by mkdir (mkdtemp's is private): a shared cache stays readable
        write(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
