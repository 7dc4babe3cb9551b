"""Each collaborator's typed, frozen settings, built from a :class:`~loop_trainer.LOOPConfig` here and nowhere
else. A collaborator takes its own settings type (defined in its own module) and never the whole config, so it
can be built and tested from its settings alone and mypy checks every key it reads.

    LOOPConfig ──▶ update_settings      ──▶ PolicyUpdate            (training/update.py)
               ──▶ generator_settings   ──▶ build_generator         (rollout/generator.py)
               ──▶ collection_settings  ──▶ the iteration's rollouts (collect_share)
               ──▶ episode_settings     ──▶ the rollout engine and the Evaluator (rollout_resources.py)
               ──▶ evaluation_settings  ──▶ periodic evaluation (LOOPTrainer.evaluate_policy)
               ──▶ start_settings, optimizer_hyperparameters, recorded_keys ──▶ resume (training/resume.py)
               ──▶ publisher_settings   ──▶ HubPublisher            (publishing/publisher.py)
               ──▶ card_settings        ──▶ the model card          (publishing/model_card.py)
               ──▶ tracker_settings     ──▶ TrackerLog              (training/trackers.py)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

from transformers.trainer_utils import HubStrategy

from ..config import EpisodeSettings, LOOPConfig
from ..config.resume_policy import RECORDED_KEYS
from ..objective import RatioLevel
from ..publishing.model_card import CardSettings, hyperparameter_rows
from ..publishing.publisher import PublisherSettings
from ..rollout.generator import GeneratorSettings, VLLMSettings
from ..stabilisers import SamplerCorrection
from .resume import OptimizerHyperparameters, StartSettings
from .trackers import TrackerSettings
from .update import UpdateSettings, importance_cap

__all__ = [
    "CardSettings",
    "CollectionSettings",
    "EvaluationSettings",
    "card_settings",
    "collection_settings",
    "episode_settings",
    "evaluation_settings",
    "generator_settings",
    "optimizer_hyperparameters",
    "publisher_settings",
    "recorded_keys",
    "start_settings",
    "tracker_settings",
    "update_settings",
]


@dataclass(frozen=True)
class CollectionSettings:
    """One iteration's collection across processes."""

    seed: int
    rollouts_per_task: int
    max_failed_fraction: float
    early_stop_done_fraction: float
    early_stop_task_fraction: float
    partial_rollouts: bool
    """Carry the groups running at a batch's cut into the next one (:mod:`..rollout.partial`)."""
    max_staleness: int
    collection_process: bool
    """Collect the batches queued ahead in a child process (:mod:`..rollout.collection_process`)."""


@dataclass(frozen=True)
class EvaluationSettings:
    """Periodic evaluation during training."""

    split: str | None
    every: int
    rollouts_per_task: int
    temperature: float
    max_tasks: int | None
    seed: int
    viewer: bool
    """Write each evaluation's viewer page (``viewer_rollouts_per_iteration`` > 0)."""

    @property
    def periodic(self) -> bool:
        return bool(self.split and self.every)


def update_settings(config: LOOPConfig, pad_token_id: int) -> UpdateSettings:
    return UpdateSettings(
        epsilon=config.epsilon,
        minibatch_size=config.minibatch_size,
        ppo_epochs=config.ppo_epochs,
        micro_batch_size=config.per_device_train_batch_size,
        kl_abort_threshold=config.kl_abort_threshold,
        seed=config.seed,
        pad_token_id=pad_token_id,
        ratio_level=cast(RatioLevel, config.ratio_level),  # LOOPConfig checked it is one
        beta=config.beta,
        epsilon_high=config.epsilon_high,
        sampler_importance_cap=importance_cap(config.sampler_importance_cap, config.max_staleness),
        sampler_importance_floor=config.sampler_importance_floor,
        sampler_correction=cast(SamplerCorrection, config.sampler_correction),  # LOOPConfig checked it is one
        group_by_length=config.train_sampling_strategy == "group_by_length",
    )


def generator_settings(config: LOOPConfig) -> GeneratorSettings:
    assert config.output_dir is not None  # TrainingArguments.__post_init__ gives it a default
    return GeneratorSettings(
        use_vllm=config.use_vllm,
        temperature=config.temperature,
        seed=config.seed,
        output_dir=config.output_dir,
        generation_batch_limit=config.generation_batch_limit,
        max_concurrent_episodes=config.max_concurrent_episodes,
        max_trajectory_tokens=config.max_trajectory_tokens,
        static_decode=config.static_decode,
        compile_decode_step=config.compile_decode_step,
        merge_adapter_for_sampling=config.merge_adapter_for_sampling,
        bf16=bool(config.bf16),
        fp16=config.fp16,
        sync_tolerance=config.vllm_sync_tolerance,
        probe_tokens=config.vllm_probe_tokens,
        keep_versions=config.max_staleness > 1,
        vllm=VLLMSettings(
            mode=config.vllm_mode,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            enable_sleep_mode=config.vllm_enable_sleep_mode,
            max_model_length=config.vllm_max_model_length,
            server_url=config.vllm_server_base_url or f"http://{config.vllm_server_host}:{config.vllm_server_port}",
            server_timeout=config.vllm_server_timeout,
            sync_dir=config.vllm_sync_dir,
        ),
    )


def collection_settings(config: LOOPConfig) -> CollectionSettings:
    return CollectionSettings(
        seed=config.seed,
        rollouts_per_task=config.rollouts_per_task,
        max_failed_fraction=config.max_failed_fraction,
        early_stop_done_fraction=config.early_stop_done_fraction,
        early_stop_task_fraction=config.early_stop_task_fraction,
        partial_rollouts=config.partial_rollouts,
        max_staleness=config.max_staleness,
        collection_process=config.collection_process,
    )


def evaluation_settings(config: LOOPConfig) -> EvaluationSettings:
    return EvaluationSettings(
        split=config.eval_split,
        every=config.eval_every,
        rollouts_per_task=config.eval_rollouts_per_task,
        temperature=config.eval_temperature,
        max_tasks=config.eval_max_tasks,
        seed=config.seed,
        viewer=config.viewer_rollouts_per_iteration > 0,
    )


def start_settings(config: LOOPConfig) -> StartSettings:
    assert config.output_dir is not None  # TrainingArguments.__post_init__ gives it a default
    return StartSettings(
        output_dir=config.output_dir,
        overwrite_output_dir=config.overwrite_output_dir,
        overwrite_interrupted_run=config.overwrite_interrupted_run,
        resume_with_changed_settings=config.resume_with_changed_settings,
        should_save=config.should_save,
    )


def optimizer_hyperparameters(config: LOOPConfig) -> OptimizerHyperparameters:
    return OptimizerHyperparameters(
        learning_rate=config.learning_rate,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_epsilon=config.adam_epsilon,
    )


def recorded_keys(config: LOOPConfig) -> dict[str, Any]:
    """The keys every checkpoint records and a resume compares, with this run's values."""
    return {key: getattr(config, key) for key in RECORDED_KEYS}


def episode_settings(config: EpisodeSettings) -> EpisodeSettings:
    """The episode limits and concurrency, as loop-eval has them (not the whole config)."""
    return EpisodeSettings(**{field.name: getattr(config, field.name) for field in dataclasses.fields(EpisodeSettings)})


def card_settings(config: LOOPConfig) -> CardSettings:
    return CardSettings(
        hyperparameters=tuple(hyperparameter_rows(config)),
        train_split=config.train_split,
        iterations_planned=config.iterations,
        max_turns=config.max_turns,
        max_new_tokens_per_turn=config.max_new_tokens_per_turn,
        max_trajectory_tokens=config.max_trajectory_tokens,
    )


def publisher_settings(config: LOOPConfig) -> PublisherSettings:
    assert config.output_dir is not None  # TrainingArguments.__post_init__ gives it a default
    return PublisherSettings(
        output_dir=config.output_dir,
        hub_strategy=HubStrategy(config.hub_strategy),
        hub_token=config.hub_token,
        hub_revision=config.hub_revision,
    )


def tracker_settings(config: LOOPConfig) -> TrackerSettings:
    return TrackerSettings(
        trajectories_every=config.log_trajectories_every, trajectories_per_table=config.num_trajectories_to_log
    )
