"""What the rollout engine takes and returns: a backend's completion, episode limits, the batch of an iteration's
trajectories (with its summary statistics), seeds, and the engine's errors; the transformers backend's counters."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..trajectory import Trajectory


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    """Sampled ids, ending with the stop token if one was sampled."""
    logprobs: list[float]
    """Log-prob of each sampled id under the sampling distribution (temperature applied)."""
    stopped: bool
    """True if the reply ended with a stop token, False if it hit ``max_new_tokens``."""


@runtime_checkable
class GenerationBackend(Protocol):
    """What samples a reply: the transformers backend, a vLLM engine or server, or a view of one."""

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        """Sample one reply. With a ``seed``, the reply must depend only on the prompt, the weights
        and the seed -- not on what else is batched with it -- so runs (and resumed runs) repeat."""
        ...


@dataclass
class DecodeCounters:
    """What a :class:`~loop_trainer.rollout.backend.TransformersBackend`'s decode loop did, summed over its
    life. The backend owns them (and shows each as an attribute of its own); the decode loop adds to them."""

    num_batches: int = 0
    """Prefills: groups of requests that joined the decode loop together (and shared prefixes prefilled)."""
    num_sequences: int = 0
    num_steps: int = 0
    """Decode steps (a step feeds every running row one token, and prefills the rows joining)."""
    num_step_rows: int = 0
    """Rows summed over decode steps: ``num_step_rows / num_steps`` is the mean batch."""
    max_running: int = 0
    num_reused_tokens: int = 0
    """Prompt tokens not prefilled again: their KV cache was kept from the episode's previous turn."""
    num_shared_tokens: int = 0
    """Prompt tokens not prefilled again: a prefix shared with other prompts was prefilled once."""
    busy_seconds: float = 0.0
    """Wall seconds the decode loop ran."""


def settle(future: asyncio.Future[Completion], result: Completion | BaseException) -> None:
    """Hand a backend's reply (or its error) to the episode awaiting it, unless it stopped waiting.
    Runs on the episode's event loop (backends call it with ``loop.call_soon_threadsafe``)."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


class RolloutFailureBudgetExceeded(RuntimeError):
    """Too many rollouts of one iteration failed to train on the rest."""


MAX_CHARS_PER_TOKEN = 16
"""Environment messages longer than ``max_trajectory_tokens`` times this many characters are cut."""


class GenerationError(RuntimeError):
    """The generation backend failed twice for one turn."""


class DroppedEpisode(Exception):
    """An episode that continued across weight updates (partial rollouts) would span more policy versions than
    allowed: it ends there, not trained on, and is counted."""


def stream_seed(seed: int, index: int) -> int:
    """The ``torch.Generator`` seed of the ``index``-th draw of a run seeded ``seed``: the task order's
    passes (``TaskSampler``) and each iteration's minibatch shuffles (``PolicyUpdate``).

    Not :func:`mix_seed`, which derives every other seed: this formula predates it, and the recorded
    demo runs (``tests/data/demo-seed0/``) depend on the task order and shuffles it gives."""
    return seed * 1_000_003 + index


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps): distinct inputs give unrelated seeds.

    Kept rather than numpy's ``SeedSequence``: every rollout's sampling seed comes from here, so a
    different mixer would change every trajectory of every run, the recorded demo replay included."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (part & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
    return state & 0x7FFFFFFFFFFFFFFF


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 40
    """Model replies per episode (AppWorld: interactions)."""
    max_new_tokens_per_turn: int = 1500
    max_trajectory_tokens: int = 32000
    """Whole-conversation budget; with less than one token of room left the episode ends."""
    max_completion_tokens: int | None = None
    """Budget of everything after the opening (replies and environment messages), as GRPOTrainer's
    max_completion_length; None: only max_trajectory_tokens. Running out also ends the episode."""


@dataclass
class RolloutBatch:
    """The outcome of one collection."""

    trajectories: list[Trajectory]
    """Completed rollouts (scored), in (task, rollout) order."""
    failed: list[Trajectory] = field(default_factory=list)
    num_cancelled: int = 0
    seconds: float = 0.0
    num_carried: int = 0
    """Partial rollouts: this batch's episodes still running at its cut, carried with their groups into the next."""
    num_dropped_stale: int = 0
    """Partial rollouts: episodes of this batch's groups dropped for spanning more than ``max_staleness`` versions."""

    def stats(self) -> dict[str, float]:
        done = self.trajectories
        endings = Counter(t.ending for t in done)
        rewards = [t.reward for t in done]
        successes = [t.success for t in done if t.success is not None]
        mean = sum(rewards) / len(rewards) if rewards else float("nan")
        turns = sum(t.num_turns for t in done)
        # groups whose rewards all tie: their leave-one-out advantages are 0, they teach nothing
        from ..stabilisers import tied_groups  # here: stabilisers imports torch, which a collection child never loads

        tied = tied_groups(rewards, [t.group for t in done])
        var = sum((r - mean) ** 2 for r in rewards) / len(rewards) if rewards else float("nan")
        return {
            "num_rollouts": float(len(done)),
            "num_failed": float(len(self.failed)),
            "num_cancelled": float(self.num_cancelled),
            "carried_episodes": float(self.num_carried),
            "dropped_stale_episodes": float(self.num_dropped_stale),
            "reward_mean": mean,
            "reward_std": math.sqrt(var) if rewards else float("nan"),
            "success_rate": sum(successes) / len(successes) if successes else float("nan"),
            "turns_mean": turns / len(done) if done else float("nan"),
            "reply_tokens_mean": sum(t.num_sampled_tokens for t in done) / turns if turns else float("nan"),
            "sampled_tokens": float(sum(t.num_sampled_tokens for t in done)),
            # the longest context the model saw: an episode split by a context policy is its segments
            "trajectory_tokens_max": float(max((end - start for t in done for start, end in t.segments), default=0)),
            "segments_mean": sum(len(t.segments) for t in done) / len(done) if done else float("nan"),
            "truncated_turns": float(sum(t.truncated_turns for t in done)),
            "repaired_messages": float(sum(t.repaired_messages for t in done)),
            "cut_messages": float(sum(t.cut_messages for t in done)),
            "ended_turn_limit": float(endings["turn_limit"]),
            "ended_trajectory_budget": float(endings["trajectory_budget"]),
            # episodes a limit ended before the environment did (their reward is what was reached)
            "truncated_fraction": (endings["turn_limit"] + endings["trajectory_budget"]) / len(done)
            if done
            else float("nan"),
            "tied_group_fraction": sum(tied.values()) / len(tied) if tied else float("nan"),
            "rollout_seconds": self.seconds,
        }
