"""What an OpenEnv environment looks like to the model (:mod:`.openenv_env`): its typed Action as one
tool, and an observation as text. Pure functions of pydantic classes and JSON schemas: no client,
no server, no openenv import."""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ["action_class", "action_tool", "default_observation_text"]


def default_observation_text(observation: Any) -> str:
    """An observation's fields but ``done``, ``reward`` and ``metadata`` as JSON, or its one string
    field alone; an MCP tool call's result (or ``{'error': ...}``)."""
    if hasattr(observation, "tool_name") and hasattr(observation, "result"):  # MCP CallToolObservation
        if getattr(observation, "error", None) is not None:
            return str({"error": getattr(observation.error, "message", str(observation.error))})
        result = observation.result
        result = result["data"] if isinstance(result, Mapping) and "data" in result else result
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    data = observation.model_dump() if hasattr(observation, "model_dump") else observation
    if not isinstance(data, Mapping):
        return str(data)
    fields = {key: value for key, value in data.items() if key not in ("done", "reward", "metadata")}
    if len(fields) == 1 and isinstance(only := next(iter(fields.values())), str):
        return only
    return json.dumps(fields, ensure_ascii=False, default=str)


def action_class(client_type: type) -> type[BaseModel] | None:
    """The pydantic Action of ``EnvClient[Action, Observation, State]``, if the class says."""
    from pydantic import BaseModel

    for klass in client_type.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
                return args[0]
    return None


def action_tool(schema: Mapping[str, Any], name: str | None, environment: str) -> dict[str, Any]:
    """An HF-style tool schema from an Action's JSON schema: its fields but ``metadata`` (OpenEnv's
    bookkeeping, not the model's to set), field titles dropped (they repeat the names)."""
    title = re.sub(r"Action$", "", str(schema.get("title", "")))
    name = name or re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", title).lower() or "step"
    properties = {
        key: {k: v for k, v in value.items() if k != "title"}
        for key, value in schema.get("properties", {}).items()
        if key != "metadata"
    }
    parameters = {
        "type": "object",
        "properties": properties,
        "required": [key for key in schema.get("required", []) if key != "metadata"],
    }
    if "$defs" in schema:
        parameters["$defs"] = schema["$defs"]
    description = schema.get("description") or f"Act in the {environment} environment (one step)."
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
