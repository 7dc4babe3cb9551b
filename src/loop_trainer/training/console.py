"""What a run prints, so that it reads well in a terminal and in a file.

In a terminal: progress bars (over iterations, and over each iteration's rollouts) with one line per
iteration above them. When stderr, where tqdm draws, is not a terminal (a log file, a pipe, a batch
job), no bars: a bar redraws itself with carriage returns, which in a file would share each iteration's
line with bar fragments. Then each iteration is one plain line, ``iteration i/N: ... ETA ...``
(:func:`.run_log.format_iteration`), that ``grep '^iteration '`` finds. ``disable_tqdm: true`` turns
the bars off everywhere.

transformers' own "Writing model shards" bar is kept out of every checkpoint (:func:`quiet_transformers_bars`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

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
