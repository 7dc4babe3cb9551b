"""One definition of how episodes run, shared by training (:class:`~loop_trainer.LOOPConfig`) and
evaluation (``loop-eval``), so the two can never disagree on a default or on a value's range."""

from __future__ import annotations

from dataclasses import dataclass

from ..rollout.context import ContextPolicy
from ..rollout.records import EpisodeLimits
from .ranges import above, at_least, setting


@dataclass
class EpisodeSettings:
    """Limits and concurrency of episodes (the paper's values are the defaults)."""

    max_turns: int = setting(40, "Model replies per episode.", at_least(1, "model replies per episode"))
    max_new_tokens_per_turn: int = setting(
        1500, "Token limit of one reply.", at_least(1, "the token limit of one reply")
    )
    max_trajectory_tokens: int = setting(
        32000,
        "Whole-conversation budget; the episode ends when it is used up.",
        at_least(1, "the whole conversation's token budget"),
    )
    max_completion_tokens: int | None = setting(
        None,
        "Budget of everything after the opening prompt (replies and environment messages), as GRPOTrainer's "
        "max_completion_length; none: max_trajectory_tokens only.",
        at_least(1, "the token budget after the opening prompt; None: no budget but max_trajectory_tokens", none=True),
    )
    max_concurrent_episodes: int = setting(
        256, "Episodes in flight at once.", at_least(1, "episodes in flight at once")
    )
    env_timeout: float = setting(
        300.0,
        "Seconds one environment call may take.",
        above(0, "seconds one environment call may take; 0 would fail every call as timed out"),
    )
    generation_batch_limit: int = setting(
        64,
        "Most sequences the transformers backend samples in one batch.",
        at_least(1, "the most sequences the transformers backend samples in one batch"),
    )
    static_decode: bool | None = setting(
        None,
        "Transformers backend: decode steps on fixed-shape KV slots, replayed as one CUDA graph per step on a GPU "
        "(eager elsewhere; 5-6x the default loop's tokens/s on an H200). Holds generation_batch_limit x the "
        "longest context (rounded up to a power of two) of KV cache for the collection. None (default): on with "
        "CUDA where the model's KV cache allows it, off on a CPU; false turns it off; true requires it.",
    )
    compile_decode_step: bool | None = setting(
        None,
        "With static_decode: run the fixed-shape decode step through torch.compile before it is captured, fusing the "
        "modelling code's small kernels (compiled once per KV capacity; 1.4-1.9x static_decode's tokens/s on an "
        "H200). None (default): on with CUDA where static_decode is on and torch.compile can run (else off, one log "
        "line), off on a CPU; false turns it off; true requires it (refused without static_decode).",
    )
    merge_adapter_for_sampling: bool | None = setting(
        None,
        "Transformers backend with a LoRA adapter: sample from a copy of the adapted layers with the adapter merged "
        "in (W + scale * B @ A, rounded once to W's dtype; refreshed when the weights change), so a decode step runs "
        "no adapter matmuls. Costs one copy of the adapted layers' weights; the trainer's log-probs still form the "
        "ratio. None (default): on with CUDA where the policy has a LoRA adapter and whole weights (not ZeRO-3), "
        "off on a CPU; false turns it off; true requires it (refused with use_vllm, without a LoRA adapter, with "
        "ZeRO-3).",
    )
    context_keep_observations: int | None = setting(
        None,
        "Context policy: the model sees the text of only the last N environment messages after the opening; older "
        "ones read '[output elided]' (each reply past the N-th starts a new trained segment). None: all of them.",
        at_least(1, "environment messages whose text the model sees; None: all", none=True),
    )
    context_observation_budget: int | None = setting(
        None,
        "Context policy: when the environment messages' text outgrows this many tokens, the oldest are elided until "
        "they fit in half of it (a compaction starts a new trained segment). None: no budget.",
        at_least(1, "tokens of environment messages the model sees before the oldest are elided; None: all", none=True),
    )
    context_strip_thinking: bool = setting(
        False,
        "Context policy: remove <think>...</think> blocks from the model's earlier replies, as Qwen3's chat template "
        "does (each reply after one that thought starts a new trained segment).",
    )

    def context_policy(self) -> ContextPolicy:
        """What the ``context_*`` keys show of an episode's history (inactive when none is set)."""
        return ContextPolicy(
            self.context_keep_observations, self.context_observation_budget, self.context_strip_thinking
        )

    def episode_limits(self) -> EpisodeLimits:
        return EpisodeLimits(
            self.max_turns, self.max_new_tokens_per_turn, self.max_trajectory_tokens, self.max_completion_tokens
        )

    def concurrency_for(self, env_limit: int | None) -> int:
        """Episodes in flight at once, bounded by what the environment can run."""
        return min(self.max_concurrent_episodes, env_limit or self.max_concurrent_episodes)
