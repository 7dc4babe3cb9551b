"""transformers 5.17, the version vLLM <= 0.31 accepts (this virtualenv runs it), names activation
checkpointing ``gradient_checkpointing`` only. The first GPU run found LOOP training with
checkpointing silently off there: these check it is on, for full fine-tuning and for LoRA."""

from __future__ import annotations

import transformers
from peft import LoraConfig

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.envs import VaultEnv
from loop_trainer.models.tiny import build_tiny_for_environment
from loop_trainer.training.activation_checkpointing import is_checkpointing


def _trainer(tmp_path, peft_config=None, **overrides):
    env = VaultEnv(num_tasks=4)
    model, tokenizer = build_tiny_for_environment(env.vocabulary(), seed=0)
    args = LOOPConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        iterations=1,
        tasks_per_iteration=1,
        rollouts_per_task=2,
        minibatch_size=2,
        max_turns=1,
        max_new_tokens_per_turn=2,
        max_trajectory_tokens=256,
        report_to="none",
        save_strategy="no",
        memory_stress_test=False,
        disable_tqdm=True,
        plot_curves=False,
        **overrides,
    )
    return LOOPTrainer(model, env, args, processing_class=tokenizer, peft_config=peft_config)


def test_this_venv_runs_transformers_5_17():
    assert "activation_checkpointing" not in transformers.TrainingArguments.__dataclass_fields__, (
        transformers.__version__
    )


def test_activation_checkpointing_reaches_the_trainer_and_the_model(tmp_path):
    trainer = _trainer(tmp_path / "full")
    assert trainer.args.gradient_checkpointing is True  # what transformers 5.17's Trainer and TRL read
    trainer.prepare_for_iterations()
    assert is_checkpointing(trainer.model)


def test_lora_with_checkpointing_gets_input_gradients_and_trains(tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = _trainer(tmp_path / "lora", peft_config=lora, learning_rate=1e-2, advantage_threshold=0.0)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    record = trainer.run_iteration()
    assert is_checkpointing(trainer.model)
    assert record["skipped_nonfinite_steps"] == 0
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not p.detach().equal(before[n])]
    assert moved, "no LoRA weight changed: with reentrant checkpointing and no input gradients nothing trains"


def test_turning_it_off_is_honoured(tmp_path):
    trainer = _trainer(tmp_path / "off", activation_checkpointing=False)
    assert trainer.args.gradient_checkpointing is False
    trainer.prepare_for_iterations()
    assert not is_checkpointing(trainer.model)
