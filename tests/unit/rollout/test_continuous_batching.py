"""TransformersBackend's continuous batching: a request joins the running batch at the next decode
step, and an episode's next turn reuses the KV cache of its previous turn. Neither may change what is
sampled: every reply equals the same seeded request decoded alone."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from loop_trainer.rollout import TransformersBackend
from loop_trainer.rollout.token_draws import draw_tokens
from support.prefix_episodes import backend_for as plain_backend

PROMPTS = [
    "<|im_start|>user\nfetch code of ann<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\ntools : find open submit<|im_end|>\n<|im_start|>assistant\nfind",
    "<|im_start|>user\nbob id k3<|im_end|>\n<|im_start|>assistant\n",
]


def backend_for(model, tok, **kwargs) -> TransformersBackend:
    # No stop tokens: every reply is exactly its limit long, so the schedule below is exact.
    return plain_backend(model, tok, **kwargs)


def assert_same_reply(got, expected):
    assert got.token_ids == expected.token_ids
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-5)


def test_a_request_joins_the_running_batch_when_a_row_finishes(vault_tiny):
    env, model, tok = vault_tiny
    prompts = [tok.encode(p) for p in PROMPTS]
    limits, seeds = [2, 10, 6], [11, 12, 13]
    backend = backend_for(model, tok, max_batch_size=2)
    replies = backend.sample(prompts, limits, seeds)
    # Rows 0 and 1 start together; row 0 ends after step 2, row 2 joins at step 3 and ends after
    # step 8, row 1 after step 10. Batches that ran to completion would need 10 + 6 steps.
    assert backend.num_steps == 10 and backend.num_batches == 2 and backend.max_running == 2
    assert [len(r.token_ids) for r in replies] == limits
    for prompt, limit, seed, reply in zip(prompts, limits, seeds, replies, strict=True):
        assert_same_reply(reply, backend_for(model, tok).sample([prompt], [limit], [seed])[0])


def test_the_next_turn_reuses_the_previous_turns_kv_cache_and_samples_the_same(vault_tiny):
    env, model, tok = vault_tiny
    prompt, observation = (
        tok.encode(PROMPTS[0]),
        tok.encode("<|im_end|>\n<|im_start|>user\nann id k1<|im_end|>\n<|im_start|>assistant\n"),
    )
    backend = backend_for(model, tok)

    async def episode():  # one event loop: one collection, the cache lives as long as it
        first = await backend.generate(prompt, 5, seed=1)
        second_prompt = prompt + first.token_ids + observation
        return first, second_prompt, await backend.generate(second_prompt, 5, seed=2)

    first, second_prompt, second = asyncio.run(episode())
    # Every token of the first turn but the last sampled one (never fed) is reused.
    assert backend.num_reused_tokens == len(prompt) + len(first.token_ids) - 1
    assert_same_reply(second, backend_for(model, tok).sample([second_prompt], [5], [2])[0])


def test_a_weight_update_drops_the_cached_turns(vault_tiny):
    env, model, tok = vault_tiny
    prompt, observation = (
        tok.encode(PROMPTS[0]),
        tok.encode("<|im_end|>\n<|im_start|>user\nno command<|im_end|>\n<|im_start|>assistant\n"),
    )
    backend = backend_for(model, tok)
    weight = next(model.parameters())

    async def episode():
        first = await backend.generate(prompt, 4, seed=1)
        with torch.no_grad():
            weight.mul_(1.5)  # an optimizer step between the turns (in place, like AdamW's)
        backend.weights_changed()
        return await backend.generate(prompt + first.token_ids + observation, 4, seed=2)

    try:
        second = asyncio.run(episode())
    finally:
        with torch.no_grad():
            weight.div_(1.5)
    assert backend.num_reused_tokens == 0
    assert len(second.token_ids) == 4


def test_batched_draws_are_torch_multinomials_draws_row_by_row():
    logits = torch.randn(7, 3000, generator=torch.Generator().manual_seed(0)) * 4
    logits[2, :1500] = -math.inf  # rows with impossible tokens
    probs = torch.softmax(logits, dim=-1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the rows split in as many parts as torch has threads: two, even where tests run on one
    try:
        with ThreadPoolExecutor(2) as pool:
            for executor in (None, pool):
                for step in range(3):
                    seeds = [100 * step + r for r in range(7)]
                    got = draw_tokens(probs, [torch.Generator().manual_seed(s) for s in seeds], executor)
                    want = [
                        torch.multinomial(probs[r], 1, generator=torch.Generator().manual_seed(s)).item()
                        for r, s in enumerate(seeds)
                    ]
                    assert got.tolist() == want
    finally:
        torch.set_num_threads(threads)
    probs[3, 5] = math.nan
    with pytest.raises(RuntimeError, match="nan"):
        draw_tokens(probs, [torch.Generator()] * 7, None)
