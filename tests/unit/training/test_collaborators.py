"""The trainer's collaborators, each built and tested alone (no LOOPTrainer): the policy update over
a single-process distribution strategy, the checkpoint stager, the run log and the generator."""

from __future__ import annotations

import json
import math
import signal
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from loop_trainer.rollout.backend import TransformersBackend
from loop_trainer.rollout.generator import GeneratorConfigError, RolloutGenerator
from loop_trainer.training.checkpoints import CheckpointStager, read_loop_state
from loop_trainer.training.run_log import RunLog, read_metrics
from loop_trainer.training.update import PolicyUpdate
from support.helpers import ScriptedBackend
from support.interrupts import sigint_taken_by_another_thread
from support.updates import policy_update, samples_for


def make_update(model, pad_token_id: int, **overrides) -> tuple[PolicyUpdate, torch.optim.Optimizer]:
    add_fused_lm_head(model)  # what GRPOTrainer installs: per-token log-probs without [T x vocab] logits
    return policy_update(model, pad_token_id, **overrides)


def test_policy_update_alone_takes_one_step_per_minibatch_and_reports_the_sampler_gap(vault_tiny):
    _, model, tok = vault_tiny
    update, _ = make_update(model, tok.pad_token_id)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = update(samples_for(tok), iteration=0)
    assert metrics["optimizer_steps"] == 2 * 2  # 2 epochs x 4 samples / minibatch 2
    assert metrics["skipped_nonfinite_steps"] == 0 and metrics["aborted_on_kl"] == 0
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    # The samples claim log-prob -1 for every sampled token; the model's differ.
    assert (
        metrics["sampler_logprob_diff"] > 0 and metrics["sampler_logprob_diff_max"] >= metrics["sampler_logprob_diff"]
    )
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_policy_update_alone_aborts_on_kl_without_touching_the_weights(vault_tiny):
    _, model, tok = vault_tiny
    update, _ = make_update(model, tok.pad_token_id, kl_abort_threshold=-1.0)  # any KL estimate is "too large"
    before = [p.detach().clone() for p in model.parameters()]
    metrics = update(samples_for(tok), iteration=0)
    assert metrics["aborted_on_kl"] == 1 and metrics["optimizer_steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # nothing left to leak into a step


def test_checkpoint_stager_publishes_complete_checkpoints_only_and_rotates(tmp_path):
    stager = CheckpointStager(is_main_process=True, barrier=lambda: None, save_total_limit=2)
    for iteration in (1, 2, 3):
        with stager.staged(tmp_path, iteration, lambda i=iteration: {"iteration": i, "history": []}) as staging:
            assert stager.staging_root == staging
            (staging / f"checkpoint-{iteration}").mkdir(parents=True)
            (staging / f"checkpoint-{iteration}" / "weights.bin").write_bytes(b"w")
        assert stager.staging_root is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    assert read_loop_state(tmp_path / "checkpoint-3")["iteration"] == 3
    # a crash mid-write publishes nothing
    with pytest.raises(RuntimeError, match="crash"), stager.staged(tmp_path, 4, lambda: {"iteration": 4}) as staging:
        (staging / "checkpoint-4").mkdir(parents=True)
        raise RuntimeError("crash")
    assert not (tmp_path / "checkpoint-4").exists() and (tmp_path / "checkpoint-3" / "weights.bin").is_file()


def test_reading_metrics_leaves_out_a_last_line_cut_short_and_refuses_a_broken_one_before_it(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}\n{"iterat')  # killed mid-write
    with caplog.at_level("WARNING"):
        assert read_metrics(tmp_path) == [{"iteration": 1}, {"iteration": 2}]
    assert "cut short" in caplog.text
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n{"iterat\n{"iteration": 3}\n')
    with pytest.raises(json.JSONDecodeError):
        read_metrics(tmp_path)


def test_run_log_alone_writes_metrics_and_continues_a_resumed_history(tmp_path):
    log = RunLog(tmp_path, writes=True, env_name="x", plot_curves=False)
    log.start()
    for i in (1, 2, 3):
        log.record({"iteration": i, "reward_mean": i / 10, "loss": float("nan")})
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert read_metrics(tmp_path)[0]["loss"] is None  # non-finite values are written as null
    resumed = RunLog(tmp_path, writes=True, env_name="x", plot_curves=False)
    resumed.start(log.history[:2])  # the checkpoint after iteration 2: iteration 3 is redone
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [1, 2]
    silent = RunLog(tmp_path / "other", writes=False, env_name="x")
    silent.start()
    silent.record({"iteration": 1, "reward_mean": 0.0})
    assert not (tmp_path / "other").exists() and len(silent.history) == 1


def test_a_ctrl_c_while_the_learning_curve_is_drawn_is_raised_once_it_is_written(tmp_path, monkeypatch):
    """matplotlib loses a KeyboardInterrupt raised in one of its weak references' callbacks (the run went on to its
    last iteration), or turns it into another error: the drawing finishes first, and the Ctrl-C is raised after."""
    from matplotlib.figure import Figure

    real_savefig = Figure.savefig

    def interrupted(self, *args, **kwargs):
        sigint_taken_by_another_thread()
        return real_savefig(self, *args, **kwargs)

    log = RunLog(tmp_path, writes=True, env_name="x", plot_curves=True)
    log.start()
    log.record({"iteration": 1, "reward_mean": 0.5, "reward_std": 0.1})  # drawn: the first curve
    log.curve_path.unlink()
    monkeypatch.setattr(Figure, "savefig", interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            log.plot(force=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert log.curve_path.read_bytes()[-8:] == b"IEND\xaeB`\x82"  # a whole PNG: its last chunk written


class FakeWeightSync:
    def __init__(self):
        self.calls = []
        self.generator = SimpleNamespace(sleep=lambda: self.calls.append("sleep"))

    def __call__(self, version):
        self.calls.append(("sync", version))
        return SimpleNamespace(seconds=0.0, logprob_diff_max=0.0, metrics=lambda: {"weight_sync_seconds": 0.0})

    def close(self):
        self.calls.append("close")


def test_generator_syncs_only_when_behind_and_leaves_a_users_backend_open(vault_tiny):
    _, _, tok = vault_tiny
    backend = ScriptedBackend(tok, lambda prompt: "x")
    backend.close = lambda: pytest.fail("a backend the user passed in is theirs to close")
    sync = FakeWeightSync()
    generator = RolloutGenerator(backend, weight_sync=sync, owns_backend=False)
    assert generator.sync(0) == {"weight_sync_seconds": 0.0}
    assert generator.sync(0) == {}  # already on iteration 0's policy
    generator.sleep()
    generator.sync(1)
    generator.close()
    assert sync.calls == [("sync", 0), "sleep", ("sync", 1), "close"]


def test_generator_honours_or_refuses_an_evaluation_temperature(vault_tiny):
    _, model, tok = vault_tiny
    plain = RolloutGenerator(
        TransformersBackend(model, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, temperature=1.0)
    )
    assert plain.for_evaluation(0.0).temperature == 0.0
    scripted = RolloutGenerator(ScriptedBackend(tok, lambda prompt: "x"), owns_backend=False)
    with pytest.raises(GeneratorConfigError, match="eval_temperature cannot be honoured.*eval_every: 0"):
        scripted.check_evaluation()


def test_loop_state_is_json(tmp_path):
    stager = CheckpointStager(is_main_process=True, barrier=lambda: None, save_total_limit=None)
    with stager.staged(tmp_path, 1, lambda: {"iteration": 1, "history": [{"loss": 0.5}]}) as staging:
        (staging / "checkpoint-1").mkdir(parents=True)
    assert json.loads((tmp_path / "checkpoint-1" / "loop_state.json").read_text())["history"] == [{"loss": 0.5}]


def test_every_forward_a_backward_follows_runs_in_the_activation_context_and_only_those(vault_tiny):
    """``activation_offloading`` hands TRL's offloader to the update as its activation context: it must
    hold the saved tensors of each minibatch step's forward (so the backward brings them back), and not
    the no-grad log-prob passes, which save nothing."""
    _, model, tok = vault_tiny
    update, _ = make_update(model, tok.pad_token_id)
    entered: list[bool] = []

    class Recording:
        def __enter__(self):
            entered.append(torch.is_grad_enabled())

        def __exit__(self, *_):
            return False

    update.activation_context = Recording
    metrics = update(samples_for(tok), iteration=0)
    # 2 epochs x 2 minibatches x 2 micro-batches of 1, each with its gradient
    assert len(entered) == 2 * 2 * 2 == 2 * metrics["optimizer_steps"] and all(entered)


def test_activation_offloading_is_refused_without_a_gpu_and_builds_trls_offloader_with_one(tmp_path, vault_tiny):
    from loop_trainer import LOOPConfig
    from loop_trainer.training.activation_checkpointing import activation_offloading

    with pytest.raises(ValueError, match="no GPU .*remove activation_offloading") as error:
        LOOPConfig(output_dir=str(tmp_path / "run"), activation_offloading=True, use_cpu=True, report_to="none")
    assert "\n" not in str(error.value)
    _, model, _ = vault_tiny
    assert activation_offloading(model, False)() is not None  # a no-op context
    if torch.cuda.is_available():  # the offloader itself needs a GPU
        on = activation_offloading(model, True)
        assert on() is on() and type(on()).__name__ == "OffloadActivations"  # one offloader, entered each time


@pytest.mark.parametrize(
    ("stage", "processes", "layout"),
    [
        (None, 4, None),  # no DeepSpeed: Trainer's whole optimizer.pt, any number of processes
        (0, 4, {"deepspeed_zero_stage": 0}),  # DeepSpeed without ZeRO: its own checkpoint, not partitioned
        (2, 4, {"deepspeed_zero_stage": 2, "processes": 4}),
        (3, 8, {"deepspeed_zero_stage": 3, "processes": 8}),
    ],
)
def test_the_optimizer_state_layout_a_checkpoint_records_follows_the_launch(stage, processes, layout):
    from types import SimpleNamespace

    from loop_trainer.training.distribution import optimizer_state_layout, zero_stage

    plugin = None if stage is None else SimpleNamespace(zero_stage=stage)
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=processes)
    assert zero_stage(accelerator) == stage  # what the trainer passes, with the accelerator's process count
    assert optimizer_state_layout(stage, processes) == layout


def test_ending_a_distributed_run_destroys_the_process_group_and_is_a_no_op_without_one(tmp_path):
    from loop_trainer.training.distribution import end_distributed_run

    end_distributed_run()  # no process group: nothing to do
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        gathered = [torch.zeros(2)]
        torch.distributed.all_gather(gathered, torch.ones(2))  # a collective holding tensors Python owns
        end_distributed_run()
        assert not torch.distributed.is_initialized()
        end_distributed_run()  # once ended, again: nothing to do
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
