"""OpenEnv environments as LOOP environments: ``from_openenv(client, tasks=...)``.

An OpenEnv (``openenv`` 0.10) environment runs behind a server; a client holds one WebSocket
session, i.e. one environment instance (``reset(**kwargs)``, then ``step(action)`` until ``done``).
The HTTP ``/reset`` and ``/step`` routes build a fresh environment per request, so multi-step
episodes need the WebSocket: every LOOP episode opens its own session in ``start`` and closes it in
``close``. ``client`` is an ``EnvClient`` subclass (with ``base_url``), a zero-argument factory
returning a client or an awaitable of one (your own launcher), or a client instance, whose
``new_session()`` gives each episode its session against the one server (a container the instance
started, e.g. with ``from_docker_image``, is shared; ``Environment.close()`` closes the instance).
The client's async API runs on the rollout engine's event loop: episodes are I/O-bound, and a
coroutine is cancelled on ``env_timeout`` where a synchronous ``.sync()`` client would be abandoned in its thread.

* Tasks: OpenEnv has no dataset. ``tasks`` holds the ``reset()`` keyword arguments, one row per task
  (an int N: seeds 0..N-1). The opening is ``system_prompt`` (if any), then one user message: the
  row's ``prompt`` (or ``instructions``) and the text of the reset observation.
* Tool mode (a typed pydantic ``Action``): one tool, named after the Action (``GuessAction`` ->
  ``guess``), whose parameters are its fields but ``metadata``; each ``<tool_call>`` (parsed as TRL
  parses it) is one ``step``, its observation a ``tool`` message. A reply without a call ends the
  episode, as in TRL; a malformed call, arguments the Action rejects or an error the server
  reports for the action come back as TRL's ``{'error': ...}`` tool message, and the episode goes
  on. Untyped clients (``GenericEnvClient``) get the parameters from the server's ``/schema``; MCP
  clients (``MCPToolClient``) the server's tools, each call a ``CallToolAction``.
* Text mode (``action_from_text``): every reply becomes one action (a ``ValueError`` from it is
  told to the model); the observation comes back as a user message.
* Reward: the sum of the steps' rewards (``"last"``: the last one's; or a function of the
  ``StepResult`` list); ``None`` counts as 0, but steps that all gave ``None`` fail the rollout.
  An episode in which the model never acted scores 0. ``done`` from the server ends the episode at
  once: the model would not act on the final observation, which is kept in ``Score.info``.
* Concurrency: one server session per episode in flight. The server must allow them
  (``SUPPORTS_CONCURRENT_SESSIONS = True``, ``create_app(..., max_concurrent_envs=N)``); pass the same N
  as ``max_concurrent_episodes``. A refused session is retried for ``capacity_wait`` seconds, then fails
  the rollout with one line saying what to raise.

The environment is here; an episode, one client session, is :class:`~.episode.OpenEnvEpisode`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from datasets import Dataset

from ...envs.base import Environment, EnvironmentSetupError, UnknownSplitError, with_task_ids
from ..trl.tool_calls import prepare_tokenizer
from .actions import action_class, action_tool, default_observation_text
from .episode import OpenEnvEpisode

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ["OpenEnvEnvironment", "default_observation_text", "from_openenv"]

INSTALL = (
    "OpenEnv is not installed: pip install 'loop-trainer[openenv]' (with this project's pinned lock, "
    "pip install --no-deps openenv==0.10.0: its gradio requirement, for the optional web UI only, conflicts "
    "with the lock; the client needs websockets, a server fastapi, uvicorn and fastmcp)"
)


def _openenv() -> Any:
    try:
        from openenv.core import mcp_client
        from openenv.core.env_server import mcp_types
    except ModuleNotFoundError as error:
        raise EnvironmentSetupError(f"{INSTALL} ({error})") from None
    return mcp_client.MCPClientBase, mcp_types.CallToolAction


def _run_in_thread(coroutine: Callable[[], Any]) -> Any:
    """``asyncio.run(coroutine())`` on a thread of its own: works whether or not a loop runs here."""
    with ThreadPoolExecutor(1, thread_name_prefix="openenv-setup") as pool:
        return pool.submit(lambda: asyncio.run(coroutine())).result()


def _rows(tasks: Any, argument: str, first_seed: int = 0) -> Dataset:
    if isinstance(tasks, int) and not isinstance(tasks, bool):
        if tasks < 1:
            raise ValueError(f"{argument}={tasks}: give at least one task (an int N means seeds {first_seed}..)")
        return Dataset.from_list([{"task_id": f"seed-{s}", "seed": s} for s in range(first_seed, first_seed + tasks)])
    if isinstance(tasks, Sequence) and not isinstance(tasks, str) and all(isinstance(r, Mapping) for r in tasks):
        tasks = Dataset.from_list([dict(row) for row in tasks])
    if not isinstance(tasks, Dataset):
        raise ValueError(
            f"{argument} must be an int (seeds), a list of dicts or a datasets.Dataset of reset() "
            f"keyword arguments, got {type(tasks).__name__}"
        )
    return with_task_ids(tasks, "task")


class OpenEnvEnvironment(Environment):
    """Episodes over an OpenEnv server, one client session each; build it with :func:`from_openenv`."""

    name = "openenv"
    default_eval_split = "eval"  # its eval_tasks
    reward_range = (-float("inf"), float("inf"))

    def __init__(
        self,
        client: Any,
        *,
        base_url: str | None = None,
        client_kwargs: Mapping[str, Any] | None = None,
        tasks: Any = 1,
        eval_tasks: Any = None,
        action_from_text: Callable[[str], Any] | None = None,
        action_class: type[BaseModel] | None = None,
        tool_name: str | None = None,
        observation_text: Callable[[Any], str] = default_observation_text,
        reward: str | Callable[[list[Any]], float] = "sum",
        system_prompt: str | None = None,
        instructions: str | None = None,
        max_concurrent_episodes: int | None = None,
        capacity_wait: float = 10.0,
        name: str = "openenv",
    ):
        self.mcp_client_class, self.call_tool_action = _openenv()
        if type(client).__name__ == "SyncEnvClient":
            raise ValueError(
                "from_openenv runs OpenEnv clients asynchronously: pass the client without .sync() "
                "(for a container: asyncio.run(MyEnv.from_docker_image(image)))"
            )
        if reward not in ("sum", "last") and not callable(reward):
            raise ValueError(f"reward must be 'sum', 'last' or a function of the StepResults, got {reward!r}")
        if client_kwargs is not None and not isinstance(client, type):
            raise ValueError(
                "client_kwargs are for a client class (with base_url); a factory or an instance is already configured"
            )
        if action_from_text is not None and (action_class is not None or tool_name is not None):
            raise ValueError(
                "action_from_text (text mode) takes every reply as an action: action_class and tool_name "
                "are for tool mode; pass one mode's arguments"
            )
        self.parent: Any = None  # a client instance whose child sessions the episodes are
        if isinstance(client, type):
            if base_url is None:
                raise ValueError(
                    f"from_openenv({client.__name__}) needs base_url= (the OpenEnv server's URL), or pass "
                    "a client instance or a factory returning one"
                )
            self.factory = lambda: client(base_url=base_url, **dict(client_kwargs or {}))
        elif hasattr(client, "new_session"):  # an instance: each episode a child session of it
            self.parent, self.factory = client, client.new_session
            self.in_process_only = (
                "its episodes are sessions of one client instance, which a collection process's copy would close"
            )
        elif callable(client):
            self.factory = client
        else:
            raise ValueError(f"client must be an EnvClient subclass, an instance or a factory, got {client!r}")
        self.name, self.base_url = name, base_url
        self.datasets = {"train": _rows(tasks, "tasks")}
        if eval_tasks is not None:
            first = tasks if isinstance(tasks, int) and isinstance(eval_tasks, int) else 0  # seeds after train's
            self.datasets["eval"] = _rows(eval_tasks, "eval_tasks", first)
        self.action_from_text, self.action_class, self.tool_name = action_from_text, action_class, tool_name
        self.observation_text, self.reward = observation_text, reward
        self.system_prompt, self.instructions = system_prompt, instructions
        self.max_concurrent_episodes, self.capacity_wait = max_concurrent_episodes, capacity_wait
        self.mode: str | None = None  # "text", "tool", "untyped" or "mcp", once a client is seen
        self.tool: dict[str, Any] | None = None
        self.action_type: Any = None
        self.tokenizer: Any = None
        self.counts = {"action_errors": 0, "capacity_retries": 0}
        self.prepared = False

    def tasks(self, split: str = "train") -> Dataset:
        if split not in self.datasets:
            raise UnknownSplitError(
                f"this environment's splits are {', '.join(map(repr, self.datasets))} "
                "(tasks, eval_tasks); set train_split / eval_split to one of them"
            )
        return self.datasets[split]

    def episode(self, task: Mapping[str, Any]) -> OpenEnvEpisode:
        return OpenEnvEpisode(self, task)

    def set_tokenizer(self, tokenizer: Any) -> None:
        if self.action_from_text is None:  # tool calls are parsed with the template's response schema
            try:
                tokenizer = prepare_tokenizer(tokenizer)
            except ValueError as error:
                raise EnvironmentSetupError(str(error)) from None
        self.tokenizer = tokenizer

    def prepare(self) -> None:
        """Open one session and reset it, so an unreachable or broken server fails at once."""
        if self.prepared:
            return

        async def probe() -> None:
            episode = self.episode(self.datasets["train"][0])
            try:
                await episode.start()
            finally:
                await episode.close()

        try:
            _run_in_thread(probe)
        except Exception as error:  # noqa: BLE001 - one line for loop-train
            detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise EnvironmentSetupError(f"OpenEnv environment {self.name!r}: {detail}") from None
        self.prepared = True

    def metrics(self) -> dict[str, float]:
        return {key: float(value) for key, value in self.counts.items()}

    def close(self) -> None:
        parent, self.parent = self.parent, None
        if parent is not None:

            async def close() -> None:  # works whichever execution mode the instance was locked to
                result = parent.close()
                if inspect.isawaitable(result):
                    await result

            _run_in_thread(close)

    async def new_client(self) -> Any:
        client = self.factory()
        if inspect.isawaitable(client):
            client = await client
        if self.mode is None:
            await self._resolve(client)
        return client

    async def _resolve(self, client: Any) -> None:
        """Text, MCP, typed or untyped actions, as the first client shows (concurrent calls agree)."""
        if self.action_from_text is not None:
            self.mode = "text"
            return
        if isinstance(client, self.mcp_client_class):
            if self.action_class is not None or self.tool_name is not None:
                raise EnvironmentSetupError(
                    "an MCP client's tools are the server's own: action_class and tool_name do not apply to it"
                )
            self.mode = "mcp"
            return
        action = self.action_class or action_class(type(client))
        if action is not None:
            self.tool, self.action_type = action_tool(action.model_json_schema(), self.tool_name, self.name), action
            self.mode = "tool"
            return
        base_url = getattr(client, "base_url", None) or self.base_url
        if base_url is None:
            raise EnvironmentSetupError(
                f"{type(client).__name__} names no typed Action and has no base_url to read "
                "the server's /schema from: pass action_class= or action_from_text="
            )

        def fetch() -> dict[str, Any]:
            with urllib.request.urlopen(f"{base_url}/schema", timeout=30) as response:
                return json.loads(response.read())["action"]

        self.tool = action_tool(await asyncio.to_thread(fetch), self.tool_name, self.name)
        self.mode = "untyped"


def from_openenv(client: Any, **kwargs: Any) -> OpenEnvEnvironment:
    """An OpenEnv environment as a LOOP :class:`~loop_trainer.envs.base.Environment`.

    ``client``: an ``EnvClient`` subclass (with ``base_url=``), a zero-argument factory returning a
    client or an awaitable of one, or a client instance (each episode a ``new_session()`` of it).
    Keywords: ``tasks`` (int N: seeds 0..N-1; or rows of ``reset()`` kwargs, with optional
    ``task_id`` and ``prompt``), ``eval_tasks``, ``action_from_text`` (text mode), ``action_class``,
    ``tool_name``, ``observation_text``, ``reward`` (``"sum"``, ``"last"`` or a function of the
    StepResults), ``system_prompt``, ``instructions``, ``max_concurrent_episodes`` (at most the
    server's ``max_concurrent_envs``), ``capacity_wait``, ``client_kwargs``, ``name``."""
    return OpenEnvEnvironment(client, **kwargs)
