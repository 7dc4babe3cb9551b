"""Token-exact, append-only chat formatting for multi-turn rollouts.

A multi-turn trajectory is built by appending, never by re-rendering: turn t+1's prompt is turn
t's prompt + the sampled ids + the ids of the newly templated messages. Sampled text is never
decoded and re-tokenised (that drifts, and then the PPO ratio lies).

New messages are rendered on their own, after an anchor system message that is then cut away.
That keeps templates that inject a default system prompt when the conversation has none (Qwen2.5)
from injecting one mid-conversation, and it works for any template that renders each message
independently of the ones before it (ChatML, Qwen2.5, Llama 3, ...). The opening of an episode is
rendered as a whole conversation, so the template behaves exactly as at inference time; so is
each new segment of an episode whose context policy rewrote its history (its earlier replies are
context there, re-tokenised from their text as the model then sees them, and never trained).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from .envs.base import Message

_ANCHOR = "\u2063loop-trainer-anchor\u2063"


class ChatTemplateError(ValueError):
    """The chat template cannot be appended to token-exactly."""


class ChatFormatter:
    """Turns chat messages into token ids that extend a conversation exactly."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("the tokenizer has no chat template; pass one (chat_template=...)")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        anchor = [{"role": "system", "content": _ANCHOR}]
        self._anchor_text = self._render(anchor)
        rendered = self._render([*anchor, {"role": "assistant", "content": _ANCHOR}])
        if not rendered.startswith(self._anchor_text) or _ANCHOR not in rendered[len(self._anchor_text) :]:
            raise ChatTemplateError("the chat template does not render messages independently of each other")
        after_reply = rendered.rsplit(_ANCHOR, 1)[1]
        self._after_reply_text = after_reply
        self._after_truncated_reply = self._encode(after_reply)
        self._after_stop: dict[int, list[int]] = {}

    def _render(
        self, messages: Sequence[Message], add_generation_prompt: bool = False, tools: Sequence[Any] | None = None
    ) -> str:
        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        text = self.tokenizer.apply_chat_template(
            list(messages),
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **extra,
            **self.chat_template_kwargs,
        )
        return cast(str, text)  # tokenize=False: the text (transformers annotates every return type at once)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def opening_ids(self, messages: Sequence[Message], tools: Sequence[Any] | None = None) -> list[int]:
        """The episode's first prompt: the opening messages as a whole conversation (with the
        ``tools`` the model may call, where the template shows them), plus the assistant header the
        model continues from. Templates show tools once, in the opening, so later turns render alike."""
        return self._encode(self._render(messages, add_generation_prompt=True, tools=tools))

    def continuation_ids(self, messages: Sequence[Message]) -> list[int]:
        """Ids of ``messages`` appended after a finished assistant turn, plus the next assistant
        header."""
        anchor = [{"role": "system", "content": _ANCHOR}]
        text = self._render([*anchor, *messages], add_generation_prompt=True)
        if not text.startswith(self._anchor_text):
            raise ChatTemplateError("the chat template renders earlier messages differently when more follow")
        return self._encode(text[len(self._anchor_text) :])

    def after_reply_ids(self, sampled_ids: Sequence[int], stopped: bool) -> list[int]:
        """Ids the template puts after an assistant reply that were not sampled.

        After a reply that ended with its stop token (Qwen's ``<|im_end|>``) that is the rest of
        the template's end-of-turn text (``"\\n"``); after a reply cut by the token limit it is the
        whole end-of-turn text, stop token included, so the conversation stays well formed.
        """
        if not stopped or not sampled_ids:
            return list(self._after_truncated_reply)
        stop_id = int(sampled_ids[-1])
        if stop_id not in self._after_stop:
            stop_text = self._decode([stop_id])
            rest = self._after_reply_text
            rest = rest[len(stop_text) :] if stop_text and rest.startswith(stop_text) else rest
            self._after_stop[stop_id] = self._encode(rest)
        return list(self._after_stop[stop_id])

    def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` takes on its own (what a context policy's token budget measures)."""
        return len(self._encode(text))

    def reply_text(self, sampled_ids: Sequence[int]) -> str:
        """The reply as the environment sees it: decoded, special tokens removed."""
        return self._decode(list(sampled_ids), skip_special_tokens=True)

    def _decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        # one sequence decodes to one str (transformers annotates the batched list[str] return too)
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a reply: the tokenizer's eos and every eos id the model's generation config
    declares (e.g. an end-of-turn token), as TRL's GRPOTrainer counts them. One definition for
    training and ``loop-eval``."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return sorted({i for i in [tokenizer.eos_token_id, *configured] if i is not None})
