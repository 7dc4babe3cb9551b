"""benchmarks/overlap.py's modes: partial rollouts beside the plain ``max_staleness`` ones, and recipe keys for every
mode (``--set``), checked without a server: what it refuses, and how a mode is named and summarised."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root, for the benchmarks package

from benchmarks import overlap  # noqa: E402


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--partial-staleness", "1"],
            "--cut-staleness, --process-staleness, --partial-process-staleness and --set apply to a --recipe",
        ),
        (
            ["--cut-staleness", "1"],
            "--cut-staleness, --process-staleness, --partial-process-staleness and --set apply to a --recipe",
        ),
        (
            ["--set", "use_peft=true"],
            "--cut-staleness, --process-staleness, --partial-process-staleness and --set apply to a --recipe",
        ),
        (
            ["--process-staleness", "1"],
            "--process-staleness, --partial-process-staleness and --set apply to a --recipe",
        ),
        (["--partial-process-staleness", "1"], "--partial-process-staleness and --set apply to a --recipe"),
        (
            ["--recipe", "recipes/demo.yaml", "--partial-process-staleness", "0"],
            "--partial-process-staleness: partial rollouts need max_staleness >= 1",
        ),
        (["--recipe", "recipes/demo.yaml", "--partial-staleness", "0"], "partial rollouts need max_staleness >= 1"),
        (["--recipe", "recipes/demo.yaml", "--process-staleness", "0"], "which needs max_staleness >= 1"),
        (["--recipe", "recipes/demo.yaml", "--set", "collection_process=true"], "--set cannot change ['collection"),
        (["--recipe", "recipes/demo.yaml", "--cut-staleness", "-1"], "max_staleness is 0 or more"),
        (["--recipe", "recipes/demo.yaml", "--set", "use_peft"], "--set takes KEY=VALUE; got ['use_peft']"),
        (["--recipe", "recipes/demo.yaml", "--set", "max_staleness=2"], "--set cannot change ['max_staleness']"),
        (
            ["--recipe", "recipes/demo.yaml", "--partial-staleness", "1", "--set", "early_stop_done_fraction=0.5"],
            "--set cannot change ['early_stop_done_fraction']",
        ),
        (
            ["--recipe", "recipes/demo.yaml", "--cut-staleness", "1", "--set", "early_stop_task_fraction=0.5"],
            "--set cannot change ['early_stop_task_fraction']",
        ),
        (  # a cut mode two versions deep needs adapters too
            ["--recipe", "recipes/errands.yaml", "--staleness", "0", "--cut-staleness", "2"],
            "max_staleness 2 needs a LoRA policy on the server",
        ),
        (  # errands.yaml trains full weights: refused before any mode spends time, not when the third one starts
            ["--recipe", "recipes/errands.yaml", "--staleness", "0", "1", "2"],
            "max_staleness 2 needs a LoRA policy on the server",
        ),
    ],
)
def test_modes_it_cannot_run_are_refused_in_one_line(argv, said, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as stopped:
        overlap.main(argv)
    assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_a_partial_mode_is_named_apart_and_counts_what_its_cut_carried():
    history = [
        {
            "seconds": 2.0 + i,
            "rollout_seconds": 1.0,
            "update_seconds": 1.0,
            "sampled_tokens": 100,
            "turns_mean": 3.0,
            "reward_mean": 0.5,
            "policy_staleness": float(min(i, 1)),
            "num_cancelled": 0.0,
            "carried_episodes": float(i + 1),
            "dropped_stale_episodes": 0.0,
        }
        for i in range(4)
    ]
    partial = overlap.summary(1, history, wall=14.0, variant="partial")
    cut = overlap.summary(1, history, wall=14.0, variant="cut")
    plain = overlap.summary(1, history, wall=14.0)
    process = overlap.summary(1, history, wall=14.0, variant="process")
    both = overlap.summary(1, history, wall=14.0, variant="partial+process")
    modes = (plain, cut, partial, process, both)
    assert [(m["mode"], m["straggler_cut"], m["partial_rollouts"], m["collection_process"]) for m in modes] == [
        ("1", False, False, False),
        ("1+cut", True, False, False),
        ("1+partial", True, True, False),
        ("1+process", False, False, True),
        ("1+partial+process", True, True, True),
    ]
    assert partial["carried_episodes"] == [1.0, 2.0, 3.0, 4.0] and partial["steady_iterations"] == 2


def test_the_cut_control_differs_from_the_partial_mode_only_in_carrying_its_stragglers():
    plain, cut, partial, process, both = (overlap.variant_flags(v) for v in overlap.VARIANTS)
    assert plain == {} and process == {"collection_process": "true"}  # the recipe's collection, in a child
    assert both == {**partial, "collection_process": "true"}  # the partial mode, its episodes in a child
    assert cut == {**overlap.CUT, "partial_rollouts": "false"} and partial == {
        **overlap.CUT,
        "partial_rollouts": "true",
    }
    with pytest.raises(ValueError, match="one of"):
        overlap.variant_flags("partial-ish")


def test_set_values_are_read_as_a_recipe_reads_them_and_decide_what_the_server_serves():
    settings = overlap.recipe_settings("recipes/errands.yaml", {"use_peft": "true", "learning_rate": "5.0e-4"})
    assert settings["use_peft"] is True and settings["learning_rate"] == 5e-4 and settings["environment"] == "errands"
    assert overlap.served_lora_rank(settings) == 16  # no lora_r in the recipe: TRL's default, as loop-train trains
    assert overlap.served_lora_rank(settings | {"lora_r": 8}) == 8
    assert overlap.served_lora_rank(overlap.recipe_settings("recipes/errands.yaml", {})) is None  # full weights
