"""The transformers backend's parts (static slots, a compiled step, the merged adapter): resolved in one
place, on by default with CUDA where they apply, off on a CPU, refused in one line where asked for and
impossible; built by one builder; and the weights version every cache is keyed by, bumped by the
generator's sync and shared by the evaluation backend. The resolver is pure, so the GPU cases run here."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model

from loop_trainer.rollout import TransformersSamplingSettings, build_transformers_backend
from loop_trainer.rollout.sampling_parts import (
    COMPILE_NEEDS_STATIC,
    MERGE_NEEDS_WHOLE_WEIGHTS,
    SamplingPartsError,
    resolve_sampling_parts,
)
from support.prefix_episodes import opening

AUTO = TransformersSamplingSettings()
NO_LORA = "merge_adapter_for_sampling needs a LoRA adapter on the policy (set lora_r, or pass a peft_config), or set it"


def parts(resolved):
    s = resolved.settings
    return s.static_decode, s.compile_decode_step, s.merge_adapter


def test_by_default_every_part_is_on_with_cuda_and_off_on_a_cpu():
    on_gpu = resolve_sampling_parts(AUTO, device_is_cuda=True)
    assert parts(on_gpu) == (True, True, True) and on_gpu.notes == () and on_gpu.compile_falls_back
    on_cpu = resolve_sampling_parts(AUTO, device_is_cuda=False, merge_problem=NO_LORA)
    assert parts(on_cpu) == (False, False, False) and on_cpu.notes == () and not on_cpu.compile_falls_back


def test_a_default_part_that_cannot_apply_is_off_with_one_note():
    zero3 = resolve_sampling_parts(AUTO, device_is_cuda=True, zero3=True)
    assert parts(zero3) == (False, False, False)  # a ZeRO-3 forward gathers its weights: no graph, no merge
    assert zero3.notes == (
        "static_decode and compile_decode_step off: ZeRO-3 gathers the weights at every forward",
        "merge_adapter_for_sampling off: ZeRO-3 partitions the weights it would merge",
    )
    bare = resolve_sampling_parts(AUTO, device_is_cuda=True, merge_problem=NO_LORA)
    assert parts(bare) == (True, True, False) and len(bare.notes) == 1 and NO_LORA in bare.notes[0]
    no_triton = resolve_sampling_parts(AUTO, device_is_cuda=True, compile_problem="torch.compile needs triton")
    assert parts(no_triton) == (True, False, True) and not no_triton.compile_falls_back
    assert no_triton.notes == ("compile_decode_step off: torch.compile needs triton",)
    for resolved in (zero3, bare, no_triton):
        assert all("\n" not in note for note in resolved.notes)


def test_a_part_set_false_is_off_and_compile_follows_static():
    off = TransformersSamplingSettings(static_decode=False, compile_decode_step=False, merge_adapter=False)
    assert parts(resolve_sampling_parts(off, device_is_cuda=True)) == (False, False, False)
    no_static = TransformersSamplingSettings(static_decode=False)
    resolved = resolve_sampling_parts(no_static, device_is_cuda=True)
    assert parts(resolved) == (False, False, True) and resolved.notes == ()  # the compiled step is static's


def test_a_part_set_true_is_on_anywhere_or_refused_in_one_line():
    wanted = TransformersSamplingSettings(static_decode=True, compile_decode_step=True, merge_adapter=True)
    resolved = resolve_sampling_parts(wanted, device_is_cuda=False)
    assert parts(resolved) == (True, True, True) and not resolved.compile_falls_back  # asked for: never silently off
    cases = [
        (TransformersSamplingSettings(compile_decode_step=True, static_decode=False), {}, COMPILE_NEEDS_STATIC),
        (TransformersSamplingSettings(compile_decode_step=True), {"device_is_cuda": False}, COMPILE_NEEDS_STATIC),
        (TransformersSamplingSettings(merge_adapter=True), {"zero3": True}, MERGE_NEEDS_WHOLE_WEIGHTS),
        (TransformersSamplingSettings(merge_adapter=True), {"merge_problem": NO_LORA}, NO_LORA),
        (
            TransformersSamplingSettings(compile_decode_step=True),
            {"compile_problem": "torch.compile needs triton"},
            "compile_decode_step: torch.compile needs triton: set compile_decode_step: false",
        ),
    ]
    for settings, facts, message in cases:
        with pytest.raises(SamplingPartsError) as error:
            resolve_sampling_parts(settings, **{"device_is_cuda": True, **facts})
        assert str(error.value) == message and "\n" not in message


def test_the_builder_resolves_the_parts_for_the_models_device(vault_tiny, caplog):
    env, model, tok = vault_tiny
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    policy = get_peft_model(model, config)
    try:
        common = {"stop_token_ids": [], "pad_token_id": tok.pad_token_id}
        on_cpu = build_transformers_backend(policy, **common)
        assert (on_cpu.static_decode, on_cpu.compile_decode_step, on_cpu.merged_adapter) == (False, False, None)
        # a CUDA device (only resolved here, nothing decodes): the fast path, the adapter merged
        with caplog.at_level("INFO"):
            on_gpu = build_transformers_backend(policy, device=torch.device("cuda"), **common)
        assert on_gpu.static_decode and on_gpu.merged_adapter is not None
        notes = [r.getMessage() for r in caplog.records if "compile_decode_step" in r.getMessage()]
        assert on_gpu.compile_decode_step == (not notes) and on_gpu.compile_falls_back == on_gpu.compile_decode_step
        view = on_gpu.with_temperature(0.0)
        assert view.merged_adapter is on_gpu.merged_adapter and view.static_decode and view.temperature == 0.0
        with pytest.raises(SamplingPartsError, match="ZeRO-3"):
            build_transformers_backend(policy, TransformersSamplingSettings(merge_adapter=True), zero3=True, **common)
    finally:
        policy.unload()
    with pytest.raises(SamplingPartsError, match="set lora_r"):
        build_transformers_backend(model, TransformersSamplingSettings(merge_adapter=True), **common)


def _generator(model, tok, tmp_path, zero_stage=None, **keys):
    from loop_trainer import LOOPConfig
    from loop_trainer.rollout.generator import build_generator
    from loop_trainer.training.settings import generator_settings

    args = LOOPConfig(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none", **keys)
    settings = dataclasses.replace(generator_settings(args), zero_stage=zero_stage)  # as the trainer gives it
    common = {"stop_token_ids": [], "tokenizer": tok, "process_index": 0, "is_main_process": True}
    return build_generator(settings, model, barrier=lambda: None, probe_scorer=None, **common)


def test_sync_bumps_the_weights_version_the_evaluation_backend_shares(vault_tiny, tmp_path):
    env, model, tok = vault_tiny
    generator = _generator(model, tok, tmp_path)
    backend, evaluation = generator.backend, generator.for_evaluation(0.0)
    assert backend.weights_version == evaluation.weights_version == 0
    generator.sync(0)  # the first iteration: the generator was behind
    assert backend.weights_version == evaluation.weights_version == 1
    generator.sync(0)  # before an evaluation, on the same policy: nothing changed
    assert backend.weights_version == 1
    generator.sync(1)
    evaluation.weights_changed()  # code that changes the weights itself says so, on any of the two
    assert backend.weights_version == evaluation.weights_version == 3
    assert backend.counters is not evaluation.counters  # each decode loop counts its own work


def test_the_merged_adapter_follows_the_synced_version_not_the_tensors(vault_tiny, tmp_path):
    env, model, tok = vault_tiny
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    policy = get_peft_model(model, config)
    try:
        generator = _generator(policy, tok, tmp_path, merge_adapter_for_sampling=True)
        backend, merged = generator.backend, generator.backend.merged_adapter
        prompt = opening(tok, "ann")
        generator.sync(0)
        backend.sample([prompt], [2], [1])
        lora_b = next(p for name, p in policy.named_parameters() if "lora_B" in name)
        with torch.no_grad():
            lora_b.mul_(3.0)  # the update, in place
        backend.sample([prompt], [2], [1])
        assert merged.num_refreshes == 1  # nobody said the weights changed: torch's tensor versions are not read
        generator.sync(1)  # the next iteration
        generator.for_evaluation(0.0).sample([prompt], [2], [1])  # the evaluation view merges the new weights
        assert merged.num_refreshes == 2
        reply = backend.sample([prompt], [3], [7])[0]
        expected = _generator(policy, tok, tmp_path).backend.sample([prompt], [3], [7])[0]
        assert reply.token_ids == expected.token_ids
        assert torch.allclose(torch.tensor(reply.logprobs), torch.tensor(expected.logprobs), atol=1e-5)
        assert merged.num_refreshes == 2
    finally:
        policy.unload()


def test_zero3_refuses_a_merge_asked_for(vault_tiny, tmp_path):
    from loop_trainer.rollout.generator import GeneratorConfigError

    env, model, tok = vault_tiny
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    policy = get_peft_model(model, config)
    try:
        with pytest.raises(GeneratorConfigError, match="ZeRO-3 partitions them") as error:
            _generator(policy, tok, tmp_path, zero_stage=3, merge_adapter_for_sampling=True)
        assert "\n" not in str(error.value)
        assert _generator(policy, tok, tmp_path, zero_stage=2, merge_adapter_for_sampling=True).backend.merged_adapter
    finally:
        policy.unload()
