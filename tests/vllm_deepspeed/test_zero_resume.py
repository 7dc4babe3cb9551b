"""A DeepSpeed run SIGKILLed mid-update or mid-checkpoint, then resumed, ends exactly where the same launch ends
uninterrupted: DeepSpeed writes its own checkpoint (each process its share of the optimizer state), which must come
back whole through the staged checkpoint, and the optimizer on the host (ZeRO-Offload) must resume its Adam state.
Resumed on another number of processes, DeepSpeed repartitions the state through its universal checkpoint
(training/repartition.py) and the run ends where it would have, to the float tolerance that 1 and 2 processes
agree to (1e-6 measured; with DeepSpeed's ZeRO-3 universal load left unmended, 1e-4 away).

Two launches of tests/support/fault_driver.py (4 iterations, 2 processes, fp32 on CPU, gloo):

- ``zero3.yaml``, overlapped (``max_staleness: 1``, the generator holding its own weights, as ZeRO-3 on several
  processes needs), killed as iteration 3's checkpoint is being written: the checkpoint of iteration 2 is resumed
  and the in-flight batch it kept is trained again; also on 1 process, where DeepSpeed's ZeRO-3 universal load
  needs mending (a weight decay and a step count: repartition.py), then the last iteration again on 2 from that
  run's checkpoint.
- ``zero2-offload.yaml`` (the optimizer in CPU memory, DeepSpeed's CPU Adam), killed after iteration 3's first
  optimizer step: the weights have moved past the checkpoint of iteration 2, which must win. Resuming it without
  DeepSpeed is refused first: it cannot load the state ZeRO-2 partitioned. Resumed on 1 process, then the last
  iteration again on 2 from that run's checkpoint, it still ends where it would have.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from support.fault_launch import final_weights, launch_fault_driver, metrics, save_vault_model

pytest.importorskip("deepspeed")

LAUNCHES = {
    "zero3_overlapped_killed_in_save": ("zero3.yaml", ("--max-staleness", "1"), "save"),
    "zero2_offload_killed_in_update": ("zero2-offload.yaml", (), "update"),
}


@pytest.fixture(scope="module")
def vault_model(tmp_path_factory):
    return save_vault_model(tmp_path_factory.mktemp("tiny-instruct"))


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_a_killed_deepspeed_run_resumes_to_the_same_weights(vault_model, tmp_path, launch):
    config, options, kill_in = LAUNCHES[launch]
    uninterrupted = launch_fault_driver(vault_model, tmp_path / "uninterrupted", *options, config=config, processes=2)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-6000:]

    run = tmp_path / "killed"
    kill = ("--kill-in", kill_in, "--kill-at", "3")
    killed = launch_fault_driver(vault_model, run, *options, *kill, config=config, processes=2)
    assert killed.returncode != 0, "the driver was to kill itself in iteration 3"
    # by themselves (torchrun may stop the second rank first, if it is slower to reach the same point)
    assert "Signal 9 (SIGKILL) received" in killed.stderr, killed.stderr[-6000:]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert list((run / "checkpoint-2").glob("global_step*")), "DeepSpeed's own checkpoint is in the staged one"
    if launch == "zero2_offload_killed_in_update":
        # A launch that cannot load the partitioned optimizer state is refused before anything trains: without
        # DeepSpeed the optimizer would silently start afresh. (A change of ZeRO stage is refused by the same
        # comparison, tests/unit/config/test_resume_policy.py; the resumes below show a real ZeRO-3 launch's layout
        # is read as ZeRO-3's.)
        refused = launch_fault_driver(vault_model, run, "--resume", processes=1)
        assert refused.returncode != 0
        assert "CheckpointError: resume_from_checkpoint:" in refused.stderr, refused.stderr[-6000:]
        assert "this launch's would be whole (no DeepSpeed)" in refused.stderr
        assert "zero_stage 2 (zero_optimization.stage in a DeepSpeed JSON), on any number of" in refused.stderr
        assert len(metrics(run)) == 2  # nothing was trained or logged
    on_one = tmp_path / "resumed-on-one"
    shutil.copytree(run, on_one)
    resumed = launch_fault_driver(vault_model, run, *options, "--resume", config=config, processes=2)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert_same_run(tmp_path / "uninterrupted", run, weights_atol=1e-6)
    assert not list(run.glob("checkpoint-*/global_step*_universal"))  # the same launch loads it as it is

    # on 1 process: DeepSpeed's universal checkpoint, converted once beside the original
    resumed = launch_fault_driver(vault_model, on_one, *options, "--resume", config=config, processes=1)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert "partitioned over 2 processes and this launch has 1: DeepSpeed repartitions it" in resumed.stderr
    assert_same_run(tmp_path / "uninterrupted", on_one, weights_atol=1e-5)

    # and back on 2, the last iteration again from the checkpoint the 1-process resume wrote: each process loads
    # (and under ZeRO-3 mends) its own half
    for done in ("checkpoint-4", "final", "run_finished.json"):
        shutil.rmtree(on_one / done) if (on_one / done).is_dir() else (on_one / done).unlink()
    resumed = launch_fault_driver(vault_model, on_one, *options, "--resume", config=config, processes=2)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert "partitioned over 1 process and this launch has 2" in resumed.stderr
    assert_same_run(tmp_path / "uninterrupted", on_one, weights_atol=1e-5)


def assert_same_run(uninterrupted, resumed, weights_atol):
    want, have = metrics(uninterrupted), metrics(resumed)
    assert [m["iteration"] for m in have] == [1, 2, 3, 4]  # continuous, nothing doubled
    keys = ("reward_mean", "num_rollouts", "num_kept", "optimizer_steps", "sampled_tokens")
    assert [[m[k] for k in keys] for m in have] == [[m[k] for k in keys] for m in want]
    assert [m["loss"] for m in have] == pytest.approx([m["loss"] for m in want], abs=1e-6)
    expected, got = final_weights(uninterrupted), final_weights(resumed)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=weights_atol, msg=name)
