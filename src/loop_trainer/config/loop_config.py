"""LOOPConfig: LOOP's settings, with the paper's as defaults, on transformers' ``TrainingArguments``.

LOOPConfig holds what LOOP uses: its own keys, the episode settings it shares with ``loop-eval``, and
the ``TrainingArguments`` fields in :data:`~.keys.HONOURED_TRAINING_ARGUMENTS`. The other
``TrainingArguments`` fields keep their defaults for transformers' ``Trainer`` but are no arguments: a
keyword ``eval_steps`` (or the key in a recipe) stops with one line naming LOOP's equivalent
(``eval_every``). Every numeric key declares its range on its field (:mod:`.ranges`), checked at
construction.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, cast

import torch
from accelerate.utils import parse_flag_from_env
from transformers import TrainingArguments
from transformers.trainer_utils import SaveStrategy

from ..objective import ADVANTAGE_ESTIMATORS, RATIO_LEVELS
from ..stabilisers import SAMPLER_CORRECTIONS
from .combinations import ConfigCombinationError, Generator, Launch, check_combinations, planning_gpu_launch
from .episode import EpisodeSettings
from .keys import only_the_training_arguments_loop_honours, refusing_unknown_keys
from .output_dir import output_dir_problem
from .ranges import above, any_number, at_least, between, check_ranges, setting, steps_or_fraction
from .trackers import report_to_problem

MAX_STALENESS_LIMIT = 8
"""The deepest overlap supported (``max_staleness``). Each step of lag is a batch the checkpoint holds and a
saving iteration waits for, a policy version the generator keeps loaded, and a step further between the policy
that sampled a token and the one trained on it, which the capped weights min(pi_old / pi_behaviour, C) correct
less well the further they drift; prime-rl's async level stops at 8 too."""


@dataclass
@only_the_training_arguments_loop_honours
class LOOPConfig(TrainingArguments, EpisodeSettings):
    r"""Configuration of :class:`~loop_trainer.LOOPTrainer`.

    The defaults are the settings of Chen et al. (2025) "Reinforcement Learning for Long-Horizon
    Interactive LLM Agents": 40 tasks x 6 rollouts per iteration, leave-one-out advantages without std
    normalisation, rollouts with :math:`|A| < 0.01` dropped, 2 epochs of shuffled minibatches of 32
    trajectories, per-token PPO clipping with :math:`\epsilon = 0.1` (range ``[1/(1+eps), 1+eps]``), AdamW
    at a constant 5e-5 with weight decay 0.01, gradient-norm clip 0.1, no KL penalty and no reference
    model -- with one exception: collection waits for every rollout (``early_stop_done_fraction`` and
    ``early_stop_task_fraction`` 1.0), where the paper stops at 0.9 / 0.75 (the AppWorld recipes set them).

    One *iteration* collects rollouts, then runs ``ppo_epochs`` passes of optimizer steps over them.
    ``iterations`` sets the run's length; ``trainer.state.global_step`` counts iterations, so
    ``logging_steps``, ``save_steps`` and ``eval_every`` are in iterations too.
    """

    # Mappings a recipe or flag may give as JSON text (TrainingArguments parses these fields).
    _VALID_DICT_FIELDS = [*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs", "chat_template_kwargs"]

    # --- the iteration -------------------------------------------------------------------------
    iterations: int = setting(
        200, "LOOP iterations (collect, then update).", at_least(1, "LOOP iterations (collect, then update)")
    )
    tasks_per_iteration: int = setting(40, "Tasks sampled per iteration.", at_least(1, "tasks sampled per iteration"))
    rollouts_per_task: int = setting(
        6,
        "Rollouts per task: the leave-one-out group.",
        at_least(2, "the leave-one-out group: each rollout's baseline is the others' mean"),
    )
    train_split: str = setting("train", "Environment split to sample tasks from.")

    # --- advantages and filtering --------------------------------------------------------------
    advantage_threshold: float = setting(
        0.01,
        "Drop rollouts with |advantage| below this (0 keeps all).",
        at_least(0, "rollouts with |advantage| below it are dropped; 0 keeps all"),
    )
    std_normalize_advantages: bool = setting(False, "Divide advantages by the group's reward std (ablation only).")
    advantage_estimator: str = setting(
        "leave_one_out",
        "leave_one_out (LOOP: r_i minus the mean of the group's other rewards) or group_mean (GRPO: "
        "r_i minus the group mean; with std_normalize_advantages, GRPO's advantage).",
    )
    ratio_level: str = setting(
        "token",
        "Where the PPO ratio is taken: token (LOOP), turn (one ratio per assistant turn) or trajectory (one "
        "per trajectory), the paper's Table 1 compares the three; or sequence (GSPO: one per trajectory, the "
        "geometric mean of its token ratios).",
    )

    # --- the update ----------------------------------------------------------------------------
    minibatch_size: int = setting(
        32,
        "Trajectories per optimizer step; also the loss's constant divisor.",
        at_least(1, "trajectories per optimizer step"),
    )
    ppo_epochs: int = setting(
        2,
        "Passes over the kept rollouts, each freshly shuffled.",
        at_least(1, "passes over each iteration's kept rollouts"),
    )
    max_training_tokens: int | None = setting(
        None,
        "Trajectories longer than this are trained on their prefix (counted); None = max_trajectory_tokens.",
        at_least(1, "longer trajectories are trained on their prefix; None: max_trajectory_tokens", none=True),
    )
    epsilon: float = setting(
        0.1,
        "PPO clip: ratio kept in [1/(1+eps), 1+eps].",
        above(0, "the PPO clip range is [1/(1+epsilon), 1+epsilon]; 0 would freeze the policy"),
    )
    beta: float = setting(
        0.0,
        "KL penalty to the starting weights (LoRA: the adapter disabled; full fine-tuning: a frozen copy, not under "
        "ZeRO-3). 0: none, the paper's LOOP.",
        at_least(0, "the coefficient of the KL penalty to the starting weights (0: none, the paper's LOOP)"),
    )
    # --- stabilisers: each off by default (LOOP as the paper); docs/stabilisers.md ---------------
    epsilon_high: float | None = setting(
        None,
        "Clip-higher (DAPO): upper clip bound 1+epsilon_high, the lower one stays 1/(1+epsilon). None: epsilon.",
        above(0, "the upper clip bound is 1+epsilon_high (clip-higher); None: 1+epsilon, LOOP's", none=True),
    )
    sampler_importance_cap: float | None = setting(
        None,
        "Importance weights toward the sampler, w = pi_old/pi_sampler, bounded above by this (how: "
        "sampler_correction; by default truncated, each token's objective times min(w, cap)). None: off.",
        above(0, "the upper bound of the weights pi_old/pi_sampler (sampler_correction); None: off", none=True),
    )
    sampler_importance_floor: float | None = setting(
        None,
        "The lower bound of the weights toward the sampler (truncated up to it, or masked below it: "
        "sampler_correction). None: no lower bound.",
        above(0, "the lower bound of the weights pi_old/pi_sampler (sampler_correction); None: none", none=True),
    )
    sampler_correction: str = setting(
        "token_truncate",
        "How the weights toward the sampler are bounded by sampler_importance_floor and sampler_importance_cap: "
        "token_truncate (each token's weight clamped to the bounds), token_mask (a token out of bounds leaves the "
        "loss: IcePop), sequence_truncate (one weight per trajectory, the product of its tokens', clamped) or "
        "sequence_mask (a trajectory out of bounds leaves the loss: MIS). Masked tokens are counted per iteration.",
    )
    max_staleness: int = setting(
        0,
        "Overlapped iterations: k collects the next k iterations' rollouts while this iteration's update runs, "
        "iteration j's by policy j-k (a generator apart from the trainer: a vLLM server, or a generation_backend "
        "holding its own weights; above 1, one holding several versions: LoRA adapters on a vLLM server). The "
        "behaviour policy's log-probs weight each token by min(pi_old/pi_sampler, sampler_importance_cap or 2). "
        "0: synchronous, the paper's.",
        between(
            0,
            MAX_STALENESS_LIMIT,
            "iterations a batch's behaviour policy may lag the policy it trains (0: synchronous LOOP)",
        ),
    )
    partial_rollouts: bool = setting(
        False,
        "Partial rollouts (with max_staleness and a straggler cut, early_stop_done_fraction below 1): the groups "
        "still running at a batch's cut are carried whole into the next batch, instead of their stragglers being "
        "cancelled; their next turns are sampled by the newest policy, each token weighted by its own sampler's "
        "log-prob. An episode spanning more than max_staleness policy versions is dropped and counted.",
    )
    collection_process: bool = setting(
        False,
        "With max_staleness and a vLLM server: collect the batches queued ahead in a child process of each training "
        "process (the environment and tokenizer sent to it by pickle), so the collection's Python work (tokenising, "
        "requests, the environment) does not hold the interpreter lock the update's kernel launches need. With "
        "partial_rollouts the child also holds the episodes carried across batches (and collects every batch). "
        "False: on a thread of the training process.",
    )
    dynamic_sampling_rounds: int = setting(
        0,
        "Dynamic sampling (DAPO): up to this many extra rounds of new tasks until the "
        "iteration has tasks_per_iteration groups whose rewards are not all equal. 0: off.",
        at_least(0, "extra collection rounds of dynamic sampling; 0: off (LOOP)"),
    )
    balance_tasks_by: str | None = setting(
        None,
        "A column of the training split (e.g. contacts' field): each iteration's tasks take its values in "
        "turn, so no draw is all one kind. None: shuffled passes over all tasks (LOOP).",
    )
    kl_abort_threshold: float = setting(
        20.0,
        "Abort the iteration's remaining updates if |KL estimate| exceeds this.",
        above(
            0,
            "an iteration's updates stop once |KL estimate| exceeds it; inf: never; 0 or less would skip nearly "
            "every optimizer step",
            inf=True,
        ),
    )

    # --- episodes ------------------------------------------------------------------------------
    temperature: float = setting(
        1.0,
        "Sampling temperature (no top-p/top-k).",
        above(0, "LOOP samples; greedy decoding is for evaluation (eval_temperature, loop-eval)"),
    )
    early_stop_done_fraction: float = setting(
        1.0,
        "Stop collecting once this fraction of rollouts finished (paper: 0.9)...",
        between(0, 1, "collection stops once this fraction of rollouts finished"),
    )
    early_stop_task_fraction: float = setting(
        1.0,
        "...and every task has this fraction of its rollouts finished (paper: 0.75).",
        between(0, 1, "...and every task has this fraction of its rollouts finished"),
    )
    max_failed_fraction: float = setting(
        0.25,
        "Stop the run if more than this fraction of an iteration's rollouts fail.",
        between(0, 1, "the run stops if more than this fraction of an iteration's rollouts fail"),
    )
    chat_template_kwargs: dict | str | None = setting(
        None, 'Keyword arguments for the tokenizer\'s chat template (e.g. {"enable_thinking": false}).'
    )

    # --- evaluation ----------------------------------------------------------------------------
    eval_split: str | None = setting(None, "Split evaluated during training (AppWorld: dev); none to skip.")
    eval_every: int = setting(
        0,
        "Evaluate on eval_split every N iterations (0: never).",
        at_least(0, "evaluate on eval_split every N iterations; 0: never"),
    )
    eval_rollouts_per_task: int = setting(
        1, "Rollouts per task in each evaluation.", at_least(1, "rollouts of every evaluation task")
    )
    eval_temperature: float = setting(
        0.0,
        "Evaluation sampling temperature; 0 is greedy.",
        at_least(0, "the evaluation sampling temperature; 0 is greedy"),
    )
    eval_max_tasks: int | None = setting(
        None,
        "Evaluate only the first N tasks of eval_split.",
        at_least(1, "evaluate only the first N tasks of eval_split; None: all of them", none=True),
    )
    memory_stress_test: bool = setting(
        True,
        "Before iteration 1, forward+backward the longest allowed trajectory so an out-of-memory error shows "
        "at start-up.",
    )

    # --- the model -----------------------------------------------------------------------------
    model_init_kwargs: dict | str | None = setting(
        None,
        "Keyword arguments for from_pretrained when the trainer is given a model id (dtype, "
        "attn_implementation, revision, ...).",
    )
    trust_remote_code: bool = setting(False, "Allow a model id's own modelling code when loading it.")
    disable_dropout: bool = setting(False, "Turn off the model's dropout (the ratio then compares equal forwards).")
    tiny_instruct_steps: int | None = setting(
        None,
        "tiny-instruct:<env> models: supervised warm-up steps on the environment's demonstrations; none: until "
        "held-out demonstrations are fitted (after at least 4 passes over them; at most 3,000 steps).",
        at_least(1, "supervised warm-up steps of a tiny-instruct model; none: until fitted", none=True),
    )

    # --- GRPOTrainer's agent arguments (reward_funcs, train_dataset, tools, environment_factory) -
    reward_weights: list[float] | None = setting(
        None,
        "Weights of reward_funcs in the episode reward (GRPOTrainer's agent arguments only).",
        unranged="a list, one weight per reward function (checked against reward_funcs); any sign",
    )
    max_tool_calling_iterations: int | None = setting(
        None,
        "Rounds of tool calls per episode (GRPOTrainer's agent arguments only).",
        at_least(
            1,
            "rounds of tool calls per episode (GRPOTrainer's agent arguments); None: no limit but max_turns",
            none=True,
        ),
    )
    malformed_tool_call: str = setting(
        "end_episode",
        "A reply opening a tool call that does not parse (GRPOTrainer's agent arguments only): "
        "end_episode (GRPOTrainer's behaviour: the reply is plain text and the rollout ends) or answer (the model gets "
        "a tool message saying the call did not parse, and the episode goes on: one typo costs a turn).",
    )

    # --- generation with vLLM ------------------------------------------------------------------
    use_vllm: bool = setting(False, "Sample rollouts with vLLM (vllm_mode: colocate or server).")
    vllm_mode: str = setting("colocate", "colocate: an engine in each training process; server: `trl vllm-serve`.")
    vllm_gpu_memory_utilization: float = setting(
        0.3,
        "Colocated engine: the fraction of each GPU's memory it takes.",
        between(0, 1, "the fraction of each GPU's memory a colocated vLLM engine takes", low_open=True),
    )
    vllm_tensor_parallel_size: int = setting(
        1, "Colocated engine: GPUs it spans.", at_least(1, "GPUs one vLLM engine spans")
    )
    vllm_enable_sleep_mode: bool = setting(False, "Colocated engine: release its memory during the update.")
    vllm_max_model_length: int | None = setting(
        None,
        "The engine's context length; None: max_trajectory_tokens.",
        at_least(1, "the vLLM engine's context length; None: max_trajectory_tokens", none=True),
    )
    vllm_server_base_url: str | None = setting(None, "Server mode: the server's URL (else host and port).")
    vllm_server_host: str = setting("0.0.0.0", "Server mode: the server's host.")
    vllm_server_port: int = setting(
        8000, "Server mode: the server's port.", between(1, 65535, "the vLLM server's TCP port")
    )
    vllm_server_timeout: float = setting(
        240.0,
        "Server mode: seconds to wait for the server at start-up.",
        above(0, "server mode: seconds to wait for the vLLM server at start-up"),
    )
    vllm_sync_tolerance: float | None = setting(
        None,
        "After each weight sync, warn if vLLM's and the trainer's log-probs on the probe sequence differ by "
        "more than this, and stop at two syncs in a row (default: 1e-3 in fp32, 0.25 in bf16; negative: never "
        "stop).",
        any_number(
            "the largest log-prob difference after a weight sync; negative: never stop; None: 1e-3 in fp32, "
            "0.25 in bf16",
            none=True,
        ),
    )
    vllm_sync_dir: str | None = setting(
        None,
        "Server mode: a directory the vLLM server can read, where adapters and weight shards are written for "
        "it (default: output_dir/weight-sync).",
    )
    vllm_probe_tokens: int = setting(
        64,
        "Length of the fixed probe sequence scored after each weight sync.",
        at_least(2, "the probe sequence's length; its log-probs need at least 2 tokens"),
    )

    # --- outputs -------------------------------------------------------------------------------
    overwrite_output_dir: bool = setting(
        False,
        "A fresh run (no resume_from_checkpoint) into an output_dir holding another run's checkpoints is "
        "refused; true deletes that run first: its checkpoint-N directories, metrics.jsonl, learning_curve.png, "
        "viewer/, rollouts/ and .staging-checkpoint/ (the model files at the top are replaced when the new run "
        "saves). Only a finished run: one that stopped before its last iteration needs overwrite_interrupted_run "
        "too. A resumed run deletes nothing.",
    )
    overwrite_interrupted_run: bool = setting(
        False,
        "With overwrite_output_dir: also delete a previous run that stopped before its last iteration (a crash, "
        "a Ctrl-C); without it such a run is kept and the new one refused, naming resume_from_checkpoint last.",
    )
    resume_with_changed_settings: bool = setting(
        False,
        "Resume even though settings an exact resume depends on (seed, tasks_per_iteration, learning_rate, "
        "environment_kwargs, ...) differ from the checkpoint's; the new values are applied from the next iteration "
        "and recorded in loop_state.json, recipe.yaml and the log.",
    )
    save_rollouts: bool = setting(False, "Write each iteration's trajectories to output_dir/rollouts/ (datasets).")
    plot_curves: bool = setting(True, "Write learning_curve.png to output_dir.")
    viewer_rollouts_per_iteration: int = setting(
        4,
        "Rollouts per iteration shown in output_dir/viewer/iteration-N.html (the best, the worst and any that "
        "failed to run); 0 writes none.",
        at_least(0, "rollouts shown in each iteration's viewer page; 0 writes none"),
    )
    log_trajectories_every: int = setting(
        1,
        "With report_to (wandb, tensorboard): a table of sampled trajectories (task, transcript, reward, advantage, "
        "kept) every N iterations; 0 logs none.",
        at_least(0, "iterations between the trackers' tables of sampled trajectories; 0 logs none"),
    )
    num_trajectories_to_log: int | None = setting(
        8,
        "Trajectories in each table: the best, the worst and any that failed to run, as in the viewer. None: all of "
        "the iteration's.",
        at_least(1, "trajectories in each tracker table; None: all of the iteration's", none=True),
    )

    # --- TrainingArguments fields with LOOP's defaults or ranges ---------------------------------
    learning_rate: float = setting(
        5e-5, "AdamW learning rate (constant).", above(0, "the optimizer's step size; 0 would never change the weights")
    )
    lr_scheduler_type: str = setting("constant", "Learning-rate schedule.")
    weight_decay: float = setting(0.01, "AdamW weight decay.", at_least(0, "AdamW's decoupled weight decay"))
    adam_beta1: float = setting(
        0.9, "AdamW's first-moment decay.", between(0, 1, "AdamW's first-moment decay", high_open=True)
    )
    adam_beta2: float = setting(
        0.999, "AdamW's second-moment decay.", between(0, 1, "AdamW's second-moment decay", high_open=True)
    )
    adam_epsilon: float = setting(
        1e-8,
        "AdamW's denominator term.",
        above(0, "AdamW's denominator term; 0 divides by zero where a gradient is zero"),
    )
    warmup_steps: float = setting(
        0,
        "Optimizer steps of linear warm-up; below 1, a fraction of all optimizer steps.",
        at_least(0, "optimizer steps of linear warm-up; below 1, a fraction of all optimizer steps"),
    )
    max_grad_norm: float = setting(
        0.1,
        "Gradient-norm clip (global norm over ranks).",
        above(
            0,
            "the global gradient-norm clip; inf: no clipping; 0 would zero every gradient, a negative value flips it",
            inf=True,
        ),
    )
    seed: int = setting(
        42,
        "Seeds Python, NumPy and torch, the task order and the sampling.",
        between(0, 4294967295, "seeds Python, NumPy and torch; NumPy takes 32-bit seeds"),
    )
    per_device_train_batch_size: int = setting(
        1,
        "Trajectories per forward/backward pass (gradient accumulation inside a minibatch).",
        at_least(1, "trajectories per forward/backward pass"),
    )
    train_sampling_strategy: str = setting(
        "random",
        "How a minibatch is cut into micro-batches: 'random' (in its shuffled order) or 'group_by_length' (its "
        "trajectories sorted by length first, so a micro-batch pads less: the same gradient up to float rounding, "
        "fewer padded tokens through the forward and backward passes).",
    )
    activation_checkpointing: bool | None = setting(
        True, "Recompute activations in the backward pass (long trajectories need it)."
    )
    gradient_checkpointing: bool | None = setting(
        None, "Deprecated alias of activation_checkpointing (transformers 5)."
    )
    activation_offloading: bool = setting(
        False,
        "Move what the update's forward saves for the backward (with activation_checkpointing: each layer's input) "
        "to pinned CPU memory, and back for the backward (TRL's activation offloading, SFTConfig's key). GPU only.",
    )
    ddp_timeout: int = setting(
        1800,
        "Seconds a collective operation may wait for the other processes.",
        at_least(1, "seconds a collective operation may wait for the other processes"),
    )
    ddp_bucket_cap_mb: int | None = setting(
        None,
        "DDP's gradient bucket size in MB.",
        at_least(1, "DDP's gradient bucket size in MB; None: torch's default", none=True),
    )
    local_rank: int = setting(
        -1,
        "Set by the launcher.",
        unranged="set by the launcher (torchrun, accelerate, deepspeed); -1 when not distributed",
    )
    # None ("where the GPU supports it") widens TrainingArguments' bool; __post_init__ resolves it to one
    bf16: bool | None = setting(None, "bf16 mixed precision; None: on where the GPU supports it.")  # type: ignore[assignment]
    logging_steps: float = setting(
        1,
        "Log every N iterations.",
        steps_or_fraction(
            "iterations between logs; below 1, a fraction of iterations", when=("logging_strategy", "steps")
        ),
    )
    report_to: None | str | list[str] = setting("none", "Trackers: 'wandb', 'trackio', 'tensorboard', 'none'.")
    save_strategy: SaveStrategy | str = setting(
        "steps", "'steps': a checkpoint every save_steps iterations (resumable); 'no': none."
    )
    save_steps: float = setting(
        1,
        "Iterations between checkpoints.",
        steps_or_fraction(
            "iterations between checkpoints; below 1, a fraction of iterations; save_strategy: no saves none",
            when=("save_strategy", "steps"),
        ),
    )
    save_total_limit: int | None = setting(
        2, "Checkpoints kept (older ones are deleted).", at_least(1, "checkpoints kept; None keeps all", none=True)
    )

    def __post_init__(self) -> None:
        try:
            check_ranges(self)
        except ValueError as error:
            raise ValueError(f"LOOPConfig: {error}") from None
        if self.output_dir is not None and (problem := output_dir_problem(self.output_dir)):
            raise ValueError(f"LOOPConfig: {problem}")
        for name, choices in (
            ("save_strategy", ("steps", "no")),
            ("logging_strategy", ("steps", "no")),
            ("advantage_estimator", ADVANTAGE_ESTIMATORS),
            ("ratio_level", RATIO_LEVELS),
            ("sampler_correction", SAMPLER_CORRECTIONS),
            ("vllm_mode", ("colocate", "server")),
            ("malformed_tool_call", ("end_episode", "answer")),
            ("train_sampling_strategy", ("random", "group_by_length")),
        ):
            value = getattr(self, name)
            if getattr(value, "value", value) not in choices:  # LOOP's loop has iterations, no epochs or eval loss
                raise ValueError(f"LOOPConfig: {name} must be one of {', '.join(choices)}, got {value!r}")
        if self.bf16 is None:  # on where the accelerator has it; TRL's default (True) fails on CPUs
            self.bf16 = not self.fp16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        if "activation_checkpointing" not in TrainingArguments.__dataclass_fields__:
            # transformers < 5.18 (the one vLLM <= 0.31 accepts) only knows gradient_checkpointing.
            if self.gradient_checkpointing is not None:
                self.activation_checkpointing = self.gradient_checkpointing
            self.gradient_checkpointing = bool(self.activation_checkpointing)
        if self.report_to is None:  # (a recipe's `report_to: null`), which transformers' Trainer would refuse
            self.report_to = "none"
        elif isinstance(self.report_to, str) and "," in self.report_to:  # a flag names one value: wandb,tensorboard
            self.report_to = [name.strip() for name in self.report_to.split(",") if name.strip()]
        super().__post_init__()  # report_to is a list from here ("all" and "none" resolved)
        if problem := report_to_problem(self.report_to):
            raise ValueError(f"LOOPConfig: {problem}")
        if problem := every_n_layers_problem(self):
            raise ValueError(f"LOOPConfig: {problem}")
        if self.max_training_tokens is None:
            self.max_training_tokens = self.max_trajectory_tokens
        try:
            check_combinations(self, self.launch())
        except ConfigCombinationError as error:
            raise ConfigCombinationError(f"LOOPConfig: {error}") from None

    def launch(self, generator: Generator = Generator.UNKNOWN, num_processes: int | None = None) -> Launch:
        """What the config knows of its launch: the processes the launcher started (``WORLD_SIZE``; the
        trainer gives accelerate's count), the DeepSpeed ZeRO stage, whether CUDA is visible (or, in the dry run,
        planned: :func:`~.combinations.planning_a_gpu_launch`)."""
        plugin = getattr(self, "deepspeed_plugin", None)
        # A CPU-only launch never runs DeepSpeed (accelerate does not pick it with cpu=True), whatever the plugin says.
        cpu_only = self.use_cpu or parse_flag_from_env("ACCELERATE_USE_CPU")
        return Launch(
            num_processes=num_processes if num_processes is not None else int(os.environ.get("WORLD_SIZE", "1") or 1),
            zero_stage=getattr(plugin, "zero_stage", None) if plugin is not None and not cpu_only else None,
            cuda=(torch.cuda.is_available() or planning_gpu_launch()) and not self.use_cpu,
            generator=generator,
        )


# A GRPOConfig or TrainingArguments key given to LOOPConfig names LOOP's equivalent, not just "unexpected keyword".
LOOPConfig.__init__ = refusing_unknown_keys(LOOPConfig, LOOPConfig.__init__)  # type: ignore[method-assign]

# LOOP's own keys: those LOOPConfig declares itself (TrainingArguments' included where it changes their default or
# range) and those of the EpisodeSettings it shares with loop-eval.
LOOP_OWN_KEYS = frozenset(LOOPConfig.__annotations__) - frozenset(
    f.name for f in dataclasses.fields(LOOPConfig) if not f.init
) | {f.name for f in dataclasses.fields(EpisodeSettings)}


def checkpointing_kwargs(args: LOOPConfig) -> dict[str, Any]:
    """A copy of the activation checkpointing kwargs, under the name this transformers reads."""
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs or {}
    return dict(cast(dict[str, Any], kwargs))  # TrainingArguments parsed a JSON string into a dict


def checkpointing_kwargs_key(args: LOOPConfig) -> str:
    """The config key this transformers reads the checkpointing kwargs from (before 5.18: gradient_...)."""
    return (
        "activation_checkpointing_kwargs"
        if hasattr(args, "activation_checkpointing_kwargs")
        else "gradient_checkpointing_kwargs"
    )


def every_n_layers_problem(config: LOOPConfig) -> str | None:
    """What is wrong with the checkpointing kwargs' ``every_n_layers`` (transformers checkpoints the decoder layers
    whose index is a multiple of it; the memory plan counts the others' activations), or None."""
    value = checkpointing_kwargs(config).get("every_n_layers", 1)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return None
    return (
        "activation_checkpointing_kwargs' every_n_layers must be a whole number >= 1 (1 checkpoints every decoder "
        f"layer, 2 every other one), got {value!r}"
    )
