"""The dry-run memory planner: exact parameter counts, shipped shapes, and plans that fit or refuse
with a knob to turn. No GPU, no weights, no network: parameters are counted on meta-device models."""

from __future__ import annotations

import json
import re

import pytest

from loop_trainer.models.memory_plan import plan_memory
from loop_trainer.models.model_shape import ModelShape, load_model_shape, shipped_shapes

NODE = {
    "world_size": 8,
    "gpu_memory_gib": 80,
    "zero_stage": 3,
    "activation_checkpointing": True,
    "max_training_tokens": 32000,
    "per_device_train_batch_size": 1,
}
LORA_7B = {"r": 8, "alpha": 16, "target_modules": "all-linear"}
LORA_32B = {"r": 16, "alpha": 32, "target_modules": "all-linear"}
# 32B bf16 weights (61 GiB) need TP >= 2; a TP-4 engine at 0.5 holds 12 full-length sequences and
# sleep mode frees the reservation during the update (the planner's arithmetic; the trainer colocates
# at TP 1 only, so the 32B recipe generates on a vLLM server).
VLLM_32B = {
    "use_vllm": True,
    "vllm_tensor_parallel_size": 4,
    "vllm_gpu_memory_utilization": 0.5,
    "vllm_sleep_mode": True,
}


@pytest.fixture(scope="module")
def qwen7b() -> ModelShape:
    return load_model_shape("Qwen/Qwen2.5-7B-Instruct")


@pytest.fixture(scope="module")
def qwen32b() -> ModelShape:
    return load_model_shape("Qwen/Qwen2.5-32B-Instruct")


def test_parameter_counts(qwen7b, qwen32b):
    assert qwen7b.num_params == 7_615_616_512
    assert qwen32b.num_params == 32_763_876_352
    assert abs(qwen7b.num_params / 7.62e9 - 1) < 0.01
    assert abs(qwen32b.num_params / 32.76e9 - 1) < 0.01
    assert qwen7b.head_dim == 128 and qwen7b.kv_dim == 512 and qwen32b.kv_dim == 1024


@pytest.mark.parametrize(
    "name, billions",
    [
        ("Qwen2.5-0.5B-Instruct", 0.494),
        ("Qwen2.5-1.5B-Instruct", 1.544),
        ("Qwen2.5-3B-Instruct", 3.086),
        ("Qwen2.5-14B-Instruct", 14.77),
        ("Qwen2.5-72B-Instruct", 72.71),
    ],
)
def test_other_shipped_shapes(name, billions):
    assert name in shipped_shapes()
    assert abs(load_model_shape(f"Qwen/{name}").num_params / (billions * 1e9) - 1) < 0.01


def test_lora_parameter_count(qwen7b):
    # r x (in + out) per projection per layer: q 2h, k/v h+kv, o 2h, gate/up/down h+I
    per_layer = 8 * (2 * 3584 + 2 * (3584 + 512) + 2 * 3584 + 3 * (3584 + 18944))
    assert qwen7b.lora_params(8, "all-linear") == 28 * per_layer
    assert qwen7b.lora_params(8, ["q_proj", "v_proj"]) == 28 * 8 * (2 * 3584 + 3584 + 512)
    with pytest.raises(ValueError, match="target_modules"):
        qwen7b.lora_params(8, ["lm_head"])


def test_load_from_local_directory(tmp_path):
    config = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_model_shape(str(tmp_path))
    layer = 64 * 64 + 64 + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert shape.num_params == 1000 * 64 + 2 * layer + 64  # tied: no separate lm_head


@pytest.mark.parametrize(
    "config",
    [
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 500,
            "tie_word_embeddings": False,
        },
        {
            "model_type": "phi3",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "vocab_size": 300,
            "pad_token_id": 0,
        },
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 1000,
            "tie_word_embeddings": True,
        },
    ],
    ids=lambda config: config["model_type"],
)
def test_any_architecture_counts_like_the_real_model(tmp_path, config):
    """Parameter and LoRA counts equal those of the model transformers and PEFT build (no hand
    formula per architecture: Phi-3 fuses q/k/v and gate/up, Llama has no attention biases)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_model_shape(str(tmp_path))
    values = dict(config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.embedding_params == model.get_input_embeddings().weight.numel()
    lora = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    assert shape.lora_params(4, "all-linear") == sum(p.numel() for p in lora.parameters() if p.requires_grad)


def test_dry_run_tiny_config_and_unknown_architecture(tmp_path):
    from loop_trainer.models.tiny import tiny_config

    shape = ModelShape.from_config(tiny_config(vocab_size=1024).to_dict(), "tiny:vault")
    assert shape.num_hidden_layers == 2 and shape.num_params > 0
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture", "hidden_size": 8}))
    with pytest.raises(ValueError, match="model_type 'no-such-architecture'") as error:
        load_model_shape(str(tmp_path))
    assert "\n" not in str(error.value)


def test_unknown_model_error(tmp_path):
    with pytest.raises(ValueError) as error:
        load_model_shape("someorg/Unknown-13B")
    message = str(error.value)
    assert "\n" not in message and "Qwen2.5-7B-Instruct" in message and "config.json" in message
    with pytest.raises(ValueError, match="config.json"):
        load_model_shape(str(tmp_path))  # a directory without config.json


def test_7b_lora_node_with_colocated_vllm_fits(qwen7b):
    for utilization in (0.3, 0.35, 0.4):
        plan = plan_memory(qwen7b, lora=LORA_7B, use_vllm=True, vllm_gpu_memory_utilization=utilization, **NODE)
        assert plan.fits, plan.format()
        assert plan.vllm_sequences >= 5
        # colocated without sleep mode: the reservation stays during the update
        assert plan.peak_gib == pytest.approx(plan.training_gib + utilization * 80)
    text = plan.format()
    assert text.rstrip().endswith("FITS") and "vLLM reservation" in text and "recomputed layer" in text


def test_32b_refuses_tp1_at_0_4(qwen32b):
    plan = plan_memory(
        qwen32b, lora=LORA_32B, use_vllm=True, vllm_tensor_parallel_size=1, vllm_gpu_memory_utilization=0.4, **NODE
    )
    assert not plan.fits
    assert any("exceed" in r and "vllm_gpu_memory_utilization >= 0.87" in r for r in plan.reasons)
    # no share of one GPU holds the weights and a sequence under the budget: generate on a server of its own
    assert plan.fix.changes == {"use_vllm": False, "vllm_server": True} and plan.fix.plan.fits
    # TP 2 at 0.4: the weights fit but not one 32k-token sequence
    plan = plan_memory(
        qwen32b,
        lora=LORA_32B,
        use_vllm=True,
        vllm_tensor_parallel_size=2,
        vllm_gpu_memory_utilization=0.4,
        vllm_sleep_mode=True,
        **NODE,
    )
    assert not plan.fits and any("less than one" in r for r in plan.reasons)
    assert plan.fix.changes == {"vllm_gpu_memory_utilization": 0.44} and plan.fix.plan.fits


def test_32b_lora_recipe_setting_fits(qwen32b):
    plan = plan_memory(qwen32b, lora=LORA_32B, **VLLM_32B, **NODE)
    assert plan.fits, plan.format()
    assert plan.vllm_sequences >= 8
    assert plan.peak_gib == pytest.approx(max(plan.training_gib, plan.generation_gib))
    # without sleep mode the reservation stacks on the update; sleep mode is the fix (a smaller share would
    # hold fewer sequences)
    awake = plan_memory(qwen32b, lora=LORA_32B, **{**VLLM_32B, "vllm_sleep_mode": False}, **NODE)
    assert not awake.fits and awake.fix.changes == {"vllm_sleep_mode": True}


def test_32b_full_finetuning_on_one_gpu_refused(qwen32b):
    plan = plan_memory(qwen32b, **{**NODE, "world_size": 1})
    assert not plan.fits
    # full fine-tuning of 32B keeps 18 B/param: only more GPUs fit it (an adapter alone does not fit one GPU)
    assert plan.fix.changes["world_size"] > 1 and plan.fix.plan.fits
    assert "DOES NOT FIT" in plan.format() and "fits with these changes together: world_size: " in plan.format()


def test_7b_long_context_without_checkpointing_refused(qwen7b):
    plan = plan_memory(
        qwen7b,
        lora=LORA_7B,
        **{**NODE, "world_size": 1, "activation_checkpointing": False, "max_training_tokens": 131072},
    )
    assert not plan.fits and plan.fix.plan.fits
    assert any("max_position_embeddings" in n for n in plan.notes)


def test_activation_formula_and_knobs(qwen7b):
    base = plan_memory(qwen7b, lora=LORA_7B, **NODE)
    rows = {r.name: r.gib for r in base.rows}
    tokens, h, kv, i = 32000, 3584, 512, 18944
    assert rows["checkpointed layer inputs"] == pytest.approx(28 * tokens * h * 2 / 2**30)
    assert rows["recomputed layer (backward)"] == pytest.approx(tokens * (8 * h + 3 * kv + 4 * i) * 2 * 1.75 / 2**30)
    # TRL's fused head: one 4096 x 32768 bf16 tile, the scored hidden states (bf16 copy + fp32 grad), 40 B/token
    assert rows["log-prob working memory"] == pytest.approx((4096 * 32768 * 2 + tokens * (h * 6 + 40)) / 2**30)
    allocated = sum(
        r.gib for r in base.rows if "train" in r.phases and r.name not in ("CUDA context", "allocator fragmentation")
    )
    assert rows["allocator fragmentation"] == pytest.approx(0.05 * allocated)
    doubled = plan_memory(qwen7b, lora=LORA_7B, **{**NODE, "per_device_train_batch_size": 2})
    assert doubled.training_gib > base.training_gib
    # the fix's max_training_tokens is the most that fits (with sleep mode, the cheaper lever it needs as well)
    one_gpu = {
        **NODE,
        "world_size": 1,
        "use_vllm": True,
        "vllm_gpu_memory_utilization": 0.3,
        "max_trajectory_tokens": 32000,
    }
    plan = plan_memory(qwen7b, lora=LORA_7B, **{**one_gpu, "max_training_tokens": 131072})
    assert plan.fix.changes == {"max_training_tokens": 91392, "vllm_sleep_mode": True}
    fixed = {**one_gpu, **plan.fix.changes}
    assert plan_memory(qwen7b, lora=LORA_7B, **fixed).fits
    assert not plan_memory(qwen7b, lora=LORA_7B, **{**fixed, "max_training_tokens": 91392 + 256}).fits


def test_transformers_backend_generation_counts_kv_cache(qwen7b):
    plan = plan_memory(qwen7b, lora=LORA_7B, generation_batch=4, **NODE)
    kv = next(r for r in plan.rows if r.name == "generation KV cache")
    assert kv.gib == pytest.approx(4 * 32000 * 2 * 28 * 4 * 128 * 2 / 2**30)
    assert plan.peak_gib == max(plan.training_gib, plan.generation_gib)
    big = plan_memory(qwen7b, lora=LORA_7B, generation_batch=64, **NODE)
    assert not big.fits and big.fix.changes == {"generation_batch": 12}  # the largest batch that fits
    assert not plan_memory(qwen7b, lora=LORA_7B, generation_batch=13, **NODE).fits


def test_invalid_tensor_parallel_size(qwen7b):
    with pytest.raises(ValueError, match="divide"):
        plan_memory(qwen7b, use_vllm=True, vllm_tensor_parallel_size=3, **NODE)


def test_activation_offloading_keeps_only_the_offloaders_stash_of_layer_inputs(qwen7b):
    from loop_trainer.models.memory_plan import OFFLOAD_STASH_LAYERS

    base = plan_memory(qwen7b, lora=LORA_7B, **NODE)
    offloaded = plan_memory(qwen7b, lora=LORA_7B, **NODE, activation_offloading=True)
    layer_input = 32000 * 3584 * 2 / 2**30
    assert {r.name: r.gib for r in base.rows}["checkpointed layer inputs"] == pytest.approx(28 * layer_input)
    row = next(r for r in offloaded.rows if r.name.startswith("checkpointed layer inputs"))
    assert "offloaded" in row.name and row.gib == pytest.approx((OFFLOAD_STASH_LAYERS + 1) * layer_input)
    assert base.training_gib - offloaded.training_gib > (28 - OFFLOAD_STASH_LAYERS - 1) * layer_input
    long = {**NODE, "world_size": 1, "max_training_tokens": 131072, "max_trajectory_tokens": 32000}
    long_vllm = {**long, "max_training_tokens": 100000, "use_vllm": True, "vllm_sleep_mode": True}
    too_long = plan_memory(qwen7b, lora=LORA_7B, **long_vllm)
    assert not too_long.fits and too_long.fix.changes == {"activation_offloading": True}
    offloaded_long = plan_memory(qwen7b, lora=LORA_7B, **long, activation_offloading=True)
    assert "activation_offloading" not in offloaded_long.fix.changes  # already on: not proposed


def test_every_n_layers_keeps_the_other_layers_activations(qwen7b):
    """transformers checkpoints the layers whose index is a multiple of every_n_layers: ceil(28 / n) of the
    7B's 28 keep only their input, the rest all their activations, as without checkpointing."""
    tokens, h, kv, i = 32000, 3584, 512, 18944
    layer_input, layer_whole = tokens * h * 2 / 2**30, tokens * (8 * h + 3 * kv + 4 * i) * 2 / 2**30
    every = {n: plan_memory(qwen7b, lora=LORA_7B, **NODE, checkpoint_every_n_layers=n) for n in (1, 2, 4, 28, 64)}
    assert not any(r.name.startswith("activations of the layers not") for r in every[1].rows)
    for n, checkpointed in ((2, 14), (4, 7), (28, 1), (64, 1)):
        rows = {r.name: r.gib for r in every[n].rows}
        assert rows["checkpointed layer inputs"] == pytest.approx(checkpointed * layer_input)
        assert rows["activations of the layers not checkpointed"] == pytest.approx((28 - checkpointed) * layer_whole)
    trained = [every[n].training_gib for n in (1, 2, 4, 28)]
    assert trained == sorted(trained) and trained[0] < trained[-1]
    uncheckpointed = plan_memory(qwen7b, lora=LORA_7B, **{**NODE, "activation_checkpointing": False})
    assert every[28].training_gib < uncheckpointed.training_gib  # one layer still checkpointed
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="checkpoint_every_n_layers must be a whole number"):
            plan_memory(qwen7b, lora=LORA_7B, **NODE, checkpoint_every_n_layers=bad)


def test_a_plan_that_does_not_fit_with_every_n_layers_is_fixed_by_checkpointing_every_layer(qwen7b):
    one_gpu = {**NODE, "world_size": 1, "max_training_tokens": 16000, "max_trajectory_tokens": 16000}
    one_gpu = {**one_gpu, "vllm_server": True}  # training alone on the GPU
    assert plan_memory(qwen7b, lora=LORA_7B, **one_gpu).fits
    shorter = {**one_gpu, "max_training_tokens": 8000}
    assert plan_memory(qwen7b, lora=LORA_7B, **shorter, checkpoint_every_n_layers=2).fits
    plan = plan_memory(qwen7b, lora=LORA_7B, **one_gpu, checkpoint_every_n_layers=2)
    assert not plan.fits and plan.fix.changes == {"checkpoint_every_n_layers": 1} and plan.fix.plan.fits
    # without checkpointing, the lever that turns it on checkpoints every layer, whatever every_n_layers said
    unchecked = {**one_gpu, "activation_checkpointing": False}
    off = plan_memory(qwen7b, lora=LORA_7B, **unchecked, checkpoint_every_n_layers=2)
    assert off.fix.changes == {"activation_checkpointing": True, "checkpoint_every_n_layers": 1} and off.fix.plan.fits


# --- the fix: settings that together fit ----------------------------------------------------------------------
def _sweep() -> list[tuple]:
    """Plans that do not fit, across models, GPU sizes, world sizes, engines and training lengths (a fixed
    slice of the product, to stay fast)."""
    engines = [
        {"use_vllm": True, "vllm_gpu_memory_utilization": u, "vllm_sleep_mode": sleep}
        for u in (0.1, 0.35, 0.9)
        for sleep in (False, True)
    ] + [{"generation_batch": 64}, {"vllm_server": True}]
    product = [
        (model, gib, world, engine, lora, tokens)
        for model in ("7b", "32b")
        for gib in (24, 40, 80)
        for world in (1, 8)
        for engine in engines
        for lora in (True, False)
        for tokens in (32000, 131072)
    ]
    return product[::5]


def _relieves(name, before, after) -> bool:
    """Whether a change lowers the memory a GPU needs (the only direction a fix may move a setting)."""
    if name in ("max_training_tokens", "generation_batch", "per_device_train_batch_size", "checkpoint_every_n_layers"):
        return after < before
    if name == "world_size":
        return after > before
    if name == "use_vllm":  # a colocated engine leaves for a server, or replaces the transformers backend
        return True
    return name == "lora" or name == "vllm_gpu_memory_utilization" or after is True


@pytest.mark.parametrize("model, gib, world, engine, lora, tokens", _sweep())
def test_a_fix_applied_together_fits_and_moves_each_setting_one_way(
    qwen7b, qwen32b, model, gib, world, engine, lora, tokens
):
    shape = qwen7b if model == "7b" else qwen32b
    settings = {
        **NODE,
        "gpu_memory_gib": gib,
        "world_size": world,
        "lora": (LORA_7B if model == "7b" else LORA_32B) if lora else None,
        "max_training_tokens": tokens,
        "max_trajectory_tokens": 32000,
        **engine,
    }
    plan = plan_memory(shape, **settings)
    if plan.fits:
        assert plan.fix is None
        return
    fix = plan.fix
    assert fix is not None and fix.changes
    # applied all at once, the changes make the plan the fix reports (and it fits, unless it says none does)
    replanned = plan_memory(shape, **{**settings, **fix.changes}, _suggest=False)
    assert replanned.fits == fix.plan.fits and replanned.peak_gib == pytest.approx(fix.plan.peak_gib)
    assert all(_relieves(name, settings.get(name), value) for name, value in fix.changes.items()), fix.changes
    # the diagnosis names what a colocated engine needs, and a fix that keeps the engine gives it that much
    for reason in plan.reasons:
        assert not re.search(r"\b(raise|lower)\b", reason), reason  # advice lives in the fix alone
        needed = re.search(r"vllm_gpu_memory_utilization >= ([0-9.]+)", reason)
        if needed and fix.plan.fits and replanned.vllm_sequences is not None:
            assert replanned.vllm_sequences >= 1
            assert fix.changes.get("vllm_gpu_memory_utilization", settings["vllm_gpu_memory_utilization"]) >= float(
                needed.group(1)
            )
    text = plan.format()
    assert ("fits with these changes together: " in text) == fix.plan.fits


def test_when_no_combination_fits_the_fix_says_so_with_the_nearest(qwen7b):
    plan = plan_memory(qwen7b, lora=LORA_7B, use_vllm=True, **{**NODE, "gpu_memory_gib": 1})
    assert not plan.fits and not plan.fix.plan.fits
    # every lever pulled: a server generates, 64 GPUs shard, layer inputs go to CPU memory, 1024 tokens train
    assert plan.fix.changes == {
        "world_size": 64,
        "activation_offloading": True,
        "max_training_tokens": 1024,
        "use_vllm": False,
        "vllm_server": True,
    }
    assert plan.fix.plan.peak_gib > plan.fix.plan.budget_gib
    line = plan.format().splitlines()[-1]
    assert line.startswith("  no combination of the settings the planner can change fits; the nearest, world_size: 64")


def test_a_kl_reference_without_an_adapter_is_a_whole_copy_of_the_weights(qwen7b):
    node = {**NODE, "zero_stage": 2}  # ZeRO-3 refuses the copy (config.combinations)
    plain = plan_memory(qwen7b, **node)
    with_copy = plan_memory(qwen7b, kl_reference_copy=True, **node)
    [row] = [r for r in with_copy.rows if r.name == "KL reference (frozen copy)"]
    assert row.gib == pytest.approx(qwen7b.num_params * 2 / 2**30)  # bf16, not sharded
    assert with_copy.training_gib == pytest.approx(plain.training_gib + row.gib * 1.05)  # and its fragmentation
    # with an adapter the reference is its own base model: nothing more
    adapter = plan_memory(qwen7b, lora=LORA_7B, kl_reference_copy=True, **node)
    assert adapter.rows == plan_memory(qwen7b, lora=LORA_7B, **node).rows


def test_offloading_the_optimizer_leaves_the_bf16_weights_and_the_gradients_on_their_way(qwen7b):
    """ZeRO-Offload at stage 2 (accelerate's offload_optimizer_device: cpu): the fp32 master, gradient and Adam state
    leave the GPU for CPU memory, whose size a note gives; DeepSpeed's reduction bucket (5e8 elements) stays, with a
    buffer of the largest parameter and, at the boundary, its fp64 copy for the norm and (larger than the bucket) a
    clone. Full fine-tuning of the 7B on one GPU."""
    one_gpu = {**NODE, "world_size": 1, "zero_stage": 2, "gpu_memory_gib": 141}
    on_gpu = plan_memory(qwen7b, **one_gpu)
    offloaded = plan_memory(qwen7b, offload_optimizer=True, **one_gpu)
    rows = {r.name: r for r in offloaded.rows}
    n, h, i = qwen7b.num_params, qwen7b.hidden_size, qwen7b.intermediate_size
    state = {r.name: r for r in on_gpu.rows}["trainable state"].gib
    assert state == pytest.approx(n * 16 / 2**30)  # fp32 master 4 + fp32 grad 4 + Adam 8
    assert rows["trainable state"].gib == 0 and "CPU" in rows["trainable state"].explanation
    largest = qwen7b.embedding_params  # 152064 x 3584 = 545e6, more than the bucket: cloned too
    assert largest > max(h * i, 500_000_000)
    staged = 500_000_000 * 2 + largest * (2 + 8) + largest * 2
    assert rows["gradients on their way to the CPU"].gib == pytest.approx(staged / 2**30)
    # the state leaves, the staging comes, the 5% fragmentation follows both
    assert offloaded.training_gib == pytest.approx(on_gpu.training_gib - (state - staged / 2**30) * 1.05)
    [note] = [n for n in offloaded.notes if "ZeRO-Offload" in n]
    assert f"{(n * 16 + n * 4) / 2**30:.2f} GiB of CPU memory" in note  # and a bf16 copy and accumulated grads
    # an adapter keeps its bf16 weights on the GPU; its largest parameter is bounded by the whole adapter
    adapter = plan_memory(qwen7b, lora=LORA_7B, offload_optimizer=True, **one_gpu)
    trainable = qwen7b.lora_params(LORA_7B["r"], "all-linear")
    adapter_rows = {r.name: r for r in adapter.rows}
    assert adapter_rows["trainable state"].gib == pytest.approx(trainable * 2 / 2**30)
    expected = (500_000_000 * 2 + trainable * (2 + 8)) / 2**30
    assert adapter_rows["gradients on their way to the CPU"].gib == pytest.approx(expected)
    for stage in (0, 1, 3):  # other stages keep other buffers: not planned
        with pytest.raises(ValueError, match="offload_optimizer .* zero_stage 2 only"):
            plan_memory(qwen7b, offload_optimizer=True, **{**one_gpu, "zero_stage": stage})
