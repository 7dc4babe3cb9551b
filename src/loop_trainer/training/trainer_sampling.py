"""The parts of a LOOP run that sample, as the trainer opens and releases them, and evaluation.

:class:`TrainerSampling` holds LOOPTrainer's generator (opened on first use: vLLM or the training model),
rollout engine and evaluator (:class:`~.rollout_resources.RolloutResources`), their release
(:meth:`~TrainerSampling.close`, or leaving ``with LOOPTrainer(...) as trainer:``), an iteration's
rollouts across processes (:meth:`~TrainerSampling.collect_rollouts`), and evaluation:
``evaluate_policy(split)`` and Trainer's ``evaluate()``. :class:`~.trainer.LOOPTrainer` builds the
resources and adds LOOP's loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from transformers import PreTrainedTokenizerBase

from ..chat import stop_token_ids
from ..evaluation import Evaluator, write_evaluation_viewer
from ..rollout import GenerationBackend, RolloutBatch, RolloutEngine, mix_seed
from ..rollout.generator import RolloutGenerator, build_generator
from ..rollout.sharding import collect_across_processes
from .logprobs import sequence_logprobs
from .rollout_resources import RolloutResources
from .trainer_hooks import TrainerHooks


class TrainerSampling(TrainerHooks):
    """The generator, rollout engine and evaluator of a LOOP run, and evaluation with them."""

    tokenizer: PreTrainedTokenizerBase
    rollout_resources: RolloutResources
    _custom_backend: GenerationBackend | None

    # --- The parts that sample, opened on demand (and released by close()) ---
    def _open_generator(self) -> RolloutGenerator:
        generator = build_generator(
            self.args,
            self.model,
            stop_token_ids=stop_token_ids(self.model, self.tokenizer),
            tokenizer=self.tokenizer,
            process_index=self.accelerator.process_index,
            is_main_process=self.accelerator.is_main_process,
            barrier=self.accelerator.wait_for_everyone,
            custom_backend=self._custom_backend,
            probe_scorer=lambda ids: sequence_logprobs(
                self.model_wrapped, ids, self.tokenizer.pad_token_id, self.accelerator.device, self.accelerator.autocast
            ),
        )
        if self.args.eval_split and self.args.eval_every:
            generator.check_evaluation()  # eval_temperature is honoured or refused now, not at iteration N
        return generator

    @property
    def generator(self) -> RolloutGenerator:
        return self.rollout_resources.generator

    @property
    def rollout_engine(self) -> RolloutEngine:
        return self.rollout_resources.engine

    @property
    def evaluator(self) -> Evaluator:
        return self.rollout_resources.evaluator

    def close(self) -> None:
        """Release what the trainer opened: rollout thread pools, the generator (a vLLM engine, its
        temporary files). The environment is its creator's to close. Safe to call twice; anything
        used afterwards is opened again."""
        self.overlap.close()  # a collection in flight finishes first: it uses the generator
        self.rollout_resources.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    # --- Rollouts ---
    def collect_rollouts(
        self, tasks: list[Mapping[str, Any]], collection_round: int = 0, iteration: int | None = None
    ) -> RolloutBatch:
        """Every process runs the episodes of its share of the tasks; all then see all results.
        ``collection_round``: the iteration's round of dynamic sampling (0: its first, LOOP's only).
        ``iteration`` (0-based; default: the one being trained): whose seed and label the rollouts get."""
        args = self.args
        step = self.state.global_step if iteration is None else iteration
        seed = mix_seed(args.seed, step) if collection_round == 0 else mix_seed(args.seed, step, collection_round)
        return collect_across_processes(
            self.rollout_engine,
            tasks,
            args.rollouts_per_task,
            num_processes=self.accelerator.num_processes,
            process_index=self.accelerator.process_index,
            seed=seed,
            description=f"iteration {step + 1} rollouts"
            + (f" (round {collection_round + 1})" if collection_round else ""),
            max_failed_fraction=args.max_failed_fraction,
            done_fraction=args.early_stop_done_fraction,
            task_fraction=args.early_stop_task_fraction,
        )

    # --- Evaluation ---
    def evaluate_policy(self, split: str | None = None) -> dict[str, float]:
        """Roll out every task of ``split`` (default ``args.eval_split``) ``eval_rollouts_per_task``
        times at ``eval_temperature`` (0: greedy); returns the environment's summary as ``eval_*``
        metrics (AppWorld: TGC and SGC overall and per difficulty). No update; the latest result
        also goes into the model card."""
        args, step = self.args, self.state.global_step
        split = split or args.eval_split
        if split is None:
            raise ValueError("LOOPTrainer.evaluate_policy(): give a split, or set args.eval_split")
        self.overlap.wait()  # max_staleness: the next batch is sampled by the policy before this sync
        synced = self.generator.sync(step)  # the generator samples the policy being evaluated
        result = self.evaluator.run(
            split,
            rollouts_per_task=args.eval_rollouts_per_task,
            seed=mix_seed(args.seed, 0xE7A1, step),
            max_tasks=args.eval_max_tasks,
        )
        self.generator.sleep()  # not awake through the checkpoint save that may follow
        self.latest_eval = {"split": split, "iteration": step, "metrics": dict(result.metrics)}
        if self.is_world_process_zero() and args.viewer_rollouts_per_iteration > 0:
            assert args.output_dir is not None  # TrainingArguments.__post_init__ gives it a default
            write_evaluation_viewer(
                result.rows,
                Path(args.output_dir) / "viewer" / f"eval-{split}-iteration-{step:05d}.html",
                title=f"{self.env.name}: {split} after iteration {step}",
            )
        return {**{f"eval_{key}": float(value) for key, value in result.metrics.items()}, **synced}

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Trainer's ``evaluate()``, LOOP's way: episodes on ``args.eval_split`` (:meth:`evaluate_policy`)."""
        if eval_dataset is not None or metric_key_prefix != "eval" or not self.args.eval_split:
            raise ValueError(
                "LOOPTrainer.evaluate() runs episodes on args.eval_split (set eval_split); it takes no "
                "eval_dataset or metric_key_prefix: call evaluate_policy(split) for another split"
            )
        metrics = self.evaluate_policy()
        self.log(metrics)
        return metrics
