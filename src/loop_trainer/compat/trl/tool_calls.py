"""Tool calling as TRL's ``GRPOTrainer`` (1.16) does it, one episode at a time.

* Which functions are tools: the ``tools`` list, plus every public function of an environment
  object's class except ``reset`` and ``get_reward`` (:func:`tool_functions`); the model sees them
  through its chat template (``apply_chat_template(tools=...)``: the schema comes from type hints
  and the docstring).
* What the model called: TRL's ``parse_response`` with the response template TRL knows for the
  tokenizer's chat template (Qwen2.5's ``<tool_call>{json}</tool_call>``, Llama 3.1, ...), on the
  sampled ids and the prompt before them (:func:`parse_reply`).
* What the model gets back: one ``tool`` message per call, ``str(result)``; an unknown tool, wrong
  arguments or a tool that raises gives ``str({"error": "<message>"})``, TRL's exact text
  (:func:`call_tools`).

When a reply opens a tool call that does not parse (malformed JSON, a call cut off by the token limit),
TRL treats the turn as plain text and ends the rollout: so does LOOP's TRL route by default. With
``malformed_tool_call: answer`` (and in the verifiers and OpenEnv adapters) the model gets a tool message
saying the call could not be parsed (:func:`malformed_call_message`), and the episode goes on, as it
would for any other failed call.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...envs.base import Message, Reply

__all__ = [
    "NOT_TOOLS",
    "call_tools",
    "malformed_call_message",
    "parse_reply",
    "prepare_tokenizer",
    "tool_functions",
    "unparsed_call",
]

NOT_TOOLS = ("reset", "get_reward")
"""Public methods of an environment class that are not tools (TRL's rule)."""


class ToolCallingSetupError(ValueError):
    """The tokenizer's chat template cannot be parsed for tool calls: one line saying what to set."""


def prepare_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` with a response template to parse tool calls with: its own, or the one TRL ships
    for its chat template (``trl.chat_template_utils.add_response_schema``)."""
    if (
        getattr(tokenizer, "response_template", None) is not None
        or getattr(tokenizer, "response_schema", None) is not None
    ):
        return tokenizer
    from trl.chat_template_utils import add_response_schema

    try:
        return add_response_schema(tokenizer)
    except ValueError:
        raise ToolCallingSetupError(
            "tool calling needs to parse the model's replies, and TRL knows no response template for this "
            "tokenizer's chat template: set tokenizer.response_template (see transformers' chat response "
            "parsing docs) or use a model whose template TRL supports (Qwen2.5/3, Llama 3.1/3.2, ...)"
        ) from None


def tool_functions(tools: Sequence[Callable] = (), environment: Any = None) -> dict[str, Callable]:
    """The callable tools by name: ``tools``, then the environment object's public methods (a method
    wins over a plain tool of the same name, as in TRL)."""
    functions = {tool.__name__: tool for tool in tools}
    if environment is not None:
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction):
            if not name.startswith("_") and name not in NOT_TOOLS:
                functions[name] = getattr(environment, name)
    return functions


def parse_reply(tokenizer: Any, reply: Reply, tools: Sequence[Any] | None = None) -> dict[str, Any]:
    """The reply as an assistant message: ``{"role": "assistant", "content": ..., "tool_calls": [...]}``
    (no ``tool_calls`` when it calls nothing or its call does not parse). Arguments are typed by
    the called tool's schema (``"7"`` -> ``7`` for an integer parameter)."""
    from trl.chat_template_utils import parse_response

    return parse_response(
        tokenizer, list(reply.token_ids), prefix=list(reply.prompt_ids) or None, tools=list(tools) if tools else None
    )


def _call_markers(tokenizer: Any) -> tuple[str, str] | None:
    fields = (getattr(tokenizer, "response_template", None) or {}).get("fields", {})
    tool_calls = fields.get("tool_calls") if isinstance(fields, Mapping) else None
    if not isinstance(tool_calls, Mapping) or not isinstance(tool_calls.get("open"), str):
        return None
    close = tool_calls.get("close_pattern")
    return tool_calls["open"], close if isinstance(close, str) else ""


def unparsed_call(tokenizer: Any, parsed: Mapping[str, Any]) -> tuple[str, str] | None:
    """For a reply that opens a tool call which did not parse: the text before the call and the
    call's body (up to its closing marker); else None."""
    markers = _call_markers(tokenizer)
    content = parsed.get("content") or ""
    if parsed.get("tool_calls") or markers is None or markers[0] not in content:
        return None
    before, body = content.split(markers[0], 1)
    return before, re.split(markers[1], body, maxsplit=1)[0] if markers[1] else body


def malformed_call_message(tokenizer: Any, parsed: Mapping[str, Any]) -> Message | None:
    """A tool message for a reply that opens a tool call which did not parse, else None."""
    call, markers = unparsed_call(tokenizer, parsed), _call_markers(tokenizer)
    if call is None or markers is None:  # a call found means markers to find it with
        return None
    body = call[1]
    try:
        json.loads(body)
        reason = 'it needs a "name" (a string) and "arguments" (an object)'
    except json.JSONDecodeError as error:
        reason = f"its JSON does not parse ({error})"
    return {
        "role": "tool",
        "name": "unknown",
        "content": str(
            {
                "error": f"malformed tool call: {reason}. Expected {markers[0]}"
                '{"name": <function-name>, "arguments": <args-json-object>}' + "."
            }
        ),
    }


async def call_tools(
    tool_calls: Sequence[Mapping[str, Any]], functions: Mapping[str, Callable]
) -> tuple[list[Message], int]:
    """Run the calls in order (a plain function on a worker thread, so a slow tool holds up only its
    own episode; a coroutine function awaited). One ``tool`` message per call, and how many failed."""
    messages, failures = [], 0
    for call in tool_calls:
        if call.get("type") != "function":
            name, result = call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call.get('type')}"}
            failures += 1
        else:
            name = call["function"]["name"]
            arguments = call["function"].get("arguments")
            arguments = {} if arguments is None else arguments
            try:
                if name not in functions:
                    raise ValueError(f"Tool {name} not found.")
                function = functions[name]
                if inspect.iscoroutinefunction(function):
                    result = await function(**arguments)
                else:
                    result = await asyncio.to_thread(function, **arguments)
            except Exception as error:  # noqa: BLE001 - the model is told, the episode goes on (as in TRL)
                result = {"error": str(error)}
                failures += 1
        messages.append({"role": "tool", "name": name, "content": str(result)})
    return messages, failures
