"""LOOPTrainer: Leave-One-Out PPO on TRL's GRPOTrainer plumbing.

GRPOTrainer provides model loading, PEFT, accelerate/DeepSpeed preparation, the fused log-prob LM
head, callbacks, logging, saving and ``push_to_hub``. LOOP replaces the training loop, because its
unit of work is an *iteration* (collect rollouts, then a data-dependent number of optimizer steps)
rather than a fixed stream of batches:

    tasks -> rollouts (multi-turn, concurrent) -> leave-one-out advantages -> drop |A| < threshold
          -> old log-probs (current policy, no grad) -> E epochs x shuffled minibatches -> step

Private TRL/transformers API used here, each pinned by tests/test_trl_contract.py:
``Trainer._inner_training_loop`` (overridden), ``Trainer._init_training_state``,
``Trainer._prepare_for_training``, ``Trainer._save_checkpoint`` and ``Trainer._get_output_dir``
(overridden to stage checkpoints), ``Trainer._load_rng_state``, the ``fused_lm_head=True`` forward
GRPOTrainer installs, and GRPOTrainer's ``eos_token_ids`` attribute.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import TrainOutput
from trl import GRPOTrainer

from .batching import TrainingSample, chunks, collate, minibatch_indices, token_logprobs
from ..chat import ChatFormatter
from ..config import LOOPConfig
from ..envs.base import Environment
from .checkpoints import CheckpointMixin
from .distribution import DistributedMixin
from ..evaluation import EvaluationMixin
from ..rollout.generator import VLLMGenerationMixin, require_vllm
from ..publishing.hub import LOOP_CITATION
from ..publishing.publisher import PublishingMixin
from ..objective import advantage_keep_mask, leave_one_out_advantages, loop_policy_loss
from .run_log import (
    CURVE_FILE,
    METRICS_FILE,
    IterationLineMixin,
    RolloutOutputsMixin,
    append_metrics,
    plot_learning_curve,
)
from ..rollout import EpisodeLimits, GenerationBackend, RolloutBatch, RolloutEngine, TransformersBackend, mix_seed
from .sampler import TaskSampler
from .stress import StressTestMixin

logger = logging.getLogger(__name__)
PLOT_INTERVAL_SECONDS = 10.0


class LOOPProgressCallback(IterationLineMixin, ProgressCallback):
    """transformers' progress bar over iterations, with one readable line per iteration."""


class LOOPPrinterCallback(IterationLineMixin, PrinterCallback):
    """One readable line per iteration when progress bars are disabled."""

def environment_reward(*_: Any, **__: Any) -> list[float]:
    """Placeholder for GRPOTrainer's required reward function: LOOP's rewards come from
    ``Episode.score`` and GRPO's reward path never runs."""
    raise RuntimeError("LOOPTrainer takes rewards from the environment; GRPO's reward functions are not used")


class LOOPTrainer(CheckpointMixin, EvaluationMixin, PublishingMixin, StressTestMixin, RolloutOutputsMixin,
                  VLLMGenerationMixin, DistributedMixin, GRPOTrainer):
    """Trains a policy with LOOP on an :class:`~loop_trainer.envs.Environment`.

    Args:
        model: a model id/path or a ``PreTrainedModel`` (as for ``GRPOTrainer``).
        env: the environment providing tasks and episodes.
        args: a :class:`LOOPConfig`.
        processing_class: the tokenizer (loaded from ``model`` if omitted); it needs a chat template.
        peft_config: e.g. a ``peft.LoraConfig``; the adapter is what gets trained.
        generation_backend: how rollouts are sampled; defaults to a colocated vLLM engine when
            ``args.use_vllm``, else to sampling with the training model.
    """

    _tag_names = ["trl", "loop"]
    _name = "LOOP"
    _paper = {
        "title": "Reinforcement Learning for Long-Horizon Interactive LLM Agents",
        "id": "2502.01600",
        "citation": LOOP_CITATION,
    }

    def __init__(
        self,
        model: str | PreTrainedModel,
        env: Environment,
        args: LOOPConfig | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        peft_config: Any | None = None,
        generation_backend: GenerationBackend | None = None,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = LOOPConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-LOOP")
        if not isinstance(args, LOOPConfig):
            raise TypeError(f"args must be a LOOPConfig, got {type(args).__name__}")
        use_vllm = args.use_vllm and generation_backend is None
        if use_vllm:
            require_vllm()
        tasks = env.tasks(args.train_split)
        if not isinstance(tasks, Dataset) or "task_id" not in tasks.column_names:
            raise ValueError(f"{type(env).__name__}.tasks() must return a datasets.Dataset with a 'task_id' column")
        # GRPOTrainer would start its own single-turn vLLM engine; LOOP builds one for episodes below.
        args.use_vllm = False
        try:
            super().__init__(
                model=model,
                reward_funcs=[environment_reward],
                args=args,
                train_dataset=tasks,
                processing_class=processing_class,
                callbacks=callbacks,
                optimizers=optimizers,
                peft_config=peft_config,
            )
        finally:
            args.use_vllm = use_vllm or args.use_vllm
        for stock, ours in ((ProgressCallback, LOOPProgressCallback), (PrinterCallback, LOOPPrinterCallback)):
            if self.pop_callback(stock) is not None:
                self.add_callback(ours)
        self.env = env
        tokenizer = self.processing_class
        tokenizer = tokenizer.tokenizer if isinstance(tokenizer, ProcessorMixin) else tokenizer
        self.tokenizer = tokenizer
        self.formatter = ChatFormatter(tokenizer, chat_template_kwargs=args.chat_template_kwargs)
        env.set_tokenizer(tokenizer)
        self._custom_backend = generation_backend is not None
        self._eval_engine: RolloutEngine | None = None
        self._eval_tasks: dict[str, list[Mapping[str, Any]]] = {}
        self.latest_eval: dict[str, Any] | None = None
        if generation_backend is not None:
            self.generation_backend = generation_backend
        elif use_vllm:
            self.generation_backend = self._build_vllm_backend()
        else:
            self.check_generation_under_zero3(samples_with_training_model=True)
            self.generation_backend = TransformersBackend(
                self.model,
                stop_token_ids=self.eos_token_ids,
                pad_token_id=tokenizer.pad_token_id,
                temperature=args.temperature,
                max_batch_size=args.generation_batch_limit,
            )
        self.rollout_engine = RolloutEngine(
            env,
            self.generation_backend,
            self.formatter,
            EpisodeLimits(args.max_turns, args.max_new_tokens_per_turn, args.max_trajectory_tokens),
            env_timeout=args.env_timeout,
            max_concurrent_episodes=min(args.max_concurrent_episodes, env.max_concurrent_episodes or args.max_concurrent_episodes),
            show_progress=not args.disable_tqdm and self.accelerator.is_local_main_process,
        )
        self.task_sampler = TaskSampler(len(tasks), seed=args.seed)
        self.history: list[dict[str, Any]] = []
        self._last_plot = -math.inf

    # ------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------
    def _inner_training_loop(
        self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None
    ) -> TrainOutput:
        args = self.args
        model = self.prepare_for_iterations(resume_from_checkpoint, trial)
        if args.memory_stress_test:
            self.run_memory_stress_test()
        if resume_from_checkpoint:
            self._load_rng_state(resume_from_checkpoint)
            self._restore_loop_state(resume_from_checkpoint)
        elif self.is_world_process_zero():
            (Path(args.output_dir) / METRICS_FILE).unlink(missing_ok=True)

        started = time.time()
        self._initial_num_input_tokens_seen = self.state.num_input_tokens_seen
        model.zero_grad()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        while self.state.global_step < args.iterations and not self.control.should_training_stop:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            record = self.run_iteration()
            self.state.global_step += 1
            if args.eval_split and args.eval_every and self.state.global_step % args.eval_every == 0:
                record.update(self.evaluate_policy())
            self.state.epoch = self.task_sampler.epoch + self.task_sampler.position / self.task_sampler.num_tasks
            record = {"iteration": self.state.global_step, **record}
            self._record(record)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.control.should_log:
                self.log({k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"})
            if self.control.should_save:
                self._save_checkpoint(model, trial)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
        self._plot(force=True)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        losses = [h["loss"] for h in self.history if math.isfinite(h.get("loss", math.nan))]
        metrics = {"train_runtime": time.time() - started, "iterations": self.state.global_step}
        if self.history:
            metrics["final_reward_mean"] = self.history[-1]["reward_mean"]
        return TrainOutput(self.state.global_step, sum(losses) / len(losses) if losses else 0.0, metrics)

    def prepare_for_iterations(self, resume_from_checkpoint: str | None = None, trial: Any = None) -> Any:
        """Create the training state, optimizer and scheduler and let accelerate wrap the model
        (``train()`` does this; call it yourself only to drive :meth:`run_iteration` by hand)."""
        args = self.args
        self.accelerator.free_memory()
        rollouts = args.tasks_per_iteration * args.rollouts_per_task
        # The scheduler needs a step count; the real one depends on how many rollouts are kept.
        max_optimizer_steps = args.iterations * args.ppo_epochs * math.ceil(rollouts / args.minibatch_size)
        self.check_distributed_launch()
        self.env.prepare()
        self._init_training_state(args.iterations, args.iterations, 1, resume_from_checkpoint, trial)
        self._enable_activation_checkpointing()
        model, _ = self._prepare_for_training(max_optimizer_steps, None, resume_from_checkpoint)
        return model

    def _enable_activation_checkpointing(self) -> None:
        # Trainer.train() switches checkpointing on before _inner_training_loop; driving iterations
        # by hand skips train(), and an uncheckpointed 32k-token backward would not fit.
        if not self.args.activation_checkpointing or getattr(self.model, "is_activation_checkpointing", True):
            return
        kwargs = dict(self.args.activation_checkpointing_kwargs or {})
        every_n_layers = kwargs.pop("every_n_layers", 1)
        offload = kwargs.pop("offload", False)
        self.model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
        )

    def run_iteration(self) -> dict[str, Any]:
        """One LOOP iteration: collect, advantages, filter, update. Returns its metrics."""
        args = self.args
        if self.optimizer is None:
            self.prepare_for_iterations()
        started = time.perf_counter()
        synced = self.sync_generator()
        tasks = [self.train_dataset[i] for i in self.task_sampler.next(args.tasks_per_iteration)]
        batch = self.collect_rollouts(tasks)
        self.sleep_generator()
        trajectories = batch.trajectories
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        groups = [t.group for t in trajectories]
        advantages = leave_one_out_advantages(rewards, groups, std_normalize=args.std_normalize_advantages)
        keep = advantage_keep_mask(advantages, args.advantage_threshold)
        samples = [
            TrainingSample.from_trajectory(t, float(a), args.max_training_tokens)
            for t, a, k in zip(trajectories, advantages.tolist(), keep.tolist(), strict=True)
            if k
        ]
        record: dict[str, Any] = {
            **batch.stats(),
            **synced,
            "num_kept": len(samples),
            "kept_fraction": len(samples) / len(trajectories) if trajectories else 0.0,
            "truncated_for_training": sum(s.truncated for s in samples),
            "tokens": sum(len(s.token_ids) for s in samples),
            "trained_sampled_tokens": sum(sum(s.loss_mask) for s in samples),
        }
        update_started = time.perf_counter()
        record.update(self.update_policy(samples) if samples else {"optimizer_steps": 0})
        record["update_seconds"] = time.perf_counter() - update_started
        record["learning_rate"] = self.optimizer.param_groups[0]["lr"]
        record["seconds"] = time.perf_counter() - started
        record["generation_retries"] = float(self.rollout_engine.generation_retries)
        record.update({f"env_{key}": value for key, value in self.env.metrics().items()})
        self.state.num_input_tokens_seen += record["tokens"]
        advantage_of = dict(zip(map(id, trajectories), advantages.tolist(), strict=True))
        if args.save_rollouts and self.is_world_process_zero():
            self._save_rollouts(batch, advantage_of)
        if args.viewer_rollouts_per_iteration > 0 and self.is_world_process_zero():
            self._write_viewer(batch, advantage_of)
        return record

    def collect_rollouts(self, tasks: list[Mapping[str, Any]]) -> RolloutBatch:
        """Every process runs the episodes of its share of the tasks; all then see all results."""
        args = self.args
        return self._collect(
            self.rollout_engine, tasks, args.rollouts_per_task, seed=mix_seed(args.seed, self.state.global_step),
            done_fraction=args.early_stop_done_fraction, task_fraction=args.early_stop_task_fraction,
            description=f"iteration {self.state.global_step + 1} rollouts",
        )

    def _collect(self, engine: RolloutEngine, tasks: list[Mapping[str, Any]], rollouts_per_task: int, *,
                 seed: int, description: str, **early_stop: float) -> RolloutBatch:
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        mine = list(range(rank, len(tasks), world))
        batch = engine.collect([tasks[i] for i in mine], rollouts_per_task, seed=seed, group_ids=mine,
                               max_failed_fraction=self.args.max_failed_fraction, description=description,
                               **early_stop)
        for trajectory in (*batch.trajectories, *batch.failed):
            trajectory.group = mine[trajectory.group]
        if world == 1:
            return batch
        parts = gather_object([batch])
        return RolloutBatch(
            trajectories=[t for part in parts for t in part.trajectories],
            failed=[t for part in parts for t in part.failed],
            num_cancelled=sum(part.num_cancelled for part in parts),
            seconds=max(part.seconds for part in parts),
        )

    # ------------------------------------------------------------------------------------------
    # The update
    # ------------------------------------------------------------------------------------------
    def update_policy(self, samples: list[TrainingSample]) -> dict[str, float]:
        """``ppo_epochs`` passes of shuffled minibatches over ``samples``, one optimizer step each."""
        args = self.args
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + self.state.global_step)
        schedule = [
            minibatch
            for _ in range(args.ppo_epochs)
            for minibatch in minibatch_indices(len(samples), args.minibatch_size, generator)
        ]
        mine = sorted({i for minibatch in schedule for i in self._share(minibatch)})
        # With several epochs a sample may be in several processes' shares; the lowest one counts it.
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        first_owner: dict[int, int] = {}
        for minibatch in schedule:
            for owner in range(world):
                for i in minibatch[owner::world]:
                    first_owner[i] = min(first_owner.get(i, owner), owner)
        counted = {i for i in mine if first_owner[i] == rank}
        old_logprobs, sampler_diff = self.compute_old_logprobs(samples, mine, counted)
        steps: list[dict[str, float]] = []
        skipped_nonfinite = 0
        aborted_on_kl = False
        for minibatch in schedule:
            step = self._minibatch_step(samples, old_logprobs, minibatch)
            if step is None:
                skipped_nonfinite += 1
                continue
            steps.append(step)
            if abs(step["kl"]) > args.kl_abort_threshold:
                logger.warning(
                    "iteration %d: KL estimate %.3g exceeds %.3g; step skipped, remaining updates aborted",
                    self.state.global_step + 1, step["kl"], args.kl_abort_threshold,
                )
                aborted_on_kl = True
                break
        taken = [s for s in steps if s["stepped"]]
        tokens = sum(s["num_tokens"] for s in steps) or 1.0

        def weighted(key: str) -> float:
            return sum(s[key] * s["num_tokens"] for s in steps) / tokens if steps else float("nan")

        return {
            "loss": sum(s["loss"] for s in taken) / len(taken) if taken else float("nan"),
            "clip_frac": weighted("clip_frac"),
            "kl": weighted("kl"),
            "ratio_mean": weighted("ratio_mean"),
            "ratio_min": min((s["ratio_min"] for s in steps), default=float("nan")),
            "ratio_max": max((s["ratio_max"] for s in steps), default=float("nan")),
            "grad_norm": sum(s["grad_norm"] for s in taken) / len(taken) if taken else float("nan"),
            "optimizer_steps": len(taken),
            "skipped_nonfinite_steps": skipped_nonfinite,
            "aborted_on_kl": int(aborted_on_kl),
            **sampler_diff,
        }

    def _share(self, minibatch: list[int]) -> list[int]:
        """This process's trajectories of a minibatch (round-robin over processes)."""
        return minibatch[self.accelerator.process_index :: self.accelerator.num_processes]

    @torch.no_grad()
    def compute_old_logprobs(
        self, samples: list[TrainingSample], indices: list[int] | None = None, counted: set[int] | None = None
    ) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
        """Log-probs of ``samples[i]`` for ``i`` in ``indices`` (default: all) under the current
        policy, in eval mode. The sampler comparison covers ``counted`` (default: all of them;
        with several processes each sample is counted by exactly one) and is combined over processes.

        LOOP takes its PPO denominator from the trainer, not the sampler; the sampler's
        log-probs are only compared, as a health check of the generation path.
        """
        indices = list(range(len(samples))) if indices is None else indices
        counted = set(indices) if counted is None else counted
        model = self.model_wrapped
        was_training = model.training
        model.eval()
        old: dict[int, torch.Tensor] = {}
        abs_diff_sum, abs_diff_max, count = 0.0, 0.0, 0
        work = list(chunks(indices, self.args.per_device_train_batch_size))
        real = len(work)
        if self._deepspeed_engine() is not None and self.accelerator.num_processes > 1:
            # Forward passes are collective under DeepSpeed: pad to the busiest process's count
            # with passes whose results are dropped.
            most = int(self.accelerator.gather(torch.tensor([real], device=self.accelerator.device)).max())
            work += [[indices[0] if indices else 0]] * (most - real)
        try:
            for k, chunk in enumerate(work):
                batch = collate([samples[i] for i in chunk], self.tokenizer.pad_token_id).to(self.accelerator.device)
                with self.accelerator.autocast():
                    logprobs = token_logprobs(model, batch).float()
                if k >= real:
                    continue
                rows = torch.tensor([i in counted for i in chunk], device=logprobs.device)[:, None]
                diff = (logprobs - batch.sampler_logprobs)[batch.loss_mask.bool() & rows].abs()
                if diff.numel():
                    abs_diff_sum += float(diff.sum())
                    abs_diff_max = max(abs_diff_max, float(diff.max()))
                    count += diff.numel()
                for row, i in enumerate(chunk):
                    old[i] = logprobs[row, : len(samples[i].token_ids)].cpu()
        finally:
            model.train(was_training)
        if self.accelerator.num_processes > 1:
            local = torch.tensor([[abs_diff_sum, float(count), abs_diff_max]], device=self.accelerator.device)
            every = self.accelerator.gather(local).reshape(-1, 3)
            abs_diff_sum, count, abs_diff_max = float(every[:, 0].sum()), int(every[:, 1].sum()), float(every[:, 2].max())
        return old, {
            "sampler_logprob_diff": abs_diff_sum / count if count else float("nan"),
            "sampler_logprob_diff_max": abs_diff_max,
        }

    def _minibatch_step(
        self, samples: list[TrainingSample], old_logprobs: dict[int, torch.Tensor], minibatch: list[int]
    ) -> dict[str, float] | None:
        """Accumulate the loss of one minibatch (this process's share), then one optimizer step.
        Returns None if the loss or the gradient norm was not finite (the step is skipped).

        Under DeepSpeed the engine is driven directly rather than through ``accelerator.backward``,
        which would take the optimizer step inside the last micro-batch's backward, before the
        loss and KL checks: every micro-batch's backward accumulates (the last one marks the
        accumulation boundary, where ZeRO finishes reducing), then, only if the step is kept,
        ``engine.step()`` computes the global pre-clip gradient norm, clips to
        ``gradient_clipping`` (= ``max_grad_norm``), updates and clears the gradients."""
        args, accelerator, model = self.args, self.accelerator, self.model_wrapped
        world = accelerator.num_processes
        engine = self._deepspeed_engine()
        size = args.per_device_train_batch_size
        # A process with no trajectory in this minibatch still runs a forward/backward (of a
        # zero-advantage stand-in: zero loss, zero gradient) so gradient collectives stay matched.
        # Under DeepSpeed every pass is collective: each process runs as many micro-batches as
        # process 0, which has the largest share, padding with stand-ins.
        micro_batches = [(indices, False) for indices in chunks(self._share(minibatch), size)]
        needed = math.ceil(math.ceil(len(minibatch) / world) / size) if engine is not None else 1
        micro_batches += [(minibatch[:1], True)] * (needed - len(micro_batches))
        # Each process divides by minibatch_size / world so that averaging gradients across
        # processes yields sum(trajectory losses) / minibatch_size, the paper's constant divisor.
        divisor = args.minibatch_size / world
        model.train()
        totals = dict.fromkeys(("loss", "clip", "kl", "ratio", "tokens"), 0.0)
        ratio_min, ratio_max = math.inf, -math.inf
        for i, (indices, stand_in) in enumerate(micro_batches):
            batch = collate([samples[j] for j in indices], self.tokenizer.pad_token_id).to(accelerator.device)
            old = torch.zeros_like(batch.sampler_logprobs)
            for row, j in enumerate(indices):
                if j in old_logprobs:
                    old[row, : old_logprobs[j].numel()] = old_logprobs[j]
            if stand_in:
                batch.advantages.zero_()
                batch.loss_mask.zero_()
            last = i == len(micro_batches) - 1
            if engine is not None:
                engine.set_gradient_accumulation_boundary(last)
                sync = contextlib.nullcontext()
            else:
                sync = contextlib.nullcontext() if last or world == 1 else accelerator.no_sync(model)
            with sync:
                with accelerator.autocast():
                    logprobs = token_logprobs(model, batch)
                out = loop_policy_loss(
                    logprobs, old, batch.advantages, batch.loss_mask, epsilon=args.epsilon, divisor=divisor
                )
                if engine is not None:
                    # scale_wrt_gas=False: the divisor already makes the accumulated gradient the
                    # minibatch's; DeepSpeed must not divide again by its gradient_accumulation_steps.
                    engine.backward(out.loss, scale_wrt_gas=False)
                else:
                    accelerator.backward(out.loss)
            n = float(out.num_tokens)
            totals["loss"] += float(out.loss.detach())
            totals["clip"] += float(out.clip_frac) * n
            totals["kl"] += float(out.kl) * n
            totals["ratio"] += float(out.ratio_mean) * n
            totals["tokens"] += n
            if n:
                ratio_min, ratio_max = min(ratio_min, float(out.ratio_min)), max(ratio_max, float(out.ratio_max))
        if world > 1:
            summed = accelerator.reduce(torch.tensor(list(totals.values()), device=accelerator.device), "sum")
            totals = dict(zip(totals, summed.tolist(), strict=True))
            extremes = accelerator.gather(torch.tensor([[ratio_min, -ratio_max]], device=accelerator.device))
            ratio_min, ratio_max = float(extremes[:, 0].min()), -float(extremes[:, 1].min())
        tokens = totals["tokens"] or 1.0
        step = {
            "loss": totals["loss"] / world,
            "clip_frac": totals["clip"] / tokens,
            "kl": totals["kl"] / tokens,
            "ratio_mean": totals["ratio"] / tokens,
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
            "num_tokens": totals["tokens"],
            "grad_norm": float("nan"),
            "stepped": False,
        }
        if not math.isfinite(step["loss"]):
            self._discard_gradients()
            logger.warning("iteration %d: non-finite loss, optimizer step skipped", self.state.global_step + 1)
            return None
        if abs(step["kl"]) > args.kl_abort_threshold:
            self._discard_gradients()
            return step
        if engine is not None:
            # ZeRO computes the norm over all partitions before clipping. A non-finite norm
            # (or an fp16 overflow) makes it skip the update and clear the gradients itself.
            engine.step()
            grad_norm, applied = engine.get_global_grad_norm(), engine.was_step_applied()
        else:
            grad_norm, applied = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm), True
        step["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        if not math.isfinite(step["grad_norm"]) or not applied:
            self._discard_gradients()
            logger.warning("iteration %d: non-finite gradient norm, optimizer step skipped", self.state.global_step + 1)
            return None
        # Under DeepSpeed accelerate's optimizer wrapper ignores step() and zero_grad() (the engine
        # did both), as its scheduler wrapper does when the scheduler is DeepSpeed's own (from the
        # DeepSpeed config; the engine stepped it). The Trainer's scheduler is stepped here.
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad()
        step["stepped"] = True
        return step

    # ------------------------------------------------------------------------------------------
    # Outputs
    # ------------------------------------------------------------------------------------------
    def _record(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if not self.is_world_process_zero():
            return
        append_metrics(self.args.output_dir, record)
        self._plot()

    def _plot(self, force: bool = False) -> None:
        # Redrawing costs ~0.3 s: often enough to watch a run, not every iteration of a fast one.
        if not self.args.plot_curves or not self.history or not self.is_world_process_zero():
            return
        if force or time.monotonic() - self._last_plot >= PLOT_INTERVAL_SECONDS:
            plot_learning_curve(self.history, Path(self.args.output_dir) / CURVE_FILE)
            self._last_plot = time.monotonic()

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.args.output_dir, METRICS_FILE)

    @property
    def curve_path(self) -> str:
        return os.path.join(self.args.output_dir, CURVE_FILE)
