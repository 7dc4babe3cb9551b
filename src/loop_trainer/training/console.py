"""What a run prints, so that it reads well in a terminal and in a file.

In a terminal: progress bars (over iterations, and over each iteration's rollouts) with one line per
iteration above them. When stderr, where tqdm draws, is not a terminal (a log file, a pipe, a batch
job), no bars: a bar redraws itself with carriage returns, which in a file would share each iteration's
line with bar fragments. Then each iteration is one plain line, ``iteration i/N: ... ETA ...``
(:func:`.run_log.format_iteration`), that ``grep '^iteration '`` finds. ``disable_tqdm: true`` turns
the bars off everywhere.

``loop-train`` also prints a short banner (model, environment, iterations, output_dir) and one line as
each start-up stage begins (:class:`StartupLog`): loading the model, then warming up (optimizer, memory
stress test) before iteration 1. transformers' own "Writing model shards" bar is kept out of every
checkpoint and final save (:func:`quiet_transformers_bars`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from transformers import TrainerCallback
from transformers.utils import logging as transformers_logging


def progress_bars_visible(stream: IO[str] | None = None) -> bool:
    """Whether a progress bar drawn on ``stream`` (default: stderr, where tqdm draws) is seen as a bar:
    a terminal, or a notebook (whose widgets are no carriage returns). tqdm's ``disable=None`` decides
    the same way for the bars it draws."""
    stream = sys.stderr if stream is None else stream
    if stream is None:  # pythonw, a daemon: no stderr at all
        return False
    if "ipykernel" in sys.modules and type(stream).__module__.startswith("ipykernel"):
        return True
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:  # a closed stream
        return False


@contextlib.contextmanager
def quiet_transformers_bars() -> Iterator[None]:
    """No progress bars from transformers inside the block (``save_pretrained``'s "Writing model shards",
    drawn at every checkpoint, even with ``disable_tqdm``); as it was on leaving. Only the bars transformers
    creates: a user's own tqdm bars and huggingface_hub's (a Hub upload running in the background) are left
    alone. Through transformers' tqdm hook, chained to any hook already set; a transformers without the hook
    (5.17) gets its global progress-bar switch, switched back on leaving if it was on."""
    set_hook = getattr(transformers_logging, "set_tqdm_hook", None)
    if set_hook is None:
        was_on = transformers_logging.is_progress_bar_enabled()
        if was_on:
            transformers_logging.disable_progress_bar()
        try:
            yield
        finally:
            if was_on:
                transformers_logging.enable_progress_bar()
        return
    previous: Callable[..., Any] | None = None

    def disabled(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kwargs = {**kwargs, "disable": True}
        return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

    previous = set_hook(disabled)
    try:
        yield
    finally:
        set_hook(previous)


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: an ETA, to the second below an hour."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class IterationClock:
    """The ETA of a run: the time per iteration so far in this session (since training began, after the
    warm-up; checkpoints and evaluations included) times the iterations left."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.first_step = 0

    def start(self, global_step: int) -> None:
        self.started, self.first_step = time.monotonic(), global_step

    def eta(self, global_step: int, max_steps: int) -> float | None:
        done = global_step - self.first_step
        if self.started is None or done <= 0:
            return None
        return (time.monotonic() - self.started) / done * max(0, max_steps - global_step)


def is_main_launch_process() -> bool:
    """The process that prints loop-train's start-up lines: rank 0 of a distributed launch (torchrun,
    accelerate and deepspeed set ``RANK``), or the only process. Read before the trainer exists."""
    return os.environ.get("RANK", "0") == "0"


def progress_description(disable_tqdm: bool | None) -> str:
    """The banner's line on what the run prints while it goes."""
    if disable_tqdm:
        return "one line per iteration (progress bars off: disable_tqdm)"
    if not progress_bars_visible():
        return "one line per iteration (no progress bars: the output is not a terminal)"
    return "progress bars, and one line per iteration"


class StartupLog(TrainerCallback):
    """loop-train's banner and its start-up stages, one line as each begins, each with how long the
    previous one took: the start-up before iteration 1 (loading the model, warming up) is no silent gap.
    Add it to the trainer (``add_callback``) for the last line, printed when training begins. Prints
    nothing when ``enabled`` is false (the other processes of a distributed launch)."""

    def __init__(self, enabled: bool = True, stream: IO[str] | None = None):
        self.enabled = enabled
        self.stream = stream
        self._stage: str | None = None
        self._since = time.monotonic()

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.stream if self.stream is not None else sys.stdout, flush=True)

    def banner(
        self,
        *,
        model: str | None,
        environment: str,
        iterations: int,
        rollouts: str,
        output_dir: str,
        resume: str | None,
        progress: str,
    ) -> None:
        self.print(f"loop-train: LOOP on environment '{environment}', model {model}")
        count = f"{iterations} iteration{'s' if iterations != 1 else ''}"
        self.print(f"  {count} of {rollouts}" + (f", resuming from {resume}" if resume else ""))
        self.print(f"  output_dir: {output_dir}")
        self.print(f"  console: {progress}")

    def stage(self, name: str, detail: str = "") -> None:
        """Stage ``name`` (``loading the model``) begins; the line says how long the previous stage took."""
        now = time.monotonic()
        done = f"{self._stage} took {now - self._since:.1f} s; " if self._stage is not None else ""
        self.print(f"{done}{name}{f' ({detail})' if detail else ''} ...")
        self._stage, self._since = name, now

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stage is None:
            return
        first, last = state.global_step + 1, state.max_steps
        iterations = f"iterations {first}-{last}" if first < last else f"iteration {first}"
        self.print(f"{self._stage} took {time.monotonic() - self._since:.1f} s; training {iterations}")
        self._stage = None
