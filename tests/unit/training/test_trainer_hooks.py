"""Pins every piece of private ``transformers.Trainer`` API LOOPTrainer relies on, and the public TRL API
it uses (the fused log-prob head). LOOPTrainer uses no private TRL API.

If one of these fails after an upgrade, the trainer's assumptions no longer hold: fix the trainer
(see the module docstring of loop_trainer/training/trainer.py), don't loosen the test.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import torch
from transformers import Trainer

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.chat import stop_token_ids
from loop_trainer.training import trainer as trainer_module
from loop_trainer.training.batching import TrainingSample, collate
from loop_trainer.training.logprobs import token_logprobs
from loop_trainer.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[3]
# The private Trainer hooks trainer.py uses (called or overridden); the module docstring lists the same.
PINNED_HOOKS = {
    "_inner_training_loop",
    "_init_training_state",
    "_prepare_for_training",
    "_load_rng_state",
    "_save_checkpoint",
    "_get_output_dir",
    "_push_from_checkpoint",
}


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_the_trainer_uses_no_private_api_but_the_pinned_hooks_and_says_so():
    used, overridden = set(), set()
    for module in (trainer_module,):  # LOOPTrainer's one class
        source = Path(module.__file__).read_text()
        tree = ast.parse(source)
        own = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        used |= {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and re.fullmatch(r"_[a-z][a-z_]*", node.attr)
            and hasattr(Trainer, node.attr)
        }
        overridden |= {
            name for name in own if name.startswith("_") and not name.startswith("__") and hasattr(Trainer, name)
        }
        assert "from trl" not in source and "import trl" not in source  # TRL's public API: model_loading only
    assert used | overridden == PINNED_HOOKS
    docstring = ast.get_docstring(ast.parse(Path(trainer_module.__file__).read_text()))
    assert all(f"``{hook}``" in docstring for hook in PINNED_HOOKS)
    assert not issubclass(LOOPTrainer, __import__("trl").GRPOTrainer)
    assert LOOPTrainer.__bases__ == (Trainer,)  # one class on Trainer, the rest composed


def test_the_private_hooks_are_called_with_keywords():
    tree = ast.parse(Path(trainer_module.__file__).read_text())
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PINNED_HOOKS
    ]
    assert calls and all(not call.args for call in calls), [ast.unparse(call) for call in calls if call.args]


def test_inner_training_loop_is_what_train_calls():
    assert params(Trainer._inner_training_loop) == [
        "self",
        "batch_size",
        "args",
        "resume_from_checkpoint",
        "trial",
        "ignore_keys_for_eval",
    ]
    assert "inner_training_loop" in inspect.getsource(Trainer.train)
    assert params(LOOPTrainer._inner_training_loop) == params(Trainer._inner_training_loop)
    assert "_load_from_checkpoint(resume_from_checkpoint)" in inspect.getsource(Trainer.train)


def test_training_state_and_preparation_helpers():
    assert params(Trainer._init_training_state) == [
        "self",
        "max_steps",
        "num_update_steps_per_epoch",
        "num_train_epochs",
        "resume_from_checkpoint",
        "trial",
    ]
    assert params(Trainer._prepare_for_training) == ["self", "max_steps", "train_dataloader", "resume_from_checkpoint"]
    source = inspect.getsource(Trainer._prepare_for_training)
    for needed in ("deepspeed_init", "create_optimizer", "create_scheduler", "self.model_wrapped = model"):
        assert needed in source, needed


def test_checkpoint_helpers_loop_resume_relies_on():
    # _save_checkpoint writes under _get_output_dir(trial) (redirected to the staging directory), rotates
    # there and pushes through _push_from_checkpoint; the RNG state files are what _load_rng_state restores.
    assert params(Trainer._save_checkpoint)[:3] == ["self", "model", "trial"]
    source = inspect.getsource(Trainer._save_checkpoint)
    for needed in (
        "self._get_output_dir(trial=trial)",
        "self._save_rng_state(output_dir)",
        "rotate_checkpoints(",
        "self._push_from_checkpoint(output_dir)",
    ):
        assert needed in source, needed
    assert params(Trainer._get_output_dir) == ["self", "trial"]
    assert params(Trainer._load_rng_state) == ["self", "checkpoint"]
    assert (
        params(Trainer._push_from_checkpoint)
        == params(LOOPTrainer._push_from_checkpoint)
        == ["self", "checkpoint_folder"]
    )
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

    assert PREFIX_CHECKPOINT_DIR == "checkpoint"
    assert params(rotate_checkpoints)[:4] == ["output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime"]
    assert callable(get_last_checkpoint)


def test_constructor_takes_grpo_trainers_arguments_and_builds_no_optimizer_yet(tmp_path, vault_tiny):
    from trl import GRPOTrainer

    grpo = params(GRPOTrainer.__init__)
    ours = params(LOOPTrainer.__init__)
    # the same names in the same order (the one-word switch), but the second: an Environment or reward_funcs
    assert ours[: len(grpo)] == ["self", "model", "env", *grpo[3:]] and grpo[2] == "reward_funcs" in ours
    env, model, tok = vault_tiny
    args = LOOPConfig(
        output_dir=str(tmp_path),
        iterations=1,
        tasks_per_iteration=1,
        rollouts_per_task=2,
        activation_checkpointing=False,
        disable_tqdm=True,
    )
    trainer = LOOPTrainer(model, env, args, processing_class=tok)
    assert stop_token_ids(trainer.model, tok) == [tok.eos_token_id]
    assert trainer.optimizer is None  # created by _prepare_for_training, not __init__
    trainer.close()


def test_fused_lm_head_returns_shifted_token_logprobs(tmp_path, vault_tiny):
    env, model, tok = vault_tiny
    args = LOOPConfig(
        output_dir=str(tmp_path),
        iterations=1,
        tasks_per_iteration=1,
        rollouts_per_task=2,
        activation_checkpointing=False,
        disable_tqdm=True,
    )
    LOOPTrainer(model, env, args, processing_class=tok).close()  # installs the fused head
    ids = [3, 7, 9, 11, 13, 17]
    t = Trajectory(task_id="x", group=0, token_ids=ids, loss_mask=[0, 0, 1, 1, 0, 1], sampler_logprobs=[0.0] * 6)
    batch = collate([TrainingSample.from_trajectory(t, 1.0, 100)], tok.pad_token_id)
    with torch.no_grad():
        got = token_logprobs(model, batch)[0]
        logits = model(torch.tensor([ids])).logits[0].float()
    reference = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    expected = torch.cat([torch.zeros(1), reference]) * torch.tensor(t.loss_mask)
    assert torch.allclose(got, expected, atol=1e-5)
