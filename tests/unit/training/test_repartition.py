"""Resuming a ZeRO checkpoint on another number of processes (training/repartition.py), short of DeepSpeed itself:
which layouts repartition, when the checkpoint is converted and when a conversion is reused, how a failed one is
reported, and the mending of DeepSpeed's ZeRO-3 universal load. tests/vllm_deepspeed/test_zero_resume.py runs it
all under DeepSpeed, SIGKILLed runs resumed on 1 and 2 processes."""

from __future__ import annotations

import types

import pytest
import torch

from loop_trainer.training import repartition
from loop_trainer.training.checkpoints import CheckpointError
from loop_trainer.training.repartition import UniversalResume, mend_zero3_load, repartitions, universal_resume


def zero(stage, processes=None):
    """A layout as distribution.optimizer_state_layout records it."""
    return {"deepspeed_zero_stage": stage, **({} if processes is None else {"processes": processes})}


@pytest.mark.parametrize(
    ("written", "launched", "expected"),
    [
        (zero(3, 8), zero(3, 4), True),
        (zero(1, 1), zero(1, 2), True),
        (zero(2, 2), zero(2, 2), False),  # the same launch: loaded as it is
        (zero(2, 2), zero(3, 1), False),  # another stage: refused (resume.py)
        (zero(0), zero(0), False),  # no ZeRO: the state is whole
        (None, zero(2, 2), False),
        (zero(2, 2), None, False),
        (None, None, False),
    ],
)
def test_only_another_process_count_under_one_zero_stage_repartitions(written, launched, expected):
    assert repartitions(written, launched) is expected


def deepspeed_checkpoint(path, tag="global_step8"):
    """A checkpoint directory as DeepSpeed leaves it: its shares in ``tag``, named by ``latest``."""
    (path / tag).mkdir(parents=True)
    (path / "latest").write_text(tag)
    return path


def converted(directory):
    """What DeepSpeed's script leaves when it has finished: the parameters' folder, then ``latest_universal``."""
    (directory / "zero").mkdir(parents=True, exist_ok=True)
    (directory.parent / "latest_universal").write_text(directory.name)


def test_the_main_process_converts_once_and_every_process_loads_the_universal_checkpoint(tmp_path, monkeypatch):
    checkpoint = deepspeed_checkpoint(tmp_path / "checkpoint-2")
    conversions, barriers = [], []
    monkeypatch.setattr(repartition, "convert", lambda c, d: conversions.append((c, d)) or converted(d))
    config = {"zero_optimization": {"stage": 3}, "checkpoint": {"tag_validation": "Warn"}}
    resume = universal_resume(
        checkpoint, zero(3, 2), zero(3, 1), config, is_main_process=True, barrier=lambda: barriers.append(1)
    )
    assert resume == UniversalResume(checkpoint, checkpoint / "global_step8_universal", 3)
    assert conversions == [(checkpoint, checkpoint / "global_step8_universal")] and barriers == [1]
    assert config["checkpoint"] == {"tag_validation": "Warn", "load_universal": True}  # the user's keys kept
    # another process (or a second resume) finds it converted
    other = {"zero_optimization": {"stage": 3}}
    assert universal_resume(checkpoint, zero(3, 2), zero(3, 4), other, is_main_process=False, barrier=lambda: None)
    assert universal_resume(checkpoint, zero(3, 2), zero(3, 1), other, is_main_process=True, barrier=lambda: None)
    assert len(conversions) == 1 and other["checkpoint"] == {"load_universal": True}


def test_nothing_is_converted_or_switched_where_the_launch_loads_the_checkpoint_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(repartition, "convert", lambda *a: pytest.fail("converted"))
    config = {"zero_optimization": {"stage": 2}}
    for written, launched in ((zero(2, 2), zero(2, 2)), (None, None), (zero(0), zero(0))):
        assert universal_resume(tmp_path, written, launched, config, is_main_process=True, barrier=pytest.fail) is None
    assert "checkpoint" not in config


def test_a_process_that_cannot_see_the_conversion_stops_with_one_line(tmp_path, monkeypatch):
    """Checkpoints on each machine's own disk: the main process converted its own copy, which no other sees."""
    checkpoint = deepspeed_checkpoint(tmp_path / "checkpoint-2")
    with pytest.raises(CheckpointError, match="cannot see .*global_step8_universal.*storage every machine shares"):
        universal_resume(checkpoint, zero(2, 2), zero(2, 4), {}, is_main_process=False, barrier=lambda: None)


def test_a_checkpoint_without_its_deepspeed_checkpoint_is_refused_in_one_line(tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    with pytest.raises(CheckpointError, match="holds no DeepSpeed checkpoint"):
        universal_resume(checkpoint, zero(2, 2), zero(2, 1), {}, is_main_process=True, barrier=lambda: None)


def test_a_conversion_cut_short_is_done_again(tmp_path, monkeypatch):
    """DeepSpeed's script writes latest_universal last: a folder without it (or with it naming another) is a
    conversion that did not finish, removed before the next."""
    checkpoint = deepspeed_checkpoint(tmp_path / "checkpoint-2")
    (checkpoint / "global_step8_universal" / "zero").mkdir(parents=True)
    (checkpoint / "global_step8_universal" / "zero" / "half-written.pt").write_bytes(b"")
    seen = []

    def convert(c, d):
        seen.append(sorted(p.name for p in d.rglob("*")) if d.exists() else None)
        converted(d)

    monkeypatch.setattr(repartition, "convert", convert)
    universal_resume(checkpoint, zero(2, 2), zero(2, 1), {}, is_main_process=True, barrier=lambda: None)
    assert seen == [["half-written.pt", "zero"]]  # handed to convert, which starts afresh (below)
    (checkpoint / "latest_universal").write_text("global_step4_universal")  # an older conversion's
    universal_resume(checkpoint, zero(2, 2), zero(2, 1), {}, is_main_process=True, barrier=lambda: None)
    assert len(seen) == 2


def test_a_conversion_that_fails_names_its_last_line_and_keeps_its_output(tmp_path, monkeypatch):
    """Run for real: DeepSpeed's script in this interpreter, which has no DeepSpeed (the main test venv)."""
    if importable("deepspeed"):
        pytest.skip("DeepSpeed is installed here: the script would run")
    checkpoint = deepspeed_checkpoint(tmp_path / "checkpoint-2")
    stale = checkpoint / "global_step8_universal" / "zero"
    stale.mkdir(parents=True)
    with pytest.raises(CheckpointError) as failed:
        repartition.convert(checkpoint, checkpoint / "global_step8_universal")
    message = str(failed.value)
    assert "DeepSpeed could not convert" in message and "No module named 'deepspeed'" in message
    assert "\n" not in message and "resume it on the number of processes that wrote it" in message
    log = checkpoint / "global_step8_universal.log"
    assert f"all of it in {log}" in message and "No module named 'deepspeed'" in log.read_text()
    assert not stale.exists() and not (checkpoint / "latest_universal").exists()


def importable(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def zero3_optimizer():
    """A torch AdamW of two groups (decay, no decay) as DeepSpeed's ZeRO-3 holds it, one flat parameter per group,
    inside accelerate's wrapper and DeepSpeed's optimizer (each keeps the one it wraps as ``.optimizer``); with the
    state saved where DeepSpeed's universal checkpoint keeps it."""
    decay, no_decay = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2))
    adam = torch.optim.AdamW([{"params": [decay], "weight_decay": 0.01}, {"params": [no_decay], "weight_decay": 0.0}])
    (decay.sum() + no_decay.sum()).backward()
    adam.step()
    wrapped = types.SimpleNamespace(optimizer=types.SimpleNamespace(optimizer=adam))
    return wrapped, adam


def test_deepspeeds_zero3_universal_load_is_mended_where_it_loaded_wrongly(tmp_path):
    """DeepSpeed 0.19 copies the first group's hyperparameters onto every group and gives every group one step
    tensor, which fused/foreach Adam then advances once per group each step."""
    wrapped, adam = zero3_optimizer()
    directory = tmp_path / "global_step8_universal"
    (directory / "zero").mkdir(parents=True)
    torch.save({"optimizer_state_dict": adam.state_dict()}, directory / "zero" / "optimizer_state.pt")
    resume = UniversalResume(tmp_path, directory, 3)
    assert mend_zero3_load(wrapped, resume) == []  # as a right load leaves it: nothing to mend

    shared = torch.tensor(8.0)
    for group in adam.param_groups:  # as DeepSpeed's load leaves it
        group["weight_decay"] = 0.01
        adam.state[group["params"][0]]["step"] = shared
    mended = mend_zero3_load(wrapped, resume)
    assert mended == ["group 1's weight_decay 0.01 -> 0.0", "2 groups' shared Adam step count"]
    assert [group["weight_decay"] for group in adam.param_groups] == [0.01, 0.0]
    steps = [adam.state[group["params"][0]]["step"] for group in adam.param_groups]
    assert steps[0] is not steps[1] and [float(step) for step in steps] == [8.0, 8.0]
    assert mend_zero3_load(wrapped, resume) == []
    # ZeRO-1 and 2 load both right: nothing is read
    assert mend_zero3_load(wrapped, UniversalResume(tmp_path, tmp_path / "absent", 2)) == []


def test_a_universal_checkpoint_of_other_parameter_groups_is_refused_in_one_line(tmp_path):
    wrapped, adam = zero3_optimizer()
    directory = tmp_path / "global_step8_universal"
    (directory / "zero").mkdir(parents=True)
    state = adam.state_dict()
    state["param_groups"] = state["param_groups"][:1]
    torch.save({"optimizer_state_dict": state}, directory / "zero" / "optimizer_state.pt")
    with pytest.raises(CheckpointError, match="has 1 parameter groups and this run's has 2"):
        mend_zero3_load(wrapped, UniversalResume(tmp_path, directory, 3))
