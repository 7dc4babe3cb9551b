"""The paper's ReAct code agent for AppWorld: its prompt, its actions and its observations.

The prompt is built from editable template files (``prompts/`` next to this module, or a directory
of your own with the same file names): ``system.md``, ``intro.md``, a worked example
``example.yaml``, ``instructions.md`` and ``task.md`` make the opening messages;
``observation.md`` and ``no_code.md`` the replies to the agent. Templates are Jinja2 and see the
task's ``supervisor`` (first_name, last_name, email, phone_number), ``date`` and ``instruction``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import yaml

from ..base import Message

DEFAULT_PROMPT_DIR = Path(__file__).with_name("prompts")
PROMPT_FILES = ("system.md", "intro.md", "example.yaml", "instructions.md", "task.md", "observation.md", "no_code.md")

_CODE_BLOCK = re.compile(r"```python[^\n]*\n(.*?)```", re.DOTALL)
# Plain text prompts (no autoescape); a missing variable is an error, not an empty string.
_PROMPT_TEMPLATES = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False)


@functools.lru_cache(maxsize=128)
def _compiled(source: str) -> jinja2.Template:
    """Each template text is compiled once: every episode renders the same few prompts."""
    return _PROMPT_TEMPLATES.from_string(source)


def extract_code(reply: str) -> str | None:
    """All ```python blocks of a reply, concatenated in order; None if there is none."""
    blocks = [block.strip("\n") for block in _CODE_BLOCK.findall(reply)]
    blocks = [block for block in blocks if block.strip()]
    return "\n\n".join(blocks) if blocks else None


def approximate_token_count(text: str) -> int:
    """About 4 characters a token: used only until a real tokenizer is bound."""
    return (len(text) + 3) // 4


@dataclass
class Truncation:
    text: str
    truncated: bool
    shown_lines: int
    total_lines: int


def truncate_at_line(text: str, max_tokens: int, count_tokens: Callable[[str], int]) -> Truncation:
    """The longest prefix of whole lines within ``max_tokens`` (at least one line is never split
    unless it alone is too long, then it is cut by characters)."""
    lines = text.splitlines()
    if count_tokens(text) <= max_tokens:
        return Truncation(text, False, len(lines), len(lines))
    low, high = 0, len(lines)  # invariant: lines[:low] fits, lines[:high+1] does not (if high < len)
    while low < high:
        middle = (low + high + 1) // 2
        if count_tokens("\n".join(lines[:middle])) <= max_tokens:
            low = middle
        else:
            high = middle - 1
    if low == 0:  # one enormous first line: cut it by characters
        characters = len(lines[0]) if lines else 0
        while characters > 0 and count_tokens(lines[0][:characters]) > max_tokens:
            characters //= 2
        return Truncation(lines[0][:characters] if lines else "", True, 0, len(lines))
    return Truncation("\n".join(lines[:low]), True, low, len(lines))


@dataclass
class ReActPrompts:
    """The agent's templates, loaded from a directory."""

    templates: dict[str, str]
    max_observation_tokens: int = 3000
    count_tokens: Callable[[str], int] = field(default=approximate_token_count)

    @classmethod
    def load(cls, directory: str | Path | None = None, **kwargs: Any) -> ReActPrompts:
        directory = Path(directory) if directory is not None else DEFAULT_PROMPT_DIR
        missing = [name for name in PROMPT_FILES if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(f"prompt directory {directory} lacks {', '.join(missing)}")
        return cls({name: (directory / name).read_text() for name in PROMPT_FILES}, **kwargs)

    def _render(self, name: str, **values: Any) -> str:
        return _compiled(self.templates[name]).render(**values).strip()

    def opening_messages(self, supervisor: Mapping[str, Any], date: str, instruction: str) -> list[Message]:
        values = {"supervisor": supervisor, "date": date, "instruction": instruction}
        messages: list[Message] = [{"role": "system", "content": self._render("system.md", **values)}]
        _append(messages, "user", self._render("intro.md", **values))
        for turn in yaml.safe_load(self.templates["example.yaml"]) or []:
            _append(messages, turn["role"], _compiled(turn["content"]).render(**values).strip())
        _append(
            messages, "user", self._render("instructions.md", **values) + "\n\n" + self._render("task.md", **values)
        )
        return messages

    def observation(self, output: str, instruction: str) -> str:
        cut = truncate_at_line(output.rstrip(), self.max_observation_tokens, self.count_tokens)
        return self._render(
            "observation.md",
            output=cut.text,
            truncated=cut.truncated,
            shown_lines=cut.shown_lines,
            total_lines=cut.total_lines,
            instruction=instruction,
        )

    def no_code(self, instruction: str) -> str:
        return self._render("no_code.md", instruction=instruction)


def _append(messages: list[Message], role: str, content: str) -> None:
    # Consecutive messages of one role are merged, so user and assistant turns alternate.
    if messages and messages[-1]["role"] == role:
        messages[-1]["content"] += "\n\n" + content
    else:
        messages.append({"role": role, "content": content})
