"""A policy update built alone (no LOOPTrainer) on a single-process strategy, and trajectories to feed it:
for the tests of the update's collaborators and of its metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from accelerate import Accelerator

from loop_trainer.training.batching import TrainingSample
from loop_trainer.training.distribution import DistributionStrategy
from loop_trainer.training.update import PolicyUpdate, UpdateSettings


def policy_update(model, pad_token_id: int, **overrides) -> tuple[PolicyUpdate, torch.optim.Optimizer]:
    """A :class:`PolicyUpdate` of ``model`` (its fused log-prob head already added) with AdamW at lr 3e-3,
    minibatches of 2, 2 epochs, micro-batches of 1, unless ``overrides`` set other :class:`UpdateSettings`."""
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    strategy = DistributionStrategy(accelerator, model, optimizer, scheduler, max_grad_norm=1.0)
    settings = {
        "epsilon": 0.1,
        "minibatch_size": 2,
        "ppo_epochs": 2,
        "micro_batch_size": 1,
        "kl_abort_threshold": 20.0,
        "seed": 0,
        "pad_token_id": pad_token_id,
    }
    settings.update(overrides)
    return PolicyUpdate(UpdateSettings(**settings), strategy, contextlib.nullcontext), optimizer


def samples_for(tokenizer) -> list[TrainingSample]:
    """Four vault replies to one prompt, advantages +1/-1, each sampled token claimed at log-prob -1."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "fetch code of ann"}], add_generation_prompt=True
    )
    prompt = list(prompt["input_ids"] if isinstance(prompt, Mapping) else prompt)
    out = []
    for reply, advantage in (("find ann", 1.0), ("open k3", -1.0), ("find ann", 1.0), ("open k3", -1.0)):
        ids = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        mask = [0] * len(prompt) + [1] * len(ids)
        out.append(TrainingSample(prompt + ids, mask, [-1.0] * len(mask), advantage, False))
    return out
