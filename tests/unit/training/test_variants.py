"""The paper's Table 1 variants, each one recipe key away from LOOP, run end to end through
loop-train's flags (2 iterations on vault with a tiny model); and the policy update's inputs to
the objective, alone (no trainer)."""

from __future__ import annotations

import math

import pytest
import torch

from loop_trainer.cli.train import cli
from loop_trainer.training.run_log import read_metrics

VARIANTS = {
    "loop": [],
    "loop-per-turn": ["--ratio_level", "turn"],
    "loop-per-trajectory (RLOO-like)": ["--ratio_level", "trajectory"],
    "loop-std-normalised": ["--std_normalize_advantages", "true"],
    "grpo-without-kl": ["--advantage_estimator", "group_mean", "--std_normalize_advantages", "true"],
}
SMALL = [
    "--model_name_or_path",
    "tiny:vault",
    "--environment_kwargs",
    '{"num_tasks": 8}',
    "--iterations",
    "2",
    "--tasks_per_iteration",
    "4",
    "--rollouts_per_task",
    "3",
    "--minibatch_size",
    "4",
    "--max_turns",
    "4",
    "--max_new_tokens_per_turn",
    "4",
    "--max_trajectory_tokens",
    "256",
    "--per_device_train_batch_size",
    "4",
    "--activation_checkpointing",
    "false",
    "--advantage_threshold",
    "0.0",
    "--learning_rate",
    "1e-2",
    "--disable_tqdm",
    "true",
    "--save_strategy",
    "no",
    "--seed",
    "0",
]


@pytest.mark.slow
def test_every_variant_trains_through_loop_train_flags(tmp_path):
    losses = {}
    for name, flags in VARIANTS.items():
        out = tmp_path / name.split()[0]
        assert cli([*SMALL, "--output_dir", str(out), *flags]) == 0, name
        records = read_metrics(out)
        assert len(records) == 2 and all(r["optimizer_steps"] > 0 for r in records), name
        losses[name] = [r["loss"] for r in records]
    # Same seed, same first rollouts: the variants differ in the update only, and they do differ.
    assert losses["loop-per-turn"] != losses["loop"] and losses["loop-per-trajectory (RLOO-like)"] != losses["loop"]
    assert losses["grpo-without-kl"] != losses["loop-std-normalised"]


def test_unknown_variant_values_are_one_line(capsys):
    for flags in (["--ratio_level", "sentence"], ["--advantage_estimator", "rloo"]):
        assert cli(["--model_name_or_path", "tiny:vault", *flags, "--dry-run"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"loop-train: error: LOOPConfig: {flags[0][2:]} must be one of")


@pytest.mark.slow
def test_grpo_with_a_kl_penalty_to_the_adapter_disabled_base(tmp_path):
    out = tmp_path / "grpo"
    flags = [
        "--advantage_estimator",
        "group_mean",
        "--std_normalize_advantages",
        "true",
        "--beta",
        "0.04",
        "--use_peft",
        "true",
        "--lora_r",
        "4",
        "--lora_alpha",
        "8",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
    ]
    assert cli([*SMALL, "--output_dir", str(out), *flags]) == 0
    records = read_metrics(out)
    assert len(records) == 2 and all(r["optimizer_steps"] > 0 for r in records)
    assert records[-1]["kl_ref"] > 0  # the adapter has moved away from the base model


def test_beta_without_an_adapter_plans_a_frozen_copy_of_the_weights(capsys):
    assert cli(["--model_name_or_path", "tiny:vault", "--beta", "0.1", "--dry-run"]) == 0
    assert "KL reference (frozen copy)" in capsys.readouterr().out
    assert cli(["--model_name_or_path", "tiny:vault", "--beta", "0.1", "--use_peft", "true", "--dry-run"]) == 0
    assert "KL reference" not in capsys.readouterr().out  # the adapter's reference is its own base model


def _kl_run(tmp_path):
    """One short iteration of the tiny model with a KL penalty, every rollout kept."""
    from loop_trainer import LOOPConfig

    return LOOPConfig(
        output_dir=str(tmp_path / "run"),
        iterations=1,
        tasks_per_iteration=4,
        rollouts_per_task=3,
        minibatch_size=4,
        max_turns=3,
        max_new_tokens_per_turn=4,
        max_trajectory_tokens=200,
        per_device_train_batch_size=4,
        activation_checkpointing=False,
        advantage_threshold=0.0,
        learning_rate=5e-2,
        beta=0.5,
        disable_tqdm=True,
        report_to=[],
        save_strategy="no",
    )


def _recorded_kl_ref(trainer) -> list:
    """The KL estimate to the reference of each minibatch step the trainer takes from now on (None: skipped)."""
    steps, step = [], trainer.policy_update.minibatch_step

    def recording(*a, **k):
        result = step(*a, **k)
        steps.append(None if result is None else result.kl_ref)
        return result

    trainer.policy_update.minibatch_step = recording
    return steps


def test_the_kl_penalty_is_exactly_zero_while_the_adapter_is_untouched(tmp_path, vault_tiny):
    from peft import LoraConfig

    from loop_trainer import LOOPTrainer

    env, model, tok = vault_tiny
    args = _kl_run(tmp_path)
    trainer = LOOPTrainer(
        model,
        env,
        args,
        processing_class=tok,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    trainer.prepare_for_iterations()
    steps = _recorded_kl_ref(trainer)
    record = trainer.run_iteration()
    assert steps[0] == 0.0  # lora_B starts at zero: policy == reference, k3 == 0 exactly
    assert steps[-1] > 0 and record["kl_ref"] > 0


def test_full_fine_tuning_refers_to_a_frozen_copy_of_its_starting_weights(tmp_path, vault_tiny):
    from loop_trainer import LOOPTrainer
    from loop_trainer.training.batching import collate
    from loop_trainer.training.logprobs import token_logprobs
    from loop_trainer.training.reference import FrozenCopy

    env, model, tok = vault_tiny
    start = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    args = _kl_run(tmp_path)
    trainer = LOOPTrainer(model, env, args, processing_class=tok)
    trainer.prepare_for_iterations()
    reference = trainer.policy_update.reference
    assert isinstance(reference, FrozenCopy) and reference.model is not model
    assert not any(p.requires_grad for p in reference.model.parameters())
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in reference.model.parameters()}
    steps = _recorded_kl_ref(trainer)
    samples: list = []
    record_samples = trainer.policy_update.fixed_logprobs

    def keeping(batch, *a, **k):
        samples.extend(batch)
        return record_samples(batch, *a, **k)

    trainer.policy_update.fixed_logprobs = keeping
    record = trainer.run_iteration()
    assert steps[0] == pytest.approx(0.0, abs=1e-6)  # policy == its starting weights: k3 == 0
    assert steps[-1] > 0 and record["kl_ref"] > 0
    moved = model.state_dict()
    assert any(not torch.equal(moved[name], start[name]) for name in start)  # the policy trained ...
    kept = reference.model.state_dict()
    assert all(torch.equal(kept[name], start[name]) for name in start)  # ... its reference did not
    # the copy's log-probs are the starting model's, through a fused head of its own (not the policy's)
    from trl.trainer import add_fused_lm_head

    from loop_trainer.models.tiny import build_tiny_for_environment

    fresh, _ = build_tiny_for_environment(env.vocabulary(), seed=0)
    fresh.load_state_dict(start)
    add_fused_lm_head(fresh, temperature=args.temperature)
    batch = collate(samples[:4], tok.pad_token_id)
    with torch.no_grad():
        assert torch.equal(reference.logprobs(model, batch), token_logprobs(fresh.eval(), batch))


def test_a_frozen_copy_runs_its_own_weights_even_of_a_model_given_a_fused_head(vault_tiny):
    from trl.trainer import add_fused_lm_head

    from loop_trainer.config.combinations import ConfigCombinationError
    from loop_trainer.training.batching import collate
    from loop_trainer.training.logprobs import token_logprobs
    from loop_trainer.training.reference import frozen_copy

    _, model, tok = vault_tiny
    add_fused_lm_head(model)  # its forward now holds the model it was added to
    reference = frozen_copy(model, temperature=1.0, zero3=False)
    batch = collate(_samples(tok), tok.pad_token_id)
    with torch.no_grad():
        before = token_logprobs(model.eval(), batch)
        logits = reference.model(input_ids=batch.input_ids).logits  # the plain forward too
        assert torch.equal(reference.logprobs(model, batch), before)
        for parameter in model.parameters():
            parameter.add_(0.05)
        assert not torch.equal(token_logprobs(model, batch), before)  # the policy moved
        assert torch.equal(reference.logprobs(model, batch), before)  # its reference did not
        assert torch.equal(reference.model(input_ids=batch.input_ids).logits, logits)
    with pytest.raises(ConfigCombinationError, match="use_peft: true"):
        frozen_copy(model, temperature=1.0, zero3=True)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 1}  # dispatched over two GPUs
    with pytest.raises(ConfigCombinationError, match="split over 2 devices"):
        frozen_copy(model, temperature=1.0, zero3=False)
    # put where the policy is, in the dtype it was prepared in (a DeepSpeed engine casts it to bfloat16)
    reference.to(torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in reference.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}


# ---------------------------------------------------------------------------------------------
# the policy update alone: explicit reference log-probs, one KL-abort check, the shuffle seed


def _policy_update(model, pad_token_id, **overrides):
    import contextlib

    from accelerate import Accelerator
    from trl.trainer.utils import add_fused_lm_head

    from loop_trainer.training.distribution import DistributionStrategy
    from loop_trainer.training.update import PolicyUpdate, UpdateSettings

    add_fused_lm_head(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # steps taken, weights unchanged
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    strategy = DistributionStrategy(Accelerator(cpu=True), model, optimizer, scheduler, max_grad_norm=1.0)
    settings = {
        "epsilon": 0.1,
        "minibatch_size": 2,
        "ppo_epochs": 1,
        "micro_batch_size": 2,
        "kl_abort_threshold": 20.0,
        "seed": 0,
        "pad_token_id": pad_token_id,
    }
    settings.update(overrides)
    return PolicyUpdate(UpdateSettings(**settings), strategy, contextlib.nullcontext, reference=_Itself())


class _Itself:
    """A reference policy that is the policy itself."""

    def logprobs(self, policy, batch):
        from loop_trainer.training.logprobs import token_logprobs

        return token_logprobs(policy, batch)


def _samples(tokenizer):
    from loop_trainer.training.batching import TrainingSample

    prompt = tokenizer.encode("fetch code of ann", add_special_tokens=False)
    out = []
    for reply, advantage in (("find ann", 1.0), ("open k3", -1.0), ("find ann", 0.5), ("open k3", -0.5)):
        ids = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append(
            TrainingSample(
                prompt + ids, [0] * len(prompt) + [1] * len(ids), [-1.0] * (len(prompt) + len(ids)), advantage, False
            )
        )
    return out


def test_reference_logprobs_reach_the_penalty_as_an_explicit_argument(vault_tiny):
    from loop_trainer.training.update import FixedLogprobs

    _, model, tok = vault_tiny
    update = _policy_update(model, tok.pad_token_id, beta=0.5)
    samples = _samples(tok)
    fixed, _ = update.fixed_logprobs(samples)
    # the reference policy here is the policy itself
    assert fixed.reference is not None and fixed.reference.keys() == fixed.old.keys() == {0, 1, 2, 3}
    assert all(torch.equal(fixed.reference[i], fixed.old[i]) for i in fixed.old)
    assert not [name for name in vars(update) if "logprob" in name]  # nothing kept on the side
    # the penalty reads exactly the log-probs it is handed: the same ones give k3 = 0 (to rounding
    # between the eval and the train pass), ones lowered by 0.5 give e^-0.5 + 0.5 - 1 per token
    same = update.minibatch_step(samples, fixed, [0, 1])
    assert same is not None and same.stepped and abs(same.kl_ref) < 1e-6
    lowered = FixedLogprobs(fixed.old, {i: r - 0.5 for i, r in fixed.reference.items()})
    shifted = update.minibatch_step(samples, lowered, [2, 3])
    assert shifted.kl_ref == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-4)
    with pytest.raises(ValueError, match="reference"):
        update.minibatch_step(samples, FixedLogprobs(fixed.old), [0, 1])
    # beta = 0: no reference pass at all
    plain, _ = _policy_update(model, tok.pad_token_id).fixed_logprobs(samples)
    assert plain.reference is None and all(torch.equal(plain.old[i], fixed.old[i]) for i in fixed.old)


def test_the_kl_abort_is_decided_once_in_the_minibatch_step(vault_tiny):
    from loop_trainer.training.update import StepResult

    _, model, tok = vault_tiny
    samples = _samples(tok)
    # the step decides: over the threshold, gradients discarded, no optimizer step, flagged
    update = _policy_update(model, tok.pad_token_id, kl_abort_threshold=-1.0)
    fixed, _ = update.fixed_logprobs(samples)
    step = update.minibatch_step(samples, fixed, [0, 1])
    assert step.kl_exceeded and not step.stepped
    # the iteration only reads the flag (it does not compare the KL with the threshold again)
    update = _policy_update(model, tok.pad_token_id, ppo_epochs=2)
    calls = []

    def scripted(samples_, fixed_, minibatch):
        calls.append(minibatch)
        exceeded = len(calls) == 3
        return StepResult(
            loss=0.0,
            clip_frac=0.0,
            kl=1e9 if not exceeded else 0.0,
            ratio_mean=1.0,
            ratio_min=1.0,
            ratio_max=1.0,
            num_tokens=1.0,
            grad_norm=0.0,
            stepped=not exceeded,
            kl_exceeded=exceeded,
        )

    update.minibatch_step = scripted
    metrics = update(samples, iteration=0)
    assert len(calls) == 3 and metrics["aborted_on_kl"] == 1 and metrics["optimizer_steps"] == 2


def test_the_stream_seed_keeps_the_recorded_stream():
    """The recorded demo run depends on this exact formula (see stream_seed's docstring)."""
    from loop_trainer.rollout import mix_seed
    from loop_trainer.rollout.records import stream_seed
    from loop_trainer.training.batching import minibatch_indices

    assert [stream_seed(0, i) for i in range(3)] == [0, 1, 2]
    assert stream_seed(7, 5) == 7 * 1_000_003 + 5 != mix_seed(7, 5)
    generator = torch.Generator().manual_seed(stream_seed(0, 0))
    expected = torch.randperm(8, generator=torch.Generator().manual_seed(0)).tolist()[:4]
    assert next(minibatch_indices(8, 4, generator)) == expected
