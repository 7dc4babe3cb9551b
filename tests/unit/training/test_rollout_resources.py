"""The run's sampling parts: the engine built from its setup, and the totals logged each iteration, a collection
process's added to the trainer's own."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from loop_trainer.chat import ChatFormatter
from loop_trainer.config import EpisodeSettings
from loop_trainer.envs.errands import ErrandsEnv
from loop_trainer.rollout.collection_protocol import ChildTotals
from loop_trainer.rollout.generator import RolloutGenerator
from loop_trainer.training.rollout_resources import RolloutResources
from support.helpers import ScriptedBackend


class RestartingEnv(ErrandsEnv):
    def metrics(self) -> dict[str, float]:
        return {"restarts": 1.0, "timeouts": 4.0}


def resources(tokenizer, env=None, env_timeout: float = 12.0, backend=None) -> RolloutResources:
    """A run's sampling parts, its generator on ``backend`` (default: one that replies "x")."""
    backend = backend or ScriptedBackend(tokenizer, lambda prompt: "x")
    return RolloutResources(
        env or RestartingEnv(num_tasks=1),
        ChatFormatter(tokenizer),
        EpisodeSettings(max_turns=5, max_concurrent_episodes=64, env_timeout=env_timeout),
        open_generator=lambda: RolloutGenerator(backend, owns_backend=False),
        eval_temperature=0.0,
    )


def test_the_engine_is_built_from_the_setup_a_collection_process_gets(qwen_tokenizer):
    env = RestartingEnv(num_tasks=1)
    env.max_concurrent_episodes = 16
    with resources(qwen_tokenizer, env) as parts:
        setup, engine = parts.engine_setup(), parts.engine
        assert (setup.env, setup.formatter, setup.env_timeout) == (env, parts.formatter, 12.0)
        assert setup.max_concurrent_episodes == 16  # bounded by what the environment runs
        assert (engine.limits, engine.env_timeout, engine.max_concurrent_episodes) == (setup.limits, 12.0, 16)
        assert engine.limits.max_turns == 5


def test_the_running_totals_add_the_collection_processs_to_the_trainers(qwen_tokenizer):
    with resources(qwen_tokenizer) as parts:
        assert parts.running_totals() == {
            "generation_retries": 0.0,
            "env_abandoned_calls": 0.0,
            "metrics_call_failures": 0.0,
            "env_restarts": 1.0,
            "env_timeouts": 4.0,
        }
        parts.engine.generation_retries = 2
        totals = ChildTotals(3, 1, {"restarts": 2.0, "retries": 5.0}, metrics_call_failures=2)
        child = SimpleNamespace(totals=totals, close=lambda timeout=None: None)
        parts._collection_process = child  # type: ignore[assignment]
        assert parts.running_totals() == {
            "generation_retries": 5.0,
            "env_abandoned_calls": 1.0,
            "metrics_call_failures": 2.0,
            "env_restarts": 3.0,
            "env_timeouts": 4.0,
            "env_retries": 5.0,
        }


class FailingMetricsEnv(ErrandsEnv):
    def metrics(self) -> dict[str, float]:
        raise ConnectionError("the environment's server is down")


def test_a_failing_metrics_does_not_end_the_iteration_it_is_counted(qwen_tokenizer):
    with resources(qwen_tokenizer, FailingMetricsEnv(num_tasks=1)) as parts:
        parts.running_totals()
        totals = parts.running_totals()
    assert totals == {"generation_retries": 0.0, "env_abandoned_calls": 0.0, "metrics_call_failures": 2.0}


class HangingMetricsEnv(ErrandsEnv):
    def __init__(self) -> None:
        super().__init__(num_tasks=1)
        self.release = threading.Event()

    def metrics(self) -> dict[str, float]:
        self.release.wait()
        return {"restarts": 1.0}


def test_a_hanging_metrics_is_bounded_by_env_timeout_and_counted(qwen_tokenizer, caplog):
    env = HangingMetricsEnv()
    try:
        with resources(qwen_tokenizer, env, env_timeout=0.05) as parts:
            assert parts.running_totals()["metrics_call_failures"] == 1.0
            assert parts.running_totals()["metrics_call_failures"] == 2.0
    finally:
        env.release.set()
    assert "metrics() did not return within env_timeout (0.05s)" in caplog.text
