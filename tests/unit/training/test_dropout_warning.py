"""A policy that trains with dropout on (PEFT's lora_dropout, TRL's default 0.05) is named in one line at
start-up: the old policy's log-probs are taken without dropout, the update's with it, so the PPO ratio is
not 1 on policy. ``disable_dropout`` switches it off and the line goes."""

from __future__ import annotations

import logging

import pytest
import torch
from peft import LoraConfig

from loop_trainer.config import LOOPConfig
from loop_trainer.models.tiny import build_tiny_model
from loop_trainer.training.model_loading import wrap_for_training

LOGGER = "loop_trainer.training.model_loading"


def _wrap(tmp_path, lora_dropout: float, disable_dropout: bool):
    model = build_tiny_model(40, eos_token_id=1, pad_token_id=0)
    args = LOOPConfig(output_dir=str(tmp_path / "o"), disable_dropout=disable_dropout)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=lora_dropout)
    return wrap_for_training(model, args, lora)


@pytest.mark.parametrize(
    ("lora_dropout", "disable_dropout", "warned"), [(0.05, False, True), (0.05, True, False), (0.0, False, False)]
)
def test_active_dropout_is_named_once_and_disable_dropout_switches_it_off(
    tmp_path, caplog, lora_dropout, disable_dropout, warned
):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        policy = _wrap(tmp_path, lora_dropout, disable_dropout)
    lines = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    active = [m.p for m in policy.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    assert bool(active) == warned
    if warned:
        (line,) = lines
        assert line.startswith(f"{len(active)} dropout layers are on (p up to 0.05")
        assert "set disable_dropout: true" in line
    else:
        assert lines == []


def test_with_dropout_on_the_update_forward_differs_from_the_old_policys(tmp_path):
    """Why the line exists: the same weights and tokens, train mode against eval mode, once the adapter is
    non-zero (its B starts at 0, so the difference grows with training)."""
    policy = _wrap(tmp_path, 0.05, False)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    ids = torch.arange(2, 30).reshape(1, -1)
    policy.eval()
    with torch.no_grad():
        old = policy(input_ids=ids).logits
    policy.train()
    torch.manual_seed(0)
    with torch.no_grad():
        new = policy(input_ids=ids).logits
    assert not torch.allclose(old, new, atol=1e-4)
