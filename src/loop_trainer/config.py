"""LOOPConfig: GRPOConfig plus LOOP's own knobs, with the paper's settings as defaults.

LOOPConfig inherits every field of TRL's ``GRPOConfig`` (and transformers' ``TrainingArguments``),
but LOOP honours only some of them. Each inherited field is in exactly one of two tables below:
:data:`HONOURED_INHERITED_KEYS` (LOOP or the Trainer machinery it keeps reads it) or
:data:`REFUSED_INHERITED_KEYS` (set away from its default, construction stops with one line naming
the key and LOOP's equivalent). ``tests/test_config_keys.py`` fails when a TRL/transformers upgrade
adds a field that is in neither, so no key is ever silently ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.trainer_utils import SaveStrategy
from trl import GRPOConfig

from .episode_settings import EpisodeSettings

# Inherited fields LOOP honours: read by LOOP's own code (trainer, rollout generator, publisher, CLI),
# or by the transformers/TRL machinery LOOPTrainer keeps (model loading, optimizer and scheduler,
# accelerate/DDP/DeepSpeed set-up, callbacks and trackers, checkpoint saving and rotation, the Hub).
HONOURED_INHERITED_KEYS = frozenset({
    # run identity, seeding, resuming
    "output_dir", "seed", "full_determinism", "resume_from_checkpoint", "restore_callback_states_from_checkpoint",
    # model loading and preparation (GRPOTrainer.__init__, the CLI)
    "model_init_kwargs", "trust_remote_code", "disable_dropout", "cast_lm_head_to_fp32", "chat_template_kwargs",
    "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs",
    # optimizer and schedule (Trainer.create_optimizer / create_scheduler)
    "optim", "optim_args", "optim_target_modules", "adam_beta1", "adam_beta2", "adam_epsilon",
    "lr_scheduler_kwargs", "warmup_steps",
    # precision and devices
    "bf16", "fp16", "tf32", "use_cpu", "debug",
    # distribution (accelerate, DDP, DeepSpeed)
    "accelerator_config", "deepspeed", "local_rank", "ddp_backend", "ddp_timeout", "ddp_find_unused_parameters",
    "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph",
    # logging, progress, trackers (callbacks, in iterations)
    "logging_strategy", "logging_first_step", "log_level", "log_level_replica", "log_on_each_node", "disable_tqdm",
    "run_name", "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
    # checkpoints and the Hub
    "save_on_each_node", "push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo",
    "hub_always_push", "hub_revision",
    # generation with vLLM (rollout/generator.py)
    "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_enable_sleep_mode",
    "vllm_max_model_length", "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
})

# Why a refused key means nothing for LOOP, shared by related keys.
_LOSS = ("its loss is the per-token clipped PPO objective of the paper, token mean per trajectory, "
         "constant divisor minibatch_size")
_NO_REFERENCE = "LOOP has no KL penalty and no reference model"
_NO_ENTROPY = "LOOP's objective has no entropy term"
_OLD_LOGPROBS = "LOOP's ratio uses old log-probs the training model recomputes, not vLLM's"
_REWARDS = "rewards come from the environment's episodes"
_EVALUATION = "LOOP evaluates by running episodes on eval_split every eval_every iterations"
_TASKS = "LOOP samples tasks_per_iteration tasks from the environment itself, seeded by seed"
_TRAINER_LOOP = "it belongs to the Trainer's training step, which LOOP replaces"
_SAMPLING = "LOOP samples with temperature only"
_UNTESTED = "LOOP is not tested with it (the model is neither compiled nor patched)"
_GENERATION = "LOOP generates multi-turn episodes with its own backends (use_vllm, generation_batch_limit)"

# Inherited fields LOOP does not use: key -> (LOOP's equivalent key or None, why).
REFUSED_INHERITED_KEYS: dict[str, tuple[str | None, str]] = {
    # --- the length of the run and the update -------------------------------------------------------------
    "max_steps": ("iterations", "a run is a number of iterations (collect, then update)"),
    "num_train_epochs": ("iterations", "a run is a number of iterations; ppo_epochs passes over each one's rollouts"),
    "num_iterations": ("ppo_epochs", "passes over each iteration's kept rollouts"),
    "gradient_accumulation_steps": (
        "minibatch_size", "minibatch_size sets the trajectories per optimizer step and per_device_train_batch_size "
        "the micro-batch"),
    "steps_per_generation": ("minibatch_size", "each iteration's rollouts are split into minibatches of trajectories"),
    "auto_find_batch_size": ("per_device_train_batch_size", "lower the micro-batch if the memory stress test fails"),
    # --- the loss -------------------------------------------------------------------------------------------
    "loss_type": (None, _LOSS),
    "epsilon_high": ("epsilon", "LOOP's clip range is [1/(1+epsilon), 1+epsilon]"),
    "delta": ("epsilon", "LOOP's clip range is [1/(1+epsilon), 1+epsilon], with no upper bound on the ratio"),
    "importance_sampling_level": (None, "LOOP's ratio is per token"),
    "sapo_temperature_neg": (None, _LOSS), "sapo_temperature_pos": (None, _LOSS),
    "vespo_k_pos": (None, _LOSS), "vespo_lambda_pos": (None, _LOSS),
    "vespo_k_neg": (None, _LOSS), "vespo_lambda_neg": (None, _LOSS),
    "off_policy_mask_threshold": (None, _LOSS),
    "mask_truncated_completions": ("max_training_tokens", "LOOP trains every kept trajectory, long ones on their prefix"),
    "average_tokens_across_devices": (None, _LOSS),
    "label_smoothing_factor": (None, _LOSS),
    "router_aux_loss_coef": (None, _LOSS),
    "beta": (None, _NO_REFERENCE), "sync_ref_model": (None, _NO_REFERENCE),
    "ref_model_mixup_alpha": (None, _NO_REFERENCE), "ref_model_sync_steps": (None, _NO_REFERENCE),
    "use_bias_correction_kl": (None, _NO_REFERENCE),
    "top_entropy_quantile": (None, _NO_ENTROPY), "entropy_coef": (None, _NO_ENTROPY),
    "use_adaptive_entropy": (None, _NO_ENTROPY), "entropy_coef_min": (None, _NO_ENTROPY),
    "entropy_coef_max": (None, _NO_ENTROPY), "entropy_coef_delta": (None, _NO_ENTROPY),
    "entropy_target": (None, _NO_ENTROPY),
    "vllm_importance_sampling_correction": (None, _OLD_LOGPROBS), "vllm_importance_sampling_mode": (None, _OLD_LOGPROBS),
    "vllm_importance_sampling_clip_max": (None, _OLD_LOGPROBS), "vllm_importance_sampling_clip_min": (None, _OLD_LOGPROBS),
    "vllm_importance_sampling_cap": (None, _OLD_LOGPROBS),
    # --- advantages and rewards ----------------------------------------------------------------------------
    "scale_rewards": ("std_normalize_advantages", "LOOP's advantages are leave-one-out, not normalised by default"),
    "num_generations": ("rollouts_per_task", "the leave-one-out group"),
    "reward_weights": (None, _REWARDS), "multi_objective_aggregation": (None, _REWARDS),
    # --- generation ----------------------------------------------------------------------------------------
    "max_completion_length": ("max_trajectory_tokens", "an episode's whole-conversation budget (max_new_tokens_per_turn "
                              "limits one reply)"),
    "max_tool_calling_iterations": ("max_turns", "model replies per episode"),
    "generation_batch_size": ("tasks_per_iteration", "an iteration collects tasks_per_iteration x rollouts_per_task "
                              "episodes"),
    "num_generations_eval": ("eval_rollouts_per_task", _EVALUATION),
    "top_p": ("temperature", _SAMPLING), "top_k": ("temperature", _SAMPLING), "min_p": ("temperature", _SAMPLING),
    "repetition_penalty": ("temperature", _SAMPLING),
    "generation_kwargs": ("temperature", _SAMPLING),
    "cache_implementation": (None, _GENERATION),
    "ds3_gather_for_generation": (None, _GENERATION),
    "use_transformers_continuous_batching": ("generation_batch_limit", _GENERATION),
    "transformers_continuous_batching_config": ("generation_batch_limit", _GENERATION),
    "use_transformers_paged": ("generation_batch_limit", _GENERATION),
    "vllm_model_impl": (None, _GENERATION),
    "vllm_structured_outputs_regex": (None, _GENERATION),
    "vllm_group_port": ("vllm_sync_dir", "LOOP syncs weights to a vLLM server through files, not an NCCL group"),
    "use_cache": (None, "LOOP's sampler turns the KV cache on itself; the training forward needs none"),
    # --- evaluation ----------------------------------------------------------------------------------------
    "eval_strategy": ("eval_every", _EVALUATION), "eval_steps": ("eval_every", _EVALUATION),
    "eval_delay": ("eval_every", _EVALUATION), "eval_on_start": ("eval_every", _EVALUATION),
    "do_eval": ("eval_every", _EVALUATION), "do_train": (None, "loop-train always trains"),
    "do_predict": (None, "loop-eval evaluates a model"),
    "per_device_eval_batch_size": ("max_concurrent_episodes", _EVALUATION),
    "prediction_loss_only": (None, _EVALUATION), "eval_do_concat_batches": (None, _EVALUATION),
    "eval_use_gather_object": (None, _EVALUATION), "eval_accumulation_steps": (None, _EVALUATION),
    "include_for_metrics": (None, _EVALUATION), "batch_eval_metrics": (None, _EVALUATION),
    "bf16_full_eval": (None, _EVALUATION), "fp16_full_eval": (None, _EVALUATION),
    "load_best_model_at_end": (None, _EVALUATION), "metric_for_best_model": (None, _EVALUATION),
    "greater_is_better": (None, _EVALUATION),
    # --- data loading --------------------------------------------------------------------------------------
    "data_seed": ("seed", _TASKS), "shuffle_dataset": (None, _TASKS), "ignore_data_skip": (None, _TASKS),
    "dataloader_drop_last": (None, _TASKS), "dataloader_num_workers": (None, _TASKS),
    "dataloader_pin_memory": (None, _TASKS), "dataloader_persistent_workers": (None, _TASKS),
    "dataloader_prefetch_factor": (None, _TASKS), "dataloader_multiprocessing_context": (None, _TASKS),
    "dataloader_in_order": (None, _TASKS), "remove_unused_columns": (None, _TASKS), "label_names": (None, _TASKS),
    "train_sampling_strategy": (None, _TASKS), "length_column_name": (None, _TASKS),
    "pad_to_multiple_of": (None, "LOOP pads each micro-batch to its longest trajectory"),
    # --- the Trainer's training step, which LOOP replaces ----------------------------------------------
    "logging_nan_inf_filter": (None, _TRAINER_LOOP), "include_num_input_tokens_seen": (None, _TRAINER_LOOP),
    "torch_empty_cache_steps": (None, _TRAINER_LOOP),
    "neftune_noise_alpha": (None, "noise on the embeddings would make the PPO ratio compare two different forwards"),
    "skip_memory_metrics": (None, _TRAINER_LOOP),
    "torch_compile": (None, _UNTESTED), "torch_compile_backend": (None, _UNTESTED), "torch_compile_mode": (None, _UNTESTED),
    "use_liger_kernel": (None, _UNTESTED), "liger_kernel_config": (None, _UNTESTED),
    "fsdp": ("deepspeed", "LOOP shards with DeepSpeed ZeRO (recipes/accelerate/zero3.yaml)"),
    "fsdp_config": ("deepspeed", "LOOP shards with DeepSpeed ZeRO (recipes/accelerate/zero3.yaml)"),
    "parallelism_config": ("deepspeed", "LOOP runs data-parallel: plain, DDP or DeepSpeed ZeRO"),
    "save_only_model": ("save_strategy", "LOOP's checkpoints hold the optimizer, RNG and task-sampler state to resume from"),
    "enable_jit_checkpoint": ("save_steps", "LOOP checkpoints between iterations; resume with resume_from_checkpoint: last"),
    # --- logging of completions ----------------------------------------------------------------------------
    "log_completions": ("save_rollouts", "viewer_rollouts_per_iteration writes rollouts as HTML pages"),
    "log_completions_hub_repo": ("save_rollouts", "rollouts are written to output_dir/rollouts/"),
    "num_completions_to_print": ("viewer_rollouts_per_iteration", "rollouts are shown in output_dir/viewer/"),
    "log_unique_prompts": ("viewer_rollouts_per_iteration", "rollouts are shown in output_dir/viewer/"),
    "log_multimodal": (None, "LOOP's episodes are text"),
}


# Values that mean a refused key's default though they compare unequal to it: HfArgumentParser
# parses TrainingArguments' `str | bool` default "no" into False.
_DEFAULT_SPELLINGS: dict[str, tuple[Any, ...]] = {"include_num_input_tokens_seen": (False,)}


def _field_default(spec: dataclasses.Field) -> Any:
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def refused_key_message(key: str, value: Any) -> str:
    """The one line that stops a run setting ``key`` (a key of :data:`REFUSED_INHERITED_KEYS`)."""
    equivalent, why = REFUSED_INHERITED_KEYS[key]
    instead = f"; use {equivalent} ({why})" if equivalent else f" ({why})"
    return f"LOOPConfig: {key}={value!r} is not used by LOOP{instead}"


@dataclass
class LOOPConfig(GRPOConfig, EpisodeSettings):
    r"""Configuration of :class:`~loop_trainer.LOOPTrainer`.

    Defaults reproduce Chen et al. (2025) "Reinforcement Learning for Long-Horizon Interactive LLM
    Agents": 40 tasks x 6 rollouts per iteration, leave-one-out advantages without std
    normalisation, rollouts with :math:`|A| < 0.01` dropped, 2 epochs of shuffled minibatches of
    32 trajectories, per-token PPO clipping with :math:`\epsilon = 0.1` (range ``[1/1.1, 1.1]``),
    AdamW at a constant 5e-5 with weight decay 0.01, gradient-norm clip 0.1, no KL penalty and no
    reference model.

    One *iteration* collects rollouts, then runs ``ppo_epochs`` passes of optimizer steps over
    them. ``iterations`` sets the run's length; ``trainer.state.global_step`` counts iterations,
    so ``logging_steps``, ``save_steps`` and ``eval_every`` are in iterations too.

    Inherited :class:`trl.GRPOConfig` fields that LOOP does not use (``loss_type``, ``beta``,
    ``gradient_accumulation_steps``, ``eval_steps``, ...) are refused when set away from their
    defaults, with LOOP's equivalent: see :data:`REFUSED_INHERITED_KEYS`.
    """

    # --- the iteration -------------------------------------------------------------------------
    iterations: int = field(default=200, metadata={"help": "LOOP iterations (collect, then update)."})
    tasks_per_iteration: int = field(default=40, metadata={"help": "Tasks sampled per iteration."})
    rollouts_per_task: int = field(default=6, metadata={"help": "Rollouts per task: the leave-one-out group."})
    train_split: str = field(default="train", metadata={"help": "Environment split to sample tasks from."})

    # --- advantages and filtering --------------------------------------------------------------
    advantage_threshold: float = field(
        default=0.01, metadata={"help": "Drop rollouts with |advantage| below this (0 keeps all)."}
    )
    std_normalize_advantages: bool = field(
        default=False, metadata={"help": "Divide advantages by the group's reward std (ablation only)."}
    )

    # --- the update ----------------------------------------------------------------------------
    minibatch_size: int = field(
        default=32, metadata={"help": "Trajectories per optimizer step; also the loss's constant divisor."}
    )
    ppo_epochs: int = field(default=2, metadata={"help": "Passes over the kept rollouts, each freshly shuffled."})
    max_training_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Trajectories longer than this are trained on their prefix (counted); "
            "None = max_trajectory_tokens."
        },
    )
    kl_abort_threshold: float = field(
        default=20.0, metadata={"help": "Abort the iteration's remaining updates if |KL estimate| exceeds this."}
    )

    # --- episodes ------------------------------------------------------------------------------
    early_stop_done_fraction: float = field(
        default=1.0, metadata={"help": "Stop collecting once this fraction of rollouts finished (paper: 0.9)..."}
    )
    early_stop_task_fraction: float = field(
        default=1.0,
        metadata={"help": "...and every task has this fraction of its rollouts finished (paper: 0.75)."},
    )
    max_failed_fraction: float = field(
        default=0.25, metadata={"help": "Stop the run if more than this fraction of an iteration's rollouts fail."}
    )

    eval_split: str | None = field(
        default=None, metadata={"help": "Split evaluated during training (AppWorld: dev); none to skip."}
    )
    eval_every: int = field(default=0, metadata={"help": "Evaluate on eval_split every N iterations (0: never)."})
    eval_rollouts_per_task: int = field(default=1, metadata={"help": "Rollouts per task in each evaluation."})
    eval_temperature: float = field(default=0.0, metadata={"help": "Evaluation sampling temperature; 0 is greedy."})
    eval_max_tasks: int | None = field(default=None, metadata={"help": "Evaluate only the first N tasks of eval_split."})
    memory_stress_test: bool = field(
        default=True,
        metadata={"help": "Before iteration 1, forward+backward the longest allowed trajectory so an out-of-memory "
                  "error shows at start-up."},
    )

    # --- vLLM (use_vllm: true; GRPOConfig's vllm_* fields size the engine) -----------------------
    vllm_sync_tolerance: float | None = field(
        default=None,
        metadata={"help": "After each weight sync, stop if vLLM's and the trainer's log-probs on the probe sequence "
                  "differ by more than this (default: 1e-3 in fp32, 0.25 in bf16; negative: never stop)."},
    )
    vllm_sync_dir: str | None = field(
        default=None,
        metadata={"help": "Server mode: a directory the vLLM server can read, where adapters and weight shards are "
                  "written for it (default: output_dir/weight-sync)."},
    )
    vllm_probe_tokens: int = field(
        default=64, metadata={"help": "Length of the fixed probe sequence scored after each weight sync."}
    )

    # --- outputs -------------------------------------------------------------------------------
    save_rollouts: bool = field(
        default=False, metadata={"help": "Write each iteration's trajectories to output_dir/rollouts/ (datasets)."}
    )
    plot_curves: bool = field(default=True, metadata={"help": "Write learning_curve.png to output_dir."})
    viewer_rollouts_per_iteration: int = field(
        default=4,
        metadata={"help": "Rollouts per iteration shown in output_dir/viewer/iteration-N.html (the best, the "
                  "worst and any that failed to run); 0 writes none."},
    )

    # --- GRPOConfig fields whose defaults change -------------------------------------------------
    learning_rate: float = field(default=5e-5, metadata={"help": "AdamW learning rate (constant)."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "Learning-rate schedule."})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=0.1, metadata={"help": "Gradient-norm clip (global norm over ranks)."})
    epsilon: float = field(default=0.1, metadata={"help": "PPO clip: ratio kept in [1/(1+eps), 1+eps]."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (no top-p/top-k)."})
    per_device_train_batch_size: int = field(
        default=1, metadata={"help": "Trajectories per forward/backward pass (gradient accumulation inside a minibatch)."}
    )
    activation_checkpointing: bool | None = field(
        default=True, metadata={"help": "Recompute activations in the backward pass (long trajectories need it)."}
    )
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Deprecated alias of activation_checkpointing (transformers 5)."}
    )
    logging_steps: float = field(default=1, metadata={"help": "Log every N iterations."})
    report_to: None | str | list[str] = field(default="none", metadata={"help": "Trackers: 'wandb', 'trackio', 'tensorboard', 'none'."})
    save_strategy: SaveStrategy | str = field(
        default="steps", metadata={"help": "'steps': a checkpoint every save_steps iterations (resumable); 'no': none."}
    )
    save_steps: float = field(default=1, metadata={"help": "Iterations between checkpoints."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Checkpoints kept (older ones are deleted)."})

    def __post_init__(self) -> None:
        # Before anything below (or GRPOConfig.__post_init__) overwrites num_generations, max_steps, ...,
        # so that a value the user set is still seen.
        self.refuse_unused_inherited_keys()
        if self.rollouts_per_task < 2:
            raise ValueError("LOOPConfig: rollouts_per_task must be >= 2 (leave-one-out needs a group)")
        try:
            self.check_episode_settings()
        except ValueError as error:
            raise ValueError(f"LOOPConfig: {error}") from None
        for name in ("iterations", "tasks_per_iteration", "minibatch_size", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"LOOPConfig: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("early_stop_done_fraction", "early_stop_task_fraction", "max_failed_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"LOOPConfig: {name} must be in [0, 1], got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError("LOOPConfig: temperature must be > 0 (LOOP samples; greedy decoding is for loop-eval)")
        for name, allowed in (("save_strategy", ("steps", "no")), ("logging_strategy", ("steps", "no"))):
            if getattr(self, name) not in allowed:  # LOOP's loop has iterations, no epochs or evaluation loss
                raise ValueError(f"LOOPConfig: {name} must be 'steps' or 'no' (in iterations), got {getattr(self, name)!r}")
        if self.bf16 is None:
            # TRL turns bf16 on by default, which fails on machines without a bf16 accelerator.
            self.bf16 = not self.fp16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        # GRPOConfig sizes its generation batch in groups of num_generations; LOOP's groups are tasks.
        self.num_generations = self.rollouts_per_task
        self.steps_per_generation = self.rollouts_per_task
        self.generation_batch_size = None
        self.max_steps = self.iterations
        self.max_completion_length = self.max_trajectory_tokens
        super().__post_init__()
        if self.max_training_tokens is None:
            self.max_training_tokens = self.max_trajectory_tokens

    def refuse_unused_inherited_keys(self) -> None:
        """Raise ValueError naming the first inherited key LOOP does not use that is set away from its default."""
        for spec in dataclasses.fields(self):
            if spec.name in REFUSED_INHERITED_KEYS:
                value = getattr(self, spec.name)
                if value != _field_default(spec) and value not in _DEFAULT_SPELLINGS.get(spec.name, ()):
                    raise ValueError(refused_key_message(spec.name, value))


# LOOP's own keys: declared by LOOPConfig itself (including inherited ones whose defaults it changes)
# or by the EpisodeSettings it shares with loop-eval.
LOOP_OWN_KEYS = frozenset(LOOPConfig.__annotations__) | {spec.name for spec in dataclasses.fields(EpisodeSettings)}
