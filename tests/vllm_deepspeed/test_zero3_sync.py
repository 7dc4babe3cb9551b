"""Weight sync from a ZeRO-3-partitioned model into colocated vLLM, gathering little at a time.

The trainer's model is wrapped by a (single-process, CPU) DeepSpeed ZeRO-3 engine, so every
parameter is partitioned (its local ``data`` is empty) and must be gathered to be read. Full
weights must reach vLLM one decoder layer at a time (never the whole model gathered), the tied
``lm_head`` included; a LoRA sync must gather the adapter's parameters and nothing else. After each
sync vLLM's log-probs equal the partitioned model's (fp32, 1e-3); before it they differ.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from vllm_helpers import logprobs_of  # tests/vllm_deepspeed

from loop_trainer.rollout import weight_sync
from loop_trainer.rollout.vllm_backend import VLLMBackend, build_colocated_llm
from loop_trainer.rollout.weight_sync import WeightSync, probe_token_ids

deepspeed = pytest.importorskip("deepspeed")

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}


@pytest.fixture(scope="module")
def engine(vault):
    # One engine for the module: building another re-creates vLLM's process groups, and a second
    # DeepSpeed engine in the process would then broadcast over a stale group.
    _, _, _, path = vault
    return build_colocated_llm(
        path, dtype="float32", max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.5, lora_rank=8
    )


@pytest.fixture()
def gathers(monkeypatch):
    """Parameter counts of each gather weight sync makes."""
    sizes: list[int] = []
    original = weight_sync._gathered

    def recording(params):
        sizes.append(sum(getattr(p, "ds_numel", p.numel()) for p in params))
        return original(params)

    monkeypatch.setattr(weight_sync, "_gathered", recording)
    return sizes


def _zero3(model):
    deepspeed.init_distributed(dist_backend="gloo")
    trainable = [p for p in model.parameters() if p.requires_grad]
    wrapped, *_ = deepspeed.initialize(model=model, config=DS_CONFIG, model_parameters=trainable)
    assert all(hasattr(p, "ds_id") and p.data.numel() == 0 for p in model.parameters())  # really partitioned

    def logprobs(ids):
        with torch.no_grad():
            logits = wrapped(torch.tensor([ids])).logits.float()
        return logits.log_softmax(-1)[0, :-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)

    return wrapped, logprobs


def test_full_weights_stream_one_layer_at_a_time_from_zero3(vault, engine, gathers, tmp_path):
    _, model, tokenizer, _ = vault
    trained = type(model)(model.config)
    trained.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    total = sum(p.numel() for p in trained.parameters())
    largest_layer = sum(p.numel() for p in trained.model.layers[0].parameters())
    _, logprobs = _zero3(trained)
    backend = VLLMBackend(engine, stop_token_ids=[tokenizer.eos_token_id])
    sync = WeightSync(
        trained, backend, logprobs, probe_token_ids(len(tokenizer), 48), tolerance=1e-3, workdir=str(tmp_path)
    )
    assert sync.compare()[0] > 1e-2
    gathers.clear()
    assert sync(1).logprob_diff_max <= 1e-3
    assert max(gathers) <= largest_layer < total / 2  # never more than one layer materialised
    assert sum(gathers) == total + trained.get_input_embeddings().weight.numel()  # + the tied lm_head
    # Put the engine's base weights back for the LoRA test.
    restore = WeightSync(
        model,
        backend,
        lambda ids: logprobs_of(model, ids),
        probe_token_ids(len(tokenizer), 48),
        tolerance=1e-3,
        workdir=str(tmp_path / "restore"),
    )
    assert restore(2).logprob_diff_max <= 1e-3


def test_lora_sync_gathers_only_the_adapter_from_zero3(vault, engine, gathers, tmp_path):
    _, model, tokenizer, _ = vault
    base = type(model)(model.config)
    base.load_state_dict(model.state_dict())
    peft_model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    adapter = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    _, logprobs = _zero3(peft_model)
    backend = VLLMBackend(engine, stop_token_ids=[tokenizer.eos_token_id])
    sync = WeightSync(
        peft_model, backend, logprobs, probe_token_ids(len(tokenizer), 48), tolerance=1e-3, workdir=str(tmp_path)
    )
    assert sync.compare()[0] > 1e-2  # the engine still serves the base model
    gathers.clear()
    assert sync(1).logprob_diff_max <= 1e-3
    assert gathers == [adapter]  # one gather, of the adapter alone: no base weight was materialised
