"""``merge_adapter_for_sampling``: the decode loop runs a view of the policy whose LoRA layers are plain
linear layers holding ``W + scale * B @ A``. It must sample the policy's distribution (up to the
merge's rounding), follow in-place weight updates, never touch the training model, and be refused
where it cannot apply."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from loop_trainer.rollout.merged_adapter import MergedAdapter, MergedAdapterError
from support.prefix_episodes import assert_same, backend_for, opening, run_episodes


@pytest.fixture
def lora_policy(vault_tiny):
    env, model, tok = vault_tiny
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    policy = get_peft_model(model, config)
    yield policy, tok
    policy.unload()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_the_merged_view_computes_the_policy_and_shares_every_other_tensor(lora_policy):
    policy, tok = lora_policy
    merged = MergedAdapter(policy)
    merged.refresh(0)
    ids = opening(tok, "ann")
    assert torch.allclose(_logits(merged.model, ids), _logits(policy, ids), atol=1e-5)
    own = {id(p) for p in merged.model.parameters()} - {id(p) for p in policy.parameters()}
    assert len(own) == len(merged._pairs) == 7 * policy.config.num_hidden_layers  # only the merged weights
    assert not any("lora" in name for name, _ in merged.model.named_parameters())
    assert merged.extra_bytes() == sum(m.numel() * m.element_size() for _, m in merged._pairs)


def test_the_merged_view_runs_no_lora_layer_even_under_the_fused_log_prob_head(vault_tiny):
    from trl.trainer import add_fused_lm_head

    env, model, tok = vault_tiny
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))  # as wrap_for_training does
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    policy = get_peft_model(model, config)
    calls = []
    hooks = [
        module.register_forward_hook(lambda *_: calls.append(1))
        for name, module in policy.named_modules()
        if name.endswith("lora_A.default")
    ]
    try:
        merged = MergedAdapter(policy)
        merged.refresh(0)
        ids = opening(tok, "ann")
        merged_logits = _logits(merged.model, ids)
        assert calls == []  # the fused head's patched forward would have run the policy itself
        assert torch.allclose(merged_logits, _logits(policy, ids), atol=1e-5) and len(calls) == len(hooks)
    finally:
        for hook in hooks:
            hook.remove()
        policy.unload()


def test_sampling_with_the_merged_adapter_gives_the_policys_replies_and_leaves_it_untouched(lora_policy):
    policy, tok = lora_policy
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    for static in (False, True):
        merged = backend_for(policy, tok, max_batch_size=3, static_decode=static, merge_adapter=True)
        replies = run_episodes(merged, tok, ["ann", "bob"], 2)
        assert_same(replies, run_episodes(backend_for(policy, tok, max_batch_size=3), tok, ["ann", "bob"], 2))
        assert merged.merged_adapter is not None and merged.merged_adapter.num_refreshes == 1
    for name, p in policy.named_parameters():
        assert torch.equal(p, before[name]), name  # bitwise: the training model is never merged into


def test_an_in_place_update_is_merged_at_the_next_decode_loop_into_the_same_storage(lora_policy):
    policy, tok = lora_policy
    merged = MergedAdapter(policy)
    merged.refresh(0)
    pointers = [m.data_ptr() for _, m in merged._pairs]
    merged.refresh(0)
    assert merged.num_refreshes == 1  # unchanged weights (the same version): nothing recomputed
    lora_b = next(p for name, p in policy.named_parameters() if "lora_B" in name)
    with torch.no_grad():
        lora_b.mul_(3.0)  # in place, as AdamW's step; its changer bumps the version
    ids = opening(tok, "bob")
    assert not torch.allclose(_logits(merged.model, ids), _logits(policy, ids), atol=1e-3)  # stale until refreshed
    merged.refresh(1)
    assert merged.num_refreshes == 2 and [m.data_ptr() for _, m in merged._pairs] == pointers  # a graph stays valid
    assert torch.allclose(_logits(merged.model, ids), _logits(policy, ids), atol=1e-5)


def test_bf16_weights_are_merged_in_float32_and_rounded_once(vault_tiny):
    env, model, tok = vault_tiny
    model = model.to(torch.bfloat16)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.0, init_lora_weights=False)
    policy = get_peft_model(model, config, autocast_adapter_dtype=True)  # float32 adapter on bf16 weights
    try:
        merged = MergedAdapter(policy)
        merged.refresh(0)
        lora, weight = merged._pairs[0]
        expected = (lora.get_base_layer().weight.float() + lora.get_delta_weight("default").float()).bfloat16()
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, expected)
    finally:
        policy.unload()
        model.float()


def test_a_policy_placed_after_the_copy_was_made_is_followed_at_the_next_refresh(vault_tiny):
    # DeepSpeed places and casts the model after the generator (and this copy) is built: the shared tensors move
    # with the policy, the merged ones must follow before they are sampled with.
    env, model, tok = vault_tiny
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.0, init_lora_weights=False)
    policy = get_peft_model(model, config, autocast_adapter_dtype=False)
    try:
        merged = MergedAdapter(policy)
        policy.to(torch.bfloat16)
        merged.refresh(0)
        lora, weight = merged._pairs[0]
        sampled = merged.model.get_submodule(merged_name(merged)).weight
        assert weight.dtype == torch.bfloat16 and sampled.data_ptr() == weight.data_ptr()
        expected = (lora.get_base_layer().weight.float() + lora.get_delta_weight("default").float()).bfloat16()
        assert torch.equal(weight, expected)
        ids = opening(tok, "ann")
        assert torch.allclose(_logits(merged.model, ids).float(), _logits(policy, ids).float(), atol=0.1)
    finally:
        policy.unload()
        model.float()


def merged_name(merged: MergedAdapter) -> str:
    plain = merged._plain[0]
    return next(name for name, module in merged.model.named_modules() if module is plain)


def test_policies_it_cannot_merge_are_refused_in_one_line(vault_tiny):
    from loop_trainer.cli.evaluate import sampling_backend
    from loop_trainer.cli.recipe import RecipeError
    from loop_trainer.config import EpisodeSettings

    env, model, tok = vault_tiny
    with pytest.raises(MergedAdapterError, match="needs a LoRA adapter on the policy") as error:
        MergedAdapter(model)
    assert "\n" not in str(error.value)
    dora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    try:
        with pytest.raises(MergedAdapterError, match="DoRA"):
            MergedAdapter(dora)
        with pytest.raises(RecipeError, match="DoRA"):  # evaluation refuses it too, rather than sampling unmerged
            sampling_backend(dora, tok, EpisodeSettings(merge_adapter_for_sampling=True))
    finally:
        dora.unload()
    for wanted in (True, False, None):  # a base model in evaluation samples as it is
        assert sampling_backend(model, tok, EpisodeSettings(merge_adapter_for_sampling=wanted)).merged_adapter is None


def test_merge_adapter_for_sampling_is_a_recipe_key_the_generator_honours_or_refuses(lora_policy, tmp_path):
    from loop_trainer import LOOPConfig
    from loop_trainer.envs import VaultEnv
    from loop_trainer.models.tiny import build_tiny_for_environment
    from loop_trainer.rollout.generator import GeneratorConfigError, build_generator
    from loop_trainer.training.settings import generator_settings

    policy, tok = lora_policy
    common = {"stop_token_ids": [], "tokenizer": tok, "process_index": 0, "is_main_process": True}
    common |= {"barrier": lambda: None, "probe_scorer": None}

    def config(**keys):
        return generator_settings(LOOPConfig(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none", **keys))

    generator = build_generator(config(merge_adapter_for_sampling=True), policy, **common)
    merged = generator.backend.merged_adapter
    assert merged is not None and generator.for_evaluation(0.0).merged_adapter is merged  # one copy, shared
    assert build_generator(config(), policy, **common).backend.merged_adapter is None
    with pytest.raises(ValueError, match="vLLM applies the LoRA adapter itself"):  # refused at config time
        config(merge_adapter_for_sampling=True, use_vllm=True)
    with pytest.raises(GeneratorConfigError, match="set lora_r"):
        bare, _ = build_tiny_for_environment(VaultEnv(num_tasks=2).vocabulary(), seed=0)
        build_generator(config(merge_adapter_for_sampling=True), bare, **common)
