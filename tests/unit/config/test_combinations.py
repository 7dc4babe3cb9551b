"""The checks that combine keys, one test per rule: refused in one line naming the keys and the fix, and the
neighbouring combinations that are fine pass. They run at config time (LOOPConfig), so --dry-run shows them."""

from __future__ import annotations

import pytest

from loop_trainer.config import LOOPConfig
from loop_trainer.config.combinations import (
    RULES,
    ConfigCombinationError,
    Generator,
    Launch,
    planning_a_gpu_launch,
    problems,
)


def config(**keys):
    return LOOPConfig(output_dir="/tmp/loop-combinations", report_to=[], **keys)


def refused(keys, launch, match):
    found = problems(config(**keys) if not isinstance(keys, LOOPConfig) else keys, launch)
    assert len(found) == 1 and match in found[0], found
    assert "\n" not in found[0]


BUILT_IN = Launch(generator=Generator.BUILT_IN)


def test_overlap_with_a_colocated_vllm_engine_is_refused_at_config_time():
    with pytest.raises(ConfigCombinationError, match="LOOPConfig: max_staleness .* set vllm_mode: server"):
        config(max_staleness=1, use_vllm=True)
    config(max_staleness=1, use_vllm=True, vllm_mode="server")


def test_overlap_with_dynamic_sampling_is_refused_at_config_time():
    with pytest.raises(ConfigCombinationError, match="dynamic_sampling_rounds .* set one of them to 0"):
        config(max_staleness=1, use_vllm=True, vllm_mode="server", dynamic_sampling_rounds=2)


def test_overlap_needs_a_generator_holding_its_own_weights():
    keys = config(max_staleness=1)  # a LOOPConfig in Python: a generation_backend may still come
    assert problems(keys, Launch()) == []
    refused(keys, BUILT_IN, "the transformers backend samples with the training model itself")
    refused(keys, Launch(generator=Generator.SHARED_WEIGHTS), "has no holds_own_weights = True")
    assert problems(keys, Launch(generator=Generator.OWN_WEIGHTS)) == []
    server = config(max_staleness=1, use_vllm=True, vllm_mode="server")
    assert problems(server, BUILT_IN) == []
    # every training process of a node overlaps (each collects its share on its own thread; docs/overlap.md)
    assert problems(server, Launch(num_processes=8, zero_stage=3, generator=Generator.BUILT_IN)) == []
    assert problems(config(max_staleness=8), Launch(num_processes=2, generator=Generator.OWN_WEIGHTS)) == []


def test_several_versions_on_a_server_need_lora_adapters():
    server = config(max_staleness=2, use_vllm=True, vllm_mode="server")
    refused(server, Launch(generator=Generator.BUILT_IN, lora=False), "train an adapter (use_peft: true)")
    assert problems(server, Launch(generator=Generator.BUILT_IN, lora=True)) == []
    assert problems(server, Launch(generator=Generator.BUILT_IN)) == []  # not known yet: the trainer checks again
    assert problems(config(max_staleness=1, use_vllm=True, vllm_mode="server"), Launch(lora=False)) == []


def test_a_collection_process_needs_overlap_on_a_vllm_server():
    server = {"use_vllm": True, "vllm_mode": "server"}
    assert problems(config(max_staleness=1, collection_process=True, **server), BUILT_IN) == []
    eight = Launch(num_processes=8, zero_stage=3, generator=Generator.BUILT_IN, lora=True)  # a child per process
    assert problems(config(max_staleness=2, collection_process=True, **server), eight) == []
    with pytest.raises(ConfigCombinationError, match="collection_process .* set max_staleness: 1 or more"):
        config(collection_process=True, **server)
    with pytest.raises(ConfigCombinationError, match="collection_process .* set use_vllm: true and vllm_mode: server"):
        config(max_staleness=1, collection_process=True)  # a generation_backend of the user's may come, not a server
    keys = config(max_staleness=1, **server)
    keys.collection_process = True
    refused(keys, Launch(generator=Generator.OWN_WEIGHTS), "a vLLM server the child process reaches by itself")
    cut = {"early_stop_done_fraction": 0.9, "partial_rollouts": True}  # the child holds the carried episodes
    assert problems(config(max_staleness=1, collection_process=True, **server, **cut), eight) == []


def test_a_kl_penalty_without_an_adapter_is_refused_under_zero3():
    keys = config(beta=0.1)
    # full fine-tuning's reference would be a copy of the sharded weights
    refused(keys, Launch(zero_stage=3, lora=False), "train a LoRA adapter (use_peft: true")
    assert problems(keys, Launch(zero_stage=3, lora=True)) == []  # the adapter's base is the reference
    assert problems(keys, Launch(zero_stage=2, num_processes=8, lora=False)) == []  # whole weights: a copy
    assert problems(keys, Launch(zero_stage=3)) == []  # not known yet: the trainer checks again
    assert problems(config(), Launch(zero_stage=3, lora=False)) == []


def test_activation_offloading_needs_a_gpu():
    keys = config()
    keys.activation_offloading = True
    refused(keys, Launch(cuda=False), "activation_offloading moves the update's saved activations")
    assert problems(keys, Launch(cuda=True)) == []
    keys.use_cpu = True
    refused(keys, Launch(cuda=True), "remove activation_offloading")


def test_a_dry_run_checks_keys_for_the_gpu_launch_it_plans(monkeypatch):
    """``--dry-run`` plans GPUs from any machine: a key that needs one is accepted there, unless use_cpu says the
    run is on a CPU."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # this machine, as a laptop planning a cluster
    with pytest.raises(ConfigCombinationError, match="LOOPConfig: activation_offloading .* no GPU"):
        config(activation_offloading=True)
    with planning_a_gpu_launch():
        assert config(activation_offloading=True).launch().cuda
        with pytest.raises(ConfigCombinationError, match="remove activation_offloading"):
            config(activation_offloading=True, use_cpu=True)
    assert not config().launch().cuda  # the planning ends with its block


def test_a_cpu_only_launch_runs_no_deepspeed_whatever_the_plugin_says(monkeypatch):
    """accelerate never picks DeepSpeed with cpu=True (use_cpu, or ACCELERATE_USE_CPU), though TrainingArguments
    builds the plugin: the launch the checks (and a resume's optimizer state layout) see has no ZeRO stage."""
    from types import SimpleNamespace

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    keys = config()
    keys.deepspeed_plugin = SimpleNamespace(zero_stage=3)
    assert keys.launch().zero_stage == 3
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert keys.launch().zero_stage is None
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    keys.use_cpu = True
    assert keys.launch().zero_stage is None


def test_compile_decode_step_needs_static_decode():
    with pytest.raises(ConfigCombinationError, match="compile_decode_step compiles .* set static_decode: true"):
        config(compile_decode_step=True, static_decode=False)
    config(compile_decode_step=True, static_decode=True)
    unset = config(static_decode=True)
    unset.compile_decode_step, unset.static_decode = True, None  # static_decode unset: on with CUDA only
    refused(unset, Launch(cuda=False), "set static_decode: true")
    assert problems(unset, Launch(cuda=True)) == []


@pytest.mark.parametrize("key", ["merge_adapter_for_sampling", "static_decode", "compile_decode_step"])
def test_the_transformers_backends_parts_are_refused_with_vllm(key):
    keys = {key: True, **({"static_decode": True} if key == "compile_decode_step" else {})}
    with pytest.raises(
        ConfigCombinationError, match="(merge_adapter_for_sampling|static_decode) .*set use_vllm: false"
    ):
        config(use_vllm=True, vllm_mode="server", **keys)
    backend = config(**keys)
    backend.use_vllm = True  # with a generation_backend of the user's, use_vllm has no engine to refuse for
    assert problems(backend, Launch(generator=Generator.OWN_WEIGHTS)) == []


def test_merging_the_adapter_needs_whole_weights():
    keys = config(merge_adapter_for_sampling=True)
    refused(keys, Launch(zero_stage=3), "ZeRO-3 partitions them")
    assert problems(keys, Launch(zero_stage=2)) == []


def test_a_colocated_vllm_engine_spans_one_gpu():
    with pytest.raises(ConfigCombinationError, match="vllm_tensor_parallel_size must be 1 with vllm_mode: colocate"):
        config(use_vllm=True, vllm_tensor_parallel_size=2)
    config(use_vllm=True, vllm_mode="server", vllm_tensor_parallel_size=2)


def test_zero3_on_several_processes_cannot_sample_with_the_training_model():
    keys = config()
    refused(keys, Launch(num_processes=2, zero_stage=3, generator=Generator.BUILT_IN), "set use_vllm: true")
    for fine in (
        # a generation_backend of the user's is theirs to run (a scripted one, an API): no collective forward of ours
        Launch(num_processes=2, zero_stage=3, generator=Generator.SHARED_WEIGHTS),
        Launch(num_processes=2, zero_stage=2, generator=Generator.BUILT_IN),
        Launch(num_processes=1, zero_stage=3, generator=Generator.BUILT_IN),
        Launch(num_processes=2, zero_stage=3, generator=Generator.OWN_WEIGHTS),
        Launch(num_processes=2, zero_stage=3),  # a LOOPConfig in Python: the trainer checks again
    ):
        assert problems(keys, fine) == []
    assert problems(config(use_vllm=True, vllm_mode="server"), Launch(2, 3, generator=Generator.BUILT_IN)) == []


def test_partial_rollouts_need_an_overlapped_collection_and_a_straggler_cut():
    with pytest.raises(ConfigCombinationError, match="set max_staleness: 1 or more, or partial_rollouts: false"):
        config(partial_rollouts=True, early_stop_done_fraction=0.9)
    with pytest.raises(ConfigCombinationError, match="set early_stop_done_fraction: 0.9"):
        config(partial_rollouts=True, max_staleness=1)
    config(partial_rollouts=True, max_staleness=1, early_stop_done_fraction=0.9)
    config(partial_rollouts=True, max_staleness=2, early_stop_task_fraction=0.75)


def test_a_sampler_correction_other_than_todays_needs_its_bounds():
    with pytest.raises(ConfigCombinationError, match=r"^LOOPConfig: sampler_correction: token_mask bounds .* no bound"):
        config(sampler_correction="token_mask")
    for mode in ("sequence_truncate", "sequence_mask"):  # a product of token weights is unbounded above
        with pytest.raises(ConfigCombinationError, match=f"sampler_correction: {mode} weighs a trajectory .* cap"):
            config(sampler_correction=mode, sampler_importance_floor=0.5)
        config(sampler_correction=mode, sampler_importance_cap=3.0)
    config(sampler_correction="token_mask", sampler_importance_floor=0.5)  # IcePop below only
    config(sampler_correction="token_truncate")  # today's default: off without a cap
    # with max_staleness the weights are capped at 2 already
    server = {"use_vllm": True, "vllm_mode": "server", "max_staleness": 1}
    assert problems(config(sampler_correction="sequence_mask", **server), BUILT_IN) == []


def test_the_sampler_floor_is_below_the_cap():
    with pytest.raises(ConfigCombinationError, match=r"sampler_importance_floor \(2.0\) must be below .* \(2.0:"):
        config(sampler_importance_cap=2.0, sampler_importance_floor=2.0)
    server = {"use_vllm": True, "vllm_mode": "server", "max_staleness": 1}
    with pytest.raises(ConfigCombinationError, match=r"\(2.0: sampler_importance_cap, or 2 with max_staleness\)"):
        config(sampler_importance_floor=2.5, **server)
    assert problems(config(sampler_importance_cap=5.0, sampler_importance_floor=2.5, **server), BUILT_IN) == []
    assert problems(config(sampler_importance_floor=0.5), Launch()) == []  # no cap: nothing to be below


def test_the_staleness_cap_is_the_updates():
    from loop_trainer.config.combinations import STALENESS_DEFAULT_CAP
    from loop_trainer.training.update import STALE_IMPORTANCE_CAP

    assert STALENESS_DEFAULT_CAP == STALE_IMPORTANCE_CAP


def test_each_rule_has_its_test_above():
    assert len(RULES) == 15, "a rule was added or removed: give it its test in this file, then update this count"
