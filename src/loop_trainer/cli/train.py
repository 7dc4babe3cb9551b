"""Train with LOOP from a recipe -- the ``loop-train`` command.

    loop-train --config recipes/demo.yaml [--key value ...]
    loop-train --config recipes/appworld/qwen2.5-7b-instruct.yaml --dry-run   # memory plan, no GPU
    accelerate launch --config_file recipes/accelerate/zero3.yaml -m loop_trainer.cli.train --config RECIPE

Like TRL's own scripts: ``make_parser()`` builds the TrlParser over (ScriptArguments, LOOPConfig,
ModelConfig) and ``main(script_args, training_args, model_args)`` runs the job (in :mod:`.recipe` and
:mod:`.train_run`; both read from here too).

This module is the entry point only, and imports nothing heavy itself: a process that multiprocessing spawns (a
collection child, ``collection_process: true``) imports the launch's main module again, this one under
``-m loop_trainer.cli.train`` (under ``loop-train``, the console script, which imports :mod:`.entry_points`). The
run, torch and transformers' trainer are imported when :func:`cli` runs, in the launch's own processes only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .recipe import make_parser
    from .train_run import main
else:  # not for mypy, which would take any name imported from here as Any (lazy_exports.py)
    __getattr__, __dir__ = lazy_exports(__name__, {".recipe": ("make_parser",), ".train_run": ("main",)})

__all__ = ["cli", "main", "make_parser"]


def cli(argv: Sequence[str] | None = None) -> int:
    """Entry point: one actionable line on user errors, exit status 2; Ctrl-C exits 130, while the run's modules are
    imported too; the exit status of :func:`.train_run.run`."""
    from .entry_points import loop_train

    return loop_train(argv)


if __name__ == "__main__":
    sys.exit(cli())
