"""What a resumed run does with each ``LOOPConfig`` key: every key LOOPConfig takes is classified here, and
tests/unit/config/test_resume_policy.py fails on a key that is not (a new key cannot slip through unclassified).

- ``compared``: recorded in every checkpoint's ``loop_state.json`` and compared on resume. A change is refused
  with one line, unless ``resume_with_changed_settings``: then it takes effect from the next iteration, since
  LOOP reads it afresh every iteration, and is recorded (log, loop_state.json, recipe.yaml, model card).
- ``applied``: compared as above; with ``resume_with_changed_settings`` the resume also writes it into the state
  the checkpoint restores (the optimizer's hyperparameters, the scheduler's base rates, the task sampler's
  position), which would otherwise bring the old value back.
- ``fixed``: compared, and never changeable on resume (the checkpoint's optimizer state belongs to its optimizer).
- ``free``: not recorded; changing it changes nothing a resumed run computes (how long it runs, where it logs,
  saves and uploads, evaluation, checks and limits that only stop a run, memory placement, how one computation
  is spread over processes).

The sampling keys are classified by measurement, not by intent: on a CPU, ``static_decode``,
``compile_decode_step``, ``merge_adapter_for_sampling``, ``generation_batch_limit`` (and so
``max_concurrent_episodes``, which sets who is batched together) each change the sampler's log-probs in the
last bits (up to 9.5e-7 on the tiny vault model with LoRA, tokens equal over short episodes; the same run
repeated is bitwise equal: ``python -m benchmarks.sampling_keys``), and those log-probs enter the objective's
importance weights: they are ``compared``, and so are their values as resolved for the device
(``sampling_parts``, recorded by the trainer). Which engine samples (``use_vllm``, ``vllm_mode``,
``vllm_max_model_length``) is compared too. Where the vLLM server listens, its memory share and sleep mode
are ``free``: vLLM's sampling is not batch-invariant, so a run sampled by vLLM resumes float-close at best.
"""

from __future__ import annotations

from enum import Enum
from types import MappingProxyType


class OnResume(Enum):
    COMPARED = "compared"
    APPLIED = "applied"
    FIXED = "fixed"
    FREE = "free"


_COMPARED = (
    # what is sampled: tasks, rollouts, episodes
    "train_split",
    "tasks_per_iteration",
    "rollouts_per_task",
    "temperature",
    "max_turns",
    "max_new_tokens_per_turn",
    "max_trajectory_tokens",
    "max_completion_tokens",
    "context_keep_observations",
    "context_observation_budget",
    "context_strip_thinking",
    "chat_template_kwargs",
    "early_stop_done_fraction",
    "early_stop_task_fraction",
    "max_tool_calling_iterations",
    "malformed_tool_call",
    "reward_weights",
    # the sampler: which engine, and the parts that change its log-probs in the last bits (measured)
    "use_vllm",
    "vllm_mode",
    "vllm_max_model_length",
    "static_decode",
    "compile_decode_step",
    "merge_adapter_for_sampling",
    "generation_batch_limit",
    "max_concurrent_episodes",
    # the model's numerics
    "model_init_kwargs",
    "disable_dropout",
    "bf16",
    "fp16",
    "tf32",
    "full_determinism",
    "use_cpu",
    # advantages, filtering and the update
    "advantage_threshold",
    "std_normalize_advantages",
    "advantage_estimator",
    "ratio_level",
    "beta",
    "minibatch_size",
    "ppo_epochs",
    "epsilon",
    "max_training_tokens",
    "kl_abort_threshold",
    "per_device_train_batch_size",
    "train_sampling_strategy",
    "max_grad_norm",
    # the stabilisers (docs/stabilisers.md)
    "epsilon_high",
    "sampler_importance_cap",
    "sampler_importance_floor",
    "sampler_correction",
    "dynamic_sampling_rounds",
    "max_staleness",
    "partial_rollouts",
)
_APPLIED = (
    # the optimizer's hyperparameters and the scheduler's base rates (restored from the checkpoint)
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    # the task sampler's order (its position is restored from the checkpoint)
    "seed",
    "balance_tasks_by",
)
_FIXED = ("optim", "optim_args", "optim_target_modules")
_FREE = (
    # where a batch's collection runs (a thread or a child process): the same requests, seeds and episodes
    "collection_process",
    # the run's length, identity and resuming
    "iterations",
    "output_dir",
    "overwrite_output_dir",
    "overwrite_interrupted_run",
    "resume_from_checkpoint",
    "resume_with_changed_settings",
    "restore_callback_states_from_checkpoint",
    # logging, progress, trackers, run outputs
    "logging_strategy",
    "logging_steps",
    "logging_first_step",
    "log_level",
    "log_level_replica",
    "log_on_each_node",
    "disable_tqdm",
    "report_to",
    "run_name",
    "project",
    "trackio_space_id",
    "trackio_bucket_id",
    "trackio_static_space_id",
    "save_rollouts",
    "plot_curves",
    "viewer_rollouts_per_iteration",
    "log_trajectories_every",
    "num_trajectories_to_log",
    # checkpoints and the Hub
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "save_on_each_node",
    "push_to_hub",
    "hub_model_id",
    "hub_strategy",
    "hub_token",
    "hub_private_repo",
    "hub_always_push",
    "hub_revision",
    # evaluation (its own seeds; it trains nothing)
    "eval_split",
    "eval_every",
    "eval_rollouts_per_task",
    "eval_temperature",
    "eval_max_tasks",
    # the starting model only: a resumed run loads its weights from the checkpoint (a tiny LoRA run's checkpoint
    # holds only the adapter: what its base is built from is the run setting tiny_base, never changed on resume)
    "tiny_instruct_steps",
    # checks and limits that only stop a run or an environment call
    "max_failed_fraction",
    "env_timeout",
    "memory_stress_test",
    "trust_remote_code",
    "vllm_sync_tolerance",
    "vllm_probe_tokens",
    "vllm_server_timeout",
    "debug",
    # memory placement: the same computation, recomputed or moved
    "activation_checkpointing",
    "activation_checkpointing_kwargs",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "activation_offloading",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep_mode",
    # where the vLLM server is, and where weights are written for it; a colocated engine spans one GPU (refused
    # otherwise) and a server's tensor parallelism is its own launch flag, so this key shapes no sampling
    "vllm_tensor_parallel_size",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_sync_dir",
    # how one computation is spread over processes (1 and 2 processes agree to float tolerance); where that decides
    # whether a checkpoint's optimizer state can load at all (DeepSpeed, its ZeRO stage and process count), the
    # trainer records it as the run setting optimizer_state_layout, compared on resume (training/resume.py: another
    # process count under the same ZeRO stage is repartitioned, training/repartition.py; anything else is refused)
    "accelerator_config",
    "deepspeed",
    "local_rank",
    "ddp_backend",
    "ddp_timeout",
    "ddp_find_unused_parameters",
    "ddp_bucket_cap_mb",
    "ddp_broadcast_buffers",
    "ddp_static_graph",
)


def _policy() -> dict[str, OnResume]:
    policy: dict[str, OnResume] = {}
    for kind, keys in (
        (OnResume.COMPARED, _COMPARED),
        (OnResume.APPLIED, _APPLIED),
        (OnResume.FIXED, _FIXED),
        (OnResume.FREE, _FREE),
    ):
        for key in keys:
            if key in policy:
                raise AssertionError(f"resume policy: {key} is classified twice")
            policy[key] = kind
    return policy


RESUME_POLICY = MappingProxyType(_policy())
"""Every key ``LOOPConfig`` takes -> what a resume does with it."""

RECORDED_KEYS = tuple(key for key, kind in RESUME_POLICY.items() if kind is not OnResume.FREE)
"""The keys recorded in every checkpoint and compared on resume."""

APPLIED_KEYS = frozenset(key for key, kind in RESUME_POLICY.items() if kind is OnResume.APPLIED)
FIXED_KEYS = frozenset(key for key, kind in RESUME_POLICY.items() if kind is OnResume.FIXED)
