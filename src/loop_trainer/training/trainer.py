"""LOOPTrainer: Leave-One-Out PPO with TRL's trainer API, on transformers' ``Trainer``.

One iteration reads top to bottom in :meth:`LOOPTrainer.run_iteration`:

    tasks -> rollouts (multi-turn, concurrent) -> leave-one-out advantages -> drop |A| < threshold
          -> policy update (old log-probs, E epochs x shuffled minibatches, one step each)

One class, in the order a run uses it: construction, the loop, the parts that sample and evaluation,
checkpoints and the Hub. The work is done by collaborators, each in its own module with typed settings of its
own (see docs/architecture.md): the model loader (:mod:`.model_loading`), the generator
(:mod:`..rollout.generator`), the rollout engine (:mod:`..rollout.engine`), the policy update
(:mod:`.update`) over a distribution strategy (:mod:`.distribution`), the evaluator (:mod:`..evaluation`),
the checkpoint stager (:mod:`.checkpoints`), resume (:mod:`.resume`), the overlapped collection
(:mod:`.overlap`), the Hub publisher (:mod:`..publishing.publisher`) and the run log (:mod:`.run_log`).
transformers' ``Trainer`` keeps what users rely on: accelerate/DDP/DeepSpeed set-up, the optimizer and
scheduler, callbacks and ``report_to``, ``save_model``, checkpoint saving and rotation, the Hub repository.

Private ``transformers.Trainer`` API used here, each pinned by tests/unit/training/test_trainer_hooks.py and
called with keywords: ``_inner_training_loop`` (overridden: LOOP's loop), ``_init_training_state`` and
``_prepare_for_training`` (the training state, optimizer, scheduler and accelerate/DeepSpeed wrapping, as
``Trainer.train`` builds them), ``_load_rng_state`` (resume), ``_save_checkpoint`` and ``_get_output_dir``
(overridden to stage checkpoints), ``_push_from_checkpoint`` (overridden: LOOP's upload of a checkpoint). No
private TRL API.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, TrainOutput

from ..chat import ChatFormatter, stop_token_ids
from ..compat.trl.arguments import environment_for, loop_config_for
from ..config import LOOPConfig, mapping_setting
from ..config.combinations import Generator, check_combinations
from ..config.loop_config import checkpointing_kwargs
from ..envs.base import Environment, load_tasks
from ..evaluation import Evaluator, write_evaluation_viewer
from ..publishing.publisher import HubPublisher
from ..rollout import GenerationBackend, RolloutBatch, RolloutEngine, TransformersBackend, mix_seed
from ..rollout.carried_groups import gather_carried, load_carried, save_carried
from ..rollout.collection_process import CollectionProcess, ContinuingInChild
from ..rollout.generator import RolloutGenerator, build_generator, require_vllm
from ..rollout.partial import CarriedGroup, ContinuingCollection
from ..rollout.sharding import collect_share, gather_shares, task_share
from ..rollout.weight_sync import is_peft
from .activation_checkpointing import activation_offloading, enable_checkpointing, is_checkpointing
from .batching import TrainingSample, training_samples
from .checkpoints import CheckpointStager, mark_finished, read_loop_state
from .distribution import DistributionStrategy, check_launch, optimizer_state_layout, zero_stage
from .dynamic_sampling import ScoredRollouts, collect_scored, score_rollouts
from .logprobs import sequence_logprobs
from .model_loading import load_policy, tiny_lora_base
from .overlap import OverlappedRollouts, staleness_metrics, tag_versions
from .reference import FrozenCopy
from .repartition import UniversalResume, mend_zero3_load, universal_resume
from .resume import OPTIMIZER_STATE_LAYOUT, TINY_BASE, apply_setting_changes, plan_start, resume_settings
from .rollout_resources import RolloutResources
from .run_log import LOOPPrinterCallback, LOOPProgressCallback, RunLog
from .sampler import task_sampler_for
from .settings import (
    card_settings,
    collection_settings,
    episode_settings,
    evaluation_settings,
    generator_settings,
    optimizer_hyperparameters,
    publisher_settings,
    recorded_keys,
    start_settings,
    tracker_settings,
    update_settings,
)
from .signals import collapse_warning, training_check_rates
from .stress import run_memory_stress_test
from .trackers import TrackerLog
from .update import PolicyUpdate

logger = logging.getLogger(__name__)

RewardFuncs = Callable | Sequence[Callable]


def _rows_as_they_are(rows: list[Any]) -> Any:
    """The data collator: LOOP's loop reads the tasks itself, the Trainer's data loader never collates."""
    return rows


class LOOPTrainer(Trainer):
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

    args: LOOPConfig  # any other arguments are translated into one
    model: PreTrainedModel | torch.nn.Module  # always given or loaded
    train_dataset: Dataset  # the training split's tasks: always passed to Trainer
    recipe_path: str | dict[str, Any] | None = None
    """The recipe the run came from (a path, or the effective values); uploaded as recipe.yaml."""
    run_settings: dict[str, Any] | None = None
    """Settings from outside LOOPConfig that shape the run, recorded in every checkpoint and compared on
    resume like LOOPConfig's recorded keys (``config/resume_policy.py``). ``loop-train`` sets ``environment``
    and ``environment_kwargs`` (its ScriptArguments); by default ``environment`` is ``env.name``."""
    setting_changes: Sequence[dict[str, Any]] = ()
    """Settings changed on resume (``resume_with_changed_settings``), oldest first: ``{"setting", "old",
    "new", "from_iteration"}``; kept in every later checkpoint."""

    def __init__(
        self,
        model: str | PreTrainedModel,
        env: Environment | RewardFuncs | None = None,
        args: LOOPConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        quantization_config: Any = None,
        peft_config: Any | None = None,
        tools: list[Callable] | None = None,
        rollout_func: Any = None,
        environment_factory: Callable | Mapping[str, Callable] | None = None,
        *,
        reward_funcs: RewardFuncs | None = None,
        generation_backend: GenerationBackend | None = None,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path or "model"
            name = str(name).rstrip("/").split("/")[-1].replace(":", "-")  # tiny-instruct:vault -> tiny-instruct-vault
            args = LOOPConfig(output_dir=f"{name}-LOOP")
        args = loop_config_for(args, train_dataset)  # a GRPOConfig is translated (compat.trl)
        env, self.trl_route, env_callbacks = environment_for(
            env,
            args,
            reward_funcs=reward_funcs,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            tools=tools,
            environment_factory=environment_factory,
            reward_processing_classes=reward_processing_classes,
            rollout_func=rollout_func,
        )
        use_vllm = args.use_vllm and generation_backend is None
        if use_vllm:
            require_vllm()
        tasks = load_tasks(env, args.train_split)  # one line for a broken task list, here rather than mid-run
        if args.eval_split and args.eval_every:
            load_tasks(env, args.eval_split)
        if args.tasks_per_iteration > len(tasks):
            logger.warning(
                "tasks_per_iteration (%d) exceeds the %d tasks of split %r: each iteration holds some tasks "
                "more than once (as separate leave-one-out groups)",
                args.tasks_per_iteration,
                len(tasks),
                args.train_split,
            )
        policy, self.tokenizer, self.reference_policy = load_policy(
            model, args, processing_class, quantization_config, peft_config, env
        )
        self._tiny_base = tiny_lora_base(model, env, args, peft_config)  # a base that a resume builds again
        super().__init__(
            model=policy,
            args=args,
            data_collator=_rows_as_they_are,
            train_dataset=tasks,
            processing_class=self.tokenizer,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        add_model_tags = getattr(self.model, "add_model_tags", None)
        if add_model_tags is not None:
            add_model_tags(self._tag_names)  # saved in the model's config: what trained it
        for stock, ours in ((ProgressCallback, LOOPProgressCallback), (PrinterCallback, LOOPPrinterCallback)):
            if self.pop_callback(stock) is not None:
                self.add_callback(ours)
        for callback in env_callbacks:  # the TRL route: the trainer's state for TRL's reward functions
            self.add_callback(callback)
        self.env = env
        env.set_tokenizer(self.tokenizer)
        self.formatter = ChatFormatter(
            self.tokenizer, chat_template_kwargs=mapping_setting(args.chat_template_kwargs, "chat_template_kwargs")
        )
        self._custom_backend = generation_backend
        # The combined-key checks again, now that the process count and the generation_backend are known.
        generator = (
            Generator.BUILT_IN
            if generation_backend is None
            else Generator.OWN_WEIGHTS
            if getattr(generation_backend, "holds_own_weights", False)
            else Generator.SHARED_WEIGHTS
        )
        launch = dataclasses.replace(
            args.launch(generator, self.accelerator.num_processes),
            zero_stage=zero_stage(self.accelerator),
            lora=is_peft(self.model),
        )
        check_combinations(args, launch)
        self.env_callbacks = env_callbacks
        self.collection_settings = collection_settings(args)
        self.evaluation_settings = evaluation_settings(args)
        self._sampling_parts: dict[str, bool] | None = None
        self.overlap = OverlappedRollouts(
            args.max_staleness, functools.partial(gather_shares, num_processes=self.accelerator.num_processes)
        )
        self._continuing: ContinuingCollection | ContinuingInChild | None = None  # partial_rollouts: at the first sync
        self._restored_groups: list[CarriedGroup] = []  # partial_rollouts: from the checkpoint resumed
        self._universal_resume: UniversalResume | None = None  # a ZeRO resume on another number of processes
        self.rollout_resources = RolloutResources(
            env,
            self.formatter,
            episode_settings(args),
            open_generator=self._open_generator,
            eval_temperature=self.evaluation_settings.temperature,
            num_processes=self.accelerator.num_processes,
            process_index=self.accelerator.process_index,
            show_progress=not args.disable_tqdm and self.accelerator.is_local_main_process,
        )
        # Built now: a setting the generator cannot honour stops the run before training starts (and an environment
        # that cannot go to a collection process).
        _ = self.rollout_resources.generator
        if args.collection_process:
            try:
                _ = self.rollout_resources.collection_process
            except BaseException:
                self.rollout_resources.close()  # the generator opened above
                raise
        self.task_sampler = task_sampler_for(tasks, args.seed, args.balance_tasks_by)
        assert args.output_dir is not None  # TrainingArguments.__post_init__ gives it a default
        self.run_log = RunLog(
            args.output_dir,
            writes=self.is_world_process_zero(),
            env_name=env.name,
            plot_curves=args.plot_curves,
            viewer_rollouts_per_iteration=args.viewer_rollouts_per_iteration,
            save_rollouts=args.save_rollouts,
        )
        # report_to's wandb / tensorboard: the trajectory tables, the curve image, the collapse alert
        self.trackers = TrackerLog(
            tracker_settings(args), self.callback_handler.callbacks, writes=self.is_world_process_zero()
        )
        self.checkpoints = CheckpointStager(args.should_save, self.accelerator.wait_for_everyone, args.save_total_limit)
        self.publisher = HubPublisher(publisher_settings(args), self._card_context)
        self.policy_update: PolicyUpdate | None = None
        self.latest_eval: dict[str, Any] | None = None

    # --- The loop ---
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """Train for ``args.iterations`` iterations. ``resume_from_checkpoint`` (a checkpoint
        directory, or True for the newest complete one in ``output_dir``) continues a run exactly:
        the same next tasks and samples, the optimizer's state, the metrics so far.

        A fresh run refuses an ``output_dir`` holding another run's checkpoints unless
        ``args.overwrite_output_dir`` (which deletes that run first). A resume refuses settings that
        differ from the checkpoint's (:meth:`resume_settings`) unless
        ``args.resume_with_changed_settings``, which applies and records them."""
        plan = plan_start(
            start_settings(self.args),
            resume_from_checkpoint,
            self.model,
            self.resume_settings,
            recipe=self.recipe_path,
            is_main_process=self.is_world_process_zero(),
            barrier=self.accelerator.wait_for_everyone,
        )
        checkpoint, self._resume_changes, self.setting_changes, self.recipe_path = plan
        try:
            return super().train(
                resume_from_checkpoint=checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
        finally:
            self.close()

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> Any:
        """Refused in one line. Trainer's own search builds each trial's model with a ``model_init``, which
        LOOPTrainer takes no argument for (a trial would need its own policy, generator and environment), and its
        refusal would ask for one."""
        raise NotImplementedError(
            "LOOPTrainer does not run hyperparameter_search (each trial would need its own policy, generator and "
            "environment): train one LOOPTrainer, or run one loop-train, per setting"
        )

    def _inner_training_loop(
        self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None
    ) -> TrainOutput:
        args = self.args
        model = self.prepare_for_iterations(resume_from_checkpoint, trial)
        if args.memory_stress_test:
            self.run_memory_stress_test()
        if resume_from_checkpoint:
            self._load_rng_state(checkpoint=resume_from_checkpoint)
            state = read_loop_state(resume_from_checkpoint)
            if not any(key == "balance_tasks_by" for key, _, _ in self._resume_changes):  # else another sampler's
                self.task_sampler.load_state_dict(state["task_sampler"])
            self.run_log.start(state["history"])
            self.overlap.load(resume_from_checkpoint)  # max_staleness: the batches that were in flight
            self._restored_groups = load_carried(  # partial_rollouts: the groups carried past the last cut
                resume_from_checkpoint, self.accelerator.num_processes, self.accelerator.process_index
            )
            apply_setting_changes(
                self._resume_changes,
                optimizer_hyperparameters(self.args),
                self.optimizer,
                self.lr_scheduler,
                self.task_sampler,
                decay_parameters=set(self.get_decay_parameter_names(self.model)),
                named_parameters=dict(self.model.named_parameters()),
                num_train_tasks=len(self.train_dataset),
            )
        else:
            self.run_log.start()
        started = time.time()
        model.zero_grad()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        self.trackers.start(self._tracker_run_settings())
        while self.state.global_step < args.iterations and not self.control.should_training_stop:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            record = self.run_iteration()
            self.state.global_step += 1
            evaluation = self.evaluation_settings
            if evaluation.periodic and self.state.global_step % evaluation.every == 0:
                record.update(self.evaluate_policy())
            sampler = self.task_sampler
            self.state.epoch = sampler.epoch + sampler.position / sampler.num_tasks
            record = {"iteration": self.state.global_step, **record}
            warning = collapse_warning([*self.history, record])
            if warning is not None and self.is_world_process_zero():
                logger.warning(warning)
                self.trackers.alert(warning, self.state.global_step)
            self.run_log.record(record)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.control.should_log:
                self.log({k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"})
            if self.control.should_save:
                self._save_checkpoint(model=model, trial=trial)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
        self.trackers.curve(self.run_log.plot(force=True), self.state.global_step)
        if self.state.global_step >= args.iterations and args.should_save:  # a later overwrite may delete it
            mark_finished(args.output_dir, self.state.global_step)
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
        self._init_training_state(
            max_steps=args.iterations,
            num_update_steps_per_epoch=args.iterations,
            num_train_epochs=1,
            resume_from_checkpoint=resume_from_checkpoint,
            trial=trial,
        )
        for callback in self.env_callbacks:  # the environment sees the state, also when iterations are driven by hand
            callback.on_train_begin(args, self.state, self.control)
        self._enable_activation_checkpointing()
        self._universal_resume = self._repartition(resume_from_checkpoint)
        model, _ = self._prepare_for_training(
            max_steps=max_optimizer_steps, train_dataloader=None, resume_from_checkpoint=resume_from_checkpoint
        )
        if self._universal_resume is not None:
            mended = mend_zero3_load(self.optimizer, self._universal_resume)
            if mended and self.is_world_process_zero():
                logger.info("resume_from_checkpoint: mended DeepSpeed's ZeRO-3 universal load: %s", "; ".join(mended))
        strategy = DistributionStrategy(
            self.accelerator, self.model_wrapped, self.optimizer, self.lr_scheduler, args.max_grad_norm
        )
        if isinstance(self.reference_policy, FrozenCopy):
            policy_dtype = next(self.accelerator.unwrap_model(self.model).parameters()).dtype
            self.reference_policy.to(self.accelerator.device, policy_dtype)
        self.policy_update = PolicyUpdate(
            update_settings(args, self.tokenizer.pad_token_id),
            strategy,
            self.accelerator.autocast,
            reference=self.reference_policy,
            activation_context=activation_offloading(
                self.accelerator.unwrap_model(self.model), args.activation_offloading
            ),
        )
        return model

    def _repartition(self, resume_from_checkpoint: str | None) -> UniversalResume | None:
        """Where ``resume_from_checkpoint`` was written under this launch's ZeRO stage on another number of
        processes: DeepSpeed's universal checkpoint, switched on in the launch's DeepSpeed config before the engine
        is built (:mod:`.repartition`); and off again where this trainer switched it on for an earlier start."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        config = plugin.deepspeed_config if plugin is not None else None
        if self._universal_resume is not None and config is not None:
            config.get("checkpoint", {}).pop("load_universal", None)
        if not resume_from_checkpoint:
            return None
        return universal_resume(
            resume_from_checkpoint,
            (read_loop_state(resume_from_checkpoint).get("settings") or {}).get(OPTIMIZER_STATE_LAYOUT),
            optimizer_state_layout(zero_stage(self.accelerator), self.accelerator.num_processes),
            config,
            is_main_process=self.is_world_process_zero(),
            all_gather=lambda value: gather_object([value]),
        )

    def _prepared_update(self) -> PolicyUpdate:
        """The policy update, after :meth:`prepare_for_iterations` (run now if it has not been)."""
        if self.policy_update is None:
            self.prepare_for_iterations()
        assert self.policy_update is not None  # prepare_for_iterations builds it
        return self.policy_update

    def run_memory_stress_test(self) -> float:
        """Forward and backward the longest trajectory the run allows, before iteration 1, so an
        out-of-memory error shows at start-up with the knobs to turn (see :mod:`.stress`)."""
        args = self.args
        policy_update = self._prepared_update()
        assert args.max_training_tokens is not None  # LOOPConfig.__post_init__ sets it
        return run_memory_stress_test(
            policy_update.strategy,
            self.accelerator.autocast,
            num_tokens=args.max_training_tokens,
            micro_batch_size=args.per_device_train_batch_size,
            vocab_size=len(self.tokenizer),
            pad_token_id=self.tokenizer.pad_token_id,
            epsilon=args.epsilon,
            divisor=args.minibatch_size,
            activation_context=policy_update.activation_context,
        )

    def _enable_activation_checkpointing(self) -> None:
        # Trainer.train() switches checkpointing on before _inner_training_loop; driving iterations
        # by hand skips train(), and an uncheckpointed 32k-token backward would not fit.
        if self.args.activation_checkpointing and not is_checkpointing(self.model):
            enable_checkpointing(self.model, checkpointing_kwargs(self.args))

    def run_iteration(self) -> dict[str, Any]:
        """One LOOP iteration: collect, advantages, filter, update. Returns its metrics."""
        args = self.args
        policy_update = self._prepared_update()
        started = time.perf_counter()
        iteration = self.state.global_step  # 0-based: the iteration being trained
        # max_staleness: collected ahead, during earlier updates, by an earlier policy (gathered here: a collective)
        ahead = self.overlap.take(iteration)
        synced = self._sync_generator(iteration)
        if ahead is None:
            scored, version = self._collect_scored(iteration), iteration
        else:
            scored, version = self._score(lambda _round, _num_tasks: ahead[0]), ahead[1]
        if args.max_staleness:
            if not args.partial_rollouts:  # partial rollouts record each turn's version as it is sampled
                tag_versions(scored.batch.trajectories, version)
            self._queue_ahead(iteration)
        if not self.overlap.iterations:
            if self._continuing is not None:  # the last batch is taken: nothing will train on what still runs
                self._continuing.cancel_in_flight()
            self.generator.sleep()
        batch, advantages = scored.batch, scored.advantages
        trajectories = batch.trajectories
        assert args.max_training_tokens is not None  # LOOPConfig.__post_init__ sets it
        kept = [(t, float(a)) for t, a, k in zip(trajectories, advantages.tolist(), scored.trained, strict=True) if k]
        # one sample per trajectory; one per segment of an episode a context policy split
        samples = [
            sample
            for index, (t, a) in enumerate(kept)
            for sample in training_samples(t, a, args.max_training_tokens, index)
        ]
        record: dict[str, Any] = {
            **batch.stats(),
            **scored.metrics,
            **training_check_rates(self.env, batch),
            **synced,
            **(staleness_metrics(trajectories, iteration) if args.max_staleness else {"policy_staleness": 0.0}),
            "num_kept": len(kept),
            "kept_fraction": len(kept) / len(trajectories) if trajectories else 0.0,
            "truncated_for_training": sum(s.truncated for s in samples),
            "tokens": sum(len(s.token_ids) for s in samples),
            "trained_sampled_tokens": sum(sum(s.loss_mask) for s in samples),
        }
        update_started = time.perf_counter()
        record.update(policy_update(samples, iteration) if samples else {"optimizer_steps": 0})
        if samples:
            self.generator.policy_updated()
        record["update_seconds"] = time.perf_counter() - update_started
        assert self.optimizer is not None  # prepare_for_iterations created it
        record["learning_rate"] = self.optimizer.param_groups[0]["lr"]
        record["seconds"] = time.perf_counter() - started
        record.update(self.rollout_resources.running_totals())
        self.state.num_input_tokens_seen += record["tokens"]
        advantage_of = dict(zip(map(id, trajectories), advantages.tolist(), strict=True))
        self.run_log.rollouts(iteration + 1, batch, advantage_of)
        trained = {id(t) for t, k in zip(trajectories, scored.trained, strict=True) if k}
        self.trackers.trajectories(iteration + 1, batch, advantage_of, trained)
        return record

    def _collect_scored(self, iteration: int) -> ScoredRollouts:
        """Iteration ``iteration``'s rollouts, collected now and scored, in as many rounds as dynamic sampling
        takes."""

        def collect_round(round_index: int, num_tasks: int) -> RolloutBatch:
            drawn = [self.train_dataset[i] for i in self.task_sampler.next(num_tasks)]
            return self.collect_rollouts(drawn, round_index, iteration=iteration)

        return self._score(collect_round)

    def _score(self, collect_round: Callable[[int, int], RolloutBatch]) -> ScoredRollouts:
        """The rollouts ``collect_round(round, num_tasks)`` returns, scored (:func:`collect_scored`)."""
        args = self.args
        return collect_scored(
            collect_round,
            functools.partial(
                score_rollouts,
                estimator=args.advantage_estimator,
                std_normalize=args.std_normalize_advantages,
                threshold=args.advantage_threshold,
            ),
            groups_wanted=args.tasks_per_iteration,
            extra_rounds=args.dynamic_sampling_rounds,
        )

    def _queue_ahead(self, iteration: int) -> None:
        """``max_staleness``: queue the batches of the next iterations up to ``iteration + max_staleness``, sampled
        by this policy (just synced), their tasks drawn now; let the generator forget the versions no queued batch
        needs."""
        args = self.args
        # Taken here, not on the collection thread: a batch that starts as the run closes then finds the process
        # closed, instead of opening another.
        collector = self.rollout_resources.collection_process if self.collection_settings.collection_process else None
        for ahead in self.overlap.to_queue(iteration, args.iterations):
            tasks = [self.train_dataset[i] for i in self.task_sampler.next(args.tasks_per_iteration)]
            sampler = self.generator.sampler(iteration)
            collect = functools.partial(self._collect_share, tasks, ahead, sampler, collector)
            self.overlap.start(ahead, iteration, collect)
        self.generator.release_versions_below(self.overlap.oldest_version(default=iteration))

    def _sync_generator(self, version: int) -> dict[str, float]:
        """Bring the generator to policy ``version`` (:meth:`RolloutGenerator.sync`). With partial rollouts the
        episodes carried across batches keep running: their turns being sampled finish first, and their next ones
        are sampled by the new policy."""
        if not self.args.partial_rollouts:
            return self.generator.sync(version)
        if self._continuing is not None:
            self._continuing.hold()
        try:
            synced = self.generator.sync(version)
        except BaseException:
            if self._continuing is not None:
                self._continuing.release()
            raise
        sampler = self.generator.sampler(version)
        if self._continuing is None:  # the first sync: nothing ran before it
            continuing = self._open_continuing(sampler)
            try:
                continuing.restore(self._restored_groups)
            except BaseException:
                continuing.close()  # the next sync opens another and restores the groups again
                raise
            self._continuing, self._restored_groups = continuing, []
        self._continuing.release(version, sampler)
        return synced

    def _open_continuing(self, sampler: GenerationBackend) -> ContinuingCollection | ContinuingInChild:
        """Partial rollouts' collection: on this process's collection thread, or held by the collection process
        (``collection_process``), which builds its engine with ``sampler``."""
        if self.collection_settings.collection_process:
            return self.rollout_resources.collection_process.continuing(self.args.max_staleness, sampler)
        return ContinuingCollection(self.rollout_engine, max_span=self.args.max_staleness)

    def _collect_share(
        self,
        tasks: list[Mapping[str, Any]],
        iteration: int,
        sampler: GenerationBackend,
        collector: CollectionProcess | None = None,
    ) -> RolloutBatch:
        """This process's share of iteration ``iteration``'s batch, sampled by ``sampler``; on the collection
        thread, so no collective (the shares are gathered when the batch is taken); ``collector`` (with
        ``collection_process``): by that child process, the thread waiting for it."""
        return self._share(tasks, iteration, sampler=sampler, collector=collector)

    def update_policy(self, samples: list[TrainingSample]) -> dict[str, float]:
        """The policy update of the current iteration on ``samples`` (see :class:`PolicyUpdate`)."""
        metrics = self._prepared_update()(samples, self.state.global_step)
        self.generator.policy_updated()
        return metrics

    # --- The parts that sample, opened on demand (and released by close()) ---
    def _open_generator(self) -> RolloutGenerator:
        generator = build_generator(
            dataclasses.replace(
                generator_settings(self.args), zero_stage=zero_stage(self.accelerator), device=self.accelerator.device
            ),
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
        backend = generator.backend
        if isinstance(backend, TransformersBackend):
            self._sampling_parts = {
                "static_decode": backend.static_decode,
                "compile_decode_step": backend.compile_decode_step,
                "merge_adapter_for_sampling": backend.merged_adapter is not None,
            }
        if self.evaluation_settings.periodic:
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
        """Release what the trainer opened: rollout thread pools, the collection process, the generator (a vLLM
        engine, its temporary files). The batches queued ahead (``max_staleness``) are dropped: those not started
        are cancelled, the one being collected finishes first (in a collection process, within its close's bound;
        then the process is ended). The environment is its creator's to close. Safe to call twice; anything used
        afterwards is opened again."""
        try:
            self.overlap.cancel_queued()  # the batches queued ahead and not started: nothing will take them now
            # The batch a collection process collects ends within its close's bound, or with the process: one stuck
            # in the child (a step blocking its event loop in C) would otherwise hold the waits below for ever.
            self.rollout_resources.close_collection_process()
        finally:
            try:
                self.rollout_resources.close_collection_process(timeout=0)  # if interrupted above: ended at once
            finally:
                self._close_collections()

    def _close_collections(self) -> None:
        """Wait for the collection under way, if any, then close the partial rollouts and the sampling parts."""
        try:
            self.overlap.close()  # a collection in flight finishes first: it uses the generator
        finally:
            try:
                if self._continuing is not None:
                    continuing, self._continuing = self._continuing, None
                    continuing.close()
            finally:
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
        step = self.state.global_step if iteration is None else iteration
        return gather_shares(self._share(tasks, step, collection_round), self.accelerator.num_processes)

    def _share(
        self,
        tasks: list[Mapping[str, Any]],
        iteration: int,
        collection_round: int = 0,
        sampler: GenerationBackend | None = None,
        collector: CollectionProcess | None = None,
    ) -> RolloutBatch:
        """This process's share of iteration ``iteration``'s rollouts (round ``collection_round``), sampled by
        ``sampler`` (default: the generator), collected by ``collector`` (default: the rollout engine, here); no
        collective."""
        settings = self.collection_settings
        seed = (
            mix_seed(settings.seed, iteration)
            if collection_round == 0
            else mix_seed(settings.seed, iteration, collection_round)
        )
        description = f"iteration {iteration + 1} rollouts" + (
            f" (round {collection_round + 1})" if collection_round else ""
        )
        if self._continuing is not None:  # partial rollouts: every turn sampled by the newest policy
            mine = task_share(len(tasks), self.accelerator.num_processes, self.accelerator.process_index)
            return self._continuing.collect(
                [tasks[i] for i in mine],
                settings.rollouts_per_task,
                iteration=iteration,
                task_indices=mine,
                num_tasks=len(tasks),
                seed=seed,
                done_fraction=settings.early_stop_done_fraction,
                task_fraction=settings.early_stop_task_fraction,
                max_failed_fraction=settings.max_failed_fraction,
                description=description,
                show_progress=self.rollout_engine.show_progress,
            )
        return collect_share(
            collector or self.rollout_engine,
            tasks,
            settings.rollouts_per_task,
            num_processes=self.accelerator.num_processes,
            process_index=self.accelerator.process_index,
            seed=seed,
            description=description,
            max_failed_fraction=settings.max_failed_fraction,
            backend=sampler,
            done_fraction=settings.early_stop_done_fraction,
            task_fraction=settings.early_stop_task_fraction,
        )

    # --- Evaluation ---
    def evaluate_policy(self, split: str | None = None) -> dict[str, float]:
        """Roll out every task of ``split`` (default ``args.eval_split``) ``eval_rollouts_per_task``
        times at ``eval_temperature`` (0: greedy); returns the environment's summary as ``eval_*``
        metrics (AppWorld: TGC and SGC overall and per difficulty). No update; the latest result
        also goes into the model card."""
        settings, step = self.evaluation_settings, self.state.global_step
        split = split or settings.split
        if split is None:
            raise ValueError("LOOPTrainer.evaluate_policy(): give a split, or set args.eval_split")
        self.overlap.wait()  # max_staleness: the next batch is sampled by the policy before this sync
        synced = self._sync_generator(step)  # the generator samples the policy being evaluated
        result = self.evaluator.run(
            split,
            rollouts_per_task=settings.rollouts_per_task,
            seed=mix_seed(settings.seed, 0xE7A1, step),
            max_tasks=settings.max_tasks,
        )
        self.generator.sleep()  # not awake through the checkpoint save that may follow
        self.latest_eval = {"split": split, "iteration": step, "metrics": dict(result.metrics)}
        if self.is_world_process_zero() and settings.viewer:
            assert self.args.output_dir is not None  # TrainingArguments.__post_init__ gives it a default
            write_evaluation_viewer(
                result.rows,
                Path(self.args.output_dir) / "viewer" / f"eval-{split}-iteration-{step:05d}.html",
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

    # --- Checkpoints ---
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self.create_model_card()  # the card travels with every checkpoint (and its periodic push)

        def loop_state() -> dict[str, Any]:
            return {
                "iteration": self.state.global_step,
                "task_sampler": self.task_sampler.state_dict(),
                "history": self.history,
                "settings": self.resume_settings(),
                "setting_changes": self.setting_changes,
            }

        self.overlap.settle()  # max_staleness: the batches in flight belong to the checkpoint (gathered: collective)
        carried = self._carried_for_checkpoint()
        with self.checkpoints.staged(
            super()._get_output_dir(trial=trial),
            self.state.global_step,
            loop_state,
            on_published=self._push_published_checkpoint,
        ) as staging:
            super()._save_checkpoint(model=model, trial=trial)
            if self.is_world_process_zero():
                checkpoint = Path(staging) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
                self.overlap.save(checkpoint)
                save_carried(carried, checkpoint)

    def _carried_for_checkpoint(self) -> list[CarriedGroup]:
        """Partial rollouts: the groups carried past the last cut, every process's, their episodes run to the end
        (a running episode cannot be saved; the run that goes on trains the same ones). A collective."""
        if self._continuing is None:
            return []
        self._continuing.finish_in_flight()
        return gather_carried(self._continuing.carried(), self.accelerator.num_processes)

    def resume_settings(self) -> dict[str, Any]:
        """The settings an exact resume depends on, as recorded in every checkpoint (:mod:`.resume`)."""
        return resume_settings(
            recorded_keys(self.args),
            env_name=self.env.name,
            num_train_tasks=len(self.train_dataset),
            model=self.accelerator.unwrap_model(self.model),
            run_settings={
                "sampling_parts": self.sampling_parts(),
                OPTIMIZER_STATE_LAYOUT: optimizer_state_layout(
                    zero_stage(self.accelerator), self.accelerator.num_processes
                ),
                TINY_BASE: self._tiny_base,
                **(self.run_settings or {}),
            },
        )

    def sampling_parts(self) -> dict[str, bool] | None:
        """The transformers backend's fast parts as resolved for this run (unset keys are decided by the device,
        so a resume on another kind of machine would sample differently): recorded and compared on resume. Read
        when the generator is built (the trainer builds it at construction), so asking never reopens one."""
        return self._sampling_parts

    def _get_output_dir(self, trial: Any) -> str:
        staging = self.checkpoints.staging_root
        return str(staging) if staging is not None else super()._get_output_dir(trial=trial)

    def _card_context(self) -> dict[str, Any]:
        model = self.accelerator.unwrap_model(self.model)
        return {
            "base_model": getattr(model.config, "_name_or_path", None) or None,
            "hub_model_id": self.hub_model_id or self.args.hub_model_id,
            "settings": card_settings(self.args),
            "peft_config": getattr(model, "peft_config", None),
            "environment": self.env.name,
            "iterations_done": self.state.global_step,
            "history": self.history,
            "eval_metrics": self.latest_eval,
            "recipe_path": self.recipe_path,
            "setting_changes": self.setting_changes,
        }

    def create_model_card(  # type: ignore[override]  # TRL's signature (GRPOTrainer's), not Trainer's
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: list[str] | None = None,
        license: str | None = None,
        **_: Any,
    ) -> None:
        """Write LOOP's model card (README.md) to ``output_dir`` (before every checkpoint, and by push_to_hub)."""
        if self.is_world_process_zero():
            assert self.args.output_dir is not None  # TrainingArguments.__post_init__ gives it a default
            self.publisher.write_card(self.args.output_dir, model_name=model_name, tags=tags, license=license)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        merge_adapter: bool = False,
        **kwargs: Any,
    ):
        """Upload the adapter (merged weights only with ``merge_adapter=True``), the tokenizer and
        its chat template, the recipe, the metrics and the model card."""
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        assert self.hub_model_id is not None  # init_hf_repo set it on the main process
        self.publisher.wait()  # periodic pushes first, so the final one lands last
        return self.publisher.upload_run(
            repo_id=self.hub_model_id,
            token=token,
            revision=revision if revision is not None else self.args.hub_revision,
            commit_message=commit_message or "End of training",
            merge_adapter=merge_adapter,
            blocking=blocking,
            **kwargs,
        )

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # Called inside Trainer._save_checkpoint with the *staging* folder.
        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return
        if not self.args.hub_always_push and self.publisher.busy():
            return  # as Trainer: skip this push while the last one runs, unless hub_always_push
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        assert self.hub_model_id is not None  # push_to_hub: Trainer.__init__ created the repository (main process)
        self.publisher.track(
            self.publisher.upload_checkpoint_model(
                checkpoint_folder,
                repo_id=self.hub_model_id,
                iteration=self.state.global_step,
                tokenizer=self.processing_class,
            )
        )

    def _push_published_checkpoint(self, checkpoint: Path) -> None:
        if self.hub_model_id is None:  # no repository: no upload of this checkpoint is pending
            return
        self.publisher.track(
            self.publisher.upload_published_checkpoint(
                checkpoint, repo_id=self.hub_model_id, iteration=self.state.global_step
            )
        )

    # --- The run log and the trackers ---
    def _tracker_run_settings(self) -> dict[str, Any]:
        """What the trackers get besides LOOPConfig (which transformers' callbacks send): the environment."""
        return {
            "environment_name": self.env.name,
            "num_train_tasks": len(self.train_dataset),
            **(self.run_settings or {}),
        }

    @property
    def tracker_locations(self) -> dict[str, str]:
        """Where each ``report_to`` tracker's run is (wandb's run directory or URL, tensorboard's logdir), once
        training has begun."""
        return dict(self.trackers.locations)

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.run_log.history

    @property
    def metrics_path(self) -> str:
        return str(self.run_log.metrics_path)

    @property
    def curve_path(self) -> str:
        return str(self.run_log.curve_path)
