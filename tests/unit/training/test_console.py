"""What a run prints: in a log file, plain lines (the banner, the start-up stages, ``iteration i/N ... ETA``
on lines of their own) and no progress bar; in a terminal, the bars; never transformers' "Writing model
shards" bar, nor a warning that LOOP's own calls trigger."""

from __future__ import annotations

import io
import re
import sys

import pytest
from tqdm.auto import tqdm
from transformers.utils import logging as transformers_logging

from loop_trainer.cli.train import cli
from loop_trainer.training.console import (
    IterationClock,
    format_duration,
    progress_bars_visible,
    quiet_transformers_bars,
)
from loop_trainer.training.run_log import format_iteration

# Two iterations of a tiny model with activation checkpointing (its flag read), a checkpoint after each, and
# the final save.
TINY_RUN = [
    "--model_name_or_path",
    "tiny:vault",
    "--environment_kwargs",
    '{"num_tasks": 4}',
    "--iterations",
    "2",
    "--tasks_per_iteration",
    "2",
    "--rollouts_per_task",
    "2",
    "--max_turns",
    "2",
    "--max_new_tokens_per_turn",
    "3",
    "--max_trajectory_tokens",
    "128",
    "--activation_checkpointing",
    "true",
    "--plot_curves",
    "false",
]
ITERATION_LINE = re.compile(r"^iteration (\d+)/(\d+): reward .* ETA (\d+s|\d+m\d\ds|\d+h\d\dm)$")


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def run(tmp_path, *flags: str) -> int:
    return cli(["--output_dir", str(tmp_path / "run"), *TINY_RUN, *flags])


# Full weights (transformers' save_pretrained at every checkpoint), or a LoRA adapter (PEFT's wrapping).
LORA = ("--use_peft", "true", "--lora_target_modules", "all-linear")


@pytest.mark.parametrize("flags", [(), LORA], ids=["full", "lora"])
def test_a_run_logged_to_a_file_prints_plain_lines_and_no_bars(tmp_path, capsys, recwarn, flags):
    assert not progress_bars_visible()  # captured output is no terminal: tqdm is not turned off by hand here
    assert run(tmp_path, *flags) == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "\r" not in text and "%|" not in text  # no bar, not even a finished one
    assert "Writing model shards" not in text
    lines = captured.out.splitlines()
    assert lines[:4] == [
        "loop-train: LOOP on environment 'vault', model tiny:vault",
        "  2 iterations of 2 tasks x 2 rollouts",
        f"  output_dir: {tmp_path / 'run'}",
        "  console: one line per iteration (no progress bars: the output is not a terminal)",
    ]
    assert lines[4] == "loading the model ..."
    assert re.fullmatch(
        r"loading the model took \d+\.\d s; warming up \(optimizer, memory stress test at 128 tokens\) \.\.\.", lines[5]
    )
    assert re.fullmatch(r"warming up took \d+\.\d s; training iterations 1-2", lines[6])
    iterations = [ITERATION_LINE.match(line) for line in lines if line.startswith("iteration")]
    assert [(m.group(1), m.group(2)) for m in iterations if m] == [("1", "2"), ("2", "2")], lines
    assert lines[9] == "LOOP: 2 iterations on 'vault'."
    ours = [w for w in recwarn if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]


@pytest.mark.parametrize(("flags", "bars"), [((), True), (("--disable_tqdm", "true"), False)])
def test_a_terminal_gets_the_bars_unless_disable_tqdm(tmp_path, capsys, monkeypatch, flags, bars):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert run(tmp_path, *flags) == 0
    out, drawn = capsys.readouterr().out, terminal.getvalue()
    assert ("iteration 1 rollouts" in drawn and "2/2 [" in drawn) is bars  # the rollouts' and the iterations' bars
    assert "Writing model shards" not in drawn
    console = "progress bars, and one line per iteration" if bars else "one line per iteration (progress bars off"
    assert console in out
    assert [line[:14] for line in out.splitlines() if line.startswith("iteration")] == [
        "iteration 1/2:",
        "iteration 2/2:",
    ]


@pytest.mark.skipif(
    not hasattr(transformers_logging, "set_tqdm_hook") or not transformers_logging.is_progress_bar_enabled(),
    reason="a transformers without the tqdm hook (5.17), or with its bars switched off",
)
def test_quiet_transformers_bars_hides_only_transformers_bars_and_restores_the_hook():
    stream = Terminal()
    seen: list[str] = []

    def users_hook(factory, args, kwargs):
        seen.append(kwargs.get("desc", ""))
        return factory(*args, **kwargs)

    previous = transformers_logging.set_tqdm_hook(users_hook)
    try:
        with quiet_transformers_bars():
            list(transformers_logging.tqdm(range(3), desc="Writing model shards", file=stream))
            list(tqdm(range(3), desc="the user's own", file=stream))
        assert seen == ["Writing model shards"]  # the user's hook still ran, on a disabled bar
        assert "Writing model shards" not in stream.getvalue() and "the user's own" in stream.getvalue()
        list(transformers_logging.tqdm(range(3), desc="after the block", file=stream))
        assert "after the block" in stream.getvalue()
    finally:
        transformers_logging.set_tqdm_hook(previous)


def test_the_iteration_line_counts_iterations_and_gives_the_eta():
    record = {"reward_mean": 0.5, "reward_std": 0.1, "seconds": 2.0}
    assert format_iteration(3, record).startswith("iteration 3: reward 0.500")  # no total, no ETA: as before
    line = format_iteration(3, record, total=120, eta=250.0)
    assert line.startswith("iteration 3/120: reward 0.500 ± 0.10") and line.endswith("  2.0s  ETA 4m10s")
    assert [format_duration(s) for s in (0, 42.4, 60, 3599, 7620)] == ["0s", "42s", "1m00s", "59m59s", "2h07m"]
    clock = IterationClock()
    assert clock.eta(5, 10) is None  # not started
    clock.start(4)  # a run resumed after iteration 4
    assert clock.eta(4, 10) is None  # no iteration done yet in this session
    eta = clock.eta(6, 10)
    assert eta is not None and eta >= 0
    assert clock.eta(10, 10) == 0
