"""run_coroutine (rollout/collection.py): a coroutine's result comes back whole, without being formatted on the way."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import threading
import warnings

import pytest

from loop_trainer.rollout import collection
from loop_trainer.rollout.collection import run_coroutine


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


@pytest.fixture()
def python_sigint():
    """Python's own SIGINT handler, which asyncio.run replaces and restores (a test before this one in the same
    process may have left another)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


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


def test_a_ctrl_c_before_the_coroutine_starts_leaves_nothing_to_report_at_exit(monkeypatch):
    """SIGINT between asyncio.run's creating its task and the task's first step: the task is cancelled unstarted, and
    the coroutine it was to await must not be reported at exit ("coroutine ... was never awaited", printed after
    loop-train's interrupt line)."""
    real_run = asyncio.run

    def interrupted_before_the_first_step(main):
        loop = asyncio.new_event_loop()
        task = loop.create_task(main)
        task.cancel()  # what asyncio.run's close does to the task the KeyboardInterrupt left behind
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)
        loop.close()
        raise KeyboardInterrupt

    async def collect():
        return 1

    monkeypatch.setattr(collection.asyncio, "run", interrupted_before_the_first_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyboardInterrupt):
            run_coroutine(collect())
        gc.collect()
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []
    monkeypatch.setattr(collection.asyncio, "run", real_run)
    assert run_coroutine(collect()) == 1
