"""``tiny-instruct:<env>``'s warm-up replays the environment's own episodes: one that hangs stops it with
one line after env_timeout instead of hanging ``loop-train`` before the first iteration."""

from __future__ import annotations

import threading

import pytest

from loop_trainer.envs import VaultEnv
from loop_trainer.models.tiny import build_tiny_from_spec, replay_demonstrations

NEVER = threading.Event()


class HangingVault(VaultEnv):
    name = "vault"

    def episode(self, task):
        episode = super().episode(task)
        episode.step = lambda reply: NEVER.wait()  # a step that never returns
        return episode


def test_a_hanging_environment_stops_the_warm_up_with_one_line():
    with pytest.raises(ValueError) as caught:
        build_tiny_from_spec("tiny-instruct:vault", HangingVault(num_tasks=4), env_timeout=0.5)
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
