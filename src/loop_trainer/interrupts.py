"""Ctrl-C held off until a block of work is whole: a checkpoint renamed into place, an event loop made, the
learning curve drawn.

Python raises KeyboardInterrupt wherever the main thread happens to be when SIGINT's handler runs, inside a
constructor or between two renames too. :func:`deferred_interrupt` swaps Python's handler for one that only notes
the signal, and raises the KeyboardInterrupt when the block is left. It swaps the handler, not the signal mask:
the kernel gives a process's signal to any thread that does not block it, and Python then runs its handler on the
main thread all the same, so blocking SIGINT on the main thread alone holds nothing off in a trainer that has
other threads (the environment's, tqdm's).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold a SIGINT (Ctrl-C) that arrives inside the block and raise it as KeyboardInterrupt on leaving. Only where
    Python's own handler is on, on the main thread: a process that ignores SIGINT (started in the background) or
    handles it its own way keeps doing so, and elsewhere than the main thread Python delivers no signals."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda number, _frame: received.append(number))
    try:
        yield
    except BaseException as error:
        _restore_python_handler()
        if received:  # the Ctrl-C is what the user asked for; the block's failure is its cause
            raise KeyboardInterrupt from error
        raise
    _restore_python_handler()
    if received:
        raise KeyboardInterrupt


def _restore_python_handler() -> None:
    # signal.signal runs the handlers of signals already received first: one received meanwhile is noted
    signal.signal(signal.SIGINT, signal.default_int_handler)
