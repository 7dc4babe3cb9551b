"""Checkpoints that a crash cannot corrupt, and everything an exact resume needs.

A checkpoint is Trainer's own (weights or adapter, optimizer, scheduler, RNG states, trainer
state) plus ``loop_state.json``: the task sampler's position and the metrics of every iteration so
far, and the settings an exact resume depends on (:mod:`.resume`). It is written into a
staging directory and renamed into place only when complete, so a crash mid-write leaves the previous
checkpoints as they were and nothing that loads wrongly; Ctrl-C while it is renamed into place waits
until the rename is done.

This module also guards an ``output_dir``: a fresh run refuses a directory holding another run's
checkpoints (:func:`check_fresh_output_dir`); :mod:`.resume` compares a resumed run's settings with
the checkpoint's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..interrupts import deferred_interrupt
from .console import quiet_transformers_bars

logger = logging.getLogger(__name__)

LOOP_STATE_FILE = "loop_state.json"
STAGING_DIR = ".staging-checkpoint"
FINISHED_FILE = "run_finished.json"
"""Written to output_dir when a run has done all its iterations: a previous run without it (or whose newest
checkpoint is newer) was interrupted, and overwrite_output_dir alone does not delete it."""
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")

# What a run writes into output_dir besides the final model files (which a new run's save replaces):
# overwrite_output_dir deletes these, and nothing else.
RUN_OUTPUTS = ("metrics.jsonl", "learning_curve.png", "viewer", "rollouts", FINISHED_FILE, STAGING_DIR)


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
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}): not a complete LOOP checkpoint") from None


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


def checkpoint_dirs(output_dir: str | os.PathLike[str]) -> list[Path]:
    """Every ``checkpoint-N`` directory in ``output_dir``, complete or not, oldest (lowest N) first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _CHECKPOINT_NAME.match(path.name)) and path.is_dir()
    ]
    return [path for _, path in sorted(found)]


def is_complete(checkpoint: str | os.PathLike[str]) -> bool:
    """A checkpoint is complete once its ``loop_state.json`` is written (it is written last)."""
    return (Path(checkpoint) / LOOP_STATE_FILE).is_file()


def last_complete_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``output_dir``, or None."""
    return next((path for path in reversed(checkpoint_dirs(output_dir)) if is_complete(path)), None)


def is_fresh(resume_from_checkpoint: str | bool | None) -> bool:
    """Whether ``resume_from_checkpoint`` asks for no resume (a fresh run)."""
    return resume_from_checkpoint in (None, False, "", "false", "False")


def resolve(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """A checkpoint directory, or ``True`` (``"last"`` on the command line) for the newest complete
    checkpoint in ``output_dir`` (incomplete ones are skipped, with a warning)."""
    if is_fresh(resume_from_checkpoint):
        return None
    if resume_from_checkpoint in (True, "true", "True", "last"):
        found = checkpoint_dirs(output_dir)
        if not found:
            raise CheckpointError(f"resume_from_checkpoint: no {PREFIX_CHECKPOINT_DIR}-N directory in {output_dir}")
        last = last_complete_checkpoint(output_dir)
        if last is None:
            raise CheckpointError(
                f"resume_from_checkpoint: no complete checkpoint in {output_dir} "
                f"({', '.join(p.name for p in found)} {'has' if len(found) == 1 else 'have'} "
                f"no {LOOP_STATE_FILE}): nothing to resume; start over with "
                "--overwrite_output_dir true, or choose another output_dir"
            )
        incomplete = [path.name for path in found if _number(path) > _number(last)]
        if incomplete:
            logger.warning(
                "resume_from_checkpoint last: skipping %s (no %s: incomplete); resuming from %s",
                ", ".join(incomplete),
                LOOP_STATE_FILE,
                last.name,
            )
        return str(last)
    path = str(resume_from_checkpoint)
    if not os.path.isdir(path):
        raise CheckpointError(f"resume_from_checkpoint: {path} is not a directory")
    read_loop_state(path)
    return path


def _number(checkpoint: Path) -> int:
    match = _CHECKPOINT_NAME.match(checkpoint.name)
    assert match is not None, f"{checkpoint} is no checkpoint directory"  # callers pass matched names only
    return int(match.group(1))


def mark_finished(output_dir: str | os.PathLike[str], iteration: int) -> None:
    """Record in ``output_dir`` that the run did all its iterations (``iteration``, the last)."""
    (Path(output_dir) / FINISHED_FILE).write_text(json.dumps({"iteration": iteration}))


def interrupted_at(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint of a run in ``output_dir`` that stopped before its last iteration (a crash, a
    Ctrl-C, a lost machine), or None: no checkpoint, or the run finished after its newest one."""
    checkpoints = checkpoint_dirs(output_dir)
    if not checkpoints:
        return None
    try:
        finished = int(json.loads((Path(output_dir) / FINISHED_FILE).read_text())["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return checkpoints[-1]
    return checkpoints[-1] if _number(checkpoints[-1]) > finished else None


def check_fresh_output_dir(
    output_dir: str | os.PathLike[str], overwrite: bool, overwrite_interrupted: bool = False
) -> list[Path]:
    """Before a fresh run (no resume): refuse an ``output_dir`` that holds another run's checkpoints,
    unless ``overwrite``. Rotation keeps the highest-numbered checkpoints, so the new run's would be
    deleted as they are written and a later ``resume_from_checkpoint: last`` would continue the old run.
    ``overwrite`` deletes a finished run only: one that stopped before its last iteration is kept unless
    ``overwrite_interrupted`` too (a recipe copied from the demo, which sets overwrite_output_dir, would
    otherwise delete a crashed 7B run on its second start). Returns what :func:`clear_previous_run` would
    delete (empty when there is no previous run)."""
    checkpoints = checkpoint_dirs(output_dir)
    if not checkpoints:
        return []
    if not overwrite:
        names = ", ".join(path.name for path in checkpoints[-3:])
        more = f" and {len(checkpoints) - 3} more" if len(checkpoints) > 3 else ""
        raise CheckpointError(
            f"output_dir {output_dir} already holds another run's checkpoints ({names}{more}): continue that run "
            "with --resume_from_checkpoint last, choose another output_dir, or pass --overwrite_output_dir true to "
            f"delete it ({_what_overwrite_deletes()})"
        )
    stopped = interrupted_at(output_dir)
    if stopped is not None and not overwrite_interrupted:
        raise CheckpointError(
            f"output_dir {output_dir} holds a run that stopped before its last iteration (newest checkpoint "
            f"{stopped.name}), which overwrite_output_dir does not delete: continue it with --resume_from_checkpoint "
            "last, choose another output_dir, or pass --overwrite_interrupted_run true to delete it and start over"
        )
    root = Path(output_dir)
    return checkpoints + [root / name for name in RUN_OUTPUTS if (root / name).exists()]


def _what_overwrite_deletes() -> str:
    return (
        "its checkpoint-N directories, "
        + ", ".join(f"{name}/" if "." not in name[1:] else name for name in RUN_OUTPUTS if name != STAGING_DIR)
        + f" and {STAGING_DIR}/; the model files at the top are replaced when the new run saves"
    )


def clear_previous_run(output_dir: str | os.PathLike[str], paths: list[Path]) -> None:
    """Delete the previous run's outputs found by :func:`check_fresh_output_dir` (overwrite_output_dir)."""
    if not paths:
        return
    logger.warning(
        "overwrite_output_dir: deleting the previous run in %s: %s",
        output_dir,
        ", ".join(path.name + ("/" if path.is_dir() else "") for path in paths),
    )
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def rotate(output_dir: str | os.PathLike[str], save_total_limit: int | None, keep: Path) -> None:
    """Delete the oldest complete checkpoints beyond ``save_total_limit``, never ``keep`` (the one just
    published). Incomplete ``checkpoint-N`` directories neither count nor get deleted, so one with a
    high number cannot push out the checkpoints a resume needs."""
    if save_total_limit is None or save_total_limit <= 0:
        return
    complete = [path for path in checkpoint_dirs(output_dir) if is_complete(path) and path != keep]
    for path in complete[: max(0, len(complete) - (save_total_limit - 1))]:
        shutil.rmtree(path, ignore_errors=True)


_SHAPE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
_ADAPTER_KEYS = ("peft_type", "r", "lora_alpha", "target_modules", "modules_to_save")


def check_matches(checkpoint: str, model: Any) -> None:
    """Refuse a checkpoint of another model or adapter before Trainer loads it (PEFT would load
    an adapter with other target modules with only a warning)."""
    adapter_file = Path(checkpoint) / "adapter_config.json"
    peft_config = getattr(model, "peft_config", None)
    if adapter_file.is_file() != bool(peft_config):
        kind = "a LoRA adapter" if adapter_file.is_file() else "full weights"
        raise CheckpointError(
            f"checkpoint {checkpoint} holds {kind}, but this run trains "
            f"{'an adapter' if peft_config else 'the full model'}"
        )
    if peft_config:
        saved = json.loads(adapter_file.read_text())
        current = next(iter(peft_config.values())).to_dict()
        for key in _ADAPTER_KEYS:
            mine, theirs = _normalise(current.get(key)), _normalise(saved.get(key))
            if mine != theirs:
                raise CheckpointError(
                    f"checkpoint {checkpoint} has an adapter with {key}={theirs!r}, this run {key}={mine!r}"
                )
        return
    config_file = Path(checkpoint) / "config.json"
    if config_file.is_file():
        saved = json.loads(config_file.read_text())
        current = model.config.to_dict()
        for key in _SHAPE_KEYS:
            if key in saved and saved[key] != current.get(key):
                raise CheckpointError(
                    f"checkpoint {checkpoint} is of a model with {key}={saved[key]!r}, "
                    f"this run's model has {key}={current.get(key)!r}"
                )


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
    def staged(
        self,
        output_dir: str | os.PathLike[str],
        iteration: int,
        loop_state: Callable[[], dict[str, Any]],
        on_published: Callable[[Path], None] = lambda _: None,
    ) -> Iterator[Path]:
        """Inside the block the Trainer writes ``checkpoint-<iteration>`` under the yielded staging
        root (without transformers' progress bars); on leaving it the checkpoint gets ``loop_state()``
        and is published atomically."""
        final_root = Path(output_dir)
        staging = staging_root(final_root)
        if self.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        self.barrier()
        self.staging_root = staging
        try:
            with quiet_transformers_bars():  # no "Writing model shards" bar at every checkpoint
                yield staging
        finally:
            self.staging_root = None
        self.barrier()
        if self.is_main_process:
            name = f"{PREFIX_CHECKPOINT_DIR}-{iteration}"
            with deferred_interrupt():  # Ctrl-C here waits until the checkpoint is in place
                write_loop_state(staging / name, loop_state())
                publish(staging / name, final_root / name)
                shutil.rmtree(staging, ignore_errors=True)
                rotate(final_root, self.save_total_limit, keep=final_root / name)
            on_published(final_root / name)
        self.barrier()
