"""``tiny-instruct:<env>``'s warm-up replays the environment's own episodes (one that hangs stops it with
one line after env_timeout instead of hanging ``loop-train`` before the first iteration), then trains for
``tiny_instruct_steps`` steps or until held-out demonstrations are fitted, reporting its progress."""

from __future__ import annotations

import threading

import pytest

from loop_trainer.envs import VaultEnv
from loop_trainer.models.tiny import (
    FitRule,
    _assistant_masked_ids,
    build_tiny_for_environment,
    build_tiny_from_spec,
    replay_demonstrations,
    reply_accuracy,
    warm_start,
)

NEVER = threading.Event()


class HangingVault(VaultEnv):
    name = "vault"

    def episode(self, task):
        episode = super().episode(task)
        episode.step = lambda reply: NEVER.wait()  # a step that never returns
        return episode


def test_a_hanging_environment_stops_the_warm_up_with_one_line():
    with pytest.raises(ValueError) as caught:
        build_tiny_from_spec("tiny-instruct:vault", HangingVault(num_tasks=4), env_timeout=0.5, warm_up_steps=400)
    message = str(caught.value)
    assert "\n" not in message and "env_timeout=0.5s" in message and "step() may hang" in message


def test_the_replay_returns_the_demonstrations_and_reraises_their_errors():
    env = VaultEnv(num_tasks=4)
    assert replay_demonstrations(env, 3, seed=0, timeout=60) == env.demonstrations(3, seed=0)

    class Broken(VaultEnv):
        def demonstrations(self, *args, **kwargs):
            raise RuntimeError("no demonstrations today")

    with pytest.raises(RuntimeError, match="no demonstrations today"):
        replay_demonstrations(Broken(num_tasks=4), 3, seed=0, timeout=60)


def tiny_vault():
    env = VaultEnv(num_tasks=16)
    model, tokenizer = build_tiny_for_environment(env.vocabulary(), seed=0)
    return env, model, tokenizer


def test_a_warm_up_without_a_step_count_stops_once_held_out_replies_are_fitted():
    env, model, tokenizer = tiny_vault()
    lines: list[str] = []
    rule = FitRule(check_every=10, window=20, min_gain=0.01, max_steps=400)
    warm_start(
        model,
        tokenizer,
        env.demonstrations(64, seed=0),
        steps=None,
        held_out=env.demonstrations(16, seed=1),
        fit=rule,
        batch_size=8,
        report=lines.append,
    )
    fitted = [line for line in lines if "fitted at step" in line]
    assert len(fitted) == 1, lines
    stopped_at = int(fitted[0].split("fitted at step ")[1].split()[0])
    assert 30 <= stopped_at < 400 and stopped_at % 10 == 0
    accuracies = [float(line.split("held-out reply accuracy ")[1].split(",")[0]) for line in lines if ", loss" in line][
        : stopped_at // 10
    ]
    assert len(accuracies) == stopped_at // 10
    assert accuracies[-1] - accuracies[-3] < 0.01  # what stopped it: under min_gain over the window
    assert accuracies[-1] > accuracies[0]  # it learned before it stopped
    # the model kept is the check with the best held-out accuracy: measured again on the same conversations
    rows = [_assistant_masked_ids(tokenizer, m) for m in env.demonstrations(16, seed=1)]
    assert reply_accuracy(model, rows) == pytest.approx(max(accuracies), abs=5e-4)
    kept = [line for line in lines if "keeping step" in line]
    assert bool(kept) == (max(accuracies) > accuracies[-1])


def test_a_warm_up_at_its_step_limit_says_so_and_a_fixed_one_measures_nothing_held_out():
    env, model, tokenizer = tiny_vault()
    lines: list[str] = []
    rule = FitRule(check_every=5, window=50, max_steps=10)
    conversations = env.demonstrations(32, seed=0)
    warm_start(
        model,
        tokenizer,
        conversations,
        steps=None,
        held_out=conversations[:4],
        fit=rule,
        batch_size=4,
        report=lines.append,
    )
    assert "stopped at its limit of 10 steps, still improving; set tiny_instruct_steps" in lines[-1]
    lines.clear()
    warm_start(model, tokenizer, conversations, steps=7, fit=rule, batch_size=4, report=lines.append)
    assert [line.split(", loss")[0] for line in lines] == ["warm-up: step 5/7", "warm-up: step 7/7"]
    assert not any("held-out" in line for line in lines)
    with pytest.raises(ValueError, match="held-out"):
        warm_start(model, tokenizer, conversations, steps=None)


def test_tiny_instruct_steps_reaches_the_warm_up(monkeypatch):
    from loop_trainer.cli import train as loop_train
    from loop_trainer.config import LOOPConfig

    seen = {}

    def fake_build(name, env, **kwargs):
        seen.update(kwargs)
        return "model", "tokenizer"

    monkeypatch.setattr(loop_train, "build_tiny_from_spec", fake_build)
    model_args = type("ModelArgs", (), {"model_name_or_path": "tiny-instruct:vault"})()
    for steps in (None, 250):
        args = LOOPConfig(output_dir="unused", tiny_instruct_steps=steps, use_cpu=True, report_to="none")
        assert loop_train.load_model_and_tokenizer(model_args, args, VaultEnv(num_tasks=4)) == ("model", "tokenizer")
        assert seen["warm_up_steps"] == steps


def test_a_warm_up_until_fitted_draws_many_demonstrations_and_a_fixed_one_the_demos_512(monkeypatch):
    """Repeating a few hundred demonstrations teaches memorising them (errands: greedy held-out success
    0.15 from 512, 0.97 from 8,192): until fitted, FitRule.conversations are drawn; a fixed count of steps
    keeps the 512 the demo's record was made with."""
    from loop_trainer.models import tiny

    drawn = []
    monkeypatch.setattr(tiny, "replay_demonstrations", lambda env, n, seed, timeout: drawn.append(n) or [])
    monkeypatch.setattr(tiny, "warm_start", lambda *args, **kwargs: None)
    tiny.build_tiny_from_spec("tiny-instruct:vault", VaultEnv(num_tasks=4), warm_up_steps=None, report=lambda _: None)
    assert drawn == [tiny.FitRule().conversations, tiny.FitRule().held_out_conversations] == [8192, 64]
    drawn.clear()
    tiny.build_tiny_from_spec("tiny-instruct:vault", VaultEnv(num_tasks=4), warm_up_steps=400, report=lambda _: None)
    assert drawn == [tiny.WARM_UP_CONVERSATIONS] == [512]


@pytest.mark.parametrize("min_passes,stop", [(0.0, 30), (5.0, 40)])
def test_a_warm_up_sees_every_demonstration_min_passes_times_before_it_may_stop(min_passes, stop):
    """A plateau before copying forms looks fitted to any window: the warm-up may stop only after
    ``min_passes`` over its demonstrations (64 conversations, 8 a step: 5 passes are 40 steps)."""
    env, model, tokenizer = tiny_vault()
    lines: list[str] = []
    rule = FitRule(check_every=10, window=20, min_gain=1.0, min_passes=min_passes, max_steps=400)  # always flat
    warm_start(
        model,
        tokenizer,
        env.demonstrations(64, seed=0),
        steps=None,
        held_out=env.demonstrations(8, seed=1),
        fit=rule,
        batch_size=8,
        report=lines.append,
    )
    assert rule.least_steps(64, 8) == 8 * min_passes
    assert [line for line in lines if "fitted at step" in line][0].startswith(f"warm-up: fitted at step {stop} ")
