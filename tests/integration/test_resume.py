"""Crash and resume: a run SIGKILLed mid-rollout, mid-update or mid-checkpoint, then resumed,
ends exactly where an uninterrupted run of the same seed ends."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from support.fault_launch import final_weights, metrics
from support.fault_launch import launch_fault_driver as drive  # alone, or as torchrun's processes=N
from support.fault_launch import save_vault_model as save_instruct_model


@pytest.fixture(scope="module")
def instruct_model(tmp_path_factory):
    """Saved once for every process of this module."""
    return save_instruct_model(tmp_path_factory.mktemp("tiny-instruct"))


def assert_same_weights(expected: Path, got: Path) -> None:
    """The final weights of two runs, to 1e-6."""
    want, have = final_weights(expected), final_weights(got)
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def uninterrupted(instruct_model, tmp_path_factory):
    output = tmp_path_factory.mktemp("uninterrupted")
    result = drive(instruct_model, output)
    assert result.returncode == 0, result.stderr[-3000:]
    return output


@pytest.mark.slow
@pytest.mark.parametrize("kill_in", ["rollouts", "update", "save"])
def test_a_killed_run_resumes_to_the_same_weights(instruct_model, uninterrupted, tmp_path, kill_in):
    if kill_in == "update":  # the first iteration after the first checkpoint that takes optimizer steps
        kill_at = next(m["iteration"] for m in metrics(uninterrupted) if m["iteration"] >= 2 and m["optimizer_steps"])
    else:
        kill_at = 3
    resumes_after = kill_at - 1
    killed = drive(instruct_model, tmp_path, "--kill-in", kill_in, "--kill-at", str(kill_at))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    complete = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert complete[-1] == f"checkpoint-{resumes_after}"  # a half-written checkpoint never appears
    resumed = drive(instruct_model, tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    assert_same_weights(uninterrupted, tmp_path)
    before, after = metrics(uninterrupted), metrics(tmp_path)
    assert [m["iteration"] for m in after] == [1, 2, 3, 4]  # continuous, nothing doubled
    for a, b in zip(before, after, strict=True):
        assert (a["reward_mean"], a["num_kept"], a["optimizer_steps"]) == (
            b["reward_mean"],
            b["num_kept"],
            b["optimizer_steps"],
        )
        assert (a.get("loss") is None) == (b.get("loss") is None)
        assert a.get("loss") is None or a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]  # pruned
    assert not list(tmp_path.glob(".staging*"))


@pytest.mark.slow
def test_two_uninterrupted_runs_of_one_seed_agree(instruct_model, uninterrupted, tmp_path):
    result = drive(instruct_model, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(uninterrupted, tmp_path)
    assert any(m["optimizer_steps"] > 0 for m in metrics(tmp_path))  # the weights really moved


@pytest.mark.slow
def test_a_run_killed_twice_still_ends_where_it_would_have(instruct_model, uninterrupted, tmp_path):
    updates = [m["iteration"] for m in metrics(uninterrupted) if m["iteration"] >= 3 and m["optimizer_steps"]]
    first = drive(instruct_model, tmp_path, "--kill-in", "rollouts", "--kill-at", "2")
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    second = drive(instruct_model, tmp_path, "--resume", "--kill-in", "update", "--kill-at", str(updates[0]))
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    last = drive(instruct_model, tmp_path, "--resume")
    assert last.returncode == 0, last.stderr[-3000:]
    assert_same_weights(uninterrupted, tmp_path)
    assert [m["reward_mean"] for m in metrics(tmp_path)] == [m["reward_mean"] for m in metrics(uninterrupted)]


@pytest.mark.slow
def test_a_run_killed_on_two_ddp_processes_resumes_on_one(instruct_model, uninterrupted, tmp_path):
    """Without DeepSpeed the optimizer state is whole and rollouts are seeded per task and rollout: a run written by
    2 processes goes on with 1 (fewer GPUs after a preemption), the same samples, and ends where 1 process ends, to
    the float tolerance at which 1 and 2 processes agree."""
    killed = drive(instruct_model, tmp_path, "--kill-in", "update", "--kill-at", "3", processes=2)
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*"))[-1] == "checkpoint-2"
    resumed = drive(instruct_model, tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    before, after = metrics(uninterrupted), metrics(tmp_path)
    assert [(m["reward_mean"], m["num_kept"]) for m in after] == [(m["reward_mean"], m["num_kept"]) for m in before]
    want, have = final_weights(uninterrupted), final_weights(tmp_path)
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_run_killed_between_rounds_of_dynamic_sampling_resumes_exactly(instruct_model, tmp_path_factory):
    options = ("--dynamic-sampling-rounds", "3", "--rollouts-per-task", "2")  # pairs tie often: rounds happen
    straight = tmp_path_factory.mktemp("dynamic-straight")
    assert drive(instruct_model, straight, *options).returncode == 0
    expected = metrics(straight)
    with_rounds = [m["iteration"] for m in expected if m["dynamic_sampling_rounds"] >= 1 and m["iteration"] >= 2]
    assert with_rounds, [m["dynamic_sampling_rounds"] for m in expected]
    assert all(m["informative_groups"] <= 4 for m in expected)
    killed_dir = tmp_path_factory.mktemp("dynamic-killed")
    killed = drive(instruct_model, killed_dir, *options, "--kill-in", "round", "--kill-at", str(with_rounds[0]))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = drive(instruct_model, killed_dir, *options, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(straight, killed_dir)
    keys = ("reward_mean", "num_rollouts", "num_kept", "dynamic_sampling_rounds", "dynamic_sampling_extra_rollouts")
    assert [[m[k] for k in keys] for m in metrics(killed_dir)] == [[m[k] for k in keys] for m in expected]


@pytest.mark.slow
def test_a_killed_run_with_a_kl_penalty_resumes_against_the_starting_weights(instruct_model, tmp_path_factory):
    """Full fine-tuning with beta > 0 keeps a frozen copy of the starting weights as the KL reference: the
    resumed run builds it from the weights it started from, not from the checkpoint's."""
    options = ("--beta", "0.5")
    straight = tmp_path_factory.mktemp("kl-straight")
    assert drive(instruct_model, straight, *options).returncode == 0
    expected = metrics(straight)
    assert expected[-1]["kl_ref"] > 0  # the policy has moved from its start
    kill_at = next(m["iteration"] for m in expected if m["iteration"] >= 2 and m["optimizer_steps"])
    killed_dir = tmp_path_factory.mktemp("kl-killed")
    killed = drive(instruct_model, killed_dir, *options, "--kill-in", "update", "--kill-at", str(kill_at))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = drive(instruct_model, killed_dir, *options, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(straight, killed_dir)
    got = metrics(killed_dir)
    assert [m.get("kl_ref") for m in got] == pytest.approx([m.get("kl_ref") for m in expected], abs=1e-7)


@pytest.fixture(scope="module")
def overlapped(instruct_model, tmp_path_factory):
    """``max_staleness: 1`` on a generator with weights of its own, 3 iterations: each batch but the first
    collected during the previous update, by the previous policy."""
    output = tmp_path_factory.mktemp("overlapped")
    result = drive(instruct_model, output, *OVERLAPPED)
    assert result.returncode == 0, result.stderr[-3000:]
    return output


OVERLAPPED = ("--max-staleness", "1", "--iterations", "3")


@pytest.mark.slow
@pytest.mark.parametrize("kill_in", ["rollouts", "collected", "update", "save"])
def test_an_overlapped_run_killed_anywhere_resumes_to_the_same_weights(instruct_model, overlapped, tmp_path, kill_in):
    """Killed while the next batch is collected, between that collection's end and the update on it, while the
    update that overlaps the following collection runs, or while a checkpoint is written: the checkpoint holds
    the batch that was in flight, and the resumed run trains on it."""
    assert [m["policy_staleness"] for m in metrics(overlapped)] == [0.0, 1.0, 1.0]
    assert (overlapped / "checkpoint-2" / "next_rollouts.pt").is_file()  # iteration 3's batch, sampled by policy 2
    assert not (overlapped / "checkpoint-3" / "next_rollouts.pt").exists()  # the last iteration has no next
    killed = drive(instruct_model, tmp_path, *OVERLAPPED, "--kill-in", kill_in, "--kill-at", "2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
    assert (tmp_path / "checkpoint-1" / "next_rollouts.pt").is_file()  # the batch that was in flight
    resumed = drive(instruct_model, tmp_path, *OVERLAPPED, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(overlapped, tmp_path)
    keys = ("reward_mean", "num_kept", "optimizer_steps", "policy_staleness", "sampler_logprob_diff_max")
    assert [[m[k] for k in keys] for m in metrics(tmp_path)] == [[m[k] for k in keys] for m in metrics(overlapped)]


SEGMENTED = (*OVERLAPPED, "--context-keep", "1", "--ratio-level", "trajectory")


@pytest.mark.slow
def test_an_overlapped_run_of_segmented_episodes_killed_between_collection_and_update_resumes_exactly(
    instruct_model, tmp_path_factory
):
    """Episodes split by a context policy (only the last observation shown), per-trajectory ratios across
    their segments, overlapped (the behaviour-policy importance weights on): a run killed with the batch
    collected ends where an uninterrupted one does, and its segments trained as the sampler saw them."""
    straight = tmp_path_factory.mktemp("segmented")
    result = drive(instruct_model, straight, *SEGMENTED)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = metrics(straight)
    assert all(m["segments_mean"] > 1.2 for m in expected)
    # each segment is what the sampler saw: on iteration 1, sampled by the policy it trains, the same log-probs
    assert expected[0]["policy_staleness"] == 0.0 and expected[0]["sampler_logprob_diff_max"] < 1e-4
    killed_dir = tmp_path_factory.mktemp("segmented-killed")
    killed = drive(instruct_model, killed_dir, *SEGMENTED, "--kill-in", "collected", "--kill-at", "2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = drive(instruct_model, killed_dir, *SEGMENTED, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(straight, killed_dir)
    keys = ("reward_mean", "num_kept", "optimizer_steps", "segments_mean", "tokens")
    assert [[m[k] for k in keys] for m in metrics(killed_dir)] == [[m[k] for k in keys] for m in expected]


@pytest.mark.slow
def test_partial_rollouts_carry_segmented_episodes_through_a_checkpoint(instruct_model, tmp_path):
    """Partial rollouts (each batch's stragglers carried into the next, across a checkpoint) of episodes
    split by a context policy."""
    result = drive(
        instruct_model, tmp_path, "--max-staleness", "1", "--partial", "--iterations", "3", "--context-keep", "1"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = metrics(tmp_path)
    assert all(m["segments_mean"] > 1.2 for m in got) and sum(m["carried_episodes"] for m in got) > 0
