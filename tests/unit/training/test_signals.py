"""The learning signals: the policy's entropy against a full softmax, the rollout statistics (tied groups,
truncated episodes, reply length), the environment's per-check rates over training rollouts, the
collapse warning on synthetic histories, and the update's stabiliser metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from loop_trainer.envs.contacts import ContactsEnv
from loop_trainer.rollout import RolloutBatch
from loop_trainer.training.batching import collate
from loop_trainer.training.logprobs import token_logprobs_and_entropy
from loop_trainer.training.run_log import format_iteration, plot_learning_curve
from loop_trainer.training.signals import (
    ENTROPY_DROP,
    PATIENCE,
    collapse_signatures,
    collapse_warning,
    training_check_rates,
)
from loop_trainer.training.update import PolicyUpdate
from loop_trainer.trajectory import Trajectory
from support.updates import policy_update, samples_for

ROOT = Path(__file__).resolve().parents[3]


def direct_entropy(model, batch, temperature: float) -> torch.Tensor:
    """[B, T] entropy of the full softmax of logits / T that sampled token t, 0 where not sampled."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)  # [B, T]: of the distribution over token t+1
    shifted = torch.cat([entropy.new_zeros(entropy.shape[0], 1), entropy[:, :-1]], dim=1)
    return shifted * batch.loss_mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_of_the_fused_head_matches_a_full_softmax(vault_tiny, temperature):
    _, model, tok = vault_tiny
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    model.eval()
    batch = collate(samples_for(tok), tok.pad_token_id)
    with torch.no_grad():
        _, entropy = token_logprobs_and_entropy(model, batch)
    assert entropy is not None
    expected = direct_entropy(model, batch, temperature)
    torch.testing.assert_close(entropy.double(), expected, rtol=1e-4, atol=1e-5)
    assert float(expected[batch.loss_mask.bool()].min()) > 0  # a real distribution, not a one-hot


def make_update(model, pad_token_id: int, **overrides) -> PolicyUpdate:
    return policy_update(model, pad_token_id, ppo_epochs=1, micro_batch_size=2, **overrides)[0]


def test_the_update_reports_the_policys_entropy_and_the_capped_fraction(vault_tiny):
    _, model, tok = vault_tiny
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    samples = samples_for(tok)  # sampler log-prob -1.0 on every sampled token
    batch = collate(samples, tok.pad_token_id)
    expected_entropy = direct_entropy(model, batch, 1.0)
    sampled = batch.loss_mask.bool()
    update = make_update(model, tok.pad_token_id, sampler_importance_cap=1.5)
    fixed, metrics = update.fixed_logprobs(samples)
    assert metrics["entropy"] == pytest.approx(float(expected_entropy[sampled].mean()), rel=1e-4)
    old = torch.zeros_like(batch.sampler_logprobs)
    for i, logprobs in fixed.old.items():
        old[i, : logprobs.numel()] = logprobs
    want_capped = float(((old - batch.sampler_logprobs)[sampled] > math.log(1.5)).float().mean())
    # the first minibatch step sees the old log-probs unchanged: its capped fraction is the direct one
    step = update.minibatch_step(samples, fixed, list(range(len(samples))))
    assert step is not None and step.capped_fraction == pytest.approx(want_capped)
    assert "importance_capped_fraction" in make_update(model, tok.pad_token_id, sampler_importance_cap=2.0)(
        samples, iteration=0
    )
    assert "importance_capped_fraction" not in make_update(model, tok.pad_token_id)(samples, iteration=0)


# --- rollout statistics and per-check rates -----------------------------------------------------------------
def trajectory(group: int, reward: float, *, turns: int = 2, sampled: int = 6, ending: str = "done") -> Trajectory:
    return Trajectory(
        task_id=f"t{group}",
        group=group,
        reward=reward,
        num_turns=turns,
        loss_mask=[0] * 3 + [1] * sampled,
        ending=ending,  # type: ignore[arg-type]
    )


def test_batch_stats_count_tied_groups_truncated_episodes_and_reply_length():
    batch = RolloutBatch(
        trajectories=[
            trajectory(0, 1.0),
            trajectory(0, 1.0, ending="turn_limit", turns=4, sampled=10),
            trajectory(1, 0.0),
            trajectory(1, 0.5, ending="trajectory_budget"),
            trajectory(2, 0.25),  # a group of one: tied
        ]
    )
    stats = batch.stats()
    assert stats["tied_group_fraction"] == pytest.approx(2 / 3)
    assert stats["truncated_fraction"] == pytest.approx(2 / 5)
    assert stats["reply_tokens_mean"] == pytest.approx((6 * 4 + 10) / (2 * 4 + 4))
    assert math.isnan(RolloutBatch(trajectories=[]).stats()["tied_group_fraction"])


def test_training_check_rates_are_the_environments_summary_of_training_rollouts():
    rollouts = []
    for checks in ({"searched": True, "found_person": True}, {"searched": True}, {}):
        t = trajectory(0, sum(checks.values()) / 4)
        t.info = {"checks": {name: checks.get(name, False) for name in ("searched", "found_person")}}
        rollouts.append(t)
    failed = trajectory(1, 0.0)
    failed.status = "failed"
    rates = training_check_rates(ContactsEnv(), RolloutBatch(trajectories=rollouts, failed=[failed]))
    assert rates["train_passed_searched"] == pytest.approx(2 / 4)  # the failed rollout passed nothing
    assert rates["train_passed_found_person"] == pytest.approx(1 / 4)
    assert rates["train_passed_answered"] == 0.0
    assert "train_success_rate" not in rates and "train_reward_mean" not in rates


# --- the collapse warning ------------------------------------------------------------------------------------
def history(entropy: list[float], tied: list[float], success: list[float] | None = None) -> list[dict]:
    success = success or [0.5] * len(entropy)
    return [
        {"iteration": i + 1, "entropy": e, "tied_group_fraction": t, "success_rate": s}
        for i, (e, t, s) in enumerate(zip(entropy, tied, success, strict=True))
    ]


def warnings_of(records: list[dict]) -> list[tuple[int, str]]:
    out = []
    for n in range(1, len(records) + 1):
        warning = collapse_warning(records[:n])
        if warning is not None:
            out.append((n, warning))
    return out


def test_a_healthy_run_never_warns():
    entropy = [0.9, 0.85, 0.88, 0.8, 0.75, 0.7, 0.72, 0.6, 0.55, 0.5]  # falls, but not under half
    tied = [0.1, 0.3, 0.8, 0.9, 0.2, 0.85, 0.4, 0.5, 0.9, 0.95]  # high, but never 3 in a row
    assert warnings_of(history(entropy, tied)) == []


def test_a_policy_that_grows_sure_while_it_learns_or_that_solves_every_group_does_not_warn():
    # entropy under half of its start while success climbs: learning, not collapsing
    entropy = [1.0, 1.0, 1.0, 0.45, 0.4, 0.3, 0.2, 0.2]
    success = [0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    assert warnings_of(history(entropy, [0.1] * len(entropy), success)) == []
    # every group tied because every rollout succeeds: nothing left to learn, nothing stalled
    tied = [0.2, 0.5, 0.9, 1.0, 1.0, 1.0]
    assert warnings_of(history([1.0] * 6, tied, [0.5, 0.7, 0.9, 1.0, 1.0, 0.95])) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_committed_real_model_runs_which_learn_the_task_never_warn(seed):
    # benchmarks/results/real-model: held-out success 0.88-1.00; their entropy halves and their groups
    # all tie once solved, which the warning read as a collapse before it weighed success
    path = ROOT / "benchmarks" / "results" / "real-model" / f"seed{seed}-metrics.jsonl"
    records = [record for record in map(json.loads, path.read_text().splitlines()) if "success_rate" in record]
    assert len(records) == 20 and max(r["success_rate"] for r in records) == 1.0
    assert warnings_of(records) == []


def test_entropy_collapse_warns_once_when_it_starts_and_names_the_keys():
    entropy = [1.0, 1.0, 1.0, 0.8, 0.45, 0.4, 0.3, 0.2, 0.2]
    got = warnings_of(history(entropy, [0.1] * len(entropy)))
    assert len(got) == 1 and got[0][0] == 5 + PATIENCE - 1  # iteration 7: the third one under half of 1.0
    assert "entropy" in got[0][1] and "epsilon_high" in got[0][1] and "iteration 7:" in got[0][1]
    assert ENTROPY_DROP == 0.5


def test_tied_groups_warn_and_warn_again_after_lapsing():
    tied = [0.2, 0.9, 0.9, 0.85, 0.9, 0.1, 0.8, 0.8, 0.8]
    got = warnings_of(history([1.0] * len(tied), tied))
    assert [n for n, _ in got] == [4, 9]
    assert all("dynamic_sampling_rounds" in text and "tied" in text for _, text in got)


def test_lost_success_warns_and_missing_entropy_is_no_signal():
    success = [0.0, 0.1, 0.3, 0.2, 0.0, 0.0, 0.0]
    records = history([math.nan] * 7, [0.0] * 7, success)
    got = warnings_of(records)
    assert [n for n, _ in got] == [7] and "success rate 0" in got[0][1]
    assert set(collapse_signatures(records)) == {"success"}
    assert collapse_signatures(records[:2]) == {}
    # one lucky success is not a success rate that was lost
    assert warnings_of(history([math.nan] * 7, [0.0] * 7, [0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0])) == []


def test_episodes_that_stop_ending_warn():
    records = history([1.0] * 8, [0.1] * 8)
    for record, truncated in zip(records, [0.0, 0.1, 0.0, 0.3, 0.9, 1.0, 1.0, 1.0], strict=True):
        record["truncated_fraction"] = truncated
    got = warnings_of(records)
    assert [n for n, _ in got] == [7] and "ended by a limit" in got[0][1] and "learning_rate" in got[0][1]
    # a run that hits max_turns from the start (a hard environment) is not collapsing
    for record in records:
        record["truncated_fraction"] = 0.9
    assert warnings_of(records) == []


def test_signatures_that_start_together_give_each_piece_of_advice_once():
    # the demo's seed 2 through a vLLM server (benchmarks/results/overlap-curves): solving 3 of 4 tasks,
    # then never submitting -- success lost and every episode ended by max_turns in the same iteration
    success = [0.2, 0.3, 0.4, 0.8, 0.8, 0.7, 0.0, 0.0, 0.0]
    records = history([1.0] * 9, [0.1] * 9, success)
    for record, truncated in zip(records, [0.0] * 6 + [1.0] * 3, strict=True):
        record["truncated_fraction"] = truncated
    (iteration, text), *more = warnings_of(records)
    assert iteration == 9 and more == []
    assert "success rate 0 for 3 iterations" in text and "100% of episodes ended by a limit" in text
    assert text.count("lower learning_rate") == 1 and "finishing an episode is rewarded" in text


def test_console_line_and_curve_show_the_signals(tmp_path):
    record = {"reward_mean": 0.5, "reward_std": 0.1, "tied_group_fraction": 0.25, "entropy": 0.4321}
    line = format_iteration(3, record)
    assert "tied 0.25" in line and "entropy 0.432" in line
    records = [{**record, "iteration": i, "truncated_fraction": 0.1, "kept_fraction": 0.5} for i in range(1, 4)]
    path = plot_learning_curve(records, tmp_path / "curve.png")
    assert path.stat().st_size > 0
