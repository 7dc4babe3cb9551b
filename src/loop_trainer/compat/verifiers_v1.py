"""A verifiers ``verifiers.v1`` taskset as a LOOP environment: ``from_verifiers(taskset)``.

verifiers 0.4 has one stack, ``verifiers.v1`` (0.3.x ships it beside the 0.3 classes, which 0.4
removed): a ``Taskset`` yields ``Task`` objects, each with its data (``TaskData``: ``prompt``,
``system_prompt`` and the task's own fields) and its scoring (``@vf.reward`` / ``@vf.metric``
methods and the rewards and metrics plugged in through ``TaskConfig``). verifiers runs a task by
launching a harness program (a ``uv`` script) that reaches the model through an OpenAI-compatible
endpoint; LOOP plays that harness itself, in-process, as verifiers' tool-less chat harness
(``null``) plays a task: the opening is the task's system prompt and prompt, the policy answers
once (with no tools, a chat harness stops at the first reply), and the task scores a
``vf.Trace`` of that conversation with verifiers' own ``Task.score``. The trajectory's reward is
the trace's (the weighted sum of the task's rewards).

Refused, each with one line naming why, because LOOP cannot run it in-process: tools
(``Toolset`` servers, which verifiers serves over MCP), tasks that need a container or a
runtime (``NEEDS_CONTAINER``, ``setup`` / ``finalize`` / ``stage_verifier`` hooks, a reward or
metric with a ``runtime`` parameter), LLM judges (``TaskConfig.judges``), tasks without a prompt
(a user simulator opens those) and an infinite taskset (bound it with ``taskset.take(n)``). An
``Env`` (a taskset and the agents that play it) is refused for its taskset: LOOP's policy is the agent.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from datasets import Dataset

from ..envs.base import Environment, EnvironmentSetupError, Episode, Message, Reply, Score, Step, UnknownSplitError
from .verifiers_messages import plain_messages

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
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, TraceTask
    except ImportError as error:
        raise EnvironmentSetupError(f"the verifiers.v1 adapter needs verifiers.v1 ({error}): {INSTALL}") from None
    return SimpleNamespace(
        vf=vf,
        AgentConfig=AgentConfig,
        AgentInfo=AgentInfo,
        MessageNode=MessageNode,
        TraceTask=TraceTask,
        state_cls=state_cls,
    )


def _needs_runtime(fn: Any) -> bool:
    # the test verifiers' own Task.score makes: a runtime parameter without a default is skipped offline
    parameter = inspect.signature(fn).parameters.get("runtime")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _refusal(vf: Any, task: Any) -> str | None:
    """Why LOOP cannot run ``task`` in-process, or None."""
    kind = type(task).__name__
    base = vf.Task
    toolsets = type(task).toolsets(task.config)
    if toolsets:
        names = ", ".join(type(t).__name__ for t in toolsets)
        return f"{kind} has tools ({names}): verifiers serves them over MCP; LOOP's adapter runs tool-less tasks"
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
        shared = type(source).toolsets(source.config)
        if shared:
            names = ", ".join(type(t).__name__ for t in shared)
            raise EnvironmentSetupError(
                f"{type(source).__name__} has shared tools ({names}): verifiers serves them over MCP; "
                "LOOP's adapter runs tool-less tasks"
            )
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

    def episode(self, task: Mapping[str, Any]) -> VerifiersTaskEpisode:
        split, position = task["split"], task["position"]
        if split not in self.loaded:
            self.tasks(split)
        return VerifiersTaskEpisode(self.v1, self.loaded[split][position])


class VerifiersTaskEpisode(Episode):
    """One task played as verifiers' tool-less chat harness plays it: the opening, one reply, the task's score."""

    def __init__(self, v1: SimpleNamespace, task: Any):
        self.v1, self.task = v1, task
        self.reply: Reply | None = None
        data, vf = task.data, v1.vf
        # the opening as verifiers messages (for the trace the task scores) and as the chat template renders it
        prompt = [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt)
        system = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
        self.prompt = system + prompt

    def start(self) -> list[Message]:
        return plain_messages(self.prompt, source="the task's prompt")

    def step(self, reply: Reply) -> Step:
        self.reply = reply
        return Step(done=True)  # no tools: a chat harness ends at the first reply

    async def score(self) -> Score:
        v1, task = self.v1, self.task
        trace = v1.vf.Trace(
            task=v1.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=v1.state_cls(type(task))(),
            agent=v1.AgentInfo(config=v1.AgentConfig()),
        )
        messages = [(message, False) for message in self.prompt]
        if self.reply is not None:  # None: LOOP's limits ended the episode before the model answered
            messages.append((v1.vf.AssistantMessage(content=str(self.reply)), True))
        for index, (message, sampled) in enumerate(messages):  # one branch: each node's parent is the one before
            trace.nodes.append(v1.MessageNode(message=message, parent=index - 1 if index else None, sampled=sampled))
        trace.stop_condition = "no_tools_called" if self.reply is not None else "max_turns"
        await task.score(trace)  # a raising reward fails this rollout (verifiers' TaskError, in one line)
        return Score(
            reward=trace.reward,
            info={
                "rewards": {name: reward.score for name, reward in trace.rewards.items() if reward is not None},
                "metrics": {name: float(value) for name, value in trace.metrics.items() if value is not None},
                "stop_condition": trace.stop_condition,
                "task_key": task.key,
            },
        )
