"""Evaluation: every task of a split rolled out K times, no update, summarised the environment's
way (:meth:`~loop_trainer.envs.Environment.summarize`). One pipeline, used by the trainer's
periodic evaluation and by ``loop-eval``, with the same episode settings (:class:`EpisodeSettings`).

    evaluator = Evaluator(env, backend, formatter, settings)
    result = evaluator.run("test", rollouts_per_task=2, seed=0)
    result.metrics  # env.summarize(rows) + num_rollouts, num_failed_to_run
    evaluator.close()  # its engine only: the environment belongs to whoever created it
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chat import ChatFormatter, stop_token_ids
from .config import EpisodeSettings
from .envs.base import Environment, load_tasks
from .rollout import GenerationBackend, RolloutEngine, mix_seed
from .rollout.backend import build_transformers_backend
from .rollout.sampling_parts import TransformersSamplingSettings
from .rollout.sharding import collect_share, gather_shares
from .trajectory import Trajectory
from .viewer import write_viewer

__all__ = ["EvaluationResult", "Evaluator", "evaluation_row", "format_metrics", "write_evaluation_viewer"]

TOKEN_LEVEL_FIELDS = ("token_ids", "loss_mask", "sampler_logprobs", "turn_ids")


def evaluation_row(trajectory: Trajectory) -> dict[str, Any]:
    """A trajectory as an evaluation result: token-level fields dropped, ``success`` a bool
    (the environment's; reward 1 where it defines none; False for a rollout that failed to run)."""
    # dataclasses.asdict less the token-level fields, which it would deep-copy only to drop (the
    # trainer builds a row per training rollout every iteration: AppWorld's hold 32k tokens each)
    row = {
        spec.name: copy.deepcopy(getattr(trajectory, spec.name))
        for spec in dataclasses.fields(trajectory)
        if spec.name not in TOKEN_LEVEL_FIELDS
    }
    if row["status"] != "completed":
        row["success"] = False
    elif row["success"] is None:
        row["success"] = row["reward"] >= 1.0
    return row


@dataclass
class EvaluationResult:
    rows: list[dict[str, Any]]
    """One per rollout, failures included, ordered by rollout index then task."""
    metrics: dict[str, float]
    """``env.summarize(rows)`` plus ``num_rollouts`` and ``num_failed_to_run``."""


class Evaluator:
    """Rolls out the tasks of a split with ``backend`` and summarises them. With several processes
    (``num_processes``, ``process_index``), each runs its share of the tasks and every process gets
    every row (call :meth:`run` on all of them)."""

    def __init__(
        self,
        env: Environment,
        backend: GenerationBackend,
        formatter: ChatFormatter,
        settings: EpisodeSettings,
        *,
        num_processes: int = 1,
        process_index: int = 0,
        show_progress: bool = False,
    ):
        self.env = env
        self.num_processes = num_processes
        self.process_index = process_index
        self.engine = RolloutEngine(
            env,
            backend,
            formatter,
            settings.episode_limits(),
            env_timeout=settings.env_timeout,
            context_policy=settings.context_policy(),
            max_concurrent_episodes=settings.concurrency_for(env.max_concurrent_episodes),
            show_progress=show_progress,
        )
        self._tasks: dict[tuple[str, int | None], list[Mapping[str, Any]]] = {}

    def tasks(self, split: str, max_tasks: int | None = None) -> list[Mapping[str, Any]]:
        """The first ``max_tasks`` tasks of ``split`` (all by default), read once."""
        if (split, max_tasks) not in self._tasks:
            tasks = load_tasks(self.env, split)
            if max_tasks is not None:
                tasks = tasks.select(range(min(max_tasks, len(tasks))))
            self._tasks[split, max_tasks] = list(tasks)
        return self._tasks[split, max_tasks]

    def run(
        self,
        split: str,
        *,
        rollouts_per_task: int = 1,
        seed: int | None = None,
        max_tasks: int | None = None,
        before_rollout: Callable[[int], None] | None = None,
    ) -> EvaluationResult:
        """Roll out every task of ``split`` ``rollouts_per_task`` times, one pass per rollout
        index k (every task once, then again): ``before_rollout(k)`` runs before pass k (e.g. to
        name AppWorld's experiment per pass), and pass k samples with ``mix_seed(seed, k)``.
        Failed rollouts are kept as unsuccessful rows; nothing is dropped or retried."""
        if rollouts_per_task < 1:
            raise ValueError(f"rollouts_per_task must be >= 1, got {rollouts_per_task}")
        tasks = self.tasks(split, max_tasks)
        rows: list[dict[str, Any]] = []
        for k in range(rollouts_per_task):
            if before_rollout is not None:
                before_rollout(k)
            description = f"evaluation on {split}" + (
                f" ({k + 1}/{rollouts_per_task})" if rollouts_per_task > 1 else ""
            )
            share = collect_share(
                self.engine,
                tasks,
                1,
                num_processes=self.num_processes,
                process_index=self.process_index,
                seed=None if seed is None else mix_seed(seed, k),
                description=description,
            )
            batch = gather_shares(share, self.num_processes)
            for trajectory in sorted((*batch.trajectories, *batch.failed), key=lambda t: t.group):
                trajectory.rollout = k
                rows.append(evaluation_row(trajectory))
        metrics = {
            **self.env.summarize(rows),
            "num_rollouts": float(len(rows)),
            "num_failed_to_run": float(sum(row["status"] != "completed" for row in rows)),
        }
        return EvaluationResult(rows, metrics)

    def close(self) -> None:
        """Release the engine's worker threads. The environment is left as it is."""
        self.engine.close()


class GreedySuccessOnTrainingTasks:
    """``probe(model, tokenizer, tasks)``: the greedy success rate of ``model`` on the first ``tasks`` tasks of
    ``env``'s train split, episodes limited by ``settings`` (what a ``tiny-instruct:`` warm-up whose environment
    names a ``warm_up_success`` stops on; the test split stays unseen): ``success_rate``, and the summary's other
    success rates (``errands``: ``success_rate_level_N`` for each level)."""

    def __init__(self, env: Environment, settings: EpisodeSettings) -> None:
        self.env = env
        self.settings = settings

    def __call__(self, model: Any, tokenizer: Any, tasks: int) -> dict[str, float]:
        self.env.prepare()  # a no-op once prepared
        model.eval()
        greedy = build_transformers_backend(
            model,
            TransformersSamplingSettings(temperature=0.0, max_batch_size=self.settings.generation_batch_limit),
            stop_token_ids=stop_token_ids(model, tokenizer),
            pad_token_id=tokenizer.pad_token_id,
        )
        evaluator = Evaluator(self.env, greedy, ChatFormatter(tokenizer), self.settings)
        try:
            metrics = evaluator.run("train", max_tasks=tasks, seed=0).metrics
            return {
                name: float(value)
                for name, value in metrics.items()
                if name.startswith("success_rate") and isinstance(value, (int, float))
            }
        finally:
            evaluator.close()

    def cache_key(self, tasks: int) -> dict[str, Any]:
        """What its readings depend on besides the model and the environment's code (a kept warm-up's key,
        :mod:`loop_trainer.models.warm_up_cache`): the episode settings and the tasks it runs."""
        self.env.prepare()
        episode = {f.name: getattr(self.settings, f.name) for f in dataclasses.fields(EpisodeSettings)}
        train = load_tasks(self.env, "train")
        return {"episode": episode, "tasks": list(train.select(range(min(tasks, len(train)))))}


def write_evaluation_viewer(rows: Sequence[Mapping[str, Any]], path: str | Path, *, title: str) -> Path:
    """The viewer page (every rollout, turn by turn) for evaluation rows, grouped by task."""
    return write_viewer(sorted(rows, key=lambda row: (str(row["task_id"]), row["rollout"])), path, title=title)


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """An evaluation's metrics, one ``name  value`` line each (numbers to 3 decimals)."""
    width = max((len(name) for name in metrics), default=0)
    return "\n".join(
        f"{name:<{width}}  {value:.3f}" if isinstance(value, float) else f"{name:<{width}}  {value}"
        for name, value in metrics.items()
    )
