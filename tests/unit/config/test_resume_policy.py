"""Every LOOPConfig key is classified for resume, and the classification is what resume does."""

from __future__ import annotations

import dataclasses

import pytest

from loop_trainer.config import LOOPConfig
from loop_trainer.config.resume_policy import APPLIED_KEYS, RECORDED_KEYS, RESUME_POLICY, OnResume
from loop_trainer.training import resume
from loop_trainer.training.settings import recorded_keys


def test_every_key_loopconfig_takes_is_classified_and_nothing_else():
    keys = {field.name for field in dataclasses.fields(LOOPConfig) if field.init}
    unclassified = sorted(keys - set(RESUME_POLICY))
    assert not unclassified, f"classify these keys in config/resume_policy.py: {unclassified}"
    assert not sorted(set(RESUME_POLICY) - keys), "the resume policy names keys LOOPConfig does not take"


def test_the_applied_keys_are_exactly_those_the_resume_writes_into_restored_state():
    assert APPLIED_KEYS == resume.SCHEDULE_KEYS | resume.OPTIMIZER_GROUP_KEYS | resume.TASK_ORDER_KEYS


@pytest.mark.parametrize(
    "key", ["static_decode", "compile_decode_step", "merge_adapter_for_sampling", "generation_batch_limit", "vllm_mode"]
)
def test_the_sampling_keys_that_change_log_probs_are_recorded(key):
    assert RESUME_POLICY[key] is OnResume.COMPARED and key in RECORDED_KEYS


def test_free_keys_are_not_recorded():
    assert not {key for key, kind in RESUME_POLICY.items() if kind is OnResume.FREE} & set(RECORDED_KEYS)


@pytest.mark.parametrize(
    "change",
    [
        {"static_decode": True},
        {"compile_decode_step": True, "static_decode": True},
        {"merge_adapter_for_sampling": True},
        {"generation_batch_limit": 8},
        {"max_concurrent_episodes": 3},
        {"use_vllm": True, "vllm_mode": "server"},
    ],
    ids=lambda change: "+".join(change),
)
def test_a_lora_run_resumed_with_a_sampling_key_changed_is_refused_naming_it(vault_tiny, tmp_path, change):
    import json

    from peft import LoraConfig, get_peft_model

    from loop_trainer.training.checkpoints import LOOP_STATE_FILE, CheckpointError

    _, model, _ = vault_tiny
    policy = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    try:

        def recorded(**keys):
            args = LOOPConfig(output_dir=str(tmp_path / "run"), report_to=[], **keys)
            return resume.resume_settings(recorded_keys(args), env_name="vault", num_train_tasks=16, model=policy)

        (tmp_path / LOOP_STATE_FILE).write_text(json.dumps({"iteration": 3, "settings": recorded()}))
        with pytest.raises(CheckpointError, match="settings differ") as refused:
            resume.compare_settings(tmp_path, recorded(**change), allow_changes=False)
        for key in change:
            assert f"{key} " in str(refused.value)
        assert resume.compare_settings(tmp_path, recorded(), allow_changes=False) == []
    finally:
        policy.unload()


@pytest.mark.parametrize(
    ("written", "launched", "says"),
    [
        (
            {"deepspeed_zero_stage": 2, "processes": 2},
            {"deepspeed_zero_stage": 3, "processes": 1},
            "is DeepSpeed ZeRO-2's, partitioned over 2 processes and this launch's would be DeepSpeed ZeRO-3's, "
            "partitioned over 1 process, which cannot load it: resume it under a launch like the one that wrote it "
            "(accelerate launch with a DeepSpeed config of zero_stage 2 (zero_optimization.stage in a DeepSpeed JSON), "
            "on any number of processes)",
        ),
        ({"deepspeed_zero_stage": 3, "processes": 8}, None, "this launch's would be whole (no DeepSpeed)"),
        (None, {"deepspeed_zero_stage": 3, "processes": 8}, "without DeepSpeed, on any number of processes"),
        ({"deepspeed_zero_stage": 0}, {"deepspeed_zero_stage": 1, "processes": 2}, "DeepSpeed's, without ZeRO"),
    ],
)
def test_a_checkpoint_whose_optimizer_state_the_launch_cannot_load_is_refused_even_with_changes_allowed(
    tmp_path, written, launched, says
):
    import json

    from loop_trainer.training.checkpoints import LOOP_STATE_FILE, CheckpointError

    settings = {"learning_rate": 1e-4, "optimizer_state_layout": written}
    (tmp_path / LOOP_STATE_FILE).write_text(json.dumps({"iteration": 3, "settings": settings}))
    current = {**settings, "optimizer_state_layout": launched}
    for allow_changes in (False, True):
        with pytest.raises(CheckpointError, match="optimizer state") as refused:
            resume.compare_settings(tmp_path, current, allow_changes=allow_changes)
        assert says in str(refused.value)
        # no weights in it (ZeRO-3 without gathering them on save): DeepSpeed's script rebuilds them
        assert f"write them with the zero_to_fp32.py in {tmp_path}" in str(refused.value)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not an exact continuation") as refused:
        resume.compare_settings(tmp_path, current, allow_changes=False)
    assert f"--model_name_or_path {tmp_path} and another output_dir" in str(refused.value)
    # DDP on another number of processes loads the whole state: nothing to refuse
    assert resume.compare_settings(tmp_path, settings, allow_changes=False) == []


def test_a_zero_checkpoint_resumes_on_another_number_of_processes_as_no_setting_change(tmp_path):
    """DeepSpeed repartitions the state of one ZeRO stage over another process count (training/repartition.py), as
    a run without DeepSpeed resumes on any: not a change to refuse, nor one to apply and record."""
    import json

    from loop_trainer.training.checkpoints import LOOP_STATE_FILE, CheckpointError

    settings = {"learning_rate": 1e-4, "optimizer_state_layout": {"deepspeed_zero_stage": 3, "processes": 8}}
    (tmp_path / LOOP_STATE_FILE).write_text(json.dumps({"iteration": 3, "settings": settings}))
    for processes in (1, 2, 16):
        fewer = {**settings, "optimizer_state_layout": {"deepspeed_zero_stage": 3, "processes": processes}}
        assert resume.compare_settings(tmp_path, fewer, allow_changes=False) == []
        # another change beside it is still the user's to allow, and the only one applied
        changed = {**fewer, "learning_rate": 2e-4}
        with pytest.raises(CheckpointError, match="settings differ") as refused:
            resume.compare_settings(tmp_path, changed, allow_changes=False)
        assert "optimizer_state_layout" not in str(refused.value)
        assert resume.compare_settings(tmp_path, changed, allow_changes=True) == [("learning_rate", 1e-4, 2e-4)]


def test_a_tiny_lora_runs_base_is_recorded_by_what_builds_it():
    """seed; a tiny-instruct model's tiny_instruct_steps; and where a greedy probe ends its warm-up (errands names a
    warm_up_success; vault does not), the episode settings the probe runs under. Nothing without an adapter, or for a
    model that is not built here."""
    from peft import LoraConfig

    from loop_trainer.config import EpisodeSettings
    from loop_trainer.envs import ErrandsEnv, VaultEnv
    from loop_trainer.training.model_loading import tiny_lora_base

    lora, vault, errands = LoraConfig(r=2), VaultEnv(num_tasks=4), ErrandsEnv(num_tasks=4)
    args = LOOPConfig(output_dir="unused", report_to=[], seed=5, tiny_instruct_steps=None, max_turns=7)
    assert tiny_lora_base("tiny:vault", vault, args, lora) == {"seed": 5}
    assert tiny_lora_base("tiny-instruct:vault", vault, args, lora) == {"seed": 5, "tiny_instruct_steps": None}
    probed = tiny_lora_base("tiny-instruct:errands", errands, args, lora)
    assert set(probed) == {"seed", "tiny_instruct_steps"} | {f.name for f in dataclasses.fields(EpisodeSettings)}
    assert probed["max_turns"] == 7
    counted = dataclasses.replace(args, tiny_instruct_steps=3)
    assert tiny_lora_base("tiny-instruct:errands", errands, counted, lora) == {"seed": 5, "tiny_instruct_steps": 3}
    assert tiny_lora_base("tiny-instruct:errands", errands, args, None) is None  # full weights: all in the checkpoint
    assert tiny_lora_base("Qwen/Qwen2.5-0.5B-Instruct", errands, args, lora) is None


def test_a_changed_tiny_base_is_refused_even_with_changes_allowed(tmp_path):
    import json

    from loop_trainer.training.checkpoints import LOOP_STATE_FILE, CheckpointError

    settings = {"learning_rate": 1e-4, "tiny_base": {"seed": 7, "tiny_instruct_steps": None, "max_turns": 6}}
    (tmp_path / LOOP_STATE_FILE).write_text(json.dumps({"iteration": 3, "settings": settings}))
    changed = {"learning_rate": 1e-4, "tiny_base": {"seed": 7, "tiny_instruct_steps": None, "max_turns": 9}}
    with pytest.raises(CheckpointError, match="would build otherwise \\(max_turns 6 -> 9\\); the adapter needs"):
        resume.compare_settings(tmp_path, changed, allow_changes=True)
    assert resume.compare_settings(tmp_path, {**settings, "learning_rate": 1e-3}, allow_changes=True)
    counted = {"learning_rate": 1e-4, "tiny_base": {"seed": 7, "tiny_instruct_steps": 5}}  # no probe now
    with pytest.raises(CheckpointError) as refused:
        resume.compare_settings(tmp_path, counted, allow_changes=True)
    assert "otherwise (tiny_instruct_steps null -> 5, a greedy probe would no longer end the warm-up)" in str(
        refused.value
    )


def test_a_tiny_lora_runs_world_is_part_of_its_base(tmp_path):
    """Its warm-up replays the environment's training tasks: another environment, other kwargs or another number
    of training tasks (all a Python-API run records of its world) would build another base. A launch that builds no
    tiny base is refused for what it does change, not for a world it does not build from."""
    import json

    from loop_trainer.training.checkpoints import LOOP_STATE_FILE, CheckpointError

    base = {"seed": 7, "tiny_instruct_steps": 3}
    settings = {"environment": "vault", "environment_kwargs": {"num_tasks": 8}, "num_train_tasks": 8, "tiny_base": base}
    (tmp_path / LOOP_STATE_FILE).write_text(json.dumps({"iteration": 3, "settings": settings}))
    for change, says in (
        ({"environment_kwargs": {"num_tasks": 6}, "num_train_tasks": 6}, 'environment_kwargs {"num_tasks": 8} -> {'),
        ({"num_train_tasks": 6}, "num_train_tasks 8 -> 6"),
    ):
        with pytest.raises(CheckpointError, match="which is built from the run's environment") as refused:
            resume.compare_settings(tmp_path, {**settings, **change}, allow_changes=True)
        assert says in str(refused.value)
    elsewhere = {**settings, "environment_kwargs": {"num_tasks": 6}, "tiny_base": None}  # no tiny base built now
    changes = resume.compare_settings(tmp_path, elsewhere, allow_changes=True)
    assert [key for key, _, _ in changes] == ["environment_kwargs", "tiny_base"]
