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
        (["--partial-staleness", "1"], "--partial-staleness and --set apply to a --recipe"),
        (["--set", "use_peft=true"], "--partial-staleness and --set apply to a --recipe"),
        (["--recipe", "recipes/demo.yaml", "--partial-staleness", "0"], "partial rollouts need max_staleness >= 1"),
        (["--recipe", "recipes/demo.yaml", "--set", "use_peft"], "--set takes KEY=VALUE; got ['use_peft']"),
    ],
)
def test_modes_it_cannot_run_are_refused_in_one_line(argv, said, capsys):
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
    partial = overlap.summary(1, history, wall=14.0, partial=True)
    plain = overlap.summary(1, history, wall=14.0)
    assert (partial["mode"], partial["partial_rollouts"], plain["mode"]) == ("1+partial", True, "1")
    assert partial["carried_episodes"] == [1.0, 2.0, 3.0, 4.0] and partial["steady_iterations"] == 2
    assert overlap.CUT == {"early_stop_done_fraction": 0.9, "early_stop_task_fraction": 0.75}  # the paper's cut
