"""``loop-train --dry-run`` as a user reads it: the plan and its verdict first (the configuration behind a flag),
settings that together make a recipe fit (re-run with them, it does), and a warning where a server address
points at a machine the server cannot be on. Offline and GPU-free: the shipped model shapes, no weights."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from loop_trainer.cli.dry_run import is_this_machine
from loop_trainer.cli.train import cli

ROOT = Path(__file__).resolve().parents[3]
R7B = ["--config", "recipes/appworld/qwen2.5-7b-instruct.yaml"]
R32B = ["--config", "recipes/appworld/qwen2.5-32b-instruct.yaml"]
SHOW = "--dry_run_show_config"


@pytest.fixture(autouse=True)
def _at_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    for launcher_variable in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(launcher_variable, raising=False)


def dry_run(capsys, *flags: str) -> tuple[int, str]:
    status = cli([*flags, "--dry-run"])
    return status, capsys.readouterr().out


# --- 1. the plan first ------------------------------------------------------------------------------------------
def test_the_plan_comes_first_and_the_configuration_behind_a_flag(capsys):
    status, out = dry_run(capsys, *R7B)
    lines = out.splitlines()
    assert status == 0 and lines[0].startswith("Dry run: Qwen/Qwen2.5-7B-Instruct (LoRA r 8) on appworld, 8 training")
    assert lines[1] == f"(every resolved setting: add {SHOW} true)"
    assert "[LOOP]" not in out and "tasks_per_iteration" not in out
    assert lines[3].startswith("Memory plan per GPU: 8 GPUs x 80 GiB") and lines[-1] == "FITS"
    status, shown = dry_run(capsys, *R7B, SHOW, "true")
    assert status == 0 and shown.rstrip().endswith("FITS") and f"add {SHOW}" not in shown
    assert shown.index("[LOOP]") < shown.index("Dry run:") < shown.index("Memory plan per GPU")
    assert "  tasks_per_iteration: 40" in shown and "  rollouts_per_task: 6" in shown
    assert shown.endswith(out.split("\n", 2)[2])  # the same plan, after the configuration


def test_the_configuration_flag_without_a_dry_run_is_one_line(capsys):
    assert cli([*R7B, SHOW, "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "loop-train: error: dry_run_show_config prints the configuration of a dry run: add --dry-run, or remove it"
    )


# --- 2. settings that together fit --------------------------------------------------------------------------------
def fix_flags(out: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith("    as flags: "))
    return shlex.split(line.removeprefix("    as flags: "))


@pytest.mark.parametrize(
    "flags",
    [
        [*R7B, "--plan_gpu_memory_gib", "24"],  # vLLM's share too small for its weights, and the peak too high
        [*R7B, "--plan_gpu_memory_gib", "40"],  # raising the share needs sleep mode to stay under the budget
        [*R7B, "--vllm_gpu_memory_utilization", "0.1"],
        [*R7B, "--use_vllm", "false"],  # the transformers backend's generation batch
        [*R7B, "--max_training_tokens", "131072", "--activation_checkpointing", "false"],
        [*R32B, "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.9"],  # 32B weights on one GPU
        [*R32B, "--use_peft", "false", "--plan_gpus", "1", "--activation_checkpointing", "false"],
        [*R7B, "--max_training_tokens", "131072", "--activation_checkpointing_kwargs", '{"every_n_layers": 4}'],
    ],
    ids=[
        "24GiB",
        "40GiB",
        "small-vllm-share",
        "transformers",
        "long-uncheckpointed",
        "32b-colocated",
        "32b-full",
        "long-every-4th-layer",
    ],
)
def test_the_settings_proposed_together_make_the_recipe_fit(flags, capsys):
    status, out = dry_run(capsys, *flags)
    assert status == 3 and "DOES NOT FIT" in out
    verdict = out[out.index("DOES NOT FIT") :].splitlines()
    fix = [line for line in verdict if line.startswith("  fits with these together: ")]
    assert len(fix) == 1 and "(the recipe re-planned with them: peak " in fix[0]
    proposed = fix_flags(out)
    keys = proposed[::2]
    assert len(keys) == len(set(keys)), proposed  # each setting once: never moved two ways
    # the recipe with exactly these flags fits (activation_offloading included, on this GPU-less machine)
    status, fixed = dry_run(capsys, *flags, *proposed)
    assert status == 0 and fixed.rstrip().endswith("FITS"), fixed


def test_the_24_gib_fix_raises_the_vllm_share_once_and_frees_it_during_the_update(capsys):
    _, out = dry_run(capsys, *R7B, "--plan_gpu_memory_gib", "24")
    assert "it needs vllm_gpu_memory_utilization >= 0.67 for the weights and one sequence" in out
    assert fix_flags(out) == [
        "--activation_offloading",
        "true",
        "--vllm_gpu_memory_utilization",
        "0.67",
        "--vllm_enable_sleep_mode",
        "true",
    ]
    assert not re.search(r"\b(raise|lower)\b", out[out.index("DOES NOT FIT") :])  # one fix, no opposite advice


def test_when_nothing_fits_the_dry_run_says_so_in_one_line(capsys):
    status, out = dry_run(capsys, *R7B, "--plan_gpu_memory_gib", "1")
    assert status == 3
    verdict = out[out.index("DOES NOT FIT") :].splitlines()
    nearest = [line for line in verdict if "no combination" in line]
    assert len(nearest) == 1 and "as flags" not in out
    assert nearest[0].startswith(
        "  no combination of the settings the planner can change fits; the nearest, plan_gpus: 64, "
    )
    assert re.search(r"peaks at [0-9.]+ GiB > budget 0\.9 GiB$", nearest[0])


# --- 3. server addresses --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, env, warned",
    [
        # the 32B recipe's 8 training processes fill their node: its vLLM server is on another
        (
            R32B,
            {},
            "vllm_server_base_url http://localhost:8000 points at the training machine, but the 8 training "
            "processes take all 8 of its GPUs",
        ),
        ([*R32B, "--vllm_server_base_url", "http://10.0.0.2:8000"], {}, None),
        ([*R32B, "--plan_gpus", "16", "--vllm_server_base_url", "http://127.0.0.1:8000"], {}, "span 2 machines of 8"),
        ([*R32B, "--plan_gpus_per_machine", "16"], {}, None),  # room on the node for the server
        ([*R32B], {"LOCAL_WORLD_SIZE": "4"}, "span 2 machines of 4"),  # what the launcher says of the machine
        # the 7B recipe's overlapped split: 4 GPUs train, the server runs on the node's other 4
        ([*R7B, "--vllm_mode", "server", "--plan_gpus", "4"], {}, None),
        (
            [*R7B, "--vllm_mode", "server", "--plan_gpus", "4", "--plan_gpus_per_machine", "4"],
            {},
            "vllm_server_host 0.0.0.0",
        ),
        (
            [
                *R32B,
                "--plan_gpus",
                "16",
                "--vllm_server_base_url",
                "http://10.0.0.2:8000",
                "--environment_kwargs",
                '{"server_urls": ["http://localhost:9000"]}',
            ],
            {},
            "environment_kwargs server_urls names http://localhost:9000, but the 16 training processes span 2",
        ),
        ([*R7B, "--plan_gpus", "16"], {}, None),  # colocated vLLM: no server to reach
    ],
)
def test_a_server_address_on_the_wrong_machine_is_warned(flags, env, warned, capsys, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    status, out = dry_run(capsys, *flags)
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert status == 0 and out.rstrip().endswith("FITS")
    if warned is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warned in warnings[0], warnings
        assert out.index("warning: ") < out.index("Memory plan per GPU")  # seen before the table


@pytest.mark.parametrize(
    "address, local",
    [
        ("http://localhost:8000", True),
        ("http://127.0.0.2:8000/v1", True),
        ("0.0.0.0", True),
        ("http://[::1]:8000", True),
        ("http://10.0.0.2:8000", False),
        ("http://gen-node-1:8000", False),
        ("https://localhost.example.com", False),
    ],
)
def test_which_addresses_name_the_machine_itself(address, local):
    assert is_this_machine(address) is local


def test_a_fix_the_recipe_does_not_confirm_is_not_printed_as_one(capsys, monkeypatch):
    """The dry run re-plans the recipe with the planner's fix applied and prints only what that confirms."""
    from loop_trainer.models import memory_plan

    def unconfirmed(args, lora=None):  # claims a fit for a change that saves nothing
        plan = memory_plan.plan_memory(**args, _suggest=False)
        plan.fits = True
        return memory_plan.Fix({"max_training_tokens": args["max_training_tokens"] - 256}, plan)

    monkeypatch.setattr(memory_plan, "find_fix", unconfirmed)
    status, out = dry_run(capsys, *R7B, "--plan_gpu_memory_gib", "24")
    assert status == 3 and "as flags" not in out and "fits with these together" not in out
    assert (
        "  the planner's fix, max_training_tokens: 31744, did not re-plan the same from the recipe; no verified fix"
        in out
    )
