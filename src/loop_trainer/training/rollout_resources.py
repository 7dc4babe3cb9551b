"""The parts of a run that sample: the generator, the rollout engine of the training iterations and
the evaluator. Each is opened on first use and all are released together by :meth:`close` (at the
end of ``train()``, by ``LOOPTrainer.close()``); used again afterwards, they are opened anew."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..chat import ChatFormatter
from ..config import EpisodeSettings
from ..envs.base import Environment
from ..evaluation import Evaluator
from ..rollout import RolloutEngine
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

    @property
    def is_open(self) -> bool:
        return any(part is not None for part in (self._generator, self._engine, self._evaluator))

    @property
    def generator(self) -> RolloutGenerator:
        if self._generator is None:
            self._generator = self.open_generator()
        return self._generator

    @property
    def engine(self) -> RolloutEngine:
        if self._engine is None:
            settings = self.settings
            self._engine = RolloutEngine(
                self.env,
                self.generator.backend,
                self.formatter,
                settings.episode_limits(),
                env_timeout=settings.env_timeout,
                context_policy=settings.context_policy(),
                show_progress=self.show_progress,
                max_concurrent_episodes=settings.concurrency_for(self.env.max_concurrent_episodes),
            )
        return self._engine

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

    def close(self) -> None:
        """Release thread pools and the generator (a vLLM engine, its temporary files); idempotent.
        The environment is its creator's to close."""
        for part in (self._evaluator, self._engine, self._generator):
            if part is not None:
                part.close()
        self._evaluator = self._engine = self._generator = None

    def __enter__(self) -> RolloutResources:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()
