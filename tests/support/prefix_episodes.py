"""Seeded multi-turn episodes on a TransformersBackend whose tasks share an opening: the prefix-sharing
and fixed-shape decode tests run them with and without the feature and compare the replies."""

from __future__ import annotations

import asyncio

import torch

from loop_trainer.rollout import TransformersBackend, TransformersSamplingSettings, build_transformers_backend

PARTS_OFF = {"static_decode": False, "compile_decode_step": False, "merge_adapter": False}


def backend_for(model, tok, **settings) -> TransformersBackend:
    """A backend built as the generator builds one, with every part of the decode loop off unless
    ``settings`` turns it on (whatever the device: the features are compared with the plain loop)."""
    return build_transformers_backend(
        model, TransformersSamplingSettings(**(PARTS_OFF | settings)), stop_token_ids=[], pad_token_id=tok.pad_token_id
    )


async def decode_loop_idle(backend: TransformersBackend) -> None:
    """Wait until the backend's decode thread has left its loop. Replies are delivered before that loop
    last looks for joining requests, so requests made right after a reply may join one step or two,
    as the threads happen to run; made after this, they all join the next loop's first step."""

    def left_the_loop() -> None:
        with backend._lock:  # held by the decode loop for as long as it runs
            pass

    await asyncio.to_thread(left_the_loop)


def opening(tok, task: str) -> list[int]:
    system = "<|im_start|>system\n" + " ".join(["tools : find open submit"] * 6) + "<|im_end|>\n"
    return tok.encode(system + f"<|im_start|>user\nfetch code of {task}<|im_end|>\n<|im_start|>assistant\n")


def run_episodes(backend, tok, tasks, rollouts, *, update_between_turns=None):
    """Each task's rollouts start from the same opening, two turns each; seeds per (task, rollout, turn).

    ``update_between_turns`` runs once, after every episode's first turn and before any second turn,
    and the backend is then told its weights changed (``weights_changed``). A barrier, not a call per
    episode: the backend decodes on its own thread, so an update made while another episode's row is
    decoding would land on a step that depends on wall-clock timing (it did, on a slower machine: one
    row's second token saw a second update its first token had not)."""
    observation = tok.encode("<|im_end|>\n<|im_start|>user\nann id k1<|im_end|>\n<|im_start|>assistant\n")
    episodes = len(tasks) * rollouts
    first_turns_done: list[None] = []
    updated = asyncio.Event()

    async def between_turns():
        first_turns_done.append(None)
        if len(first_turns_done) == episodes:
            await update_between_turns()
            backend.weights_changed()
            updated.set()
        await updated.wait()

    async def episode(task, rollout):
        prompt = opening(tok, task)
        first = await backend.generate(prompt, 4, seed=100 * len(task) + 10 * rollout + 1)
        if update_between_turns is not None:
            await between_turns()
        second = await backend.generate(prompt + first.token_ids + observation, 4, seed=10 * rollout + 2)
        return first, second

    async def collect():
        return await asyncio.gather(*(episode(task, r) for task in tasks for r in range(rollouts)))

    return asyncio.run(collect())


def assert_same(replies, expected):
    for (first, second), (first_ref, second_ref) in zip(replies, expected, strict=True):
        for got, want in ((first, first_ref), (second, second_ref)):
            assert got.token_ids == want.token_ids
            assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5), (got, want)
