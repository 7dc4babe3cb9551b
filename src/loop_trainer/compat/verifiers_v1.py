"""A verifiers ``verifiers.v1`` taskset as a LOOP environment: ``from_verifiers(taskset)``.

verifiers 0.4 has one stack, ``verifiers.v1`` (0.3.x ships it beside the 0.3 classes, which 0.4
removed): a ``Taskset`` yields ``Task`` objects, each with its data (``TaskData``: ``prompt``,
``system_prompt`` and the task's own fields), its tools (``Toolset`` servers: ``@vf.tool`` methods)
and its scoring (``@vf.reward`` / ``@vf.metric`` methods and the rewards and metrics plugged in
through ``TaskConfig``). verifiers runs a task by launching a harness program (a ``uv`` script)
that reaches the model through an OpenAI-compatible endpoint and the tools over MCP; LOOP plays
that harness itself, in-process, as verifiers' chat harness (``null``) plays a task:

* the opening is the task's system prompt and prompt, with the tools' schemas shown through the
  chat template (``apply_chat_template(tools=...)``), each named ``<server>_<tool>`` as the
  harness names MCP tools;
* each reply's tool calls (parsed from the sampled ids as TRL parses them) run in order, in
  process, on the episode's own ``Toolset`` instances (``setup()`` then ``setup_task(task)``, per
  episode), each call seeing the rollout's ``State`` as a verifiers tool server does over its
  state channel (its ``self.state``, written back after the call); a failed call answers
  ``Error executing tool <name>: <why>`` and the episode goes on;
* the episode ends at the first reply that calls no tool, when a ``@vf.stop`` on the trace says
  so (checked before each further reply), or at LOOP's limits;
* the task scores a ``vf.Trace`` of that conversation (tool calls and results included, with the
  state the tools left) with verifiers' own ``Task.score``; the trajectory's reward is the
  trace's (the weighted sum of the task's rewards).

Taskset-level tools (``Taskset.toolsets``, verifiers' shared servers) are set up per episode too:
LOOP has no server to share, so a costly ``setup()`` is paid by every episode.

Refused, each with one line naming why, because LOOP cannot run it in-process: tool servers with
a remote ``url``, a runtime other than a subprocess, or MCP handlers of their own (``register``
overridden), tasks that need a container or a runtime (``NEEDS_CONTAINER``, ``setup`` /
``finalize`` / ``stage_verifier`` hooks, a reward or metric with a ``runtime`` parameter), request
interceptors (``@vf.intercept``) and stops on a request or response, LLM judges
(``TaskConfig.judges``), tasks without a prompt (a user simulator opens those) and an infinite
taskset (bound it with ``taskset.take(n)``). An ``Env`` (a taskset and the agents that play it)
is refused for its taskset: LOOP's policy is the agent.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

from datasets import Dataset

from ..envs.base import Environment, EnvironmentSetupError, Episode, Message, Reply, Score, Step, UnknownSplitError
from .trl.tool_calls import malformed_call_message, parse_reply, prepare_tokenizer
from .verifiers_messages import plain_messages, vf_tool_calls

__all__ = ["VerifiersTasksetEnvironment", "is_v1_object"]

INSTALL = "pip install verifiers (0.3.1 or 0.4.x: both ship verifiers.v1)"


def _mro_names(obj: Any) -> set[tuple[str, str]]:
    return {(cls.__module__, cls.__name__) for cls in type(obj).__mro__}


def is_v1_object(obj: Any) -> bool:
    """Whether ``obj`` is a verifiers.v1 ``Taskset`` or ``Env`` (told apart without importing verifiers)."""
    names = _mro_names(obj)
    return ("verifiers.v1.taskset", "Taskset") in names or ("verifiers.v1.env", "Env") in names


@functools.cache
def _v1() -> SimpleNamespace:
    """``verifiers.v1`` (``.vf``) and the pieces of it a trace is built from, or one actionable line."""
    try:
        import verifiers.v1 as vf
        from verifiers.v1.configs.agent import AgentConfig
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.mcp import server as tool_server
        from verifiers.v1.session import call_hook, hook_boundary
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, TraceTask
        from verifiers.v1.utils.decorators import discover_decorated
    except ImportError as error:
        raise EnvironmentSetupError(f"the verifiers.v1 adapter needs verifiers.v1 ({error}): {INSTALL}") from None
    return SimpleNamespace(
        vf=vf,
        AgentConfig=AgentConfig,
        AgentInfo=AgentInfo,
        MessageNode=MessageNode,
        TraceTask=TraceTask,
        state_cls=state_cls,
        discover_decorated=discover_decorated,
        call_hook=call_hook,
        hook_boundary=hook_boundary,
        call_state=tool_server._call_state,  # what a tool's self.state reads during a call
    )


def _needs_runtime(fn: Any) -> bool:
    # the test verifiers' own Task.score makes: a runtime parameter without a default is skipped offline
    parameter = inspect.signature(fn).parameters.get("runtime")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _refusal(vf: Any, task: Any) -> str | None:
    """Why LOOP cannot run ``task`` in-process, or None."""
    kind = type(task).__name__
    base = vf.Task
    for server in type(task).toolsets(task.config):
        reason = _server_refusal(vf, server)
        if reason is not None:
            return f"{kind}'s {reason}"
    if task.NEEDS_CONTAINER:
        return f"{kind} needs a container (NEEDS_CONTAINER); LOOP's adapter runs tasks in-process"
    # 0.3.1's v1 Task has no stage_verifier: a hook counts where the task's class overrides verifiers' own
    hooks = [
        name
        for name in ("setup", "finalize", "stage_verifier")
        if getattr(type(task), name, None) is not getattr(base, name, None)
    ]
    if hooks:
        return f"{kind} defines {', '.join(hooks)}, which run in a runtime (a box); LOOP's adapter has none"
    v1 = _v1()
    if v1.discover_decorated(task, "intercept"):
        return f"{kind} intercepts model requests (@vf.intercept); LOOP's adapter samples the policy unaltered"
    for stop in task.hooks("stop"):
        try:
            boundary = v1.hook_boundary(stop, allow_trace=True)
        except TypeError as error:
            return f"{kind}'s stop {error}"
        if boundary is not vf.Trace:
            return (
                f"{kind}'s stop {stop.__name__} reads a {boundary.__name__}; LOOP's adapter checks stops on "
                "the trace (a vf.Trace parameter)"
            )
    if task.config.judges:
        return f"{kind} is scored by LLM judges (TaskConfig.judges); LOOP's adapter scores with rewards only"
    signals = [fn.__name__ for fn in (*task.hooks("reward"), *task.hooks("metric")) if _needs_runtime(fn)]
    if signals:
        return f"{kind}'s {', '.join(signals)} need a runtime (a runtime parameter); LOOP's adapter has none"
    if not task.hooks("reward"):
        return f"{kind} has no reward (@vf.reward or TaskConfig.rewards): LOOP trains on the task's reward"
    if task.data.prompt is None:
        return f"{kind} has no prompt (a user simulator opens it); LOOP's adapter needs TaskData.prompt"
    return None


def _server_refusal(vf: Any, server: Any) -> str | None:
    """Why LOOP cannot run the tool server ``server`` in-process, or None."""
    kind = type(server).__name__
    if getattr(server.config, "url", None):
        return f"tool server {kind} is remote (config.url); LOOP's adapter runs tool servers in-process"
    runtime = getattr(server.config, "runtime", None)
    if runtime is not None and type(runtime).__name__ != "SubprocessConfig":
        where = type(runtime).__name__
        return f"tool server {kind} runs in a {where} runtime; LOOP's adapter runs tool servers in-process"
    if type(server).register is not vf.Toolset.register:
        return f"tool server {kind} registers MCP handlers of its own (register); LOOP's adapter calls @vf.tool methods"
    return None


class Tool:
    """One ``@vf.tool`` method of an episode's tool server, as the model sees it (``schema``: named
    ``<server>_<tool>`` as verifiers' harness names MCP tools) and as a call runs it: arguments
    validated against the method's signature, the rollout's state visible as the server's
    ``self.state`` during the call and written back after it."""

    def __init__(self, v1: SimpleNamespace, server: Any, method: Callable[..., Any], rollout_state: type):
        import pydantic

        self.v1, self.server, self.method = v1, server, method
        # base State has no fields: nothing to sync; else the rollout's state class, to read and write it as JSON
        self.rollout_state: Any = pydantic.TypeAdapter(rollout_state) if server._state_cls is not v1.vf.State else None
        self.tool_name = getattr(method, "tool_name", None) or method.__name__
        prefix = server.server_name
        self.name = f"{prefix}_{self.tool_name}" if prefix else self.tool_name
        fields: dict[str, Any] = {}
        for parameter in inspect.signature(method).parameters.values():
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            annotation = Any if parameter.annotation is parameter.empty else parameter.annotation
            fields[parameter.name] = (annotation, ... if parameter.default is parameter.empty else parameter.default)
        self.arguments = pydantic.create_model(
            f"{self.name}_arguments", __config__=pydantic.ConfigDict(arbitrary_types_allowed=True), **fields
        )
        parameters = self.arguments.model_json_schema()
        parameters.pop("title", None)
        self.schema = {
            "type": "function",
            "function": {"name": self.name, "description": (method.__doc__ or "").strip(), "parameters": parameters},
        }

    async def __call__(self, arguments: Mapping[str, Any], trace: Any) -> str:
        """The tool's result as the tool message's content (``str`` as returned, anything else as JSON),
        or ``Error executing tool <name>: <why>`` for arguments that do not validate or a call that raises."""
        try:
            values = self.arguments.model_validate(dict(arguments))
            result = await self._with_state({name: getattr(values, name) for name in type(values).model_fields}, trace)
        except Exception as error:  # noqa: BLE001 - a bad call or a raising tool fails the call, not the run
            return f"Error executing tool {self.tool_name}: {error}"
        return _content(result)

    async def _with_state(self, arguments: dict[str, Any], trace: Any) -> Any:
        server, codec = self.server, self.rollout_state
        # what the server pulls from its state channel: the rollout's state, in its own state class
        state = server._state_adapter.validate_json(codec.dump_json(trace.state)) if codec else server._state_cls()
        token = self.v1.call_state.set(state)
        try:
            result = self.method(**arguments)
            if inspect.isawaitable(result):
                result = await result
        finally:
            self.v1.call_state.reset(token)
        if codec:  # the server's state replaces the rollout's, as its PUT on the state channel does
            trace.state = codec.validate_json(server._state_adapter.dump_json(state))
        return result


def _content(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, (list, tuple)):
        return "\n".join(_content(item) for item in result)
    import pydantic_core

    return pydantic_core.to_json(result, fallback=str, indent=2).decode()


class VerifiersTasksetEnvironment(Environment):
    """A verifiers.v1 ``Taskset`` as the "train" split; ``eval_taskset``, if given, as "eval"."""

    name = "verifiers"
    default_eval_split = "eval"
    reward_range = (-math.inf, math.inf)  # rewards are weighted sums of any real numbers

    def __init__(self, taskset: Any, *, eval_taskset: Any = None):
        self.v1 = _v1()
        splits = {"train": self._taskset(self.v1.vf, taskset)}
        if eval_taskset is not None:
            splits["eval"] = self._taskset(self.v1.vf, eval_taskset)
        self.tasksets = splits
        self.name = f"verifiers:{type(splits['train']).__name__}"
        self.loaded: dict[str, list[Any]] = {}
        self.datasets: dict[str, Dataset] = {}
        self.tokenizer: Any = None  # set_tokenizer(): one that parses tool calls, or None and tool_parsing says why
        self.tool_parsing: str | None = "call set_tokenizer() before running verifiers tool episodes"

    @staticmethod
    def _taskset(vf: Any, source: Any) -> Any:
        if isinstance(source, vf.Env):
            raise ValueError(
                f"{type(source).__name__} is a verifiers Env (a taskset and the agents that play it); LOOP's "
                "policy is the agent: pass its taskset, from_verifiers(env.taskset)"
            )
        if not isinstance(source, vf.Taskset):
            raise ValueError(f"expected a verifiers.v1 Taskset, got {type(source).__name__}")
        bounded = getattr(source, "bounded", None)  # 0.4; 0.3.1's v1 has INFINITE only (its head(n) clears it)
        if not (not source.INFINITE if bounded is None else bounded):
            raise EnvironmentSetupError(
                f"{type(source).__name__} is infinite; LOOP lists a split's tasks: pass taskset.take(n) "
                "(verifiers 0.3.1: taskset.head(n))"
            )
        for server in type(source).toolsets(source.config):
            reason = _server_refusal(vf, server)
            if reason is not None:
                raise EnvironmentSetupError(f"{type(source).__name__}'s shared {reason}")
        return source

    def tasks(self, split: str = "train") -> Dataset:
        if split not in self.tasksets:
            raise UnknownSplitError(
                f"this verifiers taskset environment's splits are {', '.join(map(repr, self.tasksets))} "
                "(the taskset, and eval_taskset if given); set train_split / eval_split to one of them"
            )
        if split not in self.datasets:
            tasks = list(self.tasksets[split])
            for task in tasks:
                reason = _refusal(self.v1.vf, task)
                if reason is not None:
                    raise EnvironmentSetupError(reason)
            # the task's durable id, else its name, where they name every task once; else its position
            for field in ("id", "name"):
                ids = [getattr(task.data, field, None) for task in tasks]
                if all(ids) and len(set(ids)) == len(ids):
                    break
            else:
                ids = [str(i) for i in range(len(tasks))]
            self.loaded[split] = tasks
            self.datasets[split] = Dataset.from_dict(
                {
                    "task_id": [str(i) for i in ids],
                    "split": [split] * len(tasks),
                    "position": list(range(len(tasks))),
                    "prompt": [task.data.prompt_text for task in tasks],
                }
            )
        return self.datasets[split]

    def set_tokenizer(self, tokenizer: Any) -> None:
        """The tokenizer whose chat template the policy writes tool calls in (they are parsed with it);
        one that cannot be parsed is refused only where a task has tools (``tool_parsing``: why not)."""
        try:
            self.tokenizer, self.tool_parsing = prepare_tokenizer(tokenizer), None
        except ValueError as error:
            self.tokenizer, self.tool_parsing = None, str(error)

    def episode(self, task: Mapping[str, Any]) -> VerifiersTaskEpisode:
        split, position = task["split"], task["position"]
        if split not in self.loaded:
            self.tasks(split)
        return VerifiersTaskEpisode(
            self.v1, self.loaded[split][position], self.tasksets[split], self.tokenizer, self.tool_parsing
        )


class VerifiersTaskEpisode(Episode):
    """One task played as verifiers' chat harness plays it: the opening, then replies and their tool
    calls until a reply calls none (or a stop or LOOP's limits end it), then the task's score."""

    def __init__(self, v1: SimpleNamespace, task: Any, taskset: Any, tokenizer: Any, tool_parsing: str | None):
        """``tokenizer``: one that parses tool calls, or None, and then ``tool_parsing`` says why not."""
        self.v1, self.task, self.taskset, self.tokenizer = v1, task, taskset, tokenizer
        self.tool_parsing = tool_parsing
        data, vf = task.data, v1.vf
        self.trace = vf.Trace(
            task=v1.TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
            state=v1.state_cls(type(task))(),
            agent=v1.AgentInfo(config=v1.AgentConfig()),
        )
        # the opening as verifiers messages (for the trace the task scores) and as the chat template renders it
        prompt = [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt)
        system = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
        self.prompt = system + prompt
        for message in self.prompt:
            self._record(message, sampled=False)
        self.servers: list[Any] = []
        self.by_name: dict[str, Tool] = {}
        self.turn = 0

    def _record(self, message: Any, *, sampled: bool) -> None:
        nodes = self.trace.nodes  # one branch: each node's parent is the one before
        nodes.append(self.v1.MessageNode(message=message, parent=len(nodes) - 1 if nodes else None, sampled=sampled))

    async def start(self) -> list[Message]:
        # verifiers launches the task's servers and the taskset's shared ones for a rollout; here, per episode
        own = type(self.task).toolsets(self.task.config)
        for server in [*own, *type(self.taskset).toolsets(self.taskset.config)]:
            self.servers.append(server)  # closed by close(), even if its setup fails
            await server.setup()
            if any(server is mine for mine in own):  # taskset-scoped servers skip setup_task, as in verifiers
                await server.setup_task(self.task)
            for method in self.v1.discover_decorated(server, "tool"):
                tool = Tool(self.v1, server, method, type(self.trace.state))
                if tool.name in self.by_name:
                    raise EnvironmentSetupError(
                        f"two tools are named {tool.name!r} ({type(server).__name__} and "
                        f"{type(self.by_name[tool.name].server).__name__}); verifiers refuses the same"
                    )
                self.by_name[tool.name] = tool
        if self.by_name:
            if self.tokenizer is None:
                raise EnvironmentSetupError(f"{type(self.task).__name__} has tools, but {self.tool_parsing}")
            self.tools = [tool.schema for tool in self.by_name.values()]
        return plain_messages(self.prompt, source="the task's prompt")

    async def step(self, reply: Reply) -> Step:
        vf = self.v1.vf
        self.turn += 1
        parsed = parse_reply(self.tokenizer, reply, self.tools) if self.by_name else {"content": str(reply)}
        calls = vf_tool_calls(vf.ToolCall, parsed, self.turn)
        content = parsed.get("content") or ""
        self._record(vf.AssistantMessage(content=content, tool_calls=calls or None), sampled=True)
        malformed = malformed_call_message(self.tokenizer, parsed) if self.by_name and not calls else None
        if not calls and malformed is None:
            self.trace.stop_condition = "no_tools_called"
            return Step(done=True)
        answers: list[Message] = []
        if malformed is not None:  # answered, as any failed call is, and the episode goes on
            answers.append(malformed)
        for call, wanted in zip(calls, parsed.get("tool_calls") or [], strict=True):
            tool = self.by_name.get(call.name)
            arguments = wanted["function"].get("arguments") or {}
            if tool is None:
                result = f"error: unknown tool {call.name!r}"
            elif not isinstance(arguments, dict):
                result = f"error: tool arguments must be a JSON object, got {type(arguments).__name__}"
            else:
                result = await tool(arguments, self.trace)
            self._record(vf.ToolMessage(tool_call_id=call.id, content=result, name=call.name), sampled=False)
            answers.append({"role": "tool", "name": call.name, "content": result})
        for stop in self.task.hooks("stop"):  # before the next reply, as verifiers checks them
            fired = await self.v1.call_hook(stop, {vf.Trace: self.trace})
            if not isinstance(fired, bool):
                raise ValueError(f"@stop {stop.__name__} must return bool, got {type(fired).__name__}")
            if fired:
                self.trace.stop_condition = stop.__name__
                return Step(messages=answers, done=True)
        return Step(messages=answers)

    async def score(self) -> Score:
        trace = self.trace
        if trace.stop_condition is None:  # LOOP's limits ended the episode
            trace.stop_condition = "max_turns"
        await self.task.score(trace)  # a raising reward fails this rollout (verifiers' TaskError, in one line)
        return Score(
            reward=trace.reward,
            info={
                "rewards": {name: reward.score for name, reward in trace.rewards.items() if reward is not None},
                "metrics": {name: float(value) for name, value in trace.metrics.items() if value is not None},
                "stop_condition": trace.stop_condition,
                "task_key": self.task.key,
                "tool_calls": sum(len(n.message.tool_calls or []) for n in trace.nodes if n.sampled),
            },
        )

    async def close(self) -> None:
        for server in self.servers:  # what setup() entered (ServerBase keeps an exit stack for it)
            await server._exit_stack.aclose()
