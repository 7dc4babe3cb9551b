"""What the model sees of an episode's history: context policies.

By default an episode's context is its whole history, append-only: each reply and observation is
appended to the tokens the model saw before, and the episode is one token-exact sequence. Long
agent episodes outgrow that. A context policy rewrites the history the model is shown before each
reply -- old observations elided, earlier ``<think>`` blocks stripped (as Qwen3's chat template
does) -- and when the rewritten history no longer extends what the model saw before, the rollout
engine renders it afresh and the episode continues in a new *segment*. Each segment is trained as
exactly the context the sampler saw, with the sampler's log-probs; all of an episode's segments
share its advantage and its per-trajectory token mean (docs/environments.md, "Context policies").

Two sources, the first that is set wins:

* the episode's own :meth:`~loop_trainer.envs.base.Episode.context` hook (any rewrite at all);
* :class:`ContextPolicy`, built from the ``context_*`` keys, for every environment, the built-in
  ones and AppWorld included.

A policy is a function of the history (the messages of the whole episode so far, as text): the
same history is always shown the same way, so a resumed or replayed episode sees what it saw.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..envs.base import Message

ELIDED = "[output elided]"
"""What an elided observation's content becomes: the message stays (roles keep alternating), its text goes."""

THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
"""A reasoning block as Qwen3 and DeepSeek-R1 style models write it."""

OBSERVATION_ROLES = ("user", "tool")
"""The roles of the messages a context policy may elide: what the environment answered."""


@dataclass(frozen=True)
class ContextPolicy:
    """The ``context_*`` keys: how the history is shown before each reply. Nothing set: append-only.

    ``keep_observations``: only the last N observations (environment messages after the opening)
    keep their text; older ones read :data:`ELIDED`. Every reply past the N-th observation then
    starts a new segment.

    ``observation_budget``: when the observations' text outgrows this many tokens, the oldest are
    elided until they take at most half of it (compaction, as agent harnesses do when a context
    fills up). The elided set only grows, so an episode gets a new segment only at a compaction,
    not at every reply. The newest observation is never elided.

    ``strip_thinking``: ``<think>...</think>`` blocks are removed from every reply but the one
    being written, as Qwen3's chat template removes them from earlier turns (it keeps them within
    a chain of tool calls; this removes them from every earlier reply). Every reply after one that
    thought then starts a new segment.
    """

    keep_observations: int | None = None
    observation_budget: int | None = None
    strip_thinking: bool = False

    @property
    def active(self) -> bool:
        return self.keep_observations is not None or self.observation_budget is not None or self.strip_thinking

    def shown(self, history: Sequence[Message], num_opening: int, count_tokens: Callable[[str], int]) -> list[Message]:
        """The messages the model sees for its next reply, given the episode's ``history`` (whose
        first ``num_opening`` messages, the system prompt and task, are always shown whole);
        ``count_tokens`` measures a text in the policy's tokens."""
        shown = [dict(message) for message in history]
        observations = [i for i in range(num_opening, len(shown)) if shown[i].get("role") in OBSERVATION_ROLES]
        elided: set[int] = set()
        if self.keep_observations is not None:
            elided.update(observations[: max(0, len(observations) - self.keep_observations)])
        if self.observation_budget is not None:
            sizes = [count_tokens(shown[i].get("content", "")) for i in observations]
            elided.update(compacted(observations, sizes, self.observation_budget))
        for index in elided:
            shown[index]["content"] = ELIDED
        if self.strip_thinking:
            for message in shown[num_opening:]:
                if message.get("role") == "assistant":
                    message["content"] = THINK_BLOCK.sub("", message["content"])
        return shown


def compacted(observations: Sequence[int], sizes: Sequence[int], budget: int) -> list[int]:
    """Which of ``observations`` (message indices, oldest first, ``sizes`` tokens each) a budget of
    ``budget`` tokens elides: walking the history in order, each time the kept ones outgrow the
    budget the oldest kept are elided until they fit in half of it (the newest always kept).
    Replaying the walk at every reply elides an ever-growing prefix: compactions happen at fixed
    points of the history, whatever comes after them."""
    elided: list[int] = []
    kept: list[tuple[int, int]] = []
    total = 0
    for index, size in zip(observations, sizes, strict=True):
        kept.append((index, size))
        total += size
        if total > budget:
            while len(kept) > 1 and total > budget // 2:
                oldest, oldest_size = kept.pop(0)
                elided.append(oldest)
                total -= oldest_size
    return elided


def extends(previous: Sequence[Message], shown: Sequence[Message]) -> bool:
    """Whether ``shown`` is ``previous`` with messages appended: then the model's next context is its
    last one plus the new tokens (same segment); otherwise it is rendered afresh (a new segment)."""
    return len(shown) >= len(previous) and all(
        dict(a) == dict(b) for a, b in zip(previous, shown[: len(previous)], strict=True)
    )
