"""run_coroutine (rollout/collection.py): a coroutine's result comes back whole, without being formatted on the way."""

from __future__ import annotations

import asyncio
import asyncio.selector_events as selector_events
import gc
import inspect
import os
import signal
import sys
import threading
import warnings

import pytest

from loop_trainer.rollout.collection import run_coroutine
from support.interrupts import sigint_taken_by_another_thread


class Unprintable:
    """A result that counts its reprs (raising would not do: reprlib swallows a repr's errors). A RolloutBatch's repr
    is every token id of every trajectory."""

    def __init__(self) -> None:
        self.formatted = 0

    def __repr__(self) -> str:
        self.formatted += 1
        return "Unprintable()"


async def make(value):
    await asyncio.sleep(0)
    return value


def test_the_result_is_returned_and_never_formatted_on_the_main_thread(python_sigint):
    """asyncio.run, on the main thread, puts SIGINT's handler back at its end; signal.signal formats the handler it
    replaces, a partial of the finished task, whose repr shows the task's result."""
    assert threading.current_thread() is threading.main_thread()
    result = Unprintable()
    assert run_coroutine(make(result)) is result and result.formatted == 0


def test_inside_a_running_loop_it_runs_on_a_thread_and_returns_the_same():
    result, got = Unprintable(), []

    async def notebook_cell() -> None:  # returns nothing: this test's own asyncio.run would format what it returned
        got.append(run_coroutine(make(result)))

    asyncio.run(notebook_cell())
    assert got == [result] and result.formatted == 0


def test_an_error_reaches_the_caller():
    async def fail():
        raise ValueError("the environment broke")

    with pytest.raises(ValueError, match="the environment broke"):
        run_coroutine(fail())


async def collect():
    return 1


@pytest.fixture()
def reported_at_exit(monkeypatch):
    """What Python would print at exit, after loop-train's interrupt line: warnings (a coroutine never awaited) and
    errors raised by finalisers ("Exception ignored in ...")."""
    gc.collect()  # what earlier tests in this process left is finalised before, not counted
    unraisable: list = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield lambda: (gc.collect(), [str(w.message) for w in caught] + [repr(u.exc_value) for u in unraisable])[1]


def ctrl_c_at(monkeypatch, owner, name, *, before, by_another_thread=False):
    """One real SIGINT, the first time ``owner.name`` runs: ``before`` it runs or after."""
    real, sent = getattr(owner, name), []

    def ctrl_c() -> None:
        if not sent:
            sent.append(True)
            if by_another_thread:
                sigint_taken_by_another_thread()
            else:
                os.kill(os.getpid(), signal.SIGINT)  # raises KeyboardInterrupt here, if Python's handler is on

    def interrupted(*args, **kwargs):
        if before:
            ctrl_c()
        result = real(*args, **kwargs)
        ctrl_c()
        return result

    monkeypatch.setattr(owner, name, interrupted)


def assert_the_ctrl_c_is_raised_and_nothing_is_left(monkeypatch, reported_at_exit) -> None:
    """run_coroutine raises the KeyboardInterrupt, nothing is left to report at exit, the collection's coroutine is
    closed, and with the interruption undone the next call runs."""
    coroutine = collect()
    with pytest.raises(KeyboardInterrupt):
        run_coroutine(coroutine)
    assert reported_at_exit() == []
    assert inspect.getcoroutinestate(coroutine) == inspect.CORO_CLOSED
    monkeypatch.undo()
    assert run_coroutine(collect()) == 1


@pytest.mark.parametrize("taken_by", ["the main thread", "another thread"])
def test_a_ctrl_c_while_the_event_loop_is_made_leaves_nothing_to_report_at_exit(
    monkeypatch, python_sigint, reported_at_exit, taken_by
):
    """SIGINT inside the event loop's constructor, before its self-pipe exists: without care, the half-made loop's
    finaliser fails ("'_UnixSelectorEventLoop' object has no attribute '_ssock'") and the coroutine that wraps the
    collection is never awaited; loop-train printed both after its interrupt line, once in tens of runs. A trainer
    has other threads (the environment's, tqdm's), and the kernel gives a process's signal to any thread that does
    not block it: blocking SIGINT on the main thread would not hold it off."""
    by_another_thread = taken_by == "another thread"
    ctrl_c_at(
        monkeypatch,
        selector_events.BaseSelectorEventLoop,
        "_make_self_pipe",
        before=True,
        by_another_thread=by_another_thread,
    )
    assert_the_ctrl_c_is_raised_and_nothing_is_left(monkeypatch, reported_at_exit)


def test_a_ctrl_c_before_the_coroutine_starts_leaves_nothing_to_report_at_exit(
    monkeypatch, python_sigint, reported_at_exit
):
    """SIGINT between the runner's creating its task and the task's first step: the task is cancelled unstarted, and
    the coroutine it was to await must not be reported at exit either."""
    ctrl_c_at(monkeypatch, asyncio.BaseEventLoop, "create_task", before=False)
    assert_the_ctrl_c_is_raised_and_nothing_is_left(monkeypatch, reported_at_exit)
