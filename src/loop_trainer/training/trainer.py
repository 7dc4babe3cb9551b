"""LOOPTrainer: Leave-One-Out PPO with TRL's trainer API, on transformers' ``Trainer``.

One iteration reads top to bottom in :meth:`LOOPTrainer.run_iteration`:

    tasks -> rollouts (multi-turn, concurrent) -> leave-one-out advantages -> drop |A| < threshold
          -> policy update (old log-probs, E epochs x shuffled minibatches, one step each)

The work is done by collaborators, each in its own module (see docs/architecture.md): the model
loader (:mod:`.model_loading`), the generator (:mod:`..rollout.generator`), the rollout engine
(:mod:`..rollout.engine`), the policy update (:mod:`.update`) over a distribution strategy
(:mod:`.distribution`), the evaluator (:mod:`..evaluation`), the checkpoint stager (:mod:`.checkpoints`),
the Hub publisher (:mod:`..publishing.publisher`) and the run log (:mod:`.run_log`). transformers'
``Trainer`` keeps what users rely on: accelerate/DDP/DeepSpeed set-up, the optimizer and scheduler,
callbacks and ``report_to``, ``save_model``, checkpoint saving and rotation, the Hub repository.

Private ``transformers.Trainer`` API used by LOOPTrainer (here and in :mod:`.trainer_hooks`), each pinned by
tests/unit/training/test_trainer_hooks.py: ``_inner_training_loop`` (overridden: LOOP's loop),
``_init_training_state`` and ``_prepare_for_training`` (the training state, optimizer, scheduler and
accelerate/DeepSpeed wrapping, as ``Trainer.train`` builds them), ``_load_rng_state`` (resume),
``_save_checkpoint`` and ``_get_output_dir`` (overridden to stage checkpoints), ``_push_from_checkpoint``
(overridden: LOOP's upload of a checkpoint). No private TRL API.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import TrainOutput

from ..chat import ChatFormatter, stop_token_ids
from ..compat.trl.arguments import environment_for, loop_config_for
from ..config import LOOPConfig
from ..envs.base import Environment, load_tasks
from ..evaluation import Evaluator, write_evaluation_viewer
from ..objective import advantage_keep_mask, advantages_for
from ..publishing.publisher import HubPublisher
from ..rollout import GenerationBackend, RolloutBatch, RolloutEngine, mix_seed
from ..rollout.generator import RolloutGenerator, build_generator, require_vllm
from ..rollout.sharding import collect_across_processes
from .batching import TrainingSample
from .logprobs import sequence_logprobs
from .activation_checkpointing import checkpointing_kwargs, enable_checkpointing, is_checkpointing
from .checkpoints import CheckpointStager, read_loop_state
from .distribution import DistributionStrategy, check_launch, check_sampling_with_training_model
from .model_loading import load_model, load_tokenizer, wrap_for_training
from .resume import apply_setting_changes, plan_start
from .run_log import LOOPPrinterCallback, LOOPProgressCallback, RunLog
from .sampler import TaskSampler
from .trainer_hooks import TrainerHooks
from .stress import run_memory_stress_test
from .update import PolicyUpdate, UpdateSettings
from .rollout_resources import RolloutResources

logger = logging.getLogger(__name__)

RewardFuncs = Callable | Sequence[Callable]


class LOOPTrainer(TrainerHooks):
    """Trains a policy with LOOP on an :class:`~loop_trainer.envs.Environment`, or on what a TRL
    multi-turn script hands ``GRPOTrainer`` (same argument names, same order).

    Args:
        model: a model id/path or a ``PreTrainedModel`` (as for ``GRPOTrainer``).
        env: the environment providing tasks and episodes. The trainer prepares it; whoever
            created it closes it (``loop-train`` does). In its place, GRPOTrainer's agent arguments:
            ``reward_funcs`` (also accepted here, as GRPOTrainer's second argument), ``train_dataset``
            (a ``prompt`` column), ``eval_dataset`` (split ``eval``), ``tools`` and
            ``environment_factory``, with TRL's semantics (:mod:`loop_trainer.compat.trl.environment`);
            ``args.reward_weights`` and ``args.max_tool_calling_iterations`` apply to them.
        args: a :class:`LOOPConfig`; a ``GRPOConfig`` is translated (:mod:`loop_trainer.compat.trl.grpo_config`).
        processing_class: the tokenizer (loaded from ``model`` if omitted); it needs a chat template.
        peft_config: e.g. a ``peft.LoraConfig``; the adapter is what gets trained.
        quantization_config: passed on to model loading when ``model`` is an id, as by ``GRPOTrainer``.
        generation_backend: how rollouts are sampled; defaults to a colocated vLLM engine when
            ``args.use_vllm``, else to sampling with the training model.

    ``reward_processing_classes`` (reward models) and ``rollout_func`` are refused: LOOP's rewards are
    functions or the environment's, and its rollout engine runs the episodes.

    Use it as a context manager (or call :meth:`close`) to release its thread pools, generator
    and temporary files; :meth:`train` also releases them when it ends.
    """

    _name = "LOOP"
    _tag_names = ["trl", "loop"]  # the model is tagged with these (saved in its config)

    def __init__(self, model: str | PreTrainedModel, env: Environment | RewardFuncs | None = None,
                 args: LOOPConfig | None = None, train_dataset: Dataset | None = None, eval_dataset: Dataset | None = None,
                 processing_class: PreTrainedTokenizerBase | None = None, reward_processing_classes: Any = None,
                 callbacks: list[TrainerCallback] | None = None,
                 optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
                 quantization_config: Any = None, peft_config: Any | None = None, tools: list[Callable] | None = None,
                 rollout_func: Any = None, environment_factory: Callable | Mapping[str, Callable] | None = None, *,
                 reward_funcs: RewardFuncs | None = None, generation_backend: GenerationBackend | None = None):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = LOOPConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-LOOP")
        args = loop_config_for(args, train_dataset)  # a GRPOConfig is translated (compat.trl)
        env, self.trl_route = environment_for(
            env, args, reward_funcs=reward_funcs, train_dataset=train_dataset, eval_dataset=eval_dataset, tools=tools,
            environment_factory=environment_factory, reward_processing_classes=reward_processing_classes,
            rollout_func=rollout_func)
        use_vllm = args.use_vllm and generation_backend is None
        if use_vllm:
            require_vllm()
        tasks = load_tasks(env, args.train_split)  # one line for a broken task list, here rather than mid-run
        if args.eval_split and args.eval_every:
            load_tasks(env, args.eval_split)
        if args.tasks_per_iteration > len(tasks):
            logger.warning("tasks_per_iteration (%d) exceeds the %d tasks of split %r: each iteration holds some tasks "
                           "more than once (as separate leave-one-out groups)", args.tasks_per_iteration, len(tasks),
                           args.train_split)
        if isinstance(model, str):
            model = load_model(model, args, quantization_config)
        elif quantization_config is not None:
            raise ValueError("quantization_config applies when LOOPTrainer loads the model from an id; this model is "
                             "already loaded")
        self.tokenizer = load_tokenizer(model, processing_class)
        model = wrap_for_training(model, args, peft_config)
        if args.beta > 0 and not hasattr(model, "disable_adapter"):
            raise ValueError(f"LOOPConfig: beta={args.beta} needs a LoRA adapter (use_peft: true): LOOP's reference "
                             "policy is the base model with the adapter disabled, never a second copy of the model")
        super().__init__(model=model, args=args, data_collator=lambda rows: rows, train_dataset=tasks,
                         processing_class=self.tokenizer, callbacks=callbacks, optimizers=optimizers)
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)  # saved in the model's config: what trained it
        for stock, ours in ((ProgressCallback, LOOPProgressCallback), (PrinterCallback, LOOPPrinterCallback)):
            if self.pop_callback(stock) is not None:
                self.add_callback(ours)
        self.env = env
        env.set_tokenizer(self.tokenizer)
        self.formatter = ChatFormatter(self.tokenizer, chat_template_kwargs=args.chat_template_kwargs)
        self._custom_backend = generation_backend
        if generation_backend is None and not use_vllm:
            check_sampling_with_training_model(self.accelerator)
        self.rollout_resources = RolloutResources(
            env, self.formatter, args, open_generator=self._open_generator, eval_temperature=args.eval_temperature,
            num_processes=self.accelerator.num_processes, process_index=self.accelerator.process_index,
            show_progress=not args.disable_tqdm and self.accelerator.is_local_main_process)
        self.rollout_resources.generator  # built now: a setting it cannot honour stops the run before training starts
        self.task_sampler = TaskSampler(len(tasks), seed=args.seed)
        self.run_log = RunLog(args.output_dir, writes=self.is_world_process_zero(), env_name=env.name,
                              plot_curves=args.plot_curves, viewer_rollouts_per_iteration=args.viewer_rollouts_per_iteration,
                              save_rollouts=args.save_rollouts)
        self.checkpoints = CheckpointStager(args.should_save, self.accelerator.wait_for_everyone, args.save_total_limit)
        self.publisher = HubPublisher(args, self._card_context)
        self.policy_update: PolicyUpdate | None = None
        self.latest_eval: dict[str, Any] | None = None

    # --- The parts that sample, opened on demand (and released by close()) ---
    def _open_generator(self) -> RolloutGenerator:
        generator = build_generator(
            self.args, self.model, stop_token_ids=stop_token_ids(self.model, self.tokenizer), tokenizer=self.tokenizer,
            process_index=self.accelerator.process_index, is_main_process=self.accelerator.is_main_process,
            barrier=self.accelerator.wait_for_everyone, custom_backend=self._custom_backend,
            probe_scorer=lambda ids: sequence_logprobs(self.model_wrapped, ids, self.tokenizer.pad_token_id,
                                                      self.accelerator.device, self.accelerator.autocast))
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
        self.rollout_resources.close()

    def __enter__(self) -> LOOPTrainer:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    # --- The loop ---
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> TrainOutput:
        """Train for ``args.iterations`` iterations. ``resume_from_checkpoint`` (a checkpoint
        directory, or True for the newest complete one in ``output_dir``) continues a run exactly:
        the same next tasks and samples, the optimizer's state, the metrics so far.

        A fresh run refuses an ``output_dir`` holding another run's checkpoints unless
        ``args.overwrite_output_dir`` (which deletes that run first). A resume refuses settings that
        differ from the checkpoint's (:meth:`resume_settings`) unless
        ``args.resume_with_changed_settings``, which applies and records them."""
        plan = plan_start(self.args, resume_from_checkpoint, self.model, self.resume_settings, recipe=self.recipe_path,
                          is_main_process=self.is_world_process_zero(), barrier=self.accelerator.wait_for_everyone)
        checkpoint, self._resume_changes, self.setting_changes, self.recipe_path = plan
        try:
            return super().train(resume_from_checkpoint=checkpoint, trial=trial, **kwargs)
        finally:
            self.close()

    def _inner_training_loop(self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None,
                             ignore_keys_for_eval=None) -> TrainOutput:
        args = self.args
        model = self.prepare_for_iterations(resume_from_checkpoint, trial)
        if args.memory_stress_test:
            self.run_memory_stress_test()
        if resume_from_checkpoint:
            self._load_rng_state(resume_from_checkpoint)
            state = read_loop_state(resume_from_checkpoint)
            self.task_sampler.load_state_dict(state["task_sampler"])
            self.run_log.start(state["history"])
            apply_setting_changes(self._resume_changes, self.args, self.optimizer, self.lr_scheduler, self.task_sampler,
                                  decay_parameters=set(self.get_decay_parameter_names(self.model)),
                                  named_parameters=dict(self.model.named_parameters()),
                                  num_train_tasks=len(self.train_dataset))
        else:
            self.run_log.start()
        started = time.time()
        model.zero_grad()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        while self.state.global_step < args.iterations and not self.control.should_training_stop:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            record = self.run_iteration()
            self.state.global_step += 1
            if args.eval_split and args.eval_every and self.state.global_step % args.eval_every == 0:
                record.update(self.evaluate_policy())
            sampler = self.task_sampler
            self.state.epoch = sampler.epoch + sampler.position / sampler.num_tasks
            record = {"iteration": self.state.global_step, **record}
            self.run_log.record(record)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.control.should_log:
                self.log({k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"})
            if self.control.should_save:
                self._save_checkpoint(model, trial)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
        self.run_log.plot(force=True)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        losses = [h["loss"] for h in self.history if math.isfinite(h.get("loss", math.nan))]
        metrics = {"train_runtime": time.time() - started, "iterations": self.state.global_step}
        if self.history:
            metrics["final_reward_mean"] = self.history[-1]["reward_mean"]
        return TrainOutput(self.state.global_step, sum(losses) / len(losses) if losses else 0.0, metrics)

    def prepare_for_iterations(self, resume_from_checkpoint: str | None = None, trial: Any = None) -> Any:
        """Create the training state, optimizer and scheduler, let accelerate wrap the model and
        build the policy update (``train()`` does this; call it yourself only to drive
        :meth:`run_iteration` by hand)."""
        args = self.args
        self.accelerator.free_memory()
        rollouts = args.tasks_per_iteration * args.rollouts_per_task
        # The scheduler needs a step count; the real one depends on how many rollouts are kept.
        max_optimizer_steps = args.iterations * args.ppo_epochs * math.ceil(rollouts / args.minibatch_size)
        check_launch(self.accelerator)
        self.env.prepare()
        self._init_training_state(args.iterations, args.iterations, 1, resume_from_checkpoint, trial)
        self._enable_activation_checkpointing()
        model, _ = self._prepare_for_training(max_optimizer_steps, None, resume_from_checkpoint)
        strategy = DistributionStrategy(self.accelerator, self.model_wrapped, self.optimizer, self.lr_scheduler,
                                        args.max_grad_norm)
        reference = (lambda: self.accelerator.unwrap_model(self.model).disable_adapter()) if args.beta > 0 else None
        self.policy_update = PolicyUpdate(UpdateSettings.from_args(args, self.tokenizer.pad_token_id), strategy,
                                          self.accelerator.autocast, reference=reference)
        return model

    def run_memory_stress_test(self) -> float:
        """Forward and backward the longest trajectory the run allows, before iteration 1, so an
        out-of-memory error shows at start-up with the knobs to turn (see :mod:`.stress`)."""
        args = self.args
        if self.policy_update is None:
            self.prepare_for_iterations()
        return run_memory_stress_test(
            self.policy_update.strategy, self.accelerator.autocast, num_tokens=args.max_training_tokens,
            micro_batch_size=args.per_device_train_batch_size, vocab_size=len(self.tokenizer),
            pad_token_id=self.tokenizer.pad_token_id, epsilon=args.epsilon, divisor=args.minibatch_size)

    def _enable_activation_checkpointing(self) -> None:
        # Trainer.train() switches checkpointing on before _inner_training_loop; driving iterations
        # by hand skips train(), and an uncheckpointed 32k-token backward would not fit.
        if self.args.activation_checkpointing and not is_checkpointing(self.model):
            enable_checkpointing(self.model, checkpointing_kwargs(self.args))

    def run_iteration(self) -> dict[str, Any]:
        """One LOOP iteration: collect, advantages, filter, update. Returns its metrics."""
        args = self.args
        if self.policy_update is None:
            self.prepare_for_iterations()
        started = time.perf_counter()
        iteration = self.state.global_step  # 0-based: the iteration being trained
        if self.trl_route:
            self.env.trainer_state = self.state  # TRL's reward functions get trainer_state
        synced = self.generator.sync(iteration)
        tasks = [self.train_dataset[i] for i in self.task_sampler.next(args.tasks_per_iteration)]
        batch = self.collect_rollouts(tasks)
        self.generator.sleep()
        trajectories = batch.trajectories
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        advantages = advantages_for(args.advantage_estimator, rewards, [t.group for t in trajectories],
                                    std_normalize=args.std_normalize_advantages)
        keep = advantage_keep_mask(advantages, args.advantage_threshold)
        samples = [TrainingSample.from_trajectory(t, float(a), args.max_training_tokens)
                   for t, a, k in zip(trajectories, advantages.tolist(), keep.tolist(), strict=True) if k]
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
        record.update(self.policy_update(samples, iteration) if samples else {"optimizer_steps": 0})
        record["update_seconds"] = time.perf_counter() - update_started
        record["learning_rate"] = self.optimizer.param_groups[0]["lr"]
        record["seconds"] = time.perf_counter() - started
        record["generation_retries"] = float(self.rollout_engine.generation_retries)
        record["env_abandoned_calls"] = float(self.rollout_engine.abandoned_calls)
        record.update({f"env_{key}": value for key, value in self.env.metrics().items()})
        self.state.num_input_tokens_seen += record["tokens"]
        self.run_log.rollouts(iteration + 1, batch, dict(zip(map(id, trajectories), advantages.tolist(), strict=True)))
        return record

    def collect_rollouts(self, tasks: list[Mapping[str, Any]]) -> RolloutBatch:
        """Every process runs the episodes of its share of the tasks; all then see all results."""
        args = self.args
        return collect_across_processes(
            self.rollout_engine, tasks, args.rollouts_per_task, num_processes=self.accelerator.num_processes,
            process_index=self.accelerator.process_index, seed=mix_seed(args.seed, self.state.global_step),
            description=f"iteration {self.state.global_step + 1} rollouts", max_failed_fraction=args.max_failed_fraction,
            done_fraction=args.early_stop_done_fraction, task_fraction=args.early_stop_task_fraction)

    def update_policy(self, samples: list[TrainingSample]) -> dict[str, float]:
        """The policy update of the current iteration on ``samples`` (see :class:`PolicyUpdate`)."""
        if self.policy_update is None:
            self.prepare_for_iterations()
        return self.policy_update(samples, self.state.global_step)

    # --- Evaluation ---
    def evaluate_policy(self, split: str | None = None) -> dict[str, float]:
        """Roll out every task of ``split`` (default ``args.eval_split``) ``eval_rollouts_per_task``
        times at ``eval_temperature`` (0: greedy); returns the environment's summary as ``eval_*``
        metrics (AppWorld: TGC and SGC overall and per difficulty). No update; the latest result
        also goes into the model card."""
        args, step = self.args, self.state.global_step
        split = split or args.eval_split
        synced = self.generator.sync(step)  # the generator samples the policy being evaluated
        result = self.evaluator.run(split, rollouts_per_task=args.eval_rollouts_per_task,
                                    seed=mix_seed(args.seed, 0xE7A1, step), max_tasks=args.eval_max_tasks)
        self.generator.sleep()  # not awake through the checkpoint save that may follow
        self.latest_eval = {"split": split, "iteration": step, "metrics": dict(result.metrics)}
        if self.is_world_process_zero() and args.viewer_rollouts_per_iteration > 0:
            write_evaluation_viewer(result.rows, Path(args.output_dir) / "viewer" / f"eval-{split}-iteration-{step:05d}.html",
                                    title=f"{self.env.name}: {split} after iteration {step}")
        return {**{f"eval_{key}": float(value) for key, value in result.metrics.items()}, **synced}

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Trainer's ``evaluate()``, LOOP's way: episodes on ``args.eval_split`` (:meth:`evaluate_policy`)."""
        if eval_dataset is not None or metric_key_prefix != "eval" or not self.args.eval_split:
            raise ValueError("LOOPTrainer.evaluate() runs episodes on args.eval_split (set eval_split); it takes no "
                             "eval_dataset or metric_key_prefix: call evaluate_policy(split) for another split")
        metrics = self.evaluate_policy()
        self.log(metrics)
        return metrics
