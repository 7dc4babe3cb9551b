"""The policy as LOOPTrainer wraps it for training (training/model_loading.py): what its adapter starts from.
(Its dropout warning: test_dropout_warning.py.)"""

from __future__ import annotations

import torch
from peft import LoraConfig

from loop_trainer.config import LOOPConfig
from loop_trainer.models.tiny import build_tiny_model
from loop_trainer.training.model_loading import wrap_for_training


def test_the_adapters_initial_weights_are_the_runs_seeds(tmp_path):
    """LoRA's A matrices are drawn when the adapter is added, before Trainer seeds the run: they follow ``seed``,
    whatever the random state was (two runs of one seed start from one adapter; another seed, another)."""

    def initial_adapter(seed, random_state):
        torch.manual_seed(random_state)  # whatever the script drew before
        model = build_tiny_model(40, eos_token_id=1, pad_token_id=0, seed=0)
        args = LOOPConfig(output_dir=str(tmp_path / "o"), seed=seed)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
        policy = wrap_for_training(model, args, lora)
        return {name: value.detach().clone() for name, value in policy.named_parameters() if "lora_A" in name}

    first, again, other = initial_adapter(3, 100), initial_adapter(3, 200), initial_adapter(4, 100)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    initial_adapter(5, 7)
    assert torch.equal(torch.rand(3), expected)  # the caller's random state, as it was
    assert first and first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not any(torch.equal(first[name], other[name]) for name in first)
