"""Overlapped LOOP (``max_staleness: 1``) on 2 DeepSpeed ZeRO-3 processes equals it on 1 plain process.

tests/support/fault_driver.py trains 3 iterations on a generator holding its own weights (tests/support/apart.py),
once alone and once under ``accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 2``
(fp32 on CPU, gloo). Each process collects its share of the next batch on its own thread while the ZeRO-3 update
runs its collectives on the main thread; the weight sync gathers the partitioned layers on the main thread between
the update and the next collection. The trajectories must be the same and the final weights agree to fp32
precision."""

from __future__ import annotations

import pytest
import torch

from support.fault_launch import final_weights, launch_fault_driver, metrics, save_vault_model

pytest.importorskip("deepspeed")

OVERLAPPED = ("--max-staleness", "1", "--iterations", "3")


def test_overlap_on_two_zero3_processes_matches_one_process(tmp_path):
    model_dir = save_vault_model(tmp_path / "model")
    for output_dir, config, processes in ((tmp_path / "one", None, 1), (tmp_path / "zero3", "zero3.yaml", 2)):
        result = launch_fault_driver(model_dir, output_dir, *OVERLAPPED, config=config, processes=processes)
        assert result.returncode == 0, result.stderr[-6000:]
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "zero3")
    keys = ("reward_mean", "num_rollouts", "num_kept", "optimizer_steps", "policy_staleness", "sampled_tokens")
    assert [[m[k] for k in keys] for m in two] == [[m[k] for k in keys] for m in one]
    assert [m["policy_staleness"] for m in two] == [0.0, 1.0, 1.0]
    assert all(m["weight_sync_logprob_diff_max"] < 1e-4 for m in two)  # the gathered layers reached the generator
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], abs=1e-5)
    want, have = final_weights(tmp_path / "one"), final_weights(tmp_path / "zero3")
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=1e-5, msg=name)
