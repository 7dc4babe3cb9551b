"""The paper's Table 1 variants, each one recipe key away from LOOP, run end to end through
loop-train's flags (2 iterations on vault with a tiny model)."""

from __future__ import annotations

import pytest

from loop_trainer.cli.train import cli
from loop_trainer.training.run_log import read_metrics

VARIANTS = {
    "loop": [],
    "loop-per-turn": ["--ratio_level", "turn"],
    "loop-per-trajectory (RLOO-like)": ["--ratio_level", "trajectory"],
    "loop-std-normalised": ["--std_normalize_advantages", "true"],
    "grpo-without-kl": ["--advantage_estimator", "group_mean", "--std_normalize_advantages", "true"],
}
SMALL = ["--model_name_or_path", "tiny:vault", "--environment_kwargs", '{"num_tasks": 8}', "--iterations", "2",
         "--tasks_per_iteration", "4", "--rollouts_per_task", "3", "--minibatch_size", "4", "--max_turns", "4",
         "--max_new_tokens_per_turn", "4", "--max_trajectory_tokens", "256", "--per_device_train_batch_size", "4",
         "--activation_checkpointing", "false", "--advantage_threshold", "0.0", "--learning_rate", "1e-2",
         "--disable_tqdm", "true", "--save_strategy", "no", "--seed", "0"]


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
    for flags in (["--ratio_level", "sequence"], ["--advantage_estimator", "rloo"]):
        assert cli(["--model_name_or_path", "tiny:vault", *flags, "--dry-run"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"loop-train: error: LOOPConfig: {flags[0][2:]} must be one of")


@pytest.mark.slow
def test_grpo_with_a_kl_penalty_to_the_adapter_disabled_base(tmp_path):
    out = tmp_path / "grpo"
    flags = ["--advantage_estimator", "group_mean", "--std_normalize_advantages", "true", "--beta", "0.04",
             "--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj"]
    assert cli([*SMALL, "--output_dir", str(out), *flags]) == 0
    records = read_metrics(out)
    assert len(records) == 2 and all(r["optimizer_steps"] > 0 for r in records)
    assert records[-1]["kl_ref"] > 0  # the adapter has moved away from the base model


def test_beta_without_an_adapter_is_refused_in_one_line(capsys):
    assert cli(["--model_name_or_path", "tiny:vault", "--beta", "0.1", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loop-train: error: beta=0.1 needs use_peft: true")


def test_the_kl_penalty_is_exactly_zero_while_the_adapter_is_untouched(tmp_path, vault_tiny):
    from peft import LoraConfig

    from loop_trainer import LOOPConfig, LOOPTrainer

    env, model, tok = vault_tiny
    args = LOOPConfig(output_dir=str(tmp_path / "run"), iterations=1, tasks_per_iteration=4, rollouts_per_task=3,
                      minibatch_size=4, max_turns=3, max_new_tokens_per_turn=4, max_trajectory_tokens=200,
                      per_device_train_batch_size=4, activation_checkpointing=False, advantage_threshold=0.0,
                      learning_rate=5e-2, beta=0.5, disable_tqdm=True, report_to=[], save_strategy="no")
    trainer = LOOPTrainer(model, env, args, processing_class=tok,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.prepare_for_iterations()
    steps, step = [], trainer.policy_update.minibatch_step

    def recording(*a, **k):
        result = step(*a, **k)
        steps.append(None if result is None else result.kl_ref)
        return result

    trainer.policy_update.minibatch_step = recording
    record = trainer.run_iteration()
    assert steps[0] == 0.0  # lora_B starts at zero: policy == reference, k3 == 0 exactly
    assert steps[-1] > 0 and record["kl_ref"] > 0
    from loop_trainer.tiny import build_tiny_for_environment

    full_model, _ = build_tiny_for_environment(env.vocabulary(), seed=0)
    with pytest.raises(ValueError, match="beta=0.5 needs a LoRA adapter"):
        LOOPTrainer(full_model, env, args, processing_class=tok)  # full fine-tuning: no base to refer to
