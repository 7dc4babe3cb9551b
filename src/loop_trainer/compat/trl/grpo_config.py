"""A ``GRPOConfig`` as a :class:`~loop_trainer.LOOPConfig`: the one-word switch from GRPOTrainer.

A TRL script that passes ``args=GRPOConfig(...)`` to ``LOOPTrainer`` keeps every setting it chose,
translated to LOOP's terms, and is refused (one line, all offending keys) where a setting has no
LOOP meaning. The batch shape and the run length always carry over (GRPOConfig's defaults too:
one prompt x 8 completions per step, 3 epochs); of the other keys, those set away from
GRPOConfig's defaults are carried and the rest take LOOPConfig's defaults (the paper's). The
translations:

* batch shape: GRPO samples ``generation_batch_size`` completions (``num_generations`` per prompt)
  and takes an optimizer step every ``per_device_train_batch_size x gradient_accumulation_steps x
  processes`` of them, ``num_iterations`` passes over each batch. That is LOOP's
  ``tasks_per_iteration = generation_batch_size / num_generations``, ``rollouts_per_task =
  num_generations``, ``minibatch_size`` (trajectories per optimizer step) and ``ppo_epochs``;
* length of the run: ``max_steps`` (optimizer steps) or ``num_train_epochs`` (passes over the
  prompts) become ``iterations``; ``logging_steps`` and ``save_steps``, in optimizer steps, become
  iterations the same way (rounded up);
* ``max_completion_length`` (every turn after the prompt, tool output included) is
  ``max_completion_tokens``, and also bounds one reply (``max_new_tokens_per_turn``), as in TRL;
  the number of turns is bounded by ``max_tool_calling_iterations`` + 1, or else only by the
  completion budget, as in TRL;
* ``eval_strategy="steps"`` evaluates ``eval_dataset`` (split "eval") every ``eval_steps``
  optimizer steps, as iterations, sampling ``num_generations_eval`` rollouts at ``temperature``;
* the correction toward the sampler: with ``vllm_importance_sampling_correction`` (TRL's default), any
  of ``vllm_importance_sampling_mode``, ``vllm_importance_sampling_clip_max`` (or the deprecated
  ``vllm_importance_sampling_cap``) and ``vllm_importance_sampling_clip_min`` set carries all three:
  ``sampler_correction`` (the same four values: token_truncate, token_mask, sequence_truncate,
  sequence_mask), ``sampler_importance_cap`` and ``sampler_importance_floor``; none set, LOOP's default
  (no correction) stands and is logged among the replaced defaults when ``use_vllm`` (where TRL corrects);
  ``vllm_importance_sampling_correction=False`` is LOOP's default. ``importance_sampling_level:
  sequence`` (GSPO) is ``ratio_level: sequence``;
* LOOP's start-up memory stress test is off (GRPOTrainer has none; it would size itself by
  ``max_trajectory_tokens``, which a GRPOConfig cannot set).

GRPOConfig's defaults that LOOP replaces with its own (learning rate, gradient clipping, ...) are
returned for the trainer to log.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from trl import GRPOConfig

from ...config import LOOP_EQUIVALENTS, LOOPConfig

# GRPOConfig keys with a LOOPConfig key of the same name and meaning: those LOOPConfig takes, except
# DIFFERENT_MEANING's and TRANSLATED's.
SAME_MEANING = frozenset(f.name for f in dataclasses.fields(LOOPConfig) if f.init) & frozenset(
    f.name for f in dataclasses.fields(GRPOConfig) if f.init
)
# GRPOConfig keys translated below (their values shape LOOP's batch, run length and budgets).
TRANSLATED = {
    "num_generations",
    "generation_batch_size",
    "steps_per_generation",
    "gradient_accumulation_steps",
    "num_iterations",
    "max_steps",
    "num_train_epochs",
    "max_completion_length",
    "logging_steps",
    "save_steps",
    "eval_strategy",
    "eval_steps",
    "num_generations_eval",
    # GRPOConfig requires it to hold whole groups when evaluating; LOOP runs evaluation episodes concurrently
    "per_device_eval_batch_size",
    "importance_sampling_level",
    "vllm_importance_sampling_correction",
}
# TRL's correction toward the sampler (vLLM's log-probs): carried together when any is set.
SAMPLER_CORRECTION_KEYS = {
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_cap",  # deprecated in TRL: GRPOConfig copies it into clip_max
}
TRANSLATED |= SAMPLER_CORRECTION_KEYS
# Keys GRPOConfig derives from others in __post_init__ (compared through the keys they derive from).
DERIVED = {"generation_batch_size", "steps_per_generation", "logging_dir", "do_eval"}
DIFFERENT_MEANING = {
    "epsilon": "LOOP clips the ratio to [1/(1+epsilon), 1+epsilon], GRPO to [1-epsilon, 1+epsilon_high]; "
    "LOOPConfig's epsilon is LOOP's"
}


def _differs(value: Any, default: Any) -> bool:
    value, default = getattr(value, "value", value), getattr(default, "value", default)
    return value != default and not (
        isinstance(value, float) and isinstance(default, float) and math.isnan(value) and math.isnan(default)
    )


def changed_keys(grpo: GRPOConfig) -> tuple[dict[str, Any], GRPOConfig]:
    """The keys of ``grpo`` set away from GRPOConfig's defaults (as __post_init__ leaves them), and
    a GRPOConfig of those defaults."""
    try:
        reference = GRPOConfig(output_dir=grpo.output_dir, use_cpu=grpo.use_cpu)
    except ValueError:  # GRPOConfig's bf16 default fails where there is no bf16 device: grpo must have set it
        reference = GRPOConfig(output_dir=grpo.output_dir, use_cpu=grpo.use_cpu, bf16=False)
    changed = {
        spec.name: getattr(grpo, spec.name)
        for spec in dataclasses.fields(GRPOConfig)
        if spec.init and spec.name not in DERIVED and _differs(getattr(grpo, spec.name), getattr(reference, spec.name))
    }
    return changed, reference


def _refusals(changed: dict[str, Any]) -> list[str]:
    refused = []
    for key, value in sorted(changed.items()):
        if key in DIFFERENT_MEANING:
            refused.append(f"{key}={value!r} ({DIFFERENT_MEANING[key]})")
        elif key == "scale_rewards" and getattr(value, "value", value) in ("none", False):
            continue  # no scaling: what LOOP does
        elif key not in SAME_MEANING and key not in TRANSLATED:
            equivalent = LOOP_EQUIVALENTS.get(key)
            refused.append(f"{key}={value!r} (not a LOOP setting{'; LOOP key: ' + equivalent if equivalent else ''})")
    return refused


def loop_config_from_grpo(grpo: GRPOConfig, num_tasks: int | None) -> tuple[LOOPConfig, dict[str, Any], list[str]]:
    """``grpo`` in LOOP's terms; the LOOP keys it set; and the GRPO defaults LOOP's replace (for the
    log). ``num_tasks``: the prompts in train_dataset (for ``num_train_epochs``), None if unknown."""
    changed, reference = changed_keys(grpo)
    if refused := _refusals(changed):
        raise ValueError(
            "GRPOConfig -> LOOPConfig: these settings have no LOOP meaning; drop them or use LOOPConfig: "
            + "; ".join(refused)
        )
    loop: dict[str, Any] = {k: v for k, v in changed.items() if k in SAME_MEANING and k not in TRANSLATED}
    # A GRPOConfig always defines a batch shape, a run length and a completion budget (its defaults
    # included): they carry over.
    per_step = grpo.per_device_train_batch_size * grpo.gradient_accumulation_steps * grpo.world_size
    # GRPOConfig.__post_init__ resolved both (its own checks divide by them)
    assert grpo.generation_batch_size is not None and grpo.num_generations is not None
    if grpo.generation_batch_size % per_step:
        raise ValueError(
            f"GRPOConfig -> LOOPConfig: a generation batch of {grpo.generation_batch_size} completions is "
            f"not a whole number of optimizer steps of {per_step} (per_device_train_batch_size x "
            "gradient_accumulation_steps x processes): set steps_per_generation to a multiple of "
            "gradient_accumulation_steps, or use a LOOPConfig"
        )
    loop.update(
        rollouts_per_task=grpo.num_generations,
        tasks_per_iteration=max(1, grpo.generation_batch_size // grpo.num_generations),
        minibatch_size=per_step,
        per_device_train_batch_size=grpo.per_device_train_batch_size,
        ppo_epochs=grpo.num_iterations,
    )
    steps_per_iteration = grpo.num_iterations * grpo.generation_batch_size // per_step
    if grpo.max_steps > 0:
        loop["iterations"] = math.ceil(grpo.max_steps / steps_per_iteration)
    elif num_tasks is None:
        raise ValueError("GRPOConfig -> LOOPConfig: num_train_epochs needs a train_dataset to count; set max_steps")
    else:  # TRL's sampler drops an epoch's incomplete last batch
        loop["iterations"] = max(1, int(grpo.num_train_epochs * (num_tasks // loop["tasks_per_iteration"])))
    for key in ("logging_steps", "save_steps"):
        if key in changed:
            value = getattr(grpo, key)
            loop[key] = value if value < 1 else math.ceil(value / steps_per_iteration)
    strategy = getattr(grpo.eval_strategy, "value", grpo.eval_strategy)
    if strategy == "steps":  # TRL samples num_generations_eval completions of each eval prompt every eval_steps steps
        every = grpo.eval_steps or grpo.logging_steps  # below 1: a fraction of the run
        iterations = every * loop["iterations"] if every < 1 else every / steps_per_iteration
        loop.update(
            eval_split="eval",
            eval_every=max(1, math.ceil(iterations)),
            eval_temperature=grpo.temperature,
            eval_rollouts_per_task=grpo.num_generations_eval or grpo.num_generations,
        )
    elif strategy != "no":
        raise ValueError(
            f"GRPOConfig -> LOOPConfig: eval_strategy={strategy!r}: LOOP evaluates every eval_every "
            "iterations; use eval_strategy='steps' (with eval_steps) or a LOOPConfig"
        )
    # Every turn after the prompt shares max_completion_length, and one reply may use all of it; without
    # max_tool_calling_iterations TRL's turns are bounded only by it (each turn takes a token at least).
    loop.update(
        max_completion_tokens=grpo.max_completion_length,
        max_new_tokens_per_turn=grpo.max_completion_length,
        max_turns=grpo.max_completion_length
        if grpo.max_tool_calling_iterations is None
        else grpo.max_tool_calling_iterations + 1,
    )
    if grpo.importance_sampling_level != "token":  # TRL's "sequence": GSPO's geometric-mean ratio
        loop["ratio_level"] = grpo.importance_sampling_level
    if grpo.vllm_importance_sampling_correction and SAMPLER_CORRECTION_KEYS & changed.keys():
        loop.update(
            sampler_correction=grpo.vllm_importance_sampling_mode,
            sampler_importance_cap=grpo.vllm_importance_sampling_clip_max,
            sampler_importance_floor=grpo.vllm_importance_sampling_clip_min,
        )
    # GRPOTrainer has no start-up memory check, and LOOP's would size itself by max_trajectory_tokens, which a
    # GRPOConfig cannot set: a LOOPConfig turns it on with the right size.
    loop["memory_stress_test"] = False
    config = LOOPConfig(output_dir=grpo.output_dir, **loop)
    replaced = [
        f"{key}: GRPO's {_shown(getattr(reference, key))} -> LOOP's {_shown(getattr(config, key))}"
        for key in sorted(SAME_MEANING - TRANSLATED)
        if key not in changed and _differs(getattr(reference, key), getattr(config, key))
    ]
    if grpo.use_vllm and grpo.vllm_importance_sampling_correction and "sampler_correction" not in loop:
        replaced.append(
            f"vllm_importance_sampling_mode: GRPO's {_shown(grpo.vllm_importance_sampling_mode)} (clip_max "
            f"{_shown(grpo.vllm_importance_sampling_clip_max)}) -> LOOP's none (set vllm_importance_sampling_mode "
            "to carry it as sampler_correction)"
        )
    if "scale_rewards" not in changed:
        replaced.append(
            f"scale_rewards: GRPO's {_shown(reference.scale_rewards)} -> LOOP's leave-one-out advantage, not scaled"
        )
    return config, loop, replaced


def _shown(value: Any) -> str:
    return repr(getattr(value, "value", value))
