"""A small synthetic AppWorld world, built offline, for the tests (not shipped in the package).

AppWorld runs in its own virtualenv (its pins clash with the main one); this module only shells
out to it. :func:`build_synthetic_world` makes that venv (``tools/ensure_appworld_venv.sh``) and
runs ``tests/support/worldgen.py`` under it, once per version of the generator
and of ``requirements/appworld.lock``, into a cache dir. The returned root holds ``data/``
(AppWorld format: ``APPWORLD_ROOT=<root>`` works for ``appworld.AppWorld``, the environment
server and ``appworld evaluate``) and ``synthetic_solutions.json`` (per task: solution code,
the no-op pass fraction, number of tests, difficulty, split).

The cached root is shared: worlds write ``experiments/outputs/<experiment_name>`` under
``APPWORLD_ROOT``, so give every run its own experiment name, or point ``APPWORLD_ROOT`` at a
fresh directory whose ``data`` is a symlink to ``<root>/data``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["appworld_python", "build_synthetic_world", "ensure_appworld_venv", "repo_root"]

WORLDGEN = Path(__file__).resolve().with_name("worldgen.py")
COMPLETE_MARKER = ".complete"


def _cache_dir() -> Path:
    return Path(os.environ.get("LOOP_CACHE_DIR", Path.home() / ".cache" / "loop_trainer"))


def repo_root() -> Path:
    """The source checkout these tests live in (tests/support/ -> the repository)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "tools" / "ensure_appworld_venv.sh").is_file():
        raise RuntimeError(
            f"tools/ensure_appworld_venv.sh not found under {root}: run the tests from a source checkout"
        )
    return root


def _run(command: list[str], what: str, **kwargs) -> str:
    """Run ``command``; its stdout, or a RuntimeError with the end of its output."""
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result.stdout


@functools.cache
def ensure_appworld_venv() -> Path:
    """Create (once per requirements/appworld.lock) AppWorld's venv; return its directory."""
    root = repo_root()
    output = _run(["bash", str(root / "tools" / "ensure_appworld_venv.sh")], "tools/ensure_appworld_venv.sh", cwd=root)
    return Path(output.strip().splitlines()[-1])


def appworld_python() -> Path:
    """The AppWorld venv's python (the venv is created on first use)."""
    return ensure_appworld_venv() / "bin" / "python"


def _world_key() -> str:
    digest = hashlib.sha256(WORLDGEN.read_bytes())
    with contextlib.suppress(RuntimeError):
        digest.update((repo_root() / "requirements" / "appworld.lock").read_bytes())
    return digest.hexdigest()[:16]


def build_synthetic_world(cache_dir: Path | None = None, python: Path | str | None = None) -> Path:
    """Build (once per generator + lock version) the synthetic world and return its root.

    ``python``: an AppWorld venv's python (``appworld install`` done); by default the venv from
    tools/ensure_appworld_venv.sh. Safe to call from concurrent processes (flock); the world is
    built in a temporary directory and renamed into place.
    """
    cache = Path(cache_dir) if cache_dir is not None else _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / f"appworld-synthetic-{_world_key()}"
    if (root / COMPLETE_MARKER).is_file():
        return root
    with open(cache / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / COMPLETE_MARKER).is_file():
            return root
        interpreter = str(python) if python is not None else str(appworld_python())
        shutil.rmtree(root, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=cache))
        os.chmod(tmp, 0o755)
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith("APPWORLD_")}
            _run([interpreter, str(WORLDGEN), "--root", str(tmp)], "worldgen.py", cwd=tmp, env=env)
            (tmp / COMPLETE_MARKER).touch()
            os.rename(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root
