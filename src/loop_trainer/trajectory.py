"""A trajectory: one rollout as the trainer sees it -- token ids, loss mask, sampler log-probs, reward."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .envs.base import Message

Status = Literal["completed", "failed", "cancelled"]
Ending = Literal["done", "turn_limit", "trajectory_budget", "error", "cancelled"]


@dataclass
class Trajectory:
    """One episode, token-exact.

    ``token_ids`` is the whole conversation as the model saw and produced it. ``loss_mask`` is 1
    exactly on the tokens the policy sampled (its replies, including each sampled stop token) and 0
    on everything else: system and user messages, observations, the assistant header, and any token
    the rollout engine appended (the newline after a stop token, or a stop token after a reply cut
    by the per-turn limit). ``sampler_logprobs`` holds the sampler's log-prob of each sampled token
    (0 elsewhere); the trainer recomputes its own and only compares. ``turn_ids`` holds, for each
    sampled token, the index of the assistant turn that produced it (0 for the first reply, 1 for
    the second, ...) and -1 on every token with ``loss_mask`` 0: the per-turn importance ratio
    (``loop_policy_loss(ratio_level="turn")``) groups tokens by it.

    An episode whose context policy rewrote its history (:mod:`loop_trainer.rollout.context`) is
    several *segments*, each the whole context the model saw for its replies from then on, laid end
    to end in these lists: ``segment_starts`` holds where each segment after the first begins. An
    append-only episode is one segment (``segment_starts`` empty).
    """

    task_id: str
    group: int
    """Index of the task within its iteration: the leave-one-out group."""
    rollout: int = 0
    """Which of the task's rollouts this is (0 .. K-1)."""
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    """Per token: the assistant turn (0, 1, ...) a sampled token belongs to; -1 where not sampled."""
    turn_versions: list[int] = field(default_factory=list)
    """Per assistant turn: the policy version (the iteration whose weights) that sampled it; set by the trainer
    (``max_staleness``: a batch may be sampled by an older policy than the one it trains)."""
    prompt_length: int = 0
    """Tokens of the opening prompt (before the first reply)."""
    segment_starts: list[int] = field(default_factory=list)
    """Token index where each segment after the first begins (a context rewritten by a context policy,
    rendered afresh); empty for an append-only episode."""
    reward: float = 0.0
    success: bool | None = None
    status: Status = "completed"
    ending: Ending = "done"
    num_turns: int = 0
    truncated_turns: int = 0
    """Replies cut by the per-turn token limit (they got a stop token appended, mask 0)."""
    repaired_messages: int = 0
    """Environment messages that were not valid UTF-8 text (repaired with U+FFFD)."""
    cut_messages: int = 0
    """Environment messages too long to fit any trajectory (cut, with a note)."""
    error: str | None = None
    seconds: float = 0.0
    messages: list[Message] = field(default_factory=list)
    """The conversation as text, replies included (for logs and the trajectory viewer)."""
    num_opening_messages: int = 0
    """How many of ``messages`` the episode opened with (system prompt, examples, task)."""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def segments(self) -> list[tuple[int, int]]:
        """``(start, end)`` token spans of the segments, in order (one for an append-only episode)."""
        bounds = [0, *self.segment_starts, len(self.token_ids)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    @property
    def context_start(self) -> int:
        """Where the segment the model is writing in begins: its context is ``token_ids[context_start:]``."""
        return self.segment_starts[-1] if self.segment_starts else 0

    def append(
        self, token_ids: list[int], *, sampled: bool, logprobs: list[float] | None = None, turn: int | None = None
    ) -> None:
        """Append tokens. Sampled tokens are labelled with ``turn`` (default: ``num_turns``, the
        index of the reply not yet counted); tokens not sampled with -1."""
        self.token_ids.extend(token_ids)
        self.loss_mask.extend([int(sampled)] * len(token_ids))
        self.sampler_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(token_ids))
        label = (self.num_turns if turn is None else turn) if sampled else -1
        self.turn_ids.extend([label] * len(token_ids))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
