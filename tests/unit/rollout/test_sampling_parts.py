"""The transformers backend's parts (static slots, a compiled step, the merged adapter): resolved in one
place, on by default with CUDA where they apply, off on a CPU, refused in one line where asked for and
impossible. The resolver is pure, so the GPU cases run here."""

from __future__ import annotations

import pytest

from loop_trainer.rollout.sampling_parts import (
    COMPILE_NEEDS_STATIC,
    MERGE_NEEDS_WHOLE_WEIGHTS,
    SamplingPartsError,
    TransformersSamplingSettings,
    resolve_sampling_parts,
)

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
    assert parts(zero3) == (True, True, False)
    assert zero3.notes == ("merge_adapter_for_sampling off: ZeRO-3 partitions the weights it would merge",)
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
