"""The trainer-side pieces of vLLM generation that need no vLLM."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from loop_trainer.envs import VaultEnv
from loop_trainer.rollout.generator import _model_path
from loop_trainer.rollout.vllm_backend import vllm_lora_rank
from loop_trainer.rollout.weight_sync import layerwise_weights, probe_token_ids


def test_a_model_built_in_memory_is_saved_for_the_engine_without_its_adapter(tmp_path):
    from loop_trainer.models.tiny import build_tiny_for_environment

    model, _ = build_tiny_for_environment(VaultEnv.vocabulary(), seed=0)
    model.name_or_path = ""
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    path = _model_path(peft_model, str(tmp_path / "init"))
    assert path == str(tmp_path / "init")
    reloaded = type(model).from_pretrained(path)
    assert set(reloaded.state_dict()) == set(expected)
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    # A model that has a directory is loaded from it, not copied.
    model.name_or_path = str(tmp_path / "init")
    assert _model_path(peft_model, str(tmp_path / "unused")) == str(tmp_path / "init")
    assert not (tmp_path / "unused").exists()


def test_full_weight_stream_names_every_weight_once_plus_the_tied_head():
    from loop_trainer.models.tiny import build_tiny_for_environment

    model, _ = build_tiny_for_environment(VaultEnv.vocabulary(), seed=0)
    names = [name for name, _ in layerwise_weights(model)]
    assert names[-1] == "lm_head.weight" and len(names) == len(set(names))
    assert set(names) == {name for name, _ in model.named_parameters()} | {"lm_head.weight"}


def test_probe_and_lora_rank_helpers():
    probe = probe_token_ids(100, 32, avoid={0, 1, 2})
    assert len(probe) == 32 and not {0, 1, 2} & set(probe) and probe == probe_token_ids(100, 32, avoid={0, 1, 2})
    assert [vllm_lora_rank(r) for r in (4, 8, 9, 64, 300)] == [8, 8, 16, 64, 320]
