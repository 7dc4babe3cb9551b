"""interrupts.py: deferred_interrupt raises a Ctrl-C inside the block on leaving it, once the block is whole;
noted_interrupts notes a Ctrl-C whose KeyboardInterrupt something dropped."""

from __future__ import annotations

import os
import signal
import time

import pytest

from loop_trainer.interrupts import deferred_interrupt, noted_interrupts
from support.interrupts import sigint_taken_by_another_thread


@pytest.fixture()
def sigint_handler():
    """Sets SIGINT's handler for one test, and puts back the one before."""
    previous = signal.getsignal(signal.SIGINT)
    yield lambda handler: signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_inside_the_block_is_raised_after_it(sigint_handler):
    sigint_handler(signal.default_int_handler)
    done = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupt():
        os.kill(os.getpid(), signal.SIGINT)
        done.append("the rest of the block")
    assert done == ["the rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_taken_by_another_thread_is_held_too(sigint_handler):
    """The kernel gives a process's signal to any thread that does not block it; Python runs the handler on the
    main thread all the same, the deferring one inside the block."""
    sigint_handler(signal.default_int_handler)
    done = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupt():
        sigint_taken_by_another_thread()
        done.append("the rest of the block")
    assert done == ["the rest of the block"]


def test_a_process_that_ignores_sigint_keeps_ignoring_it(sigint_handler):
    """Started in the background by a shell without job control: SIGINT is ignored, inside the block too."""
    sigint_handler(signal.SIG_IGN)
    with deferred_interrupt():
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_a_handler_of_the_programs_own_is_left_to_handle_it(sigint_handler):
    handled = []
    sigint_handler(lambda number, _frame: handled.append(number))
    with deferred_interrupt():
        os.kill(os.getpid(), signal.SIGINT)
        assert handled == [signal.SIGINT]


def test_a_ctrl_c_inside_a_block_that_then_fails_is_still_raised_with_the_failure_as_its_cause(sigint_handler):
    """The user asked to stop: the run ends as interrupted (exit 130), the failure kept as the cause."""
    sigint_handler(signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt) as raised, deferred_interrupt():
        os.kill(os.getpid(), signal.SIGINT)
        raise OSError("the disk is full")
    assert isinstance(raised.value.__cause__, OSError)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(OSError, match="the disk is full"), deferred_interrupt():  # without a Ctrl-C: the failure
        raise OSError("the disk is full")


@pytest.fixture()
def no_wakeup_fd():
    """No wakeup fd set for one test (noted_interrupts stands down beside another), and the one before put back."""
    previous = signal.set_wakeup_fd(-1)
    yield
    signal.set_wakeup_fd(previous)


def open_fds():
    return sorted(os.listdir("/proc/self/fd"))


def a_library_dropping_a_ctrl_c():
    """A Ctrl-C taken where a library's bare except swallows its KeyboardInterrupt."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the KeyboardInterrupt ends it at once
    except KeyboardInterrupt:
        pass
    else:
        pytest.fail("no KeyboardInterrupt came")


def test_a_ctrl_c_whose_keyboard_interrupt_was_dropped_is_noted(sigint_handler, no_wakeup_fd):
    sigint_handler(signal.default_int_handler)
    before = open_fds()
    with noted_interrupts() as interrupted:
        assert not interrupted()
        a_library_dropping_a_ctrl_c()
        assert interrupted() and interrupted()  # asked again, still so
    assert interrupted()  # and after the block, its pipe closed
    assert signal.set_wakeup_fd(-1) == -1  # none left set
    assert open_fds() == before


def test_other_signals_are_not_taken_for_a_ctrl_c(sigint_handler, no_wakeup_fd):
    sigint_handler(signal.default_int_handler)
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        with noted_interrupts() as interrupted:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.01)
            assert not interrupted()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_wakeup_fd_set_before_is_left_alone_and_one_set_inside_stays(sigint_handler, no_wakeup_fd):
    """asyncio's, where a loop handles signals: nothing is noted then (a SIGINT's byte goes to its owner)."""
    sigint_handler(signal.default_int_handler)
    read, write = os.pipe()
    for end in (read, write):
        os.set_blocking(end, False)
    try:
        signal.set_wakeup_fd(write)
        with noted_interrupts() as interrupted:
            a_library_dropping_a_ctrl_c()
            assert not interrupted()
        assert signal.set_wakeup_fd(-1) == write and os.read(read, 16) == bytes([signal.SIGINT])
        with noted_interrupts():
            signal.set_wakeup_fd(write)
        assert signal.set_wakeup_fd(-1) == write
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.parametrize("handler", [signal.SIG_IGN, lambda *_: None], ids=["ignored", "handled its own way"])
def test_nothing_is_noted_where_python_does_not_raise_a_ctrl_c(sigint_handler, no_wakeup_fd, handler):
    """A process that ignores SIGINT takes none; one that handles it itself decides what a Ctrl-C means."""
    sigint_handler(handler)
    with noted_interrupts() as interrupted:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert not interrupted()
    assert signal.set_wakeup_fd(-1) == -1
