"""Shared prefixes: the plan (which prefixes to prefill once, and what each prompt extends) and the
backend that follows it. Sharing may not change what is sampled: every reply equals the same seeded
request decoded without sharing, across joins, turns and a weight update."""

from __future__ import annotations

import asyncio
import random

import torch

from loop_trainer.rollout.prefix_cache import PrefixNode, SharedPrefixes, anchor_length, plan
from support.prefix_episodes import assert_same, backend_for, decode_loop_idle, opening, run_episodes

SYSTEM = list(range(1000, 1040))  # 40 tokens every task starts with


def task_prompt(task: int, length: int = 20) -> list[int]:
    return SYSTEM + [2000 + 100 * task + i for i in range(length)]


def test_nested_openings_are_prefilled_once_per_level():
    # 2 tasks x 3 rollouts (identical prompts per task) and one prompt of another task
    prompts = [task_prompt(0)] * 3 + [task_prompt(1)] * 3 + [task_prompt(2, 5)]
    nodes, anchors = plan(prompts, SharedPrefixes(0))
    system, task0, task1 = nodes
    assert system.tokens == tuple(SYSTEM) and system.parent is None and system.level == 1
    # each task's prompt but its last token, which each rollout feeds itself
    assert task0.tokens == tuple(prompts[0][:-1]) and task0.parent is system and task0.level == 2
    assert task1.tokens == tuple(prompts[3][:-1]) and task1.parent is system
    assert anchors == [task0] * 3 + [task1] * 3 + [system]


def test_prefixes_shorter_than_min_shared_are_not_worth_a_pass():
    prompts = [SYSTEM[:10] + [1, 2, 3], SYSTEM[:10] + [4, 5, 6]]
    assert plan(prompts, SharedPrefixes(0)) == ([], [None, None])
    nodes, anchors = plan(prompts, SharedPrefixes(0), min_shared=8)
    assert [node.tokens for node in nodes] == [tuple(SYSTEM[:10])] and anchors == [nodes[0]] * 2


def test_a_stored_prefix_is_extended_not_prefilled_again():
    stored = SharedPrefixes(0)
    stored.put(tuple(SYSTEM), [])
    prompts = [task_prompt(0)] * 2 + [task_prompt(1)]
    nodes, anchors = plan(prompts, stored)
    (task0,) = nodes
    assert task0.parent == tuple(SYSTEM) and task0.level == 1
    assert anchors == [task0, task0, tuple(SYSTEM)]  # a lone prompt still extends the stored opening


def test_the_store_keeps_the_recently_used_within_its_capacity():
    store = SharedPrefixes(0, capacity_tokens=50)
    store.put(tuple(range(20)), [])
    store.put(tuple(range(100, 120)), [])
    assert store.longest(list(range(30)), at_most=29) == tuple(range(20))  # used: the other one is older
    store.put(tuple(range(200, 220)), [])
    assert list(store.entries) == [tuple(range(20)), tuple(range(200, 220))] and store.tokens == 40
    assert store.longest(list(range(30)), at_most=19) is None  # a prompt keeps a token of its own


def test_plans_of_random_prompts_keep_their_invariants():
    rng = random.Random(0)
    for _ in range(300):
        # prompts built from a few shared stems, so that prefixes nest and repeat
        stems = [[rng.randrange(4) for _ in range(rng.randrange(0, 30))] for _ in range(3)]
        prompts = [
            rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(1, 25))]
            for _ in range(rng.randrange(1, 9))
        ]
        stored = SharedPrefixes(0)
        for stem in stems[:1]:
            if stem:
                stored.put(tuple(stem), [])
        nodes, anchors = plan(prompts, stored, min_shared=3)
        made = set(map(id, nodes))
        for node in nodes:  # a node extends its parent, is made once, and serves two prompts or more
            assert len(node.tokens) - anchor_length(node.parent) >= 3
            parent = node.parent.tokens if isinstance(node.parent, PrefixNode) else node.parent or ()
            assert node.tokens[: len(parent)] == parent
            if isinstance(node.parent, PrefixNode):
                assert id(node.parent) in made and node.parent.level < node.level
            assert sum(tuple(p[: len(node.tokens)]) == node.tokens and len(p) > len(node.tokens) for p in prompts) >= 2
        assert [node.level for node in nodes] == sorted(node.level for node in nodes)
        for prompt, anchor in zip(prompts, anchors, strict=True):
            tokens = () if anchor is None else anchor.tokens if isinstance(anchor, PrefixNode) else anchor
            assert tuple(prompt[: len(tokens)]) == tokens and len(tokens) < len(prompt)
            if isinstance(anchor, PrefixNode):
                assert id(anchor) in made
            else:
                assert anchor is None or anchor in stored.entries
        # no two identical prompts may both be prefilled whole when they share enough
        for a in range(len(prompts)):
            for b in range(a):
                if prompts[a] == prompts[b] and len(prompts[a]) > 3:
                    assert anchors[a] is not None and anchors[a] is anchors[b]


# --- the backend -------------------------------------------------------------------------------


def test_shared_openings_sample_what_unshared_ones_do_across_joins_and_turns(vault_tiny):
    env, model, tok = vault_tiny
    tasks = ["ann", "bob"]
    # a batch of 4 rows: 2 of the 6 first turns join later and find the openings already stored
    shared = backend_for(model, tok, max_batch_size=4)
    replies = run_episodes(shared, tok, tasks, 3)
    expected = run_episodes(backend_for(model, tok, max_batch_size=4, share_prefixes=False), tok, tasks, 3)
    assert_same(replies, expected)
    system_and_task = [len(opening(tok, task)) - 1 for task in tasks]
    # every first turn but the ones that prefilled a task's opening extends it; the opening's
    # common system part is prefilled once for both tasks
    assert shared.num_shared_tokens >= 4 * min(system_and_task)
    assert shared.num_reused_tokens > 0  # the second turns still reuse their own first turn


def test_a_weight_update_drops_the_shared_openings(vault_tiny):
    env, model, tok = vault_tiny
    weight = next(model.parameters())
    original = weight.detach().clone()
    prompt = opening(tok, "ann")

    def two_rounds(backend):
        """Three rollouts, an optimizer step, three more rollouts of the same opening: one collection."""

        async def rounds():
            first = await asyncio.gather(*(backend.generate(prompt, 4, seed=s) for s in range(3)))
            with torch.no_grad():
                weight.mul_(1.5)  # in place, like AdamW's step
            backend.weights_changed()
            await decode_loop_idle(backend)  # the second round joins at once: its count of shared tokens is exact
            return first + await asyncio.gather(*(backend.generate(prompt, 4, seed=s) for s in range(3, 6)))

        try:
            return asyncio.run(rounds())
        finally:
            with torch.no_grad():
                weight.copy_(original)

    shared = backend_for(model, tok)
    replies = two_rounds(shared)
    expected = two_rounds(backend_for(model, tok, share_prefixes=False))
    for got, want in zip(replies, expected, strict=True):
        assert got.token_ids == want.token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
    # both rounds extended an opening, each prefilled with its round's weights
    assert shared.num_shared_tokens == 6 * (len(prompt) - 1)
