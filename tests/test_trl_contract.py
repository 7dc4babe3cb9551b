"""Pins every piece of TRL/transformers private API that LOOPTrainer relies on.

If one of these fails after an upgrade, the trainer's assumptions no longer hold: fix the trainer
(see the module docstring of loop_trainer/trainer.py), don't loosen the test.
"""

from __future__ import annotations

import inspect

import torch
import transformers
import trl
from transformers import Trainer
from trl import GRPOTrainer

from loop_trainer.chat import stop_token_ids
from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.training.batching import collate, TrainingSample, token_logprobs
from loop_trainer.trajectory import Trajectory


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_versions_are_the_ones_we_pinned():
    assert trl.__version__.startswith("1.16."), trl.__version__
    assert transformers.__version__.startswith("5.23."), transformers.__version__


def test_inner_training_loop_is_what_train_calls():
    assert params(Trainer._inner_training_loop) == [
        "self", "batch_size", "args", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"
    ]
    assert "inner_training_loop" in inspect.getsource(Trainer.train)
    assert params(LOOPTrainer._inner_training_loop) == params(Trainer._inner_training_loop)


def test_training_state_and_preparation_helpers():
    assert params(Trainer._init_training_state) == [
        "self", "max_steps", "num_update_steps_per_epoch", "num_train_epochs", "resume_from_checkpoint", "trial"
    ]
    assert params(Trainer._prepare_for_training) == ["self", "max_steps", "train_dataloader", "resume_from_checkpoint"]
    source = inspect.getsource(Trainer._prepare_for_training)
    for needed in ("deepspeed_init", "create_optimizer", "create_scheduler", "self.model_wrapped = model"):
        assert needed in source, needed
    assert params(Trainer._save_checkpoint)[:3] == ["self", "model", "trial"]


def test_checkpoint_helpers_loop_resume_relies_on():
    # _save_checkpoint writes under _get_output_dir(trial) (redirected to the staging directory)
    # and rotates there; the RNG state files are what _load_rng_state restores.
    source = inspect.getsource(Trainer._save_checkpoint)
    for needed in ("self._get_output_dir(trial=trial)", "self._save_rng_state(output_dir)", "rotate_checkpoints("):
        assert needed in source, needed
    assert params(Trainer._get_output_dir) == ["self", "trial"]
    assert params(Trainer._load_rng_state) == ["self", "checkpoint"]
    assert "_load_from_checkpoint(resume_from_checkpoint)" in inspect.getsource(Trainer.train)
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

    assert PREFIX_CHECKPOINT_DIR == "checkpoint"
    assert params(rotate_checkpoints)[:4] == ["output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime"]
    assert callable(get_last_checkpoint)


def test_grpo_constructor_and_attributes(tmp_path, vault_tiny):
    signature = params(GRPOTrainer.__init__)
    for name in ("model", "reward_funcs", "args", "train_dataset", "processing_class", "callbacks", "optimizers",
                 "peft_config"):
        assert name in signature, name
    env, model, tok = vault_tiny
    args = LOOPConfig(output_dir=str(tmp_path), iterations=1, tasks_per_iteration=1, rollouts_per_task=2,
                      activation_checkpointing=False, disable_tqdm=True)
    trainer = LOOPTrainer(model, env, args, processing_class=tok)
    # Our one definition of the stop ids (training and loop-eval) agrees with GRPOTrainer's.
    assert stop_token_ids(trainer.model, tok) == sorted(trainer.eos_token_ids) == [tok.eos_token_id]
    assert trainer.optimizer is None  # created by _prepare_for_training, not __init__


def test_fused_lm_head_returns_shifted_token_logprobs(tmp_path, vault_tiny):
    env, model, tok = vault_tiny
    args = LOOPConfig(output_dir=str(tmp_path), iterations=1, tasks_per_iteration=1, rollouts_per_task=2,
                      activation_checkpointing=False, disable_tqdm=True)
    LOOPTrainer(model, env, args, processing_class=tok)  # installs the fused head
    ids = [3, 7, 9, 11, 13, 17]
    t = Trajectory(task_id="x", group=0, token_ids=ids, loss_mask=[0, 0, 1, 1, 0, 1], sampler_logprobs=[0.0] * 6)
    batch = collate([TrainingSample.from_trajectory(t, 1.0, 100)], tok.pad_token_id)
    with torch.no_grad():
        got = token_logprobs(model, batch)[0]
        logits = model(torch.tensor([ids])).logits[0].float()
    reference = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    expected = torch.cat([torch.zeros(1), reference]) * torch.tensor(t.loss_mask)
    assert torch.allclose(got, expected, atol=1e-5)
