"""LOOPConfig: GRPOConfig plus LOOP's own knobs, with the paper's settings as defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.trainer_utils import SaveStrategy
from trl import GRPOConfig

from .episode_settings import EpisodeSettings

# GRPO options that have no meaning in LOOP; setting one away from its neutral value is an error
# rather than a silent no-op.
_UNSUPPORTED_GRPO_OPTIONS = {
    "beta": 0.0,
    "num_iterations": 1,
    "top_entropy_quantile": 1.0,
    "entropy_coef": 0.0,
    "sync_ref_model": False,
}


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
    so ``logging_steps``, ``save_steps`` and ``eval_steps`` are in iterations too.

    Every field of :class:`trl.GRPOConfig` is accepted; the ones that mean nothing for LOOP
    (``beta``, ``num_iterations``, ``loss_type``, entropy bonuses, ...) are rejected if changed.
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
        for name, neutral in _UNSUPPORTED_GRPO_OPTIONS.items():
            if getattr(self, name) != neutral:
                raise ValueError(f"LOOPConfig: {name}={getattr(self, name)!r} is not supported by LOOP (keep {neutral!r})")
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
        if self.top_p != 1.0 or self.top_k not in (0, None) or (self.min_p or 0.0) != 0.0:
            raise ValueError("LOOPConfig: LOOP samples with temperature only; leave top_p=1, top_k=0, min_p unset")
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
