"""Overlapped iterations (``max_staleness: 1``): the next batch is sampled by the current policy on a generator
holding weights of its own while the update runs; the update weights each token toward that behaviour policy;
the key is refused where it cannot apply. (Exact resume over the schedule: tests/integration/test_resume.py.)"""

from __future__ import annotations

import copy
import math
import threading
import time

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from loop_trainer import LOOPTrainer
from loop_trainer.chat import stop_token_ids
from loop_trainer.training.batching import collate
from loop_trainer.training.overlap import OverlappedRollouts
from loop_trainer.training.settings import update_settings
from loop_trainer.training.update import STALE_IMPORTANCE_CAP, PolicyUpdate, importance_cap
from support.apart import ApartBackend, VersionedApartBackend
from support.updates import policy_update, samples_for
from unit.test_stabilisers import brute_force_loss
from unit.training.test_trainer import tiny_args


def config(tmp_path, **keys):
    """test_trainer's tiny run, 3 iterations of 2 tasks, with nothing written but metrics."""
    quiet = {"save_strategy": "no", "plot_curves": False, "memory_stress_test": False, "report_to": "none"}
    quiet |= {"viewer_rollouts_per_iteration": 0, "use_cpu": True, "bf16": False}
    return tiny_args(tmp_path, **{"iterations": 3, "tasks_per_iteration": 2, **quiet, **keys})


def test_the_next_batch_is_sampled_by_this_policy_while_this_update_runs(vault_tiny, tmp_path, monkeypatch):
    env, model, tok = vault_tiny
    backend = ApartBackend(model, stop_token_ids=stop_token_ids(model, tok), pad_token_id=tok.pad_token_id)
    trainer = LOOPTrainer(
        model, env, config(tmp_path, max_staleness=1), processing_class=tok, generation_backend=backend
    )
    events: list[tuple[str, int, float, str]] = []  # (what, iteration, time, thread)
    pushes: list[int] = []  # how many weight pushes had happened when each collection started
    collect, collect_share, load = trainer.collect_rollouts, trainer._collect_share, backend.load_weights

    collecting = {i: threading.Event() for i in range(3)}

    def note_start(iteration):
        events.append(("collect", iteration, time.perf_counter(), threading.current_thread().name))
        if iteration in collecting:
            collecting[iteration].set()
        pushes.append(len(loaded))

    def collect_rollouts(tasks, collection_round=0, iteration=None):  # iteration 0's, collected in place
        note_start(iteration)
        return collect(tasks, collection_round, iteration=iteration)

    def collect_ahead(tasks, iteration, sampler, collector):  # a later iteration's share, on the collection thread
        note_start(iteration)
        return collect_share(tasks, iteration, sampler, collector)

    loaded: list[float] = []

    def load_weights(weights):
        loaded.append(time.perf_counter())
        load(weights)

    trainer.collect_rollouts, trainer._collect_share, backend.load_weights = (
        collect_rollouts,
        collect_ahead,
        load_weights,
    )
    call = PolicyUpdate.__call__

    def timed(update, samples, iteration):
        events.append(("update starts", iteration, time.perf_counter(), threading.current_thread().name))
        try:
            return call(update, samples, iteration)
        finally:
            # A tiny update can end before the collection thread is first scheduled: hold its end until the
            # next batch's collection has started (bounded), so only a collection that waits for the update
            # to end fails the check below, not the machine's scheduling.
            if iteration + 1 in collecting:
                collecting[iteration + 1].wait(timeout=60)
            events.append(("update ends", iteration, time.perf_counter(), threading.current_thread().name))

    monkeypatch.setattr(PolicyUpdate, "__call__", timed)
    trainer.train()
    at = {(what, i): (t, thread) for what, i, t, thread in events}
    assert [r["policy_staleness"] for r in trainer.history] == [0.0, 1.0, 1.0]
    for i in (1, 2):  # iteration i's batch: collected on another thread, during iteration i-1's update
        started, thread = at[("collect", i)]
        assert thread.startswith("loop-next-rollouts") and at[("update ends", i - 1)][0] > started
    assert pushes == [1, 1, 2]  # each batch after exactly one push per iteration before it: by the policy before
    assert all(r["weight_sync_logprob_diff_max"] < 1e-5 for r in trainer.history)
    stale = trainer.history[1:]
    assert all(r["sampler_logprob_diff_max"] > 1e-4 for r in stale if r["optimizer_steps"])  # one policy behind
    assert all("importance_capped_fraction" in r for r in trainer.history)


def test_the_stale_batch_trains_on_decoupled_ppo_against_a_brute_force(vault_tiny):
    """pi_old (the trainer's log-probs before the update) is the clip's proximal policy; each token is weighted
    by min(pi_old / pi_behaviour, 2) toward the behaviour policy that sampled it (the sampler's log-probs)."""
    _, model, tok = vault_tiny
    add_fused_lm_head(model)
    samples = samples_for(tok)
    update, _ = policy_update(model, tok.pad_token_id, sampler_importance_cap=importance_cap(None, 1))
    fixed, _ = update.fixed_logprobs(samples)
    behaviour = torch.Generator().manual_seed(0)
    for i, sample in enumerate(samples):  # the sampler's log-probs: an older policy's, within +-1.5 of pi_old's
        noise = (torch.rand(len(sample.token_ids), generator=behaviour, dtype=torch.float64) * 3 - 1.5).tolist()
        sample.sampler_logprobs = [
            float(lp) + n if m else 0.0 for lp, n, m in zip(fixed.old[i].tolist(), noise, sample.loss_mask, strict=True)
        ]
    batch = collate(samples, tok.pad_token_id)

    def padded(logprobs_by_row: dict[int, torch.Tensor]) -> torch.Tensor:
        out = torch.zeros_like(batch.sampler_logprobs, dtype=torch.float64)
        for i, logprobs in logprobs_by_row.items():
            out[i, : logprobs.numel()] = logprobs.double()
        return out

    old = padded(fixed.old)
    mask = batch.loss_mask.double()
    sampler = batch.sampler_logprobs.double()
    weights = torch.where(mask.bool(), torch.clamp(torch.exp(old - sampler), max=STALE_IMPORTANCE_CAP), 1.0)
    assert weights[mask.bool()].min() < 1 < STALE_IMPORTANCE_CAP == weights[mask.bool()].max()  # both sides, capped
    minibatch = [0, 1]
    step = update.minibatch_step(samples, fixed, minibatch)
    assert step is not None
    # the first step: the policy is still pi_old, so each ratio is 1 (a ratio toward the sampler would not be)
    rows = torch.tensor(minibatch)

    def brute_force(logp: torch.Tensor) -> float:  # epsilon 0.1, divisor: the minibatch of 2
        args = (logp[rows], old[rows], batch.advantages[rows], mask[rows])
        return brute_force_loss(*(a.tolist() for a in args), 0.1, 2, weights=weights[rows].tolist())

    assert step.loss == pytest.approx(brute_force(old), rel=1e-4)
    assert step.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert step.capped_fraction == pytest.approx(
        float(((old - sampler)[rows][mask[rows].bool()] > math.log(2)).double().mean())
    )
    # the next step on the same minibatch: the policy has moved, so the ratios pi_theta / pi_old are not 1; the
    # weights toward the sampler stay those of pi_old (fixed for the whole update)
    moved, _ = update.fixed_logprobs(samples, minibatch)
    logp = padded(moved.old)
    second = update.minibatch_step(samples, fixed, minibatch)
    assert second is not None
    ratios = torch.exp(logp - old)[rows][mask[rows].bool()]
    assert (ratios - 1).abs().max() > 1e-2  # really off 1
    assert second.loss == pytest.approx(brute_force(logp), rel=1e-4)
    assert second.ratio_mean == pytest.approx(float(ratios.mean()), rel=1e-4)


def test_the_cap_defaults_to_two_with_staleness_and_is_the_keys_otherwise(tmp_path):
    server = {"use_vllm": True, "vllm_mode": "server"}
    assert update_settings(config(tmp_path, max_staleness=1, **server), 0).sampler_importance_cap == 2.0
    capped = config(tmp_path, max_staleness=1, sampler_importance_cap=5.0, **server)
    assert update_settings(capped, 0).sampler_importance_cap == 5.0
    assert update_settings(config(tmp_path), 0).sampler_importance_cap is None  # LOOP: no weights


def test_max_staleness_is_refused_in_one_line_where_it_cannot_apply(vault_tiny, tmp_path):
    env, model, tok = vault_tiny
    cases = [
        (
            {"max_staleness": 1, "use_vllm": True, "vllm_mode": "colocate"},
            "colocated vLLM engine shares the training GPU",
        ),
        (
            {"max_staleness": 1, "use_vllm": True, "vllm_mode": "server", "dynamic_sampling_rounds": 2},
            "set one of them to 0",
        ),
        ({"max_staleness": 9}, "max_staleness"),
    ]
    for keys, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            config(tmp_path, **keys)
        assert "\n" not in str(error.value)
    stale = config(tmp_path, max_staleness=1)
    with pytest.raises(ValueError, match="samples with the training model itself") as error:
        LOOPTrainer(model, env, stale, processing_class=tok)
    assert "\n" not in str(error.value) and "max_staleness: 0" in str(error.value)
    with pytest.raises(ValueError, match="has no holds_own_weights"):
        LOOPTrainer(model, env, stale, processing_class=tok, generation_backend=_PlainBackend())
    # above 1, the generator must hold several versions at once
    one_version = ApartBackend(model, stop_token_ids=stop_token_ids(model, tok), pad_token_id=tok.pad_token_id)
    with pytest.raises(ValueError, match="has no at_version") as error:
        LOOPTrainer(model, env, config(tmp_path, max_staleness=2), processing_class=tok, generation_backend=one_version)
    assert "\n" not in str(error.value) and "max_staleness: 1" in str(error.value)


class _PlainBackend:
    async def generate(self, prompt_ids, max_new_tokens, seed=None):
        raise AssertionError("never sampled")


def test_two_steps_of_staleness_sample_each_batch_by_the_policy_two_iterations_back(vault_tiny, tmp_path):
    """max_staleness: 2 on a generator holding several versions: batch j is sampled by policy max(0, j - 2), through
    that version's view, whatever was loaded since; the versions no queued batch needs are released."""
    env, model, tok = vault_tiny
    backend = VersionedApartBackend(
        model, stop_token_ids=stop_token_ids(model, tok), pad_token_id=tok.pad_token_id, max_batch_size=1
    )
    trainer = LOOPTrainer(
        model, env, config(tmp_path, max_staleness=2, iterations=5), processing_class=tok, generation_backend=backend
    )
    sampled_by: dict[int, int] = {}  # iteration -> the version whose view sampled its batch
    checked: list[float] = []
    collect_share = trainer._collect_share

    def collect_ahead(tasks, iteration, sampler, collector):
        (version,) = [v for v, view in backend.views.items() if view is sampler]
        sampled_by[iteration] = version
        share = collect_share(tasks, iteration, sampler, collector)
        # the sampler's log-probs are that version's (a copy the trainer has moved on from since)
        trajectory = next(t for t in share.trajectories if t.num_sampled_tokens)
        ids = torch.tensor([trajectory.token_ids])
        with torch.no_grad():
            logits = sampler.model(input_ids=ids).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)
        mask = torch.tensor(trajectory.loss_mask[1:], dtype=torch.bool)
        checked.append(float((logprobs[mask] - torch.tensor(trajectory.sampler_logprobs[1:])[mask]).abs().max()))
        assert all(v == version for v in trajectory.turn_versions)
        return share

    trainer._collect_share = collect_ahead
    trainer.train()
    assert sampled_by == {1: 0, 2: 0, 3: 1, 4: 2}
    assert max(checked) < 1e-4
    assert [r["policy_staleness"] for r in trainer.history] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert all(r["policy_staleness_max"] == r["policy_staleness_min"] == r["policy_staleness"] for r in trainer.history)
    assert backend.released == [0, 1, 2, 3]  # each once no queued batch needed it (the last ones at the end)


def test_a_batch_of_mixed_versions_trains_on_each_tokens_own_behaviour_policy(vault_tiny):
    """Tokens sampled by different policies in one batch (whole trajectories of different versions, and one
    trajectory whose turns came from two versions, as a rollout continued across a weight update): each token
    is weighted by min(pi_old / pi_its_own_behaviour, 2), the behaviour log-probs computed here from the two
    policies themselves."""
    _, model, tok = vault_tiny
    policies = []
    for seed in (1, 2):  # two older versions: the policy with its weights moved two different ways
        older = copy.deepcopy(model).eval()
        noise = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in older.parameters():
                p.add_(torch.randn(p.shape, generator=noise) * 0.1)
        policies.append(older)
    add_fused_lm_head(model)
    samples = samples_for(tok)
    update, _ = policy_update(
        model, tok.pad_token_id, sampler_importance_cap=importance_cap(None, 2), minibatch_size=len(samples)
    )
    fixed, _ = update.fixed_logprobs(samples)

    def logprobs_of(policy, token_ids):
        ids = torch.tensor([token_ids])
        with torch.no_grad():
            logits = policy(input_ids=ids).logits[0, :-1].double()
        return [0.0, *torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1).tolist()]

    versions = []  # per sample, per token: which older policy sampled it
    for i, sample in enumerate(samples):
        by = [logprobs_of(p, sample.token_ids) for p in policies]
        if i == len(samples) - 1:  # its reply's first half by one version, the rest by the other
            first = sample.loss_mask.index(1)
            half = first + sum(sample.loss_mask) // 2
            turn = [0 if k < half else 1 for k in range(len(sample.token_ids))]
        else:
            turn = [i % 2] * len(sample.token_ids)
        sample.sampler_logprobs = [
            by[v][k] if m else 0.0 for k, (v, m) in enumerate(zip(turn, sample.loss_mask, strict=True))
        ]
        versions.append(turn)
    last = samples[-1]
    assert len({v for v, m in zip(versions[-1], last.loss_mask, strict=True) if m}) == 2  # really mixed
    batch = collate(samples, tok.pad_token_id)
    old = torch.zeros_like(batch.sampler_logprobs, dtype=torch.float64)
    behaviour = torch.zeros_like(old)
    for i, sample in enumerate(samples):
        old[i, : len(sample.token_ids)] = fixed.old[i].double()
        behaviour[i, : len(sample.token_ids)] = torch.tensor(sample.sampler_logprobs, dtype=torch.float64)
    mask = batch.loss_mask.double()
    weights = torch.where(mask.bool(), torch.clamp(torch.exp(old - behaviour), max=STALE_IMPORTANCE_CAP), 1.0)
    assert weights[mask.bool()].min() < 0.9 and (weights[mask.bool()] == STALE_IMPORTANCE_CAP).any()
    rows = torch.arange(len(samples))
    step = update.minibatch_step(samples, fixed, rows.tolist())
    assert step is not None
    args = (old[rows], old[rows], batch.advantages[rows], mask[rows])  # first step: the policy is pi_old
    expected = brute_force_loss(*(a.tolist() for a in args), 0.1, len(samples), weights=weights[rows].tolist())
    assert step.loss == pytest.approx(expected, rel=1e-4)
    # without each token's own behaviour policy (every token weighted toward the first version) it would differ
    first = torch.zeros_like(old)
    for i, sample in enumerate(samples):
        first[i, : len(sample.token_ids)] = torch.tensor(logprobs_of(policies[0], sample.token_ids))
    wrong = torch.where(mask.bool(), torch.clamp(torch.exp(old - first), max=STALE_IMPORTANCE_CAP), 1.0)
    assert brute_force_loss(*(a.tolist() for a in args), 0.1, len(samples), weights=wrong.tolist()) != pytest.approx(
        step.loss, rel=1e-3
    )


def test_partial_rollouts_carry_the_groups_running_at_the_cut_and_continue_them_with_the_next_policy(
    vault_tiny, tmp_path, monkeypatch
):
    """Each batch's second task is a straggler: its episodes' first step waits for the generator's next policy.
    The cut (half the new episodes) trains the first task's group and carries the second's, whose later turns are
    sampled by the next policy: trained tokens lag the trained policy by 1 and 2 iterations."""
    env, model, tok = vault_tiny
    backend = ApartBackend(model, stop_token_ids=stop_token_ids(model, tok), pad_token_id=tok.pad_token_id)
    pushes: list[int] = []
    load = backend.load_weights
    monkeypatch.setattr(backend, "load_weights", lambda weights: (load(weights), pushes.append(1)))
    created, waited_out = iter(range(10**6)), []
    make_episode = env.episode

    def episode(task):
        made, straggler, pushes_at_start = make_episode(task), next(created) // 4 % 2 == 1, len(pushes)
        step, steps = made.step, []

        def slow_step(reply):
            steps.append(reply)
            deadline = time.monotonic() + 30
            while straggler and len(steps) == 1 and len(pushes) == pushes_at_start:
                if time.monotonic() > deadline:
                    waited_out.append(task["task_id"])
                    break
                time.sleep(0.002)
            return step(reply)

        made.step = slow_step
        return made

    monkeypatch.setattr(env, "episode", episode)
    keys = {"max_staleness": 1, "partial_rollouts": True, "early_stop_done_fraction": 0.5}
    args = config(tmp_path, iterations=5, early_stop_task_fraction=0.0, **keys)
    trainer = LOOPTrainer(model, env, args, processing_class=tok, generation_backend=backend)
    trainer.train()
    assert waited_out == []  # every straggler went on with the next policy: none was waited for at a cut
    history = trainer.history
    first = history[0]  # collected in place: the first task's group trained, the straggler group carried
    assert (first["num_rollouts"], first["carried_episodes"], first["policy_staleness_max"]) == (4.0, 4.0, 0.0)
    assert all(r["num_cancelled"] == 0 and r["num_failed"] == 0 for r in history)
    assert [r["policy_staleness_min"] for r in history[1:]] == [1.0] * 4
    assert max(r["policy_staleness_max"] for r in history) == 2.0  # a carried turn by the policy before
    assert sum(r["num_rollouts"] + r["dropped_stale_episodes"] for r in history[1:]) > 4 * 4  # stragglers trained


def test_closing_cancels_the_batches_not_started_and_waits_for_the_one_being_collected():
    """As a run ends with batches queued ahead: those not started never start; the one being collected finishes
    (it uses the generator), its error dropped (nothing takes its batch); the queue is empty for a run after it."""
    overlap = OverlappedRollouts(max_staleness=3)
    collecting, release, started = threading.Event(), threading.Event(), []

    def first():
        started.append(1)
        collecting.set()
        release.wait(30)
        raise RuntimeError("the generator was closed under it")

    overlap.start(1, 0, first)
    overlap.start(2, 0, lambda: started.append(2))
    overlap.start(3, 0, lambda: started.append(3))
    being_collected = overlap._queue[0].share
    assert collecting.wait(30)
    overlap.cancel_queued()
    threading.Timer(0.5, release.set).start()  # after close() has begun: it must wait for it
    overlap.close()
    assert being_collected is not None and being_collected.done()
    assert started == [1] and overlap.iterations == []
    overlap.close()  # idempotent
    assert overlap.to_queue(0, 10) == range(1, 4)  # queued anew from the iteration it is at
