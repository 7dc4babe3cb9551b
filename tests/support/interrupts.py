"""SIGINT as a user's Ctrl-C may reach a process of several threads."""

from __future__ import annotations

import signal
import threading


def sigint_taken_by_another_thread() -> None:
    """SIGINT to this process as the kernel may deliver it: to a thread other than the main one, whose handler
    (Python's C one) notes it before the thread ends; Python raises it on the main thread, at its next bytecode."""
    thread = threading.Thread(target=lambda: signal.pthread_kill(threading.get_ident(), signal.SIGINT))
    thread.start()
    thread.join()
