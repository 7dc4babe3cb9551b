"""Shared by the vLLM tests: run episodes through a backend, and score token ids with a model."""

from __future__ import annotations

import torch

from loop_trainer.chat import ChatFormatter
from loop_trainer.rollout import EpisodeLimits, RolloutEngine

LIMITS = EpisodeLimits(max_turns=4, max_new_tokens_per_turn=12, max_trajectory_tokens=400)


def collect(env, backend, tokenizer, tasks, rollouts=2, seed=7):
    engine = RolloutEngine(
        env,
        backend,
        ChatFormatter(tokenizer),
        LIMITS,
        env_timeout=10.0,
        max_concurrent_episodes=16,
        show_progress=False,
    )
    return engine.collect(tasks, rollouts, seed=seed)


def logprobs_of(model, token_ids):
    """log p(token_ids[t] | token_ids[:t]) for t >= 1, at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits.float()
    return logits.log_softmax(-1)[0, :-1].gather(1, torch.tensor(token_ids[1:])[:, None]).squeeze(1)
