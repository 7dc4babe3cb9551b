"""Ctrl-C held off until a block of work is whole (a checkpoint renamed into place, an event loop made, the
learning curve drawn), and Ctrl-C noted where a library may drop it (the imports a command starts with).

Python raises KeyboardInterrupt wherever the main thread happens to be when SIGINT's handler runs, inside a
constructor or between two renames too. :func:`deferred_interrupt` swaps Python's handler for one that only notes
the signal, and raises the KeyboardInterrupt when the block is left. It swaps the handler, not the signal mask:
the kernel gives a process's signal to any thread that does not block it, and Python then runs its handler on the
main thread all the same, so blocking SIGINT on the main thread alone holds nothing off in a trainer that has
other threads (the environment's, tqdm's).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator


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


@contextlib.contextmanager
def noted_interrupts() -> Iterator[Callable[[], bool]]:
    """Note every SIGINT (Ctrl-C) the process takes inside the block, whether or not its KeyboardInterrupt
    survives, and yield a function that says whether one came (also after the block). CPython drops a
    KeyboardInterrupt raised in a ``__del__`` or a weak reference's callback (printing "Exception ignored in"), and
    a library's bare ``except`` drops it too: a Ctrl-C in the seconds a command spends importing torch, transformers
    and TRL was lost that way about once in 20 (benchmarks/ctrl_c.py). Noted through ``signal.set_wakeup_fd``, to
    which the interpreter writes each signal's number before any Python code runs; Python's handler stays as it is.

    Noting nothing (the function always says no) off the main thread, where Python's own SIGINT handler is not on
    (a process that ignores SIGINT, or handles it its own way), or where a wakeup fd is set already (asyncio's, by a
    loop that handles signals): that one is put back at once, with any signal that came meanwhile. A process forked
    inside the block (not exec'd) shares the pipe: its signals would be noted too."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: False
        return
    read, write = os.pipe()
    taken, closed = bytearray(), False

    def drain() -> None:
        if not closed:
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(read, 512):
                    taken.extend(chunk)

    def interrupted() -> bool:
        drain()
        return signal.SIGINT in taken

    try:
        for end in (read, write):
            os.set_blocking(end, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous == -1:
            yield interrupted
        else:  # another's: theirs again, with what came meanwhile
            signal.set_wakeup_fd(previous)
            drain()
            with contextlib.suppress(OSError):
                os.write(previous, bytes(taken))
            taken.clear()
            yield lambda: False
    finally:
        # whatever was left set (this block's, or one set inside it, which stays), also where a KeyboardInterrupt
        # came between setting ours and the block: never the closed pipe's number, which the next file would reuse
        current = signal.set_wakeup_fd(-1)
        if current not in (-1, write):
            signal.set_wakeup_fd(current)
        drain()
        closed = True
        os.close(read)
        os.close(write)
