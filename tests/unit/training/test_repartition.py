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
    (directory / "zero" / "optimizer_state.pt").write_bytes(b"")
    (directory.parent / "latest_universal").write_text(directory.name)


def one_process(value):
    return [value]


def beside_the_main_process(*main_values):
    """``all_gather`` as process 1 of 2 sees it, the main process's values scripted, one per call."""
    values = iter(main_values)
    return lambda value: [next(values), value]


def test_the_main_process_converts_once_and_every_process_loads_the_universal_checkpoint(tmp_path, monkeypatch):
    checkpoint = deepspeed_checkpoint(tmp_path / "checkpoint-2")
    conversions, gathered = [], []
    monkeypatch.setattr(repartition, "convert", lambda c, d: conversions.append((c, d)) or converted(d))
    config = {"zero_optimization": {"stage": 3}, "checkpoint": {"tag_validation": "Warn"}}

    def all_gather(value):
        gathered.append(value)
        return [value]

    resume = universal_resume(checkpoint, zero(3, 2), zero(3, 1), config, is_main_process=True, all_gather=all_gather)
    universal = checkpoint / "global_step8_universal"
    assert resume == UniversalResume(checkpoint, universal, 3)
    assert conversions == [(checkpoint, universal)]
    assert gathered == [("converted", "global_step8_universal"), True]  # its outcome, then that it sees the folder
    assert config["checkpoint"] == {"tag_validation": "Warn", "load_universal": True}  # the user's keys kept
    # another process, told by the main one, and a second resume find it converted
    other = {"zero_optimization": {"stage": 3}}
    told = beside_the_main_process(("converted", "global_step8_universal"), True)
    assert universal_resume(checkpoint, zero(3, 2), zero(3, 4), other, is_main_process=False, all_gather=told)
    assert universal_resume(checkpoint, zero(3, 2), zero(3, 1), other, is_main_process=True, all_gather=one_process)
    assert len(conversions) == 1 and other["checkpoint"] == {"load_universal": True}


def test_nothing_is_converted_or_switched_where_the_launch_loads_the_checkpoint_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(repartition, "convert", lambda *a: pytest.fail("converted"))
    config = {"zero_optimization": {"stage": 2}}
    for written, launched in ((zero(2, 2), zero(2, 2)), (None, None), (zero(0), zero(0))):
        assert (
            universal_resume(tmp_path, written, launched, config, is_main_process=True, all_gather=pytest.fail) is None
        )
    assert "checkpoint" not in config


def test_a_conversion_that_fails_on_the_main_process_stops_every_process_with_its_line(tmp_path, monkeypatch):
    """Not the main process alone, leaving the others to wait at DeepSpeed's first collective until ddp_timeout."""
    checkpoint = deepspeed_checkpoint(tmp_path / "checkpoint-2")

    def convert(c, d):
        raise CheckpointError("resume_from_checkpoint: DeepSpeed could not convert it")

    monkeypatch.setattr(repartition, "convert", convert)
    with pytest.raises(CheckpointError, match="DeepSpeed could not convert it") as main:
        universal_resume(checkpoint, zero(2, 2), zero(2, 1), {}, is_main_process=True, all_gather=one_process)
    told = beside_the_main_process(("failed", str(main.value)))
    with pytest.raises(CheckpointError, match="DeepSpeed could not convert it"):
        universal_resume(checkpoint, zero(2, 2), zero(2, 1), {}, is_main_process=False, all_gather=told)

    def unwritable(c, d):
        raise PermissionError(13, "Permission denied", str(d))

    monkeypatch.setattr(repartition, "convert", unwritable)
    with pytest.raises(CheckpointError, match="Permission denied.*make room or write access there") as refused:
        universal_resume(checkpoint, zero(2, 2), zero(2, 1), {}, is_main_process=True, all_gather=one_process)
    assert "\n" not in str(refused.value)


def test_a_process_that_cannot_see_the_conversion_stops_every_process_with_one_line(tmp_path):
    """Checkpoints on each machine's own disk: the main process converted its own copy, which process 1 does not
    see; both stop (process 1 sees its own folder empty; the main process is told)."""
    checkpoint = deepspeed_checkpoint(tmp_path / "checkpoint-2")
    says = "process 1 cannot see .*global_step8_universal.*storage every machine shares"
    told = beside_the_main_process(("converted", "global_step8_universal"), True)
    with pytest.raises(CheckpointError, match=says):
        universal_resume(checkpoint, zero(2, 2), zero(2, 4), {}, is_main_process=False, all_gather=told)
    converted(checkpoint / "global_step8_universal")
    with pytest.raises(CheckpointError, match=says):
        universal_resume(checkpoint, zero(2, 2), zero(2, 4), {}, is_main_process=True, all_gather=lambda v: [v, False])


def test_a_checkpoint_without_its_deepspeed_checkpoint_is_refused_in_one_line(tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    with pytest.raises(CheckpointError, match="holds no DeepSpeed checkpoint"):
        universal_resume(checkpoint, zero(2, 2), zero(2, 1), {}, is_main_process=True, all_gather=one_process)


def test_a_conversion_cut_short_or_deleted_is_done_again(tmp_path, monkeypatch):
    """DeepSpeed's script writes latest_universal last: a folder without it (or with it naming another) is a
    conversion that did not finish, removed before the next; so is a folder deleted for its size."""
    checkpoint = deepspeed_checkpoint(tmp_path / "checkpoint-2")
    universal = checkpoint / "global_step8_universal"
    (universal / "zero").mkdir(parents=True)
    (universal / "zero" / "half-written.pt").write_bytes(b"")
    seen = []

    def convert(c, d):
        seen.append(sorted(p.name for p in d.rglob("*")) if d.exists() else None)
        converted(d)

    monkeypatch.setattr(repartition, "convert", convert)
    universal_resume(checkpoint, zero(2, 2), zero(2, 1), {}, is_main_process=True, all_gather=one_process)
    assert seen == [["half-written.pt", "zero"]]  # handed to convert, which starts afresh (below)
    (checkpoint / "latest_universal").write_text("global_step4_universal")  # an older conversion's
    universal_resume(checkpoint, zero(2, 2), zero(2, 1), {}, is_main_process=True, all_gather=one_process)
    import shutil

    shutil.rmtree(universal)  # latest_universal left behind
    universal_resume(checkpoint, zero(2, 2), zero(2, 1), {}, is_main_process=True, all_gather=one_process)
    assert seen[1:] == [["half-written.pt", "optimizer_state.pt", "zero"], None]


def fake_interpreter(tmp_path, monkeypatch, script):
    """``sys.executable`` replaced by a shell script: what convert runs DeepSpeed's script with."""
    interpreter = tmp_path / "python"
    interpreter.write_text("#!/bin/sh\n" + script)
    interpreter.chmod(0o755)
    monkeypatch.setattr(repartition.sys, "executable", str(interpreter))


def test_a_conversion_that_fails_names_its_last_line_and_keeps_its_output(tmp_path, monkeypatch):
    checkpoint = deepspeed_checkpoint(tmp_path / "checkpoint-2")
    stale = checkpoint / "global_step8_universal" / "zero"
    stale.mkdir(parents=True)
    (checkpoint / "latest_universal").write_text("global_step8_universal")
    fake_interpreter(
        tmp_path, monkeypatch, "echo '*** 1. Extracting ZeRO fragments'\necho 'ValueError: no'  >&2\nexit 3\n"
    )
    with pytest.raises(CheckpointError) as failed:
        repartition.convert(checkpoint, checkpoint / "global_step8_universal")
    message = str(failed.value)
    assert "DeepSpeed could not convert" in message and "(exit code 3: ValueError: no;" in message
    assert "\n" not in message and "resume it on the number of processes that wrote it" in message
    log = checkpoint / "global_step8_universal.log"
    assert f"all of its output in {log}" in message and "Extracting ZeRO fragments" in log.read_text()
    assert not stale.exists() and not (checkpoint / "latest_universal").exists()  # the old one, removed first

    fake_interpreter(tmp_path, monkeypatch, "echo '  0%|   | 0/26'\nkill -9 $$\n")
    with pytest.raises(CheckpointError, match="killed by signal 9, out of host memory perhaps"):
        repartition.convert(checkpoint, checkpoint / "global_step8_universal")


def test_a_conversion_runs_deepspeeds_own_script_and_drops_its_output_when_it_succeeds(tmp_path, monkeypatch):
    checkpoint = deepspeed_checkpoint(tmp_path / "checkpoint-2")
    universal = checkpoint / "global_step8_universal"
    # as the script does: the folder, then latest_universal; the arguments it was given, kept to be read
    fake_interpreter(
        tmp_path,
        monkeypatch,
        f'echo "$@" > {tmp_path}/arguments\nmkdir -p {universal}/zero\ntouch {universal}/zero/optimizer_state.pt\n'
        f"printf global_step8_universal > {checkpoint}/latest_universal\n",
    )
    repartition.convert(checkpoint, universal)
    arguments = (tmp_path / "arguments").read_text().split()
    assert arguments == [
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(checkpoint / "global_step8"),
        "--output_folder",
        str(universal),
        "--inject_missing_state",
    ]
    assert not (checkpoint / "global_step8_universal.log").exists()


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
