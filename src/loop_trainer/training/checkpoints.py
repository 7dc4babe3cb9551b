"""Checkpoints that a crash cannot corrupt, and everything an exact resume needs.

A checkpoint is Trainer's own (weights or adapter, optimizer, scheduler, RNG states, trainer
state) plus ``loop_state.json``: the task sampler's position and the metrics of every iteration so
far. It is written into a staging directory and renamed into place only when complete, so a crash
mid-write leaves the previous checkpoints as they were and nothing that loads wrongly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

logger = logging.getLogger(__name__)

LOOP_STATE_FILE = "loop_state.json"
STAGING_DIR = ".staging-checkpoint"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not fit the model being trained."""


def staging_root(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / STAGING_DIR


def write_loop_state(directory: str | os.PathLike[str], state: dict[str, Any]) -> None:
    (Path(directory) / LOOP_STATE_FILE).write_text(json.dumps(state, default=float))


def read_loop_state(directory: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(directory) / LOOP_STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {LOOP_STATE_FILE}: not a complete LOOP checkpoint")
    return json.loads(path.read_text())


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def publish(staged: Path, final: Path) -> None:
    """Move a fully written checkpoint into place atomically (same file system)."""
    _fsync_tree(staged)
    if final.exists():  # the same iteration saved again after a resume
        retired = final.with_name(final.name + ".old")
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(final, retired)
        os.replace(staged, final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staged, final)
    _fsync_dir(final.parent)


def resolve(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """A checkpoint directory, or ``True`` (``"last"`` on the command line) for the newest complete
    checkpoint in ``output_dir``."""
    if resume_from_checkpoint in (None, False, "", "false", "False"):
        return None
    if resume_from_checkpoint in (True, "true", "True", "last"):
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise CheckpointError(f"resume_from_checkpoint: no {PREFIX_CHECKPOINT_DIR}-N directory in {output_dir}")
        return last
    path = str(resume_from_checkpoint)
    if not os.path.isdir(path):
        raise CheckpointError(f"resume_from_checkpoint: {path} is not a directory")
    read_loop_state(path)
    return path


_SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size")
_ADAPTER_KEYS = ("peft_type", "r", "lora_alpha", "target_modules", "modules_to_save")


def check_matches(checkpoint: str, model: Any) -> None:
    """Refuse a checkpoint of another model or adapter before Trainer loads it (PEFT would load
    an adapter with other target modules with only a warning)."""
    adapter_file = Path(checkpoint) / "adapter_config.json"
    peft_config = getattr(model, "peft_config", None)
    if adapter_file.is_file() != bool(peft_config):
        kind = "a LoRA adapter" if adapter_file.is_file() else "full weights"
        raise CheckpointError(f"checkpoint {checkpoint} holds {kind}, but this run trains "
                              f"{'an adapter' if peft_config else 'the full model'}")
    if peft_config:
        saved = json.loads(adapter_file.read_text())
        current = next(iter(peft_config.values())).to_dict()
        for key in _ADAPTER_KEYS:
            mine, theirs = _normalise(current.get(key)), _normalise(saved.get(key))
            if mine != theirs:
                raise CheckpointError(f"checkpoint {checkpoint} has an adapter with {key}={theirs!r}, this run {key}={mine!r}")
        return
    config_file = Path(checkpoint) / "config.json"
    if config_file.is_file():
        saved = json.loads(config_file.read_text())
        current = model.config.to_dict()
        for key in _SHAPE_KEYS:
            if key in saved and saved[key] != current.get(key):
                raise CheckpointError(f"checkpoint {checkpoint} is of a model with {key}={saved[key]!r}, "
                                      f"this run's model has {key}={current.get(key)!r}")


def _normalise(value: Any) -> Any:
    return sorted(value) if isinstance(value, (list, set, tuple)) else value


class CheckpointStager:
    """Writes checkpoints so that a crash cannot corrupt them: the Trainer saves into a staging
    directory, the LOOP state is added, and only then is the directory renamed into place and the
    oldest checkpoints rotated out. Every process calls :meth:`staged`; only the main one writes."""

    def __init__(self, is_main_process: bool, barrier: Callable[[], None], save_total_limit: int | None):
        self.is_main_process = is_main_process
        self.barrier = barrier
        self.save_total_limit = save_total_limit
        self.staging_root: Path | None = None
        """While a checkpoint is being written: where the Trainer must write it."""

    @contextlib.contextmanager
    def staged(self, output_dir: str | os.PathLike[str], iteration: int, loop_state: Callable[[], dict[str, Any]],
               on_published: Callable[[Path], None] = lambda _: None) -> Iterator[Path]:
        """Inside the block the Trainer writes ``checkpoint-<iteration>`` under the yielded staging
        root; on leaving it the checkpoint gets ``loop_state()`` and is published atomically."""
        final_root = Path(output_dir)
        staging = staging_root(final_root)
        if self.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        self.barrier()
        self.staging_root = staging
        try:
            yield staging
        finally:
            self.staging_root = None
        self.barrier()
        if self.is_main_process:
            name = f"{PREFIX_CHECKPOINT_DIR}-{iteration}"
            write_loop_state(staging / name, loop_state())
            publish(staging / name, final_root / name)
            on_published(final_root / name)
            shutil.rmtree(staging, ignore_errors=True)
            rotate_checkpoints(str(final_root), save_total_limit=self.save_total_limit, use_mtime=False)
        self.barrier()
