"""Messages between verifiers and LOOP (:mod:`.verifiers`): verifiers' messages as the chat template
renders them, and the policy's sampled reply as the ``vf.Response`` verifiers awaits."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any

from ..envs.base import EnvironmentSetupError, EpisodeContractError, Message, Reply
from .trl.tool_calls import parse_reply, unparsed_call


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = [p if isinstance(p, Mapping) else p.model_dump() for p in content]
    if kinds := {p.get("type") for p in parts} - {"text"}:
        raise EpisodeContractError(
            f"{where} has {', '.join(map(str, kinds))} content; LOOP's verifiers adapter takes text"
        )
    return "".join(p["text"] for p in parts)


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # a malformed call, kept as the model wrote it


def plain_messages(messages: Any, source: str = "verifiers") -> list[Message]:
    """verifiers messages (pydantic or dicts) as the chat template renders them: text content,
    assistant ``tool_calls`` in HF form (arguments a dict), tool messages with their call id."""
    out = []
    for index, message in enumerate(messages):
        m = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
        role = m.get("role")
        if role == "text":
            raise EpisodeContractError(f"{source} message {index} is a completion-style 'text' message; LOOP runs chat")
        plain: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{source} message {index}")}
        if m.get("reasoning_content"):
            plain["reasoning_content"] = m["reasoning_content"]
        if role == "assistant" and m.get("tool_calls"):
            plain["tool_calls"] = [
                {
                    "type": "function",
                    "id": call.get("id"),
                    "function": {"name": call["name"], "arguments": _arguments(call["arguments"])},
                }
                for call in m["tool_calls"]
            ]
        if role == "tool" and m.get("tool_call_id") is not None:
            plain["tool_call_id"] = m["tool_call_id"]
        out.append(plain)
    return out


def vf_tool_calls(tool_call: Any, parsed: Mapping[str, Any], turn: int) -> list[Any]:
    """The parsed reply's tool calls as verifiers ``ToolCall``s (``tool_call``: the class; 0.3's ``vf.types``
    and ``verifiers.v1`` each have one), numbered ``call_<turn>_<i>``, arguments as JSON text."""
    return [
        tool_call(
            id=f"call_{turn}_{i}",
            name=call["function"]["name"],
            arguments=json.dumps(call["function"].get("arguments") or {}),
        )
        for i, call in enumerate(parsed.get("tool_calls") or [])
    ]


def vf_response(types: Any, reply: Reply, tokenizer: Any, tool_defs: list[dict[str, Any]] | None, turn: int) -> Any:
    """The policy's reply as the ``vf.Response`` verifiers awaits (``types``: ``vf.types``): its tool calls
    parsed from the sampled ids (when the rollout has ``tool_defs``) and numbered by ``turn``; a call that
    does not parse goes to verifiers as written, so the environment reports the error in its own words."""
    parsed: dict[str, Any] = {"role": "assistant", "content": str(reply)}
    if tool_defs:
        if tokenizer is None:
            raise EnvironmentSetupError("call set_tokenizer() before running verifiers tool episodes")
        parsed = parse_reply(tokenizer, reply, tool_defs)
    calls = vf_tool_calls(types.ToolCall, parsed, turn)
    content = parsed.get("content") or ""
    unparsed = unparsed_call(tokenizer, parsed) if not calls and tool_defs else None
    if unparsed is not None:
        # hand verifiers the unparsed call, so the environment reports the error in its own words
        content, body = unparsed[0], unparsed[1].strip()
        name = re.search(r'"name"\s*:\s*"([^"]*)"', body)
        calls = [types.ToolCall(id=f"call_{turn}_0", name=name.group(1) if name else "", arguments=body)]
    message = types.ResponseMessage(
        content=content,
        reasoning_content=parsed.get("reasoning_content"),
        tool_calls=calls or None,
        finish_reason="tool_calls" if calls else "stop",
        is_truncated=False,
    )
    # usage lets max_total_completion_tokens and verifiers' token metrics work
    prompt_tokens, completion_tokens = len(reply.prompt_ids), len(reply.token_ids)
    usage = types.Usage(
        prompt_tokens=prompt_tokens,
        reasoning_tokens=0,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
    return types.Response(
        id=f"loop-{turn}", created=int(time.time()), model="loop-policy", usage=usage, message=message
    )
