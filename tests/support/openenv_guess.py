"""A small OpenEnv environment for the adapter's tests, served by OpenEnv's own server on 127.0.0.1.

``GuessEnvironment``: guess a number from 0 to 9 (``seed % 10``, or ``target``); each guess answers
"higher", "lower" or "correct". Reward -0.25 for a wrong guess, 1.0 for the right one (so rewards
leave [0, 1]); done after the right guess or ``MAX_GUESSES`` guesses. A guess out of range raises
(OpenEnv reports it as an execution error). Class-level records let tests see what reached the
server: the actions per session, how many sessions are open now and at most.

``CalculatorEnvironment``: an MCP-style OpenEnv environment (FastMCP tools ``add`` and ``submit``;
``submit`` of the right sum ends the episode with reward 1).

``serve(app)``: runs an app with uvicorn in a thread on a free port, yields its base URL once
``/health`` answers, and stops it afterwards.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any
from uuid import uuid4

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_GUESSES = 4


class GuessAction(Action):
    """Guess the secret number."""

    number: int = Field(..., description="Your guess, from 0 to 9")
    comment: str = Field("", description="Optional: why you guess this")


class GuessObservation(Observation):
    feedback: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    lock = threading.Lock()
    actions: list[tuple[int, int, str]] = []  # (seed, number, comment), as the server received them
    open_sessions = peak_sessions = 0
    barrier: threading.Barrier | None = None  # set by a test: every session's first step waits here

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.seed = self.target = 0
        self.counted = False

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, target: int | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.seed = seed or 0
        self.target = self.seed % 10 if target is None else target
        with GuessEnvironment.lock:
            if not self.counted:
                self.counted = True
                GuessEnvironment.open_sessions += 1
                GuessEnvironment.peak_sessions = max(GuessEnvironment.peak_sessions, GuessEnvironment.open_sessions)
        return GuessObservation(feedback=f"I am thinking of a number from 0 to 9 (game {self.seed}).", reward=None)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        if self._state.step_count == 0 and GuessEnvironment.barrier is not None:
            GuessEnvironment.barrier.wait(timeout=30)  # returns only once every session has got here
        self._state.step_count += 1
        with GuessEnvironment.lock:
            GuessEnvironment.actions.append((self.seed, action.number, action.comment))
        if not 0 <= action.number <= 9:
            raise ValueError(f"{action.number} is not between 0 and 9")
        if action.number == self.target:
            return GuessObservation(feedback="correct", reward=1.0, done=True)
        feedback = "higher" if action.number < self.target else "lower"
        return GuessObservation(feedback=feedback, reward=-0.25, done=self._state.step_count >= MAX_GUESSES)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        with GuessEnvironment.lock:
            if self.counted:
                self.counted = False
                GuessEnvironment.open_sessions -= 1

    @classmethod
    def forget(cls) -> None:
        with cls.lock:
            cls.actions, cls.peak_sessions, cls.barrier = [], cls.open_sessions, None


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    def _step_payload(self, action: GuessAction) -> dict[str, Any]:
        return action.model_dump(exclude={"metadata"})

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[GuessObservation]:
        observation = GuessObservation(
            feedback=payload.get("observation", {}).get("feedback", ""),
            done=payload.get("done", False),
            reward=payload.get("reward"),
        )
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


def guess_app(max_sessions: int = 4):
    return create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=max_sessions)


class TaskObservation(Observation):
    task: str = ""


class CalculatorEnvironment(MCPEnvironment):
    """MCP tools: add two numbers; submit the sum of the task's numbers."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        from fastmcp import FastMCP

        mcp = FastMCP("calculator")
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.numbers = (0, 0)

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two numbers."""
            return a + b

        @mcp.tool()
        def submit(answer: int) -> str:
            """Submit the final answer."""
            return "submitted"

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.numbers = ((seed or 0) + 2, 3)
        return TaskObservation(task=f"What is {self.numbers[0]} + {self.numbers[1]}?")

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and action.tool_name == "submit" and observation.error is None:
            right = action.arguments.get("answer") == sum(self.numbers)
            observation.reward, observation.done = (1.0 if right else 0.0), True
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        raise ValueError(f"unknown action {type(action).__name__}")

    @property
    def state(self) -> State:
        return self._state


def calculator_app():
    return create_fastapi_app(CalculatorEnvironment, CallToolAction, CallToolObservation, max_concurrent_envs=4)


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """``app`` served by uvicorn in a thread on a free 127.0.0.1 port: its base URL, once healthy."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the port is ours from here on: no race with another test's server
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws_ping_interval=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="openenv-server", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=1) as response:
                if response.status == 200:
                    break
        except OSError:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the OpenEnv test server did not come up") from None
            time.sleep(0.05)
    try:
        yield base_url
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
