"""LOOPConfig: GRPOConfig plus LOOP's own knobs, with the paper's settings as defaults.

LOOPConfig inherits every field of TRL's ``GRPOConfig`` (and transformers' ``TrainingArguments``),
but LOOP honours only some of them. Each inherited field is in exactly one of two tables (in
:mod:`.config_keys`): :data:`HONOURED_INHERITED_KEYS` (LOOP or the Trainer machinery it keeps reads it) or
:data:`REFUSED_INHERITED_KEYS` (set away from its default, construction stops with one line naming
the key and LOOP's equivalent). ``tests/test_config_keys.py`` fails when a TRL/transformers upgrade
adds a field that is in neither, so no key is ever silently ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments
from transformers.trainer_utils import SaveStrategy
from trl import GRPOConfig

from .config_keys import (  # the tables are part of LOOPConfig's API, so they are importable from here too
    HONOURED_INHERITED_KEYS,
    RANGES,
    REFUSED_INHERITED_KEYS,
    UNRANGED_KEYS,
    DEFAULT_SPELLINGS,
    field_default,
    output_dir_problem,
    refused_key_message,
)
from .episode_settings import EpisodeSettings, check_ranges
from .objective import ADVANTAGE_ESTIMATORS, RATIO_LEVELS

__all__ = ["HONOURED_INHERITED_KEYS", "LOOP_OWN_KEYS", "RANGES", "REFUSED_INHERITED_KEYS", "UNRANGED_KEYS", "LOOPConfig",
           "output_dir_problem", "refused_key_message"]


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

    Inherited :class:`trl.GRPOConfig` fields that LOOP does not use (``loss_type``, ``epsilon_high``,
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
    advantage_estimator: str = field(
        default="leave_one_out",
        metadata={"help": "leave_one_out (LOOP: r_i minus the mean of the group's other rewards) or group_mean "
                  "(GRPO: r_i minus the group mean; with std_normalize_advantages, GRPO's advantage)."},
    )
    ratio_level: str = field(
        default="token",
        metadata={"help": "Where the PPO ratio is taken: token (LOOP), turn (one ratio per assistant turn) or "
                  "trajectory (one per trajectory); the paper's Table 1 compares the three."},
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
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "A fresh run (no resume_from_checkpoint) into an output_dir holding another run's checkpoints "
                  "is refused; true deletes that run first: its checkpoint-N directories, metrics.jsonl, "
                  "learning_curve.png, viewer/, rollouts/ and .staging-checkpoint/ (the model files at the top are "
                  "replaced when the new run saves). A resumed run deletes nothing."},
    )
    resume_with_changed_settings: bool = field(
        default=False,
        metadata={"help": "Resume even though settings an exact resume depends on (seed, tasks_per_iteration, "
                  "learning_rate, environment_kwargs, ...) differ from the checkpoint's; the new values are applied "
                  "from the next iteration and recorded in loop_state.json, recipe.yaml and the log."},
    )
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
        self.refuse_out_of_range_values()
        for name, allowed in (("save_strategy", ("steps", "no")), ("logging_strategy", ("steps", "no"))):
            if getattr(self, name) not in allowed:  # LOOP's loop has iterations, no epochs or evaluation loss
                raise ValueError(f"LOOPConfig: {name} must be 'steps' or 'no' (in iterations), got {getattr(self, name)!r}")
        for name, allowed in (("advantage_estimator", ADVANTAGE_ESTIMATORS), ("ratio_level", RATIO_LEVELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"LOOPConfig: {name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.bf16 is None:
            # TRL turns bf16 on by default, which fails on machines without a bf16 accelerator.
            self.bf16 = not self.fp16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        # GRPOConfig sizes its generation batch in groups of num_generations; LOOP's groups are tasks.
        self.num_generations = self.rollouts_per_task
        self.steps_per_generation = self.rollouts_per_task
        self.generation_batch_size = None
        self.max_steps = self.iterations
        self.max_completion_length = self.max_trajectory_tokens
        if "activation_checkpointing" not in TrainingArguments.__dataclass_fields__:
            # transformers < 5.18 (the one vLLM <= 0.31 accepts) only knows gradient_checkpointing: without
            # this its Trainer and TRL (PEFT's input gradients) would run with checkpointing silently off.
            if self.gradient_checkpointing is not None:
                self.activation_checkpointing = self.gradient_checkpointing
            self.gradient_checkpointing = bool(self.activation_checkpointing)
        super().__post_init__()
        if self.max_training_tokens is None:
            self.max_training_tokens = self.max_trajectory_tokens

    def refuse_out_of_range_values(self) -> None:
        """Raise ValueError (one line naming the key, the allowed values and the value) for the first key
        outside its range in :data:`RANGES`, or an ``output_dir`` that cannot be written."""
        try:
            check_ranges(self, RANGES)
        except ValueError as error:
            raise ValueError(f"LOOPConfig: {error}") from None
        if self.output_dir is not None and (problem := output_dir_problem(self.output_dir)):
            raise ValueError(f"LOOPConfig: {problem}")

    def refuse_unused_inherited_keys(self) -> None:
        """Raise ValueError naming the first inherited key LOOP does not use that is set away from its default."""
        for spec in dataclasses.fields(self):
            if spec.name in REFUSED_INHERITED_KEYS:
                value = getattr(self, spec.name)
                if value != field_default(spec) and value not in DEFAULT_SPELLINGS.get(spec.name, ()):
                    raise ValueError(refused_key_message(spec.name, value))


# LOOP's own keys: declared by LOOPConfig itself (including inherited ones whose defaults it changes)
# or by the EpisodeSettings it shares with loop-eval.
LOOP_OWN_KEYS = frozenset(LOOPConfig.__annotations__) | {spec.name for spec in dataclasses.fields(EpisodeSettings)}
