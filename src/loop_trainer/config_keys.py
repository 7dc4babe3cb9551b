"""Which inherited ``GRPOConfig``/``TrainingArguments`` keys LOOP honours and which it refuses (with
LOOP's equivalent), and the range of values every numeric key allows. :class:`~loop_trainer.LOOPConfig`
checks both at construction; ``tests/test_config_keys.py`` and ``tests/test_config_ranges.py`` fail
when a key is in no table, so no key is ever silently ignored or left unchecked.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .episode_settings import EPISODE_RANGES, Rule

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
    # GRPOTrainer's agent arguments (train_dataset, reward_funcs, tools, environment_factory): read then,
    # refused with an Environment (training/trl_arguments.py)
    "reward_weights", "max_tool_calling_iterations",
    # generation with vLLM (rollout/generator.py)
    # the KL penalty to the adapter-disabled base model (training/update.py); LoRA only
    "beta",
    "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_enable_sleep_mode",
    "vllm_max_model_length", "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
})

# Why a refused key means nothing for LOOP, shared by related keys.
_LOSS = ("its loss is the per-token clipped PPO objective of the paper, token mean per trajectory, "
         "constant divisor minibatch_size")
_NO_REFERENCE = "LOOP's only reference policy is the base model with the LoRA adapter disabled (beta)"
_NO_ENTROPY = "LOOP's objective has no entropy term"
_OLD_LOGPROBS = "LOOP's ratio uses old log-probs the training model recomputes, not vLLM's"
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
    "importance_sampling_level": ("ratio_level", "LOOP's ratio is per token by default; ratio_level: turn or trajectory for the paper's ablations"),
    "sapo_temperature_neg": (None, _LOSS), "sapo_temperature_pos": (None, _LOSS),
    "vespo_k_pos": (None, _LOSS), "vespo_lambda_pos": (None, _LOSS),
    "vespo_k_neg": (None, _LOSS), "vespo_lambda_neg": (None, _LOSS),
    "off_policy_mask_threshold": (None, _LOSS),
    "mask_truncated_completions": ("max_training_tokens", "LOOP trains every kept trajectory, long ones on their prefix"),
    "average_tokens_across_devices": (None, _LOSS),
    "label_smoothing_factor": (None, _LOSS),
    "router_aux_loss_coef": (None, _LOSS),
    "sync_ref_model": (None, _NO_REFERENCE),
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
    "scale_rewards": ("std_normalize_advantages", "LOOP's advantages are leave-one-out, not normalised by default (advantage_estimator: group_mean with std_normalize_advantages is GRPO's)"),
    "num_generations": ("rollouts_per_task", "the leave-one-out group"),
    "multi_objective_aggregation": (None, "LOOP's advantage is leave-one-out on the weighted sum of the rewards "
                                    "(sum_then_normalize, without normalising); it needs no per-reward scaling"),
    # --- generation ----------------------------------------------------------------------------------------
    "max_completion_length": ("max_completion_tokens", "the budget of everything after the opening prompt "
                              "(max_trajectory_tokens: the whole conversation; max_new_tokens_per_turn: one reply)"),
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
DEFAULT_SPELLINGS: dict[str, tuple[Any, ...]] = {"include_num_input_tokens_seen": (False,)}


def field_default(spec: dataclasses.Field) -> Any:
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def refused_key_message(key: str, value: Any) -> str:
    """The one line that stops a run setting ``key`` (a key of :data:`REFUSED_INHERITED_KEYS`)."""
    equivalent, why = REFUSED_INHERITED_KEYS[key]
    instead = f"; use {equivalent} ({why})" if equivalent else f" ({why})"
    return f"LOOPConfig: {key}={value!r} is not used by LOOP{instead}"


# The values every numeric key allows: LOOP's own keys and the inherited ones it honours. key -> Rule(the
# allowed values, what the key does or what a value outside them would do[, the setting the rule applies
# under]). LOOPConfig.__post_init__ checks them all before anything runs, so loop-train, --dry-run and
# Python code refuse a value outside its range with one line (episode_settings.range_message);
# tests/test_config_ranges.py fails when a numeric key has neither a rule nor a reason in UNRANGED_KEYS.
RANGES: dict[str, Rule] = {
    **EPISODE_RANGES,  # max_turns, max_new_tokens_per_turn, max_trajectory_tokens, env_timeout, ... (shared with loop-eval)
    # --- the iteration
    "iterations": Rule(">= 1", "LOOP iterations (collect, then update)"),
    "tasks_per_iteration": Rule(">= 1", "tasks sampled per iteration"),
    "rollouts_per_task": Rule(">= 2", "the leave-one-out group: each rollout's baseline is the others' mean"),
    "temperature": Rule("> 0", "LOOP samples; greedy decoding is for evaluation (eval_temperature, loop-eval)"),
    "early_stop_done_fraction": Rule("in [0, 1]", "collection stops once this fraction of rollouts finished"),
    "early_stop_task_fraction": Rule("in [0, 1]", "...and every task has this fraction of its rollouts finished"),
    "max_failed_fraction": Rule("in [0, 1]", "the run stops if more than this fraction of an iteration's rollouts fail"),
    # --- advantages and the update
    "advantage_threshold": Rule(">= 0", "rollouts with |advantage| below it are dropped; 0 keeps all"),
    "minibatch_size": Rule(">= 1", "trajectories per optimizer step"),
    "ppo_epochs": Rule(">= 1", "passes over each iteration's kept rollouts"),
    "per_device_train_batch_size": Rule(">= 1", "trajectories per forward/backward pass"),
    "max_training_tokens": Rule(">= 1 or None", "longer trajectories are trained on their prefix; None: max_trajectory_tokens"),
    "beta": Rule(">= 0", "the coefficient of the KL penalty to the base model (0: none, the paper's LOOP)"),
    "epsilon": Rule("> 0", "the PPO clip range is [1/(1+epsilon), 1+epsilon]; 0 would freeze the policy"),
    "kl_abort_threshold": Rule("> 0 or inf", "an iteration's updates stop once |KL estimate| exceeds it; inf: never; "
                               "0 or less would skip nearly every optimizer step"),
    "max_grad_norm": Rule("> 0 or inf", "the global gradient-norm clip; inf: no clipping; 0 would zero every "
                          "gradient, a negative value flips it"),
    "learning_rate": Rule("> 0", "the optimizer's step size; 0 would never change the weights"),
    "weight_decay": Rule(">= 0", "AdamW's decoupled weight decay"),
    "adam_beta1": Rule("in [0, 1)", "AdamW's first-moment decay"),
    "adam_beta2": Rule("in [0, 1)", "AdamW's second-moment decay"),
    "adam_epsilon": Rule("> 0", "AdamW's denominator term; 0 divides by zero where a gradient is zero"),
    "warmup_steps": Rule(">= 0", "optimizer steps of linear warm-up; below 1, a fraction of all optimizer steps"),
    "seed": Rule("in [0, 4294967295]", "seeds Python, NumPy and torch; NumPy takes 32-bit seeds"),
    # --- evaluation
    "eval_every": Rule(">= 0", "evaluate on eval_split every N iterations; 0: never"),
    "eval_rollouts_per_task": Rule(">= 1", "rollouts of every evaluation task"),
    "eval_temperature": Rule(">= 0", "the evaluation sampling temperature; 0 is greedy"),
    "max_tool_calling_iterations": Rule(">= 1 or None", "rounds of tool calls per episode (GRPOTrainer's agent "
                                        "arguments); None: no limit but max_turns"),
    "eval_max_tasks": Rule(">= 1 or None", "evaluate only the first N tasks of eval_split; None: all of them"),
    # --- vLLM and distribution
    "vllm_gpu_memory_utilization": Rule("in (0, 1]", "the fraction of each GPU's memory a colocated vLLM engine takes"),
    "vllm_tensor_parallel_size": Rule(">= 1", "GPUs one vLLM engine spans"),
    "vllm_max_model_length": Rule(">= 1 or None", "the vLLM engine's context length; None: max_trajectory_tokens"),
    "vllm_server_port": Rule("in [1, 65535]", "the vLLM server's TCP port"),
    "vllm_server_timeout": Rule("> 0", "server mode: seconds to wait for the vLLM server at start-up"),
    "vllm_sync_tolerance": Rule("a number or None", "the largest log-prob difference after a weight sync; "
                                "negative: never stop; None: 1e-3 in fp32, 0.25 in bf16"),
    "vllm_probe_tokens": Rule(">= 2", "the probe sequence's length; its log-probs need at least 2 tokens"),
    "ddp_timeout": Rule(">= 1", "seconds a collective operation may wait for the other processes"),
    "ddp_bucket_cap_mb": Rule(">= 1 or None", "DDP's gradient bucket size in MB; None: torch's default"),
    # --- outputs
    "logging_steps": Rule("a whole number >= 1 or in (0, 1)", "iterations between logs; below 1, a fraction of "
                          "iterations", when="logging_strategy: steps"),
    "save_steps": Rule("a whole number >= 1 or in (0, 1)", "iterations between checkpoints; below 1, a fraction of "
                       "iterations; save_strategy: no saves none", when="save_strategy: steps"),
    "save_total_limit": Rule(">= 1 or None", "checkpoints kept; None keeps all"),
    "viewer_rollouts_per_iteration": Rule(">= 0", "rollouts shown in each iteration's viewer page; 0 writes none"),
}

# Numeric keys LOOP honours without a range check, and why.
UNRANGED_KEYS: dict[str, str] = {
    "local_rank": "set by the launcher (torchrun, accelerate, deepspeed); -1 when not distributed",
}


def output_dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be a run's output directory, in one line (it is a file, lies under a file,
    or cannot be written or created), or None. A directory that does not exist yet is fine as long
    as its nearest existing parent is a writable directory; nothing is created here."""
    target = os.path.abspath(path)
    if os.path.lexists(target) and not os.path.exists(target):
        return f"output_dir {path!r} is a broken symbolic link"
    if os.path.exists(target):
        if not os.path.isdir(target):
            return f"output_dir {path!r} is a file, not a directory (choose a directory path)"
        if not os.access(target, os.W_OK | os.X_OK):
            return f"output_dir {path!r} is not writable (choose a directory you can write to)"
        return None
    parent = os.path.dirname(target)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"output_dir {path!r} cannot be created: {parent!r} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"output_dir {path!r} cannot be created: {parent!r} is not writable"
    return None
