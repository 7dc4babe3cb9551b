"""The transformers ``Trainer`` API, LOOP's way: checkpoints staged with LOOP's state, the model card and
the Hub uploads of :class:`~loop_trainer.publishing.publisher.HubPublisher`, the run log's files.

:class:`TrainerHooks` holds the ``Trainer`` methods LOOPTrainer overrides to delegate to its collaborators;
:class:`~.trainer_sampling.TrainerSampling` adds the parts that sample (and ``evaluate()``),
:class:`~.trainer.LOOPTrainer` LOOP's loop. The private ``Trainer`` hooks overridden here
(``_save_checkpoint``, ``_get_output_dir``, ``_push_from_checkpoint``) are pinned by
tests/unit/training/test_trainer_hooks.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedModel, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy

from ..config import LOOPConfig
from ..envs.base import Environment
from ..publishing.publisher import HubPublisher
from .checkpoints import CheckpointStager
from .overlap import OverlappedRollouts
from .resume import resume_settings
from .run_log import RunLog
from .sampler import BalancedTaskSampler, TaskSampler


class TrainerHooks(Trainer):
    """The ``Trainer`` methods a LOOP run overrides: each delegates to a collaborator the subclass builds."""

    args: LOOPConfig  # LOOPTrainer translates any other arguments into one
    model: PreTrainedModel | torch.nn.Module  # LOOPTrainer always has one
    train_dataset: Dataset  # the training split's tasks: LOOPTrainer always passes them
    env: Environment
    checkpoints: CheckpointStager
    publisher: HubPublisher
    task_sampler: TaskSampler | BalancedTaskSampler
    latest_eval: dict[str, Any] | None
    recipe_path: str | dict[str, Any] | None = None
    """The recipe the run came from (a path, or the effective values); uploaded as recipe.yaml."""
    run_settings: dict[str, Any] | None = None
    """Settings from outside LOOPConfig that shape the run, recorded in every checkpoint and compared on
    resume like LOOPConfig's (see ``resume.RESUME_SETTINGS``). ``loop-train`` sets ``environment``
    and ``environment_kwargs`` (its ScriptArguments); by default ``environment`` is ``env.name``."""
    setting_changes: Sequence[dict[str, Any]] = ()
    """Settings changed on resume (``resume_with_changed_settings``), oldest first: ``{"setting", "old",
    "new", "from_iteration"}``; kept in every later checkpoint."""

    run_log: RunLog
    overlap: OverlappedRollouts
    """``max_staleness``: the next iteration's rollouts, collected during this one's update."""

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

        with self.checkpoints.staged(
            super()._get_output_dir(trial),
            self.state.global_step,
            loop_state,
            on_published=self._push_published_checkpoint,
        ) as staging:
            super()._save_checkpoint(model, trial)
            if self.is_world_process_zero():  # max_staleness: the batch in flight belongs to the checkpoint
                self.overlap.save(Path(staging) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

    def resume_settings(self) -> dict[str, Any]:
        """The settings an exact resume depends on, as recorded in every checkpoint (:mod:`.resume`)."""
        return resume_settings(
            self.args,
            env_name=self.env.name,
            num_train_tasks=len(self.train_dataset),
            model=self.accelerator.unwrap_model(self.model),
            run_settings=self.run_settings,
        )

    def _get_output_dir(self, trial: Any) -> str:
        staging = self.checkpoints.staging_root
        return str(staging) if staging is not None else super()._get_output_dir(trial)

    def _card_context(self) -> dict[str, Any]:
        model = self.accelerator.unwrap_model(self.model)
        return {
            "base_model": getattr(model.config, "_name_or_path", None) or None,
            "hub_model_id": self.hub_model_id or self.args.hub_model_id,
            "args": self.args,
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

    # --- The run log ---
    @property
    def history(self) -> list[dict[str, Any]]:
        return self.run_log.history

    @property
    def metrics_path(self) -> str:
        return str(self.run_log.metrics_path)

    @property
    def curve_path(self) -> str:
        return str(self.run_log.curve_path)
