"""Crash and resume of overlapped runs beyond one process and one step of staleness (docs/overlap.md):
``max_staleness: 2`` killed with two batches in flight, and ``max_staleness: 1`` on two training processes
(torchrun, gloo, DDP) against one process, and killed and resumed; partial rollouts killed with carried groups in
the checkpoint, and on two processes against one. Apart from tests/integration/test_resume.py so
the two files run on different test workers."""

from __future__ import annotations

import signal

import pytest
import torch

from integration.test_resume import OVERLAPPED, assert_same_weights, drive, final_weights, metrics, save_instruct_model


@pytest.fixture(scope="module")
def instruct_model(tmp_path_factory):
    return save_instruct_model(tmp_path_factory.mktemp("tiny-instruct"))


@pytest.fixture(scope="module")
def overlapped(instruct_model, tmp_path_factory):
    """``max_staleness: 1`` on one process, 3 iterations (as tests/integration/test_resume.py's)."""
    output = tmp_path_factory.mktemp("overlapped")
    result = drive(instruct_model, output, *OVERLAPPED)
    assert result.returncode == 0, result.stderr[-3000:]
    return output


TWO_STEPS = ("--max-staleness", "2", "--iterations", "4")


@pytest.fixture(scope="module")
def two_steps(instruct_model, tmp_path_factory):
    """``max_staleness: 2``: batches 1 and 2 sampled by policy 0, batch 3 by policy 1; a generator holding a copy
    of each version a queued batch needs."""
    output = tmp_path_factory.mktemp("two-steps")
    result = drive(instruct_model, output, *TWO_STEPS)
    assert result.returncode == 0, result.stderr[-3000:]
    return output


@pytest.mark.slow
@pytest.mark.parametrize("kill_in", ["collected", "update"])
def test_two_steps_of_staleness_killed_resume_with_both_batches_in_flight(instruct_model, two_steps, tmp_path, kill_in):
    assert [m["policy_staleness"] for m in metrics(two_steps)] == [0.0, 1.0, 2.0, 2.0]
    killed = drive(instruct_model, tmp_path, *TWO_STEPS, "--kill-in", kill_in, "--kill-at", "3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    held = torch.load(tmp_path / "checkpoint-2" / "next_rollouts.pt", weights_only=False)["batches"]
    assert [(b["iteration"], b["version"]) for b in held] == [(2, 0), (3, 1)]  # iterations 3 and 4, by policies 0, 1
    resumed = drive(instruct_model, tmp_path, *TWO_STEPS, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(two_steps, tmp_path)
    keys = ("reward_mean", "num_kept", "optimizer_steps", "policy_staleness", "sampler_logprob_diff_max")
    assert [[m[k] for k in keys] for m in metrics(tmp_path)] == [[m[k] for k in keys] for m in metrics(two_steps)]


@pytest.fixture(scope="module")
def overlapped_on_two_processes(instruct_model, tmp_path_factory):
    output = tmp_path_factory.mktemp("overlapped-2")
    result = drive(instruct_model, output, *OVERLAPPED, processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return output


@pytest.mark.slow
def test_overlap_on_two_processes_matches_one(overlapped, overlapped_on_two_processes):
    """Each process collects its share of the next batch on its own thread while the update (DDP, gloo) runs;
    the shares are gathered at the iteration boundary. The same tasks and seeds, so the same trajectories; the
    update is data-parallel, so the weights agree to float rounding."""
    keys = ("reward_mean", "num_rollouts", "num_kept", "optimizer_steps", "policy_staleness", "sampled_tokens")
    assert_two_processes_match_one(overlapped, overlapped_on_two_processes, keys)


def assert_two_processes_match_one(one_dir, two_dir, keys: tuple[str, ...]) -> None:
    """The same metrics ``keys``, the losses and the final weights to 1e-5 (the update is data-parallel)."""
    one, two = metrics(one_dir), metrics(two_dir)
    assert [[m[k] for k in keys] for m in two] == [[m[k] for k in keys] for m in one]
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], abs=1e-5)
    want, have = final_weights(one_dir), final_weights(two_dir)
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("kill_in", ["update"])  # "collected" too in test_resume.py, on one process
def test_overlap_on_two_processes_killed_resumes_to_the_same_weights(
    instruct_model, overlapped_on_two_processes, tmp_path, kill_in
):
    killed = drive(instruct_model, tmp_path, *OVERLAPPED, "--kill-in", kill_in, "--kill-at", "2", processes=2)
    assert killed.returncode != 0, killed.stderr[-3000:]  # one process killed; the launcher stops the other
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
    assert (tmp_path / "checkpoint-1" / "next_rollouts.pt").is_file()
    resumed = drive(instruct_model, tmp_path, *OVERLAPPED, "--resume", processes=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(overlapped_on_two_processes, tmp_path)
    keys = ("reward_mean", "num_kept", "optimizer_steps", "policy_staleness")
    assert [[m[k] for k in keys] for m in metrics(tmp_path)] == [
        [m[k] for k in keys] for m in metrics(overlapped_on_two_processes)
    ]


PARTIAL = ("--max-staleness", "1", "--partial", "--iterations", "4")


@pytest.fixture(scope="module")
def partial(instruct_model, tmp_path_factory):
    """Partial rollouts: each batch is cut at half its new episodes, and the straggling half's groups are carried
    into the next batch (tests/support/fault_driver.py: they end when a checkpoint finishes them)."""
    output = tmp_path_factory.mktemp("partial")
    result = drive(instruct_model, output, *PARTIAL)
    assert result.returncode == 0, result.stderr[-3000:]
    return output


@pytest.mark.slow
def test_partial_rollouts_killed_resume_with_the_carried_episodes_of_the_checkpoint(instruct_model, partial, tmp_path):
    """A checkpoint holds the groups running past the last cut, run to their end (a running environment cannot be
    saved; the run that goes on trains the same ones), beside the batch in flight: the resumed run trains them."""
    history = metrics(partial)
    # Batch 1 is cut during update 0, before checkpoint 1 finishes the stragglers of batches 0 and 1; those join
    # batch 2 (8 new + 16 carried), and from then on each checkpoint finishes the stragglers of one batch.
    assert [m["num_rollouts"] for m in history] == [8.0, 8.0, 24.0, 16.0]
    assert [m["carried_episodes"] for m in history] == [8.0, 16.0, 8.0, 8.0]
    assert [m["policy_staleness_max"] for m in history] == [0.0, 1.0, 2.0, 2.0]  # carried: trained a step later
    killed = drive(instruct_model, tmp_path, *PARTIAL, "--kill-in", "update", "--kill-at", "3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    carried = torch.load(tmp_path / "checkpoint-2" / "carried_episodes.pt", weights_only=False)["groups"]
    assert [(g["iteration"], g["task_index"], len(g["ended"])) for g in carried] == [(2, 2, 4), (2, 3, 4)]
    resumed = drive(instruct_model, tmp_path, *PARTIAL, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(partial, tmp_path)
    keys = ("reward_mean", "num_rollouts", "num_kept", "optimizer_steps", "policy_staleness", "sampled_tokens")
    assert [[m[k] for k in keys] for m in metrics(tmp_path)] == [[m[k] for k in keys] for m in history]


@pytest.mark.slow
def test_partial_rollouts_on_two_processes_match_one(instruct_model, partial, tmp_path):
    """Each process carries its own share's groups (and a checkpoint gathers them); the batches, gathered in task
    order, are the one process's."""
    result = drive(instruct_model, tmp_path, *PARTIAL, processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    keys = ("reward_mean", "num_rollouts", "carried_episodes", "num_kept", "policy_staleness", "sampled_tokens")
    assert_two_processes_match_one(partial, tmp_path, keys)
