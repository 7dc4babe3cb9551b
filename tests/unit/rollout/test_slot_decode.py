"""``static_decode``: the running rows' decode steps on fixed-shape slots (one CUDA graph per step on
a GPU; eager here). It may not change what is sampled: every reply equals the same seeded request
decoded by the dynamic batch, across joins, turns, shared openings, a growing capacity, a weight
update and a LoRA-wrapped model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model

from loop_trainer.rollout.slot_decode import MIN_CAPACITY, SlotDecoder
from support.prefix_episodes import assert_same, backend_for, opening, run_episodes


def test_slots_sample_what_the_dynamic_batch_does_across_joins_turns_and_shared_openings(vault_tiny):
    env, model, tok = vault_tiny
    tasks = ["ann", "bob"]
    # 4 slots for 6 episodes: rows join as others finish, second turns extend their first turn's cache
    static = backend_for(model, tok, max_batch_size=4, static_decode=True)
    replies = run_episodes(static, tok, tasks, 3)
    assert_same(replies, run_episodes(backend_for(model, tok, max_batch_size=4), tok, tasks, 3))
    assert static.num_reused_tokens > 0 and static.num_shared_tokens > 0
    slots = static.slot_decoder(torch.device("cpu"))
    assert slots.capacity == MIN_CAPACITY and slots.num_captures == 0  # eager on the CPU: no graph


def test_a_long_prompt_joining_grows_the_slots_and_keeps_the_running_rows(vault_tiny):
    env, model, tok = vault_tiny
    short = opening(tok, "ann")
    long = opening(tok, "bob") * (MIN_CAPACITY // len(opening(tok, "bob")) + 1)  # over the first capacity
    prompts, limits, seeds = [short, short, long], [3, 12, 5], [1, 2, 3]
    static = backend_for(model, tok, max_batch_size=2, static_decode=True)
    replies = static.sample(prompts, limits, seeds)
    expected = backend_for(model, tok, max_batch_size=2).sample(prompts, limits, seeds)
    for got, want in zip(replies, expected, strict=True):
        assert got.token_ids == want.token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
    slots = static.slot_decoder(torch.device("cpu"))
    assert slots.capacity == 2 * MIN_CAPACITY and sorted(slots.free) == [0, 1]


def test_a_weight_update_between_turns_is_seen_by_the_slots(vault_tiny):
    env, model, tok = vault_tiny
    weight = next(model.parameters())
    original = weight.detach().clone()

    async def update():
        with torch.no_grad():
            weight.mul_(1.5)  # in place, like AdamW's step: the slots (and a graph) read the new values

    def episodes(backend):
        try:
            return run_episodes(backend, tok, ["ann"], 2, update_between_turns=update)
        finally:
            with torch.no_grad():
                weight.copy_(original)

    replies = episodes(backend_for(model, tok, static_decode=True))
    assert_same(replies, episodes(backend_for(model, tok)))


def test_a_lora_wrapped_policy_decodes_the_same_on_slots(vault_tiny):
    env, model, tok = vault_tiny
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    policy = get_peft_model(model, config)
    try:
        static = run_episodes(backend_for(policy, tok, max_batch_size=3, static_decode=True), tok, ["ann", "bob"], 2)
        assert_same(static, run_episodes(backend_for(policy, tok, max_batch_size=3), tok, ["ann", "bob"], 2))
    finally:
        policy.unload()


def test_slots_are_reused_and_a_replaced_parameter_rebuilds_them(vault_tiny):
    env, model, tok = vault_tiny
    backend = backend_for(model, tok, static_decode=True)
    first = backend.slot_decoder(torch.device("cpu"))
    assert backend.slot_decoder(torch.device("cpu")) is first  # kept across collections
    weight = next(model.parameters())
    original = weight.data
    weight.data = original.clone()  # a new storage: a captured graph would read the old one
    try:
        assert backend.slot_decoder(torch.device("cpu")) is not first
    finally:
        weight.data = original


@pytest.mark.parametrize("columns, capacity", [(1, MIN_CAPACITY), (MIN_CAPACITY, MIN_CAPACITY), (257, 512)])
def test_capacity_is_the_next_power_of_two(vault_tiny, columns, capacity):
    env, model, tok = vault_tiny
    slots = SlotDecoder(model, 2, torch.device("cpu"), cuda_graphs=True)
    slots.reserve(columns)
    assert slots.capacity == capacity and slots.cuda_graphs is False  # graphs only on CUDA
    assert slots.keys[0].shape == (2, model.config.num_key_value_heads, capacity, slots.head_dim)


def test_static_decode_is_a_recipe_key_the_generator_honours_and_refuses_with_vllm(vault_tiny, tmp_path):
    from loop_trainer import LOOPConfig
    from loop_trainer.rollout.generator import build_generator
    from loop_trainer.training.settings import generator_settings

    env, model, tok = vault_tiny
    common = {"stop_token_ids": [], "tokenizer": tok, "process_index": 0, "is_main_process": True}
    common |= {"barrier": lambda: None, "probe_scorer": None}
    args = LOOPConfig(output_dir=str(tmp_path / "run"), static_decode=True, use_cpu=True, report_to="none")
    generator = build_generator(generator_settings(args), model, **common)
    assert generator.backend.static_decode and generator.for_evaluation(0.0).static_decode
    with pytest.raises(ValueError, match="static_decode applies to the transformers backend"):  # at config time
        LOOPConfig(output_dir=str(tmp_path / "run"), static_decode=True, use_vllm=True, use_cpu=True, report_to="none")


def test_a_compiled_step_samples_what_the_dynamic_batch_does(vault_tiny):
    env, model, tok = vault_tiny
    compiled = backend_for(model, tok, max_batch_size=3, static_decode=True, compile_decode_step=True)
    replies = run_episodes(compiled, tok, ["ann", "bob"], 2)
    assert_same(replies, run_episodes(backend_for(model, tok, max_batch_size=3), tok, ["ann", "bob"], 2))
    slots = compiled.slot_decoder(torch.device("cpu"))
    assert slots.compile_step and slots._compiled is not None  # the steps ran through torch.compile
    assert compiled.with_temperature(0.0).compile_decode_step  # evaluation decodes the same way


def test_compile_decode_step_without_static_decode_is_refused_in_one_line(vault_tiny, tmp_path):
    from loop_trainer import LOOPConfig
    from loop_trainer.cli.evaluate import EvalArguments
    from loop_trainer.cli.recipe import RecipeError
    from loop_trainer.rollout.generator import GeneratorConfigError, build_generator
    from loop_trainer.training.settings import generator_settings

    env, model, tok = vault_tiny
    with pytest.raises(ValueError, match="set static_decode: true"):
        backend_for(model, tok, compile_decode_step=True)
    common = {"stop_token_ids": [], "tokenizer": tok, "process_index": 0, "is_main_process": True}
    common |= {"barrier": lambda: None, "probe_scorer": None}
    for static in (False, None):  # unset, static_decode is off on a CPU
        with pytest.raises(ValueError, match="LOOPConfig: compile_decode_step .*set static_decode: true") as error:
            LOOPConfig(output_dir=str(tmp_path / "run"), compile_decode_step=True, static_decode=static, report_to=[])
        assert "\n" not in str(error.value)
    # a generator built from settings alone resolves the parts itself, and refuses the same way
    settings = generator_settings(LOOPConfig(output_dir=str(tmp_path / "run"), report_to=[]))
    with pytest.raises(GeneratorConfigError, match="set static_decode: true"):
        build_generator(dataclasses.replace(settings, compile_decode_step=True), model, **common)
    with pytest.raises(RecipeError, match="set static_decode: true"):
        EvalArguments(environment="vault", output_dir=str(tmp_path / "eval"), compile_decode_step=True)


def test_a_failing_compile_falls_back_to_the_plain_step_only_when_it_was_not_asked_for(vault_tiny, monkeypatch, caplog):
    from loop_trainer.rollout import TransformersBackend

    env, model, tok = vault_tiny

    def broken_compile(function, **kwargs):
        def compiled(*args, **kw):
            raise RuntimeError("the compiler failed")

        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    prompts, limits, seeds = [opening(tok, "ann"), opening(tok, "bob")], [3, 5], [1, 2]
    asked = backend_for(model, tok, static_decode=True, compile_decode_step=True)
    with pytest.raises(RuntimeError, match="the compiler failed"):
        asked.sample(prompts, limits, seeds)  # compile_decode_step: true is required: its failure reaches the rows
    by_default = TransformersBackend(  # as build_transformers_backend makes it on a GPU by default
        model,
        stop_token_ids=[],
        pad_token_id=tok.pad_token_id,
        static_decode=True,
        compile_decode_step=True,
        compile_falls_back=True,
    )
    with caplog.at_level("WARNING"):
        replies = by_default.sample(prompts, limits, seeds)
    monkeypatch.undo()
    for got, want in zip(replies, backend_for(model, tok).sample(prompts, limits, seeds), strict=True):
        assert got.token_ids == want.token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
    slots = by_default.slot_decoder(torch.device("cpu"))
    assert not slots.compile_step and slots.compile_error == "RuntimeError: the compiler failed"
    assert [r.getMessage() for r in caplog.records if "compile_decode_step" in r.getMessage()] == [
        "compile_decode_step: torch.compile failed, the step runs uncompiled: RuntimeError: the compiler failed"
    ]
