"""``tiny-instruct:<env>``'s warm-up replays the environment's own episodes (one that hangs stops it with
one line after env_timeout instead of hanging ``loop-train`` before the first iteration), then trains for
``tiny_instruct_steps`` steps or until held-out demonstrations are fitted, reporting its progress."""

from __future__ import annotations

import threading

import pytest

from loop_trainer.envs import VaultEnv
from loop_trainer.models.tiny import (
    FitRule,
    SuccessProbe,
    assistant_masked_ids,
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
    rule = FitRule(check_every=10, window=20, min_gain=0.01, max_steps=400, cool_steps=0)
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
    rows = [assistant_masked_ids(tokenizer, m) for m in env.demonstrations(16, seed=1)]
    assert reply_accuracy(model, rows) == pytest.approx(max(accuracies), abs=5e-4)
    kept = [line for line in lines if "keeping step" in line]
    assert bool(kept) == (max(accuracies) > accuracies[-1])


def test_a_warm_up_at_its_step_limit_says_so_and_a_fixed_one_measures_nothing_held_out():
    env, model, tokenizer = tiny_vault()
    lines: list[str] = []
    rule = FitRule(check_every=5, window=50, max_steps=10, cool_steps=0)
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
    assert "reached its limit of 10 steps, still improving; set tiny_instruct_steps" in lines[-1]
    lines.clear()
    warm_start(model, tokenizer, conversations, steps=7, fit=rule, batch_size=4, report=lines.append)
    assert [line.split(", loss")[0] for line in lines] == ["warm-up: step 5/7", "warm-up: step 7/7"]
    assert not any("held-out" in line for line in lines)
    with pytest.raises(ValueError, match="held-out"):
        warm_start(model, tokenizer, conversations, steps=None)


def test_tiny_instruct_steps_reaches_the_warm_up(monkeypatch):
    from loop_trainer.cli import train_run as loop_train
    from loop_trainer.config import LOOPConfig

    seen = {}

    def fake_build(name, env, **kwargs):
        seen.update(kwargs)
        return "model", "tokenizer"

    from loop_trainer.training import model_loading

    monkeypatch.setattr(model_loading, "build_tiny_from_spec", fake_build)
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
    monkeypatch.setenv("LOOP_WARM_UP_CACHE", "0")  # the stand-in warm-up's weights are not to be kept
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
    rule = FitRule(check_every=10, window=20, min_gain=1.0, min_passes=min_passes, max_steps=400, cool_steps=0)  # flat
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


def test_a_warm_up_with_a_success_probe_stops_when_greedy_success_reaches_the_level_and_keeps_those_weights():
    """Where greedy success is a cliff in reply accuracy (errands), fitted means greedy success at the
    environment's level: probed at every check, from the first (no minimum of passes, no window), and the
    weights probed at the stop are the ones kept, even when an earlier check had a better accuracy."""
    env, model, tokenizer = tiny_vault()
    lines: list[str] = []
    rule = FitRule(check_every=5, window=10, min_gain=1.0, min_passes=100.0, max_steps=400, cool_steps=0)
    readings = iter([0.0, 0.1, 0.79, 0.8, 1.0])
    probed: list[dict[str, float]] = []

    def measure(probed_model):
        probed.append({name: float(value.sum()) for name, value in probed_model.state_dict().items()})
        success = next(readings)
        return {"success_rate": success, "success_rate_level_1": 1.0, "success_rate_level_2": success / 2}

    warm_start(
        model,
        tokenizer,
        env.demonstrations(64, seed=0),
        steps=None,
        held_out=env.demonstrations(8, seed=1),
        fit=rule,
        batch_size=8,
        report=lines.append,
        probe=SuccessProbe(measure, level=0.8, tasks=12),
    )
    assert len(probed) == 4  # steps 5, 10, 15, 20: stopped at the first reading >= 0.8
    probe_line = (
        "warm-up: step 15, greedy success on 12 training tasks 0.79 (level 1 1.00, level 2 0.40) (fitted at 0.8)"
    )
    assert probe_line in "\n".join(lines)
    assert lines[-1] == "warm-up: fitted at step 20 (greedy success 0.80 >= 0.8)"
    assert probed[-1] == {name: float(value.sum()) for name, value in model.state_dict().items()}
    assert not model.training


def test_a_warm_up_whose_environment_names_several_readings_stops_when_each_reaches_its_rate():
    """warm_up_success as a mapping: the mean reaching its rate is not enough while a named level lags."""
    env, model, tokenizer = tiny_vault()
    lines: list[str] = []
    readings = iter([(0.5, 0.1), (0.9, 0.5), (0.9, 0.8)])  # (success_rate, success_rate_level_3)

    def measure(_):
        mean, hardest = next(readings)
        return {"success_rate": mean, "success_rate_level_3": hardest}

    warm_start(
        model,
        tokenizer,
        env.demonstrations(32, seed=0),
        steps=None,
        held_out=env.demonstrations(4, seed=1),
        fit=FitRule(check_every=2, window=2, min_gain=1.0, min_passes=100.0, max_steps=50, cool_steps=0),
        batch_size=4,
        report=lines.append,
        probe=SuccessProbe(measure, level={"success_rate": 0.8, "success_rate_level_3": 0.8}, tasks=6),
    )
    assert (
        "warm-up: step 4, greedy success on 6 training tasks 0.90 (level 3 0.50) "
        "(fitted at success_rate 0.8, level 3 0.8)" in "\n".join(lines)
    )
    assert not any("fitted at step 4" in line for line in lines)
    assert lines[-1] == "warm-up: fitted at step 6 (greedy success 0.90 >= success_rate 0.8, level 3 0.8)"


def test_a_warm_up_success_the_probe_cannot_read_or_out_of_range_is_refused_with_one_line():
    from loop_trainer.models.tiny import checked_warm_up_success

    class Named(VaultEnv):
        warm_up_success = {"success_rate_level_4": 0.8}

    probe = SuccessProbe(lambda _: {}, level=Named.warm_up_success, tasks=4)
    with pytest.raises(ValueError) as caught:
        probe.reached({"success_rate": 1.0, "success_rate_level_1": 1.0})
    assert "\n" not in str(caught.value) and "success_rate_level_4" in str(caught.value)
    assert checked_warm_up_success(Named(num_tasks=4)) == {"success_rate_level_4": 0.8}
    for bad in (0, 1.5, True, "0.8", {}, {"success_rate": 2.0}, {1: 0.5}):
        Named.warm_up_success = bad
        with pytest.raises(ValueError) as caught:
            checked_warm_up_success(Named(num_tasks=4))
        assert "\n" not in str(caught.value) and "warm_up_success" in str(caught.value)


def test_a_warm_up_whose_probe_never_reaches_the_level_says_so_at_its_limit():
    env, model, tokenizer = tiny_vault()
    lines: list[str] = []
    conversations = env.demonstrations(32, seed=0)
    warm_start(
        model,
        tokenizer,
        conversations,
        steps=None,
        held_out=conversations[:4],
        fit=FitRule(check_every=5, window=5, min_gain=1.0, min_passes=0.0, max_steps=10, cool_steps=0),  # flat: 10
        batch_size=4,
        report=lines.append,
        probe=SuccessProbe(lambda _: {"success_rate": 0.5}, level=0.9, tasks=4),
    )
    assert not any("fitted at step" in line for line in lines)
    assert lines[-1 - any("keeping step" in line for line in lines)].startswith(
        "warm-up: reached its limit of 10 steps without greedy success 0.9"
    )


def test_the_probe_reaches_the_warm_up_only_where_the_environment_names_a_level(monkeypatch):
    """``warm_up_success`` (errands: 0.8) turns the probe on; vault names none, and a fixed count of steps
    (the demo's) never probes."""
    from loop_trainer.envs import ErrandsEnv
    from loop_trainer.models import tiny

    probes = []
    monkeypatch.setenv("LOOP_WARM_UP_CACHE", "0")  # every build warms up: none reads another's
    monkeypatch.setattr(tiny, "replay_demonstrations", lambda env, n, seed, timeout: [])
    monkeypatch.setattr(tiny, "warm_start", lambda *args, probe=None, **kwargs: probes.append(probe))
    greedy = lambda model, tokenizer, tasks: {"success_rate": 1.0}  # noqa: E731
    lines: list[str] = []
    for name, env, steps in [
        ("tiny-instruct:vault", VaultEnv(num_tasks=4), None),
        ("tiny-instruct:errands", ErrandsEnv(num_tasks=2), 400),
        ("tiny-instruct:errands", ErrandsEnv(num_tasks=2), None),
    ]:
        tiny.build_tiny_from_spec(name, env, warm_up_steps=steps, report=lines.append, greedy_success=greedy)
    assert probes[:2] == [None, None]
    assert probes[2].level == ErrandsEnv.warm_up_success == 0.8 and probes[2].tasks == FitRule().probe_tasks
    assert "until greedy success on 64 training tasks reaches 0.8" in lines[-1]


def test_the_tiny_model_has_the_depth_its_environment_declares():
    """``tiny_layers`` on the environment sets the decoder's depth for ``tiny:`` and ``tiny-instruct:`` alike;
    a depth that is not a positive whole number is refused with one line."""

    class DeepVault(VaultEnv):
        tiny_layers = 3

    lines: list[str] = []
    shallow, _ = build_tiny_from_spec("tiny:vault", VaultEnv(num_tasks=4))
    deep, _ = build_tiny_from_spec("tiny:vault", DeepVault(num_tasks=4))
    warmed, _ = build_tiny_from_spec(
        "tiny-instruct:vault", DeepVault(num_tasks=4), warm_up_steps=1, report=lines.append
    )
    assert shallow.config.num_hidden_layers == 2 and len(shallow.model.layers) == 2
    assert deep.config.num_hidden_layers == warmed.config.num_hidden_layers == 3 and len(deep.model.layers) == 3
    assert lines[0].startswith("tiny-instruct:vault (3 layers): replaying")

    for bad in (0, 2.5, True, "4"):
        DeepVault.tiny_layers = bad
        with pytest.raises(ValueError) as caught:
            build_tiny_from_spec("tiny:vault", DeepVault(num_tasks=4))
        assert "\n" not in str(caught.value) and "tiny_layers" in str(caught.value)


def test_the_greedy_probe_rolls_out_training_tasks_with_the_recipe_episode_limits():
    """What loop-train hands the warm-up: greedy success on the first tasks of the train split (the test split
    stays unseen), under the run's episode limits."""
    from loop_trainer.cli.evaluate import GreedySuccessOnTrainingTasks
    from loop_trainer.config import EpisodeSettings

    env, model, tokenizer = tiny_vault()
    seen, replies = [], []
    make_episode = env.episode

    def recorded(task):
        seen.append(task["task_id"])
        episode = make_episode(task)
        step = episode.step
        episode.step = lambda reply: replies.append(reply) or step(reply)
        return episode

    env.episode = recorded
    measure = GreedySuccessOnTrainingTasks(env, EpisodeSettings(max_turns=2, max_new_tokens_per_turn=3))
    assert measure(model, tokenizer, 4) == {"success_rate": 0.0}  # an untrained model solves nothing
    assert sorted(seen) == sorted(env.tasks("train")["task_id"][:4])
    assert 4 <= len(replies) <= 8 and all(len(reply.token_ids) <= 3 for reply in replies)
    warm_start(model, tokenizer, env.demonstrations(512, seed=0), steps=200, report=lambda _: None)
    limits = {"max_new_tokens_per_turn": 4, "max_trajectory_tokens": 1024}
    two_turns = GreedySuccessOnTrainingTasks(env, EpisodeSettings(max_turns=2, **limits))
    six_turns = GreedySuccessOnTrainingTasks(env, EpisodeSettings(max_turns=6, **limits))
    assert two_turns(model, tokenizer, 16)["success_rate"] == 0.0 < six_turns(model, tokenizer, 16)["success_rate"]


def test_the_greedy_probe_reads_success_by_level_where_the_environment_reports_levels():
    """errands summarises success by level; the probe hands those rates to the warm-up's progress lines."""
    from loop_trainer.cli.evaluate import GreedySuccessOnTrainingTasks
    from loop_trainer.config import EpisodeSettings
    from loop_trainer.envs import ErrandsEnv

    env = ErrandsEnv(num_tasks=2, levels=[1, 3])
    model, tokenizer = build_tiny_from_spec("tiny:errands", env)
    measure = GreedySuccessOnTrainingTasks(env, EpisodeSettings(max_turns=2, max_new_tokens_per_turn=3))
    nothing = {"success_rate": 0.0, "success_rate_level_1": 0.0, "success_rate_level_3": 0.0}
    assert measure(model, tokenizer, 4) == nothing


def test_a_warm_up_until_fitted_groups_its_draws_by_length_and_a_fixed_one_draws_as_before():
    import torch

    from loop_trainer.models.tiny import _length_grouped_batches

    rows = [([0] * length, [1] * length) for length in (5, 40, 9, 33, 17, 21, 2, 28)]
    drawn = torch.randint(len(rows), (4 * 3,), generator=torch.Generator().manual_seed(7)).tolist()
    grouped = _length_grouped_batches(rows, 4, 3, torch.Generator().manual_seed(7))
    assert sorted(i for batch in grouped for i in batch) == sorted(drawn)  # the same uniform draws, regrouped
    assert [len(batch) for batch in grouped] == [4, 4, 4]
    spans = sorted((min(len(rows[i][0]) for i in b), max(len(rows[i][0]) for i in b)) for b in grouped)
    assert all(spans[k][1] <= spans[k + 1][0] for k in range(2))  # batches do not overlap in length

    single = _length_grouped_batches(rows, 4, 1, torch.Generator().manual_seed(7))
    assert single == [torch.randint(len(rows), (4,), generator=torch.Generator().manual_seed(7)).tolist()]


def test_a_warm_up_until_fitted_ramps_the_fit_rules_rate_then_cools_it_and_a_fixed_one_keeps_adamws_defaults(
    monkeypatch,
):
    import torch

    optimizers: list[dict] = []

    class Recorded(torch.optim.AdamW):
        def __init__(self, params, **settings):
            optimizers.append({"betas": settings["betas"], "rates": []})
            super().__init__(params, **settings)

        def step(self, closure=None):
            optimizers[-1]["rates"].append(self.param_groups[0]["lr"])
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", Recorded)
    env, model, tokenizer = tiny_vault()
    conversations = env.demonstrations(16, seed=0)
    rule = FitRule(check_every=2, max_steps=4, learning_rate=4e-3, warmup_steps=2, adam_beta2=0.9, cool_steps=2)
    warm_start(model, tokenizer, conversations, steps=None, held_out=conversations[:2], fit=rule, batch_size=4)
    warm_start(model, tokenizer, conversations, steps=3, fit=rule, batch_size=4)
    warm_start(model, tokenizer, conversations, steps=2, fit=rule, batch_size=4, learning_rate=3e-3)
    until_fitted, fixed, fixed_rate = optimizers
    # at its limit (4 steps) it cools: 2 more steps, the rate falling linearly towards 0
    assert until_fitted["betas"] == (0.9, 0.9)
    assert until_fitted["rates"] == pytest.approx([2e-3, 4e-3, 4e-3, 4e-3, 4e-3 * 2 / 3, 4e-3 / 3])
    assert fixed == {"betas": (0.9, 0.999), "rates": [1e-3] * 3}  # the demo's record: AdamW's defaults at 1e-3
    assert fixed_rate == {"betas": (0.9, 0.999), "rates": [3e-3] * 2}


@pytest.mark.parametrize("decay", [0.5, None])
def test_a_warm_up_until_fitted_probes_and_keeps_the_moving_average_of_its_weights(monkeypatch, decay):
    """Every check measures the weights' exponential moving average (``average_decay``), from the weights the
    warm-up started with, and the model is left with the average where the cooling after the probe ends
    (``cool_steps``); ``None``: the last step's weights, as before. A fixed count of steps (the demo's) never
    averages."""
    import torch

    after_steps: list[dict[str, torch.Tensor]] = []

    class Recorded(torch.optim.AdamW):
        def step(self, closure=None):
            result = super().step(closure)
            after_steps.append({name: value.detach().clone() for name, value in model.named_parameters()})
            return result

    monkeypatch.setattr(torch.optim, "AdamW", Recorded)
    env, model, tokenizer = tiny_vault()
    started = {name: value.detach().clone() for name, value in model.named_parameters()}
    conversations = env.demonstrations(32, seed=0)
    probed: list[dict[str, torch.Tensor]] = []

    def measure(probed_model):
        probed.append({name: value.detach().clone() for name, value in probed_model.named_parameters()})
        return {"success_rate": [0.0, 1.0, 1.0][len(probed) - 1]}  # fitted at the second check, then 3 cooled steps

    rule = FitRule(check_every=3, max_steps=50, learning_rate=1e-2, warmup_steps=0, average_decay=decay, cool_steps=3)
    warm_start(
        model,
        tokenizer,
        conversations,
        steps=None,
        held_out=conversations[:2],
        fit=rule,
        batch_size=4,
        report=lambda _: None,
        probe=SuccessProbe(measure, level=0.8, tasks=4),
    )
    assert len(after_steps) == 9 and len(probed) == 3
    expected = dict(started)
    averages = []
    for weights in after_steps:
        expected = (
            {name: expected[name] + (1 - decay) * (weights[name] - expected[name]) for name in weights}
            if decay
            else weights
        )
        averages.append(expected)
    for probed_weights, step in zip(probed, (3, 6, 9), strict=True):
        for name, value in probed_weights.items():
            torch.testing.assert_close(value, averages[step - 1][name])
    final = dict(model.named_parameters())
    for name, value in averages[-1].items():
        torch.testing.assert_close(final[name].detach(), value)
    last_step_is_kept = all(torch.equal(final[name].detach(), value) for name, value in after_steps[-1].items())
    assert last_step_is_kept == (decay is None)

    after_steps.clear()
    warm_start(model, tokenizer, conversations, steps=2, fit=rule, batch_size=4)
    assert all(torch.equal(value.detach(), after_steps[-1][name]) for name, value in model.named_parameters())
