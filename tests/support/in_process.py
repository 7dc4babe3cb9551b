"""loop-train run in the test's process, for the tests of what it refuses."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import pytest

from loop_trainer.cli.train import cli


def loop_train_in_process(capsys: pytest.CaptureFixture[str], argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """:func:`~loop_trainer.cli.train.cli` (what the ``loop-train`` command calls) with ``argv``: its exit status and
    what it printed, as ``subprocess.run`` returns a command's, without a new interpreter's 6 s of imports."""
    status = cli(list(argv))
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(["loop-train", *argv], status, printed.out, printed.err)
