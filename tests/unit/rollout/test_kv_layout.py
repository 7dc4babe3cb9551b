"""What the model's KV cache allows is decided once per backend (a probe at the first decode loop), logged
once in one line, and the decode loop's parts are configured from it: a cache that cannot be cut per row
turns the prefix caches and the slots off for good, one whose rows cannot leave keeps a batch until all
its rows are done. No mode changes mid-run, and what is sampled stays what the plain loop samples."""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache

from loop_trainer.rollout import kv_layout, sampled_policy
from loop_trainer.rollout.kv_layout import KVLayout, probe_kv_layout
from support.prefix_episodes import assert_same, backend_for, opening, run_episodes

SHARED_KV = KVLayout(rows_can_leave=True, rows_can_be_cut=False, layer_types=("DynamicLayer",))
SLIDING = KVLayout(rows_can_leave=False, rows_can_be_cut=False, layer_types=("DynamicSlidingWindowLayer",))


def _states(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(2, 1, length, 4), torch.zeros(2, 1, length, 4)


def test_the_layout_of_plain_sliding_window_and_shared_caches(vault_tiny):
    env, model, tok = vault_tiny
    plain = probe_kv_layout(model.eval(), torch.device("cpu"), tok.pad_token_id)
    assert plain.rows_can_leave and plain.rows_can_be_cut and plain.turned_off(True, True) is None
    sliding = KVLayout.of(DynamicCache(ddp_cache_data=[(*_states(3), torch.tensor(2))]))
    assert not sliding.rows_can_leave and not sliding.rows_can_be_cut
    shared = KVLayout.of(DynamicCache(ddp_cache_data=[_states(3), (None, None)]))  # the second layer reuses the first's
    assert shared.rows_can_leave and not shared.rows_can_be_cut
    assert not kv_layout.is_plain(DynamicCache(ddp_cache_data=[_states(3), (None, None)]))
    for layout in (sliding, shared):
        note = layout.turned_off(static_decode=True, share_prefixes=True)
        assert note is not None and "\n" not in note and "static_decode" in note and "shared prefixes" in note
    assert "joining a running batch" in sliding.turned_off(False, False) and "static_decode" not in shared.turned_off(
        False, False
    )


def test_a_cache_that_cannot_be_cut_turns_the_caches_and_slots_off_once(vault_tiny, monkeypatch, caplog):
    env, model, tok = vault_tiny
    probes = []

    def probe(*args):
        probes.append(args)
        return SHARED_KV

    monkeypatch.setattr(sampled_policy, "probe_kv_layout", probe)
    backend = backend_for(model, tok, max_batch_size=4, static_decode=True)
    with caplog.at_level(logging.WARNING, logger="loop_trainer.rollout.sampled_policy"):
        replies = run_episodes(backend, tok, ["ann", "bob"], 3)  # two turns: two decode loops at least
        backend.with_temperature(0.0).sample([opening(tok, "ann")], [2], [1])  # the evaluation view: decided already
    monkeypatch.undo()
    expected = run_episodes(backend_for(model, tok, max_batch_size=4, share_prefixes=False), tok, ["ann", "bob"], 3)
    assert_same(replies, expected)
    assert len(probes) == 1 and len(caplog.records) == 1 and "static_decode" in caplog.records[0].getMessage()
    assert backend.num_reused_tokens == backend.num_shared_tokens == 0 and backend._slot_decoder is None


def test_rows_that_cannot_leave_keep_the_batch_until_all_are_done(vault_tiny, monkeypatch):
    env, model, tok = vault_tiny
    prompts = [opening(tok, "ann"), opening(tok, "bob")[:20], opening(tok, "bob")]
    limits, seeds = [2, 10, 6], [11, 12, 13]
    monkeypatch.setattr(sampled_policy, "probe_kv_layout", lambda *args: SLIDING)
    backend = backend_for(model, tok, max_batch_size=2)
    replies = backend.sample(prompts, limits, seeds)
    monkeypatch.undo()
    # rows 0 and 1 run 10 steps together (row 0's samples after its second dropped), then row 2 its 6
    assert backend.num_steps == 16 and backend.num_batches == 2
    for prompt, limit, seed, reply in zip(prompts, limits, seeds, replies, strict=True):
        alone = backend_for(model, tok).sample([prompt], [limit], [seed])[0]
        assert reply.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(reply.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
