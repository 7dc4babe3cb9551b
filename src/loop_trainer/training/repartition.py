"""Resuming a DeepSpeed ZeRO run on another number of processes, through DeepSpeed's universal checkpoint.

Under ZeRO 1-3 each process saves its share of the optimizer state (``global_stepN/``), cut for the number of
processes that wrote it, and DeepSpeed loads those shares only into the same number. Its universal checkpoint is the
same state cut per parameter instead (``zero/<parameter>/{fp32,exp_avg,exp_avg_sq}.pt``), which a launch of any
size loads (``checkpoint.load_universal`` in the DeepSpeed config). A resume of a checkpoint written under the same
ZeRO stage on another number of processes goes this way:

1. :func:`universal_resume` (before the engine is built): the main process converts the checkpoint once, with
   DeepSpeed's own script (``python -m deepspeed.checkpoint.ds_to_universal``), into ``global_stepN_universal/``
   beside the original, which it leaves as it was; a conversion found complete from an earlier resume (or made by
   hand with the same command) is reused. Every process then switches ``load_universal`` on in the launch's
   DeepSpeed config.
2. Transformers' Trainer loads the checkpoint as ever, and DeepSpeed repartitions the state as it loads it.
3. :func:`mend_zero3_load`: DeepSpeed 0.19's ZeRO-3 universal load restores two things wrongly, which a resume
   would otherwise carry into every later step (measured, a 2-process ZeRO-3 run resumed on 1: final weights
   1.3e-4 from the uninterrupted run's, 1.2e-6 with both mended, where the same run on 1 and 2 processes differ by
   1.0e-6): the first parameter group's hyperparameters are copied onto every group (weight decay on the norms and
   biases, whose group has none), and one Adam step count is shared by every group, so each optimizer step counts
   once per group. ZeRO-1 and ZeRO-2 load both right.

A change of ZeRO stage, or between DeepSpeed and none, is still refused (:mod:`.resume`): only the process count
is carried over.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoints import CheckpointError

logger = logging.getLogger(__name__)

UNIVERSAL_SUFFIX = "_universal"
LATEST_UNIVERSAL = "latest_universal"
"""The file naming the universal checkpoint to load, as DeepSpeed reads it (its ``latest`` for the original)."""


def repartitions(written: Mapping[str, int] | None, launched: Mapping[str, int] | None) -> bool:
    """Whether a checkpoint whose optimizer state is laid out as ``written`` resumes under a launch whose would be
    ``launched`` (``distribution.optimizer_state_layout``) by repartitioning it: the same ZeRO stage, 1 to 3, on
    another number of processes."""
    if not isinstance(written, Mapping) or not isinstance(launched, Mapping):
        return False
    stage = written.get("deepspeed_zero_stage")
    return (
        isinstance(stage, int)
        and stage >= 1
        and launched.get("deepspeed_zero_stage") == stage
        and written.get("processes") != launched.get("processes")
    )


@dataclass(frozen=True)
class UniversalResume:
    """A resume that loads ``checkpoint`` through its universal conversion in ``directory``."""

    checkpoint: Path
    directory: Path
    zero_stage: int


def universal_resume(
    checkpoint: str | os.PathLike[str],
    written: Mapping[str, int] | None,
    launched: Mapping[str, int] | None,
    deepspeed_config: dict[str, Any] | None,
    *,
    is_main_process: bool,
    all_gather: Callable[[Any], list[Any]],
) -> UniversalResume | None:
    """Before the DeepSpeed engine is built: where ``written`` :func:`repartitions` into ``launched``, convert
    ``checkpoint`` (the main process, once) and switch ``load_universal`` on in ``deepspeed_config`` (the launch's,
    which accelerate builds the engine from). Every process calls it; None where nothing is repartitioned.
    ``all_gather``: each process's value, in process order, on every process (where the others wait for the main
    process's conversion), so that a conversion that fails, or a process that cannot see it, stops every process
    with the same line rather than leaving the others waiting at the engine's first collective."""
    if not repartitions(written, launched):
        return None
    assert written is not None and launched is not None  # by repartitions
    if deepspeed_config is None:
        raise CheckpointError(f"resume_from_checkpoint: {checkpoint} needs DeepSpeed's config, and accelerate has none")
    checkpoint = Path(checkpoint)
    outcome: tuple[str, str] | None = None  # the main process's: ("converted", folder name) or ("failed", line)
    if is_main_process:
        try:
            directory = checkpoint / (_tag(checkpoint) + UNIVERSAL_SUFFIX)
            done = _converted(directory)
            processes = f"{written['processes']} process{'es' if written['processes'] != 1 else ''}"
            logger.warning(
                "resume_from_checkpoint: %s holds ZeRO-%d's optimizer state partitioned over %s and this launch has "
                "%d: DeepSpeed repartitions it from its universal checkpoint, %s",
                checkpoint,
                written["deepspeed_zero_stage"],
                processes,
                launched["processes"],
                "converted earlier" if done else f"converting it now into {directory}",
            )
            if not done:
                convert(checkpoint, directory)
            outcome = ("converted", directory.name)
        except CheckpointError as error:
            outcome = ("failed", str(error))
        except OSError as error:  # a checkpoint folder it cannot write, a full disk
            outcome = (
                "failed",
                f"resume_from_checkpoint: {checkpoint} could not be converted into DeepSpeed's universal checkpoint "
                f"({error}): make room or write access there, or resume on the number of processes that wrote it",
            )
    kind, value = all_gather(outcome)[0]
    if kind == "failed":
        raise CheckpointError(value)
    directory = checkpoint / value
    blind = [index for index, seen in enumerate(all_gather(_converted(directory))) if not seen]
    if blind:  # another machine's disk: the main process converted a copy of its own
        raise CheckpointError(
            f"resume_from_checkpoint: process{'es' if len(blind) > 1 else ''} {', '.join(map(str, blind))} cannot "
            f"see {directory}, the universal checkpoint the main process converted: resume from a checkpoint on "
            "storage every machine shares"
        )
    deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    return UniversalResume(checkpoint, directory, written["deepspeed_zero_stage"])


def _tag(checkpoint: Path) -> str:
    """The DeepSpeed checkpoint in ``checkpoint`` (``global_stepN``, as its ``latest`` file names it)."""
    latest = checkpoint / "latest"
    tag = latest.read_text().strip() if latest.is_file() else ""
    if not tag or not (checkpoint / tag).is_dir():
        raise CheckpointError(
            f"resume_from_checkpoint: {checkpoint} records DeepSpeed's optimizer state but holds no DeepSpeed "
            "checkpoint (a 'latest' file naming its global_step folder): it cannot be resumed under DeepSpeed"
        )
    return tag


def _converted(directory: Path) -> bool:
    """Whether ``directory`` holds a whole conversion: DeepSpeed's script writes ``latest_universal`` last (and the
    folder may have been deleted since, for its size, leaving that small file behind)."""
    try:
        latest = (directory.parent / LATEST_UNIVERSAL).read_text().strip()
    except OSError:
        return False
    return latest == directory.name and (directory / "zero" / "optimizer_state.pt").is_file()


def convert(checkpoint: Path, directory: Path) -> None:
    """Convert ``checkpoint``'s DeepSpeed checkpoint into ``directory`` with DeepSpeed's script, in a process of its
    own (it forks workers of its own, which a training process with a process group and threads should not do).
    A conversion cut short is removed first; one that fails is raised in one line, its output kept beside it."""
    source = checkpoint / _tag(checkpoint)
    (checkpoint / LATEST_UNIVERSAL).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)
    log = directory.with_name(directory.name + ".log")
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
    command += ["--input_folder", str(source), "--output_folder", str(directory), "--inject_missing_state"]
    with log.open("w") as output:
        finished = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if finished.returncode != 0 or not _converted(directory):
        if finished.returncode < 0:  # its workers hold shards of the state: the host's memory is the usual end
            said = f"killed by signal {-finished.returncode}, out of host memory perhaps"
        else:
            lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
            said = f"exit code {finished.returncode}: {lines[-1].strip() if lines else 'no output'}"
        raise CheckpointError(
            f"resume_from_checkpoint: DeepSpeed could not convert {source} into a universal checkpoint ({said}; all "
            f"of its output in {log}): resume it on the number of processes that wrote it"
        )
    log.unlink()


def mend_zero3_load(optimizer: Any, resume: UniversalResume) -> list[str]:
    """After DeepSpeed has loaded ``resume``'s universal checkpoint into ``optimizer`` (the Trainer's, as accelerate
    wraps it): under ZeRO-3, put back each parameter group's own hyperparameters and give each group its own Adam
    step count (the module docstring says why). Returns what was mended, for the log; nothing where DeepSpeed loaded
    it right (ZeRO-1 and 2, or a DeepSpeed that has mended its own load)."""
    if resume.zero_stage != 3:
        return []
    torch_optimizer = _innermost(optimizer)
    # the main process's share of the state, beside the groups: mapped, not read (only the groups are wanted)
    path = resume.directory / "zero" / "optimizer_state.pt"
    saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    saved_groups = saved["optimizer_state_dict"]["param_groups"]
    if len(saved_groups) != len(torch_optimizer.param_groups):
        raise CheckpointError(
            f"resume_from_checkpoint: {resume.checkpoint}'s optimizer has {len(saved_groups)} parameter groups and "
            f"this run's has {len(torch_optimizer.param_groups)}: resume it with the settings it was written with"
        )
    mended: list[str] = []
    for index, (group, saved_group) in enumerate(zip(torch_optimizer.param_groups, saved_groups, strict=True)):
        for key, value in saved_group.items():
            if key != "params" and group.get(key) != value:
                mended.append(f"group {index}'s {key} {group.get(key)!r} -> {value!r}")
                group[key] = value
    seen, shared = set(), 0
    for state in torch_optimizer.state.values():
        step = state.get("step")
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"], shared = step.clone(), shared + 1
            seen.add(id(step))
    if shared:
        mended.append(f"{shared + 1} groups' shared Adam step count")
    return mended


def _innermost(optimizer: Any) -> Any:
    """The torch optimizer holding the state: inside accelerate's wrapper and DeepSpeed's ZeRO optimizer, each of
    which keeps the one it wraps as ``.optimizer`` (torch's own have no such attribute)."""
    while getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
    return optimizer
