"""One definition of how episodes run, shared by training (:class:`~loop_trainer.LOOPConfig`) and
evaluation (``loop-eval``), so the two can never disagree on a default."""

from __future__ import annotations

from dataclasses import dataclass, field

from .rollout.engine import EpisodeLimits


@dataclass
class EpisodeSettings:
    """Limits and concurrency of episodes (the paper's values are the defaults)."""

    max_turns: int = field(default=40, metadata={"help": "Model replies per episode."})
    max_new_tokens_per_turn: int = field(default=1500, metadata={"help": "Token limit of one reply."})
    max_trajectory_tokens: int = field(
        default=32000, metadata={"help": "Whole-conversation budget; the episode ends when it is used up."}
    )
    max_concurrent_episodes: int = field(default=256, metadata={"help": "Episodes in flight at once."})
    env_timeout: float = field(default=300.0, metadata={"help": "Seconds one environment call may take."})
    generation_batch_limit: int = field(
        default=64, metadata={"help": "Most sequences the transformers backend samples in one batch."}
    )

    def episode_limits(self) -> EpisodeLimits:
        return EpisodeLimits(self.max_turns, self.max_new_tokens_per_turn, self.max_trajectory_tokens)

    def concurrency_for(self, env_limit: int | None) -> int:
        """Episodes in flight at once, bounded by what the environment can run."""
        return min(self.max_concurrent_episodes, env_limit or self.max_concurrent_episodes)

    def check_episode_settings(self) -> None:
        for name in ("max_turns", "max_new_tokens_per_turn", "max_trajectory_tokens", "max_concurrent_episodes",
                     "generation_batch_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.env_timeout > 0:
            raise ValueError(f"env_timeout must be > 0 seconds, got {self.env_timeout}")
