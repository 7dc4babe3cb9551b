"""Warmed-up tiny models, kept on disk: a ``tiny-instruct:<env>`` model's supervised warm-up takes from seconds to
an hour on a CPU, and every ``loop-train``, ``loop-eval``, ``loop-compare`` and resume of a recipe would otherwise
run it again (every process of a distributed run at once).

A warm-up is kept under a key made of everything its result depends on: the spec, its seed, steps and layers, the
environment's vocabulary and the demonstrations replayed for it (their text), the greedy probe's episode settings
and tasks where one decides when it is fitted, the source of loop_trainer and of the environment's module, and the
machine's numerics (torch's, transformers' and tokenizers' versions, the CPU's kernel family, torch's thread count
and default dtype). So a kept warm-up is the one a build would make, bit for bit; a changed setting, environment or
release misses and is built afresh. What the key cannot see: where a probe decides the end, grading code outside
the environment's module, or an instance setting that changes grading but not the tasks. Inputs that are not plain
data have no stable key and are not kept. The warm-up draws from a fork of torch's global random state
(:func:`~.tiny.build_tiny_from_spec`), so what follows a build (a LoRA adapter's initial weights) draws the same
numbers whether it warmed up or read.

Where: ``$LOOP_CACHE_DIR/tiny-warm-ups/<key>/`` (default ``~/.cache/loop_trainer``), or the folder
``LOOP_WARM_UP_CACHE`` names; delete it to start over. ``LOOP_WARM_UP_CACHE=0`` builds every time and keeps nothing.
One build at a time per key (a file lock): the processes of a distributed run wait for the first and read what it
kept. A cache that cannot be written or read costs only the time: the warm-up runs as before, and the log says why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from ..numerics import numerics_fingerprint
from .kept_folders import cache_home, one_builder, write_whole

logger = logging.getLogger(__name__)

FORMAT = 1
"""Bumped when what a kept warm-up holds changes."""
SETTING_VARIABLE = "LOOP_WARM_UP_CACHE"
WEIGHTS_FILE = "model.safetensors"
ABOUT_FILE = "about.json"


def cache_root() -> Path | None:
    """The folder kept warm-ups live in: ``LOOP_WARM_UP_CACHE`` if it names one, ``None`` if it is ``0`` (keeping
    off), else ``$LOOP_CACHE_DIR/tiny-warm-ups``."""
    setting = os.environ.get(SETTING_VARIABLE, "").strip()
    if setting.lower() in ("0", "false", "no", "off"):
        return None
    if setting:
        return Path(setting).expanduser()
    return cache_home() / "tiny-warm-ups"


@functools.cache
def _package_source_digest() -> str:
    """Every Python file of the installed loop_trainer, as one digest: any change to the code invalidates."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def module_source_digest(cls: type) -> str | None:
    """The digest of the file that defines ``cls`` (an environment's grading and demonstrations live there);
    ``None`` where there is no such file (a class made in a notebook)."""
    try:
        source = inspect.getsourcefile(cls)
    except TypeError:
        return None
    if source is None or not Path(source).is_file():
        return None
    return hashlib.sha256(Path(source).read_bytes()).hexdigest()


def machine_numerics() -> dict[str, Any]:
    """What decides a float's last bit here besides the inputs."""
    import tokenizers
    import transformers

    return {
        "numerics": numerics_fingerprint(),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "threads": torch.get_num_threads(),
        "default_dtype": str(torch.get_default_dtype()),
        "platform": platform.machine(),
    }


def warm_up_key(parts: Mapping[str, Any]) -> str:
    """The key of a warm-up built from ``parts``, on this machine, by this code. ``parts`` must be plain data
    (JSON's types, string keys): anything else has no stable text (a set's order, an object's address) and raises
    ``TypeError``."""
    payload = {"format": FORMAT, "code": _package_source_digest(), "machine": machine_numerics(), **parts}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def cached_warm_up(
    model: torch.nn.Module,
    parts: Mapping[str, Any] | None,
    warm_up: Callable[[], object],
    *,
    label: str,
    report: Callable[[str], None],
) -> None:
    """Run ``warm_up()`` (which trains ``model`` in place), or put into ``model`` the weights that a warm-up from the
    same ``parts`` left before. ``parts`` ``None``: the warm-up cannot be keyed (a probe whose settings are not
    known) or is not to be kept, so it runs and nothing is kept."""
    if parts is None:
        warm_up()
        return
    try:
        root = cache_root()
        key = None if root is None else warm_up_key(parts)
    except (TypeError, ValueError) as error:  # inputs that are not plain data: no stable key
        report(f"{label}: the warm-up's inputs have no stable key ({error}); warming up without keeping it")
        root = key = None
    except RuntimeError as error:  # no home folder to keep it in
        report(f"{label}: no folder to keep the warm-up in ({error}); warming up without it")
        root = key = None
    if root is None or key is None:
        warm_up()
        return
    folder = root / key
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(one_builder(folder))
        except OSError as error:
            report(f"{label}: cannot keep the warm-up in {root} ({error}); warming up without it")
            warm_up()
            return
        if (folder / WEIGHTS_FILE).is_file():
            initial = {name: value.clone() for name, value in model.state_dict().items()}
            try:
                _read(model, folder)
            except Exception as error:  # noqa: BLE001 - a damaged or foreign entry: built again, replaced
                model.load_state_dict(initial)  # a read that failed half-way may have copied some tensors in
                report(f"{label}: the kept warm-up in {folder} cannot be read ({error}); warming up again")
            else:
                report(f"{label}: the warm-up read from {folder} (kept by an earlier build from the same inputs)")
                return
        warm_up()
        try:
            _write(model, folder, parts, label)
        except Exception as error:  # noqa: BLE001 - a full disk (safetensors' own error, not an OSError), ...
            report(f"{label}: could not keep the warm-up in {folder} ({error}); the next build warms up again")


def _read(model: torch.nn.Module, folder: Path) -> None:
    missing, unexpected = load_model(model, folder / WEIGHTS_FILE, strict=False)
    if missing or unexpected:
        raise ValueError(f"it holds other weights (missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.eval()


def _write(model: torch.nn.Module, folder: Path, parts: Mapping[str, Any], label: str) -> None:
    def write(staging: Path) -> None:
        save_model(model, str(staging / WEIGHTS_FILE))
        about = {"spec": label, "built": time.strftime("%Y-%m-%d %H:%M:%S"), **machine_numerics()}
        about.update({name: parts[name] for name in ("seed", "steps", "layers") if name in parts})
        (staging / ABOUT_FILE).write_text(json.dumps(about, indent=1, default=str) + "\n")

    write_whole(folder, write)  # a damaged entry, read and refused above, is replaced
