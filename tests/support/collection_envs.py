"""The environments and episodes the collection-process tests send to a child
(tests/unit/rollout/test_collection_process.py).

Defined here, not in the test module: a spawned child imports the module of each class it unpickles, and the test
module imports the trainer (torch, transformers), about 6 s a child on one of two cores. This one imports
loop_trainer's environments only, as a user's environment module would.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loop_trainer.envs.base import Environment, EnvironmentSetupError, Episode, Message, Score, Step
from loop_trainer.envs.errands import ErrandsEnv, ErrandsEpisode


def cannot_rebuild() -> None:
    raise ImportError("no module named my_private_env")


class UnrebuildableEnv(ErrandsEnv):
    def __reduce__(self):
        return (cannot_rebuild, ())


class UnpreparedEnv(ErrandsEnv):
    def prepare(self) -> None:
        raise EnvironmentSetupError("the tool server at :9000 does not answer")


def exit_at_once() -> None:
    os._exit(3)  # as a script without the __main__ guard may, or the OOM killer


class VanishingEnv(ErrandsEnv):
    def __reduce__(self):
        return (exit_at_once, ())


class CountingEnv(ErrandsEnv):
    """Counts its episodes in metrics() (a running total, as AppWorld's restarts are), and its prepare() calls."""

    def __init__(self) -> None:
        super().__init__(num_tasks=1)
        self.episodes = 0
        self.prepared = 0

    def prepare(self) -> None:
        self.prepared += 1

    def episode(self, task):
        self.episodes += 1
        return super().episode(task)

    def metrics(self) -> dict[str, float]:
        return {"episodes": float(self.episodes), "prepared": float(self.prepared)}


class MetricsThatFailAfterTheFirstEnv(CountingEnv):
    """metrics() answers its first call; the later ones raise, or never return (``hang``)."""

    def __init__(self, hang: bool = False) -> None:
        super().__init__()
        self.hang = hang
        self.calls = 0

    def metrics(self) -> dict[str, float]:
        self.calls += 1
        if self.calls > 1 and self.hang:
            threading.Event().wait()  # never returns: the child's exit is not held up by it either
        if self.calls > 1:
            raise ConnectionError("the environment's server is down")
        return super().metrics()


class UnsendableEpisode(ErrandsEpisode):
    def score(self) -> Score:
        score = super().score()
        score.info["check"] = lambda: None  # not JSON, as Score.info asks, nor picklable
        return score


class UnsendableEnv(ErrandsEnv):
    def episode(self, task):
        return UnsendableEpisode(task, self.form)


class UnsendableMetricsEnv(ErrandsEnv):
    def metrics(self) -> dict[str, float]:
        return {"check": lambda: None}  # type: ignore[dict-item]  # not a float, as metrics() asks


class GatedEpisode(Episode):
    """Done after the task's ``turns`` replies; a task with ``wait_after`` waits after that many steps until the
    file its ``gate`` names exists (an event another process can set)."""

    def __init__(self, task: Mapping[str, Any]):
        self.task, self.turn = task, 0

    async def start(self) -> list[Message]:
        return [{"role": "user", "content": f"task {self.task['task_id']}"}]

    async def step(self, reply: str) -> Step:
        self.turn += 1
        if self.turn == self.task.get("wait_after"):
            while not Path(self.task["gate"]).exists():
                await asyncio.sleep(0.01)
        return Step(messages=[{"role": "user", "content": f"obs {self.turn}"}], done=self.turn >= self.task["turns"])

    async def score(self) -> Score:
        return Score(reward=self.turn / 10, success=True)


class GatedEnv(Environment):
    name = "gated"

    def tasks(self, split: str = "train") -> Any:
        raise NotImplementedError

    def episode(self, task: Mapping[str, Any]) -> GatedEpisode:
        return GatedEpisode(task)


def explode_outside(pid: int) -> None:
    if os.getpid() != pid:
        raise RuntimeError("this group cannot be rebuilt in the child")


class Unrebuildable:
    def __reduce__(self):
        return (explode_outside, (os.getpid(),))


class ClosingEnv(ErrandsEnv):
    """Writes the closing process's id to ``marker`` as it closes, a line per close()."""

    def __init__(self, marker: Path) -> None:
        super().__init__(num_tasks=1)
        self.marker = marker

    def close(self) -> None:
        with open(self.marker, "a") as file:
            file.write(f"{os.getpid()}\n")


class SlowClosingEnv(ClosingEnv):
    """Takes 3 s to close, then writes the closing process's id and thread's name."""

    def close(self) -> None:
        time.sleep(3.0)
        with open(self.marker, "a") as file:
            file.write(f"{os.getpid()} {threading.current_thread().name}\n")


class StuckInNativeCodeEpisode(ErrandsEpisode):
    """Its step() runs on the event loop (the child's main thread) and deadlocks there in C: it locks a pthread
    mutex it holds already, a call that never returns to Python, so no Python signal handler can run."""

    def __init__(self, task, form: str, marker: Path) -> None:
        super().__init__(task, form)
        self.marker = marker

    async def step(self, reply: str) -> Step:
        libc = ctypes.CDLL(None)
        mutex = ctypes.create_string_buffer(64)  # zeroed: an initialised default mutex (glibc)
        libc.pthread_mutex_lock(mutex)
        with open(self.marker, "a") as file:
            file.write("stuck\n")
        libc.pthread_mutex_lock(mutex)
        raise AssertionError("unreachable: a default mutex locked twice by one thread deadlocks")


class StuckEpisodesEnv(ClosingEnv):
    """Its episodes are ``episode_class`` (one of the stuck ones here), told ``episode_marker``."""

    def __init__(self, marker: Path, episode_marker: Path, episode_class: type = StuckInNativeCodeEpisode) -> None:
        super().__init__(marker)
        self.episode_marker, self.episode_class = episode_marker, episode_class

    def episode(self, task):
        return self.episode_class(task, self.form, self.episode_marker)


class SleepingCloseEnv(ErrandsEnv):
    """Its close() never returns in time (it pickles, unlike an Event's wait)."""

    def close(self) -> None:
        time.sleep(3600)


class ForkingThenStuckEpisode(ErrandsEpisode):
    """Its step() forks a grandchild (no exec: it inherits the child's end of the trainer's pipes) that outlives the
    child, writes its pid to ``marker``, then blocks the event loop (a sleep that releases the interpreter lock)."""

    def __init__(self, task, form: str, marker: Path) -> None:
        super().__init__(task, form)
        self.marker = marker

    async def step(self, reply: str) -> Step:
        grandchild = os.fork()
        if grandchild == 0:
            time.sleep(120)
            os._exit(0)
        self.marker.write_text(str(grandchild))
        time.sleep(3600)
        raise AssertionError("unreachable: the child is ended first")


class SignalHandlingLoopEnv(ClosingEnv):
    """Its prepare() (on the child's main thread) leaves an event loop there with a handler for SIGUSR1, as an
    asyncio library's signal receiver does: the loop takes the wakeup fd over."""

    def prepare(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.add_signal_handler(signal.SIGUSR1, lambda: None)

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "loop"}
