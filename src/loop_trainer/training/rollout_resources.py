"""The parts of a run that sample: the generator, the rollout engine of the training iterations, the
evaluator and (``collection_process``) the child process that collects the batches queued ahead. Each is
opened on first use and all are released together by :meth:`close` (at the end of ``train()``, by
``LOOPTrainer.close()``); used again afterwards, they are opened anew."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..chat import ChatFormatter
from ..config import EpisodeSettings
from ..envs.base import Environment
from ..evaluation import Evaluator
from ..rollout import RolloutEngine
from ..rollout.collection_process import CollectionProcess
from ..rollout.collection_protocol import ChildTotals
from ..rollout.engine import EngineSetup
from ..rollout.env_metrics import EnvMetricsReader
from ..rollout.generator import RolloutGenerator


class RolloutResources:
    def __init__(
        self,
        env: Environment,
        formatter: ChatFormatter,
        settings: EpisodeSettings,
        *,
        open_generator: Callable[[], RolloutGenerator],
        eval_temperature: float,
        num_processes: int = 1,
        process_index: int = 0,
        show_progress: bool = False,
    ):
        self.env, self.formatter, self.settings = env, formatter, settings
        self.open_generator = open_generator
        self.eval_temperature = eval_temperature
        self.num_processes, self.process_index, self.show_progress = num_processes, process_index, show_progress
        self._generator: RolloutGenerator | None = None
        self._engine: RolloutEngine | None = None
        self._evaluator: Evaluator | None = None
        self._collection_process: CollectionProcess | None = None
        self._env_metrics = EnvMetricsReader(env, timeout=settings.env_timeout)

    @property
    def is_open(self) -> bool:
        parts = (self._generator, self._engine, self._evaluator, self._collection_process)
        return any(part is not None for part in parts)

    @property
    def generator(self) -> RolloutGenerator:
        if self._generator is None:
            self._generator = self.open_generator()
        return self._generator

    @property
    def engine(self) -> RolloutEngine:
        if self._engine is None:
            self._engine = self.engine_setup().build(self.generator.backend, self.show_progress)
        return self._engine

    def engine_setup(self) -> EngineSetup:
        settings = self.settings
        return EngineSetup(
            self.env,
            self.formatter,
            settings.episode_limits(),
            settings.env_timeout,
            settings.context_policy(),
            settings.concurrency_for(self.env.max_concurrent_episodes),
        )

    @property
    def collection_process(self) -> CollectionProcess:
        """A child process that collects batches with a copy of this engine's setup (``collection_process``)."""
        if self._collection_process is None:
            self._collection_process = CollectionProcess(self.engine_setup())
        return self._collection_process

    def running_totals(self) -> dict[str, float]:
        """The run's totals so far, logged each iteration: generation retries, abandoned environment calls, the
        environment's own metrics (``env_``) and the reads of its ``metrics()`` that got no answer, the collection
        process's added to this process's."""
        child = self._collection_process.totals if self._collection_process is not None else ChildTotals()
        totals = {
            "generation_retries": float(self.engine.generation_retries + child.generation_retries),
            "env_abandoned_calls": float(self.engine.abandoned_calls + child.abandoned_calls),
        }
        env_metrics = self._env_metrics.read()
        for key, value in child.env_metrics.items():
            env_metrics[key] = env_metrics.get(key, 0.0) + value
        failures = {"metrics_call_failures": float(self._env_metrics.failures + child.metrics_call_failures)}
        return totals | failures | {f"env_{key}": value for key, value in env_metrics.items()}

    @property
    def evaluator(self) -> Evaluator:
        if self._evaluator is None:
            self._evaluator = Evaluator(
                self.env,
                self.generator.for_evaluation(self.eval_temperature),
                self.formatter,
                self.settings,
                num_processes=self.num_processes,
                process_index=self.process_index,
                show_progress=self.show_progress,
            )
        return self._evaluator

    def close_collection_process(self, timeout: float | None = None) -> None:
        """End the collection process, if one is open (a batch it is collecting may finish first, within
        ``timeout``: by default its ``close_timeout``): what :meth:`close` does first, and what the trainer does
        before it waits for the batches queued ahead, so that a batch stuck in the child cannot hold that wait for
        ever."""
        if self._collection_process is not None:
            self._collection_process.close(timeout)
            self._collection_process = None  # only once closed: an interrupted close is tried again by close()

    def close(self) -> None:
        """Release thread pools and the generator (a vLLM engine, its temporary files); idempotent.
        The environment is its creator's to close."""
        self.close_collection_process()
        for part in (self._evaluator, self._engine, self._generator):
            if part is not None:
                part.close()
        self._evaluator = self._engine = self._generator = None

    def __enter__(self) -> RolloutResources:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()
