"""One OpenEnv episode (:mod:`.environment`): a client session of its own, ``reset`` with the task's
keyword arguments, then one ``step`` per action the policy's reply holds (a parsed tool call, or the
whole reply in text mode), scored from the ``StepResult`` rewards."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from ...envs.base import Episode, EpisodeContractError, Message, Reply, Score, Step
from ..trl.tool_calls import malformed_call_message, parse_reply

if TYPE_CHECKING:
    from .environment import OpenEnvEnvironment

SERVER_ERROR = re.compile(r"Server error: (.*) \(code: (\w+)\)$", re.S)  # EnvClient's RuntimeError text
ACTION_ERRORS = ("VALIDATION_ERROR", "EXECUTION_ERROR")  # the action's fault: the model is told, not the run failed


class OpenEnvEpisode(Episode):
    def __init__(self, env: OpenEnvEnvironment, task: Mapping[str, Any]):
        self.env, self.task = env, task
        self.reset_kwargs = {k: v for k, v in task.items() if k not in ("task_id", "prompt")}
        self.client: Any = None
        self.results: list[Any] = []
        self.done, self.action_errors, self.last_observation = False, 0, ""

    async def start(self) -> list[Message]:
        env = self.env
        deadline = time.monotonic() + env.capacity_wait
        while True:
            self.client = await env.new_client()
            try:
                reset = await self.client.reset(**self.reset_kwargs)
                break
            except RuntimeError as error:
                match = SERVER_ERROR.search(str(error))
                if match is None or match.group(2) != "CAPACITY_REACHED":
                    raise
                # a session that just closed frees its slot a moment later: wait a little, then say what to change
                await self.close()
                if time.monotonic() > deadline:
                    limit = re.search(r"/(\d+) sessions", match.group(1))
                    raise RuntimeError(
                        f"the OpenEnv server refused a session ({match.group(1)}): let it run as many sessions as "
                        "episodes run at once (create_app(..., max_concurrent_envs=N) and SUPPORTS_CONCURRENT_SESSIONS"
                        " = True on its Environment), or cap LOOP's: from_openenv(..., max_concurrent_episodes="
                        f"{limit.group(1) if limit else 'N'})"
                    ) from None
                env.counts["capacity_retries"] += 1
                await asyncio.sleep(0.2)
        if env.mode == "mcp":
            self.tools = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in await self.client.list_tools()
            ]
        elif env.mode != "text":
            self.tools = [env.tool]
        opening = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
        prompt = self.task.get("prompt") or env.instructions
        observation = env.observation_text(reset.observation)
        text = "\n\n".join(part for part in (prompt, observation) if part)
        return [*opening, {"role": "user", "content": text}]

    async def step(self, reply: Reply) -> Step:
        env = self.env
        if env.mode == "text":
            assert env.action_from_text is not None  # text mode is action_from_text's
            try:
                action = env.action_from_text(str(reply))
            except ValueError as error:  # pydantic's ValidationError is one: the reply is not an action
                return Step([{"role": "user", "content": self._error(f"no action in this reply: {error}")}])
            content = await self._act(action)
            return Step(done=True) if self.done else Step([{"role": "user", "content": content}])
        assert self.tools is not None  # start() listed them (tool and MCP modes)
        parsed = parse_reply(env.tokenizer, reply, self.tools)
        calls = parsed.get("tool_calls")
        if not calls:
            malformed = malformed_call_message(env.tokenizer, parsed)
            if malformed is None:
                return Step(done=True)  # as in TRL: no call, the model is done
            self._count_error()
            return Step([malformed])
        messages = []
        for call in calls:
            function = call.get("function") or {}
            name = function.get("name", "unknown")
            if call.get("type") != "function":
                content = self._error(f"Unsupported tool call type: {call.get('type')}")
            elif name not in {tool["function"]["name"] for tool in self.tools}:
                content = self._error(f"Tool {name} not found.")
            else:
                content = await self._call(name, function.get("arguments") or {})
            if self.done:
                return Step(done=True)
            messages.append({"role": "tool", "name": name, "content": content})
        return Step(messages)

    async def _call(self, name: str, arguments: Any) -> str:
        env = self.env
        if env.mode == "mcp":
            return await self._act(env.call_tool_action(tool_name=name, arguments=dict(arguments)))
        if env.mode == "untyped":  # GenericEnvClient: the server validates
            return await self._act(dict(arguments))
        try:
            action = env.action_type(**arguments)
        except (ValueError, TypeError) as error:  # pydantic's ValidationError is a ValueError
            # pydantic's message spans lines and links its docs: one "field: problem" per error instead
            problems = error.errors() if hasattr(error, "errors") else [{"loc": (), "msg": str(error)}]
            text = "; ".join(f"{'.'.join(map(str, e['loc'])) or name}: {e['msg']}" for e in problems)
            return self._error(f"invalid arguments for {name}: {text}")
        return await self._act(action)

    async def _act(self, action: Any) -> str:
        """One ``step``: the observation's text, or the error the server reported for the action."""
        try:
            result = await self.client.step(action)
        except RuntimeError as error:
            match = SERVER_ERROR.search(str(error))
            if match is None or match.group(2) not in ACTION_ERRORS:
                raise  # a broken session, not a bad action: the rollout fails
            return self._error(match.group(1))
        self.results.append(result)
        self.done = bool(result.done)
        self.last_observation = self.env.observation_text(result.observation)
        return self.last_observation

    def _error(self, message: str) -> str:
        self._count_error()
        return str({"error": message})

    def _count_error(self) -> None:
        self.action_errors += 1
        self.env.counts["action_errors"] += 1

    def score(self) -> Score:
        rewards = [result.reward for result in self.results]
        if callable(self.env.reward):
            reward = self.env.reward(self.results)
        elif not rewards:
            reward = 0.0  # the model never acted
        elif all(value is None for value in rewards):
            raise EpisodeContractError(
                f"the OpenEnv server gave no reward in any of this episode's {len(rewards)} "
                "steps (every StepResult.reward is None): pass reward=<function of the "
                "StepResults> to from_openenv"
            )
        elif self.env.reward == "last":
            reward = rewards[-1] or 0.0
        else:
            reward = sum(value or 0.0 for value in rewards)
        return Score(
            reward=reward,
            info={
                "steps": len(self.results),
                "rewards": rewards,
                "done": self.done,
                "action_errors": self.action_errors,
                "last_observation": self.last_observation,
            },
        )

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.close()
            parent = self.env.parent
            with suppress(AttributeError, ValueError):  # new_session() keeps every child until its parent closes
                parent._child_clients.remove(client)
