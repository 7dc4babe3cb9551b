"""Checkpoints that a crash cannot corrupt, and everything an exact resume needs.

A checkpoint is Trainer's own (weights or adapter, optimizer, scheduler, RNG states, trainer
state) plus ``loop_state.json``: the task sampler's position and the metrics of every iteration so
far. It is written into a staging directory and renamed into place only when complete, so a crash
mid-write leaves the previous checkpoints as they were and nothing that loads wrongly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint, rotate_checkpoints

from .run_log import METRICS_FILE, append_metrics

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


class CheckpointMixin:
    """LOOPTrainer's checkpointing: staged, atomic checkpoints with the LOOP state, and exact resume.
    (Mixed into LOOPTrainer, before GRPOTrainer; uses its task_sampler and history.)"""

    _checkpoint_root: Path | None = None

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> TrainOutput:
        """Train for ``args.iterations`` iterations. ``resume_from_checkpoint`` (a checkpoint
        directory, or True for the newest one in ``output_dir``) continues a run exactly: the same
        next tasks and samples, the optimizer's state, the metrics so far."""
        checkpoint = resolve(resume_from_checkpoint, self.args.output_dir)
        if checkpoint is not None:
            check_matches(checkpoint, self.model)
        return super().train(resume_from_checkpoint=checkpoint, trial=trial, **kwargs)

    def _restore_loop_state(self, checkpoint: str) -> None:
        state = read_loop_state(checkpoint)
        self.task_sampler.load_state_dict(state["task_sampler"])
        self.history = list(state["history"])
        if self.is_world_process_zero():  # the curve continues; iterations after the checkpoint are redone
            path = Path(self.args.output_dir) / METRICS_FILE
            path.unlink(missing_ok=True)
            for record in self.history:
                append_metrics(self.args.output_dir, record)
        logger.info("resumed from %s after iteration %d", checkpoint, self.state.global_step)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # Trainer writes the checkpoint into a staging directory; it is renamed into place only
        # once complete (with loop_state.json), so a crash mid-write never leaves a bad checkpoint.
        final_root = Path(super()._get_output_dir(trial))
        staging = staging_root(final_root)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._checkpoint_root = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._checkpoint_root = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            write_loop_state(staging / name, {
                "iteration": self.state.global_step,
                "task_sampler": self.task_sampler.state_dict(),
                "history": self.history,
            })
            publish(staging / name, final_root / name)
            self._push_published_checkpoint(final_root / name)
            shutil.rmtree(staging, ignore_errors=True)
            rotate_checkpoints(str(final_root), save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
        self.accelerator.wait_for_everyone()

    def _get_output_dir(self, trial: Any) -> str:
        return str(self._checkpoint_root) if self._checkpoint_root is not None else super()._get_output_dir(trial)
