"""``loop-train``, ``loop-eval`` and ``loop-compare``: the console scripts pyproject.toml names.

Each imports its command only when it runs. Importing a command imports torch, transformers and TRL, seven seconds
on a two-core CPU machine, and a Ctrl-C in those seconds would otherwise end in a traceback through the imports:
here it ends like a Ctrl-C later on, in one line and exit status 130, also where a library in those imports dropped
the KeyboardInterrupt.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from ..interrupts import noted_interrupts


def run_command(program: str, module: str, function: str, argv: Sequence[str] | None = None) -> int:
    """``module.function(argv)``, its module imported first; a Ctrl-C during the import is one line, status 130,
    also one whose KeyboardInterrupt a library dropped (:func:`~loop_trainer.interrupts.noted_interrupts`)."""
    with noted_interrupts() as interrupted:
        try:
            command = getattr(importlib.import_module(module), function)
        except KeyboardInterrupt:
            command = None
        except Exception as error:
            # a Ctrl-C can come out of an import as another error: a KeyboardInterrupt in a __set_name__ becomes
            # a RuntimeError, which TRL's lazy modules wrap in one more ("Failed to import trl.trainer.utils");
            # an error of its own, with or without a Ctrl-C about, is raised as it is
            if not _caused_by_interrupt(error):
                raise
            command = None
        if command is None or interrupted():  # its KeyboardInterrupt raised, turned, or dropped inside a library
            print(f"{program}: interrupted while starting; nothing was run", file=sys.stderr)
            return 130
    return int(command(argv))


def _caused_by_interrupt(error: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among ``error``'s causes and contexts."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def loop_train(argv: Sequence[str] | None = None) -> int:
    return run_command("loop-train", "loop_trainer.cli.train_run", "run", argv)


def loop_eval(argv: Sequence[str] | None = None) -> int:
    return run_command("loop-eval", "loop_trainer.cli.evaluate", "cli", argv)


def loop_compare(argv: Sequence[str] | None = None) -> int:
    return run_command("loop-compare", "loop_trainer.cli.compare", "cli", argv)
