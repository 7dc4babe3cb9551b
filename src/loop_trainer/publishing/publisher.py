"""LOOPTrainer's Hub side: the model card and exactly what gets uploaded (see :mod:`.hub`).

Trainer's stock push uploads the whole output folder (rollouts, viewer pages, staging
checkpoints) and pushes checkpoints from the staging directory before they are complete. Here a
push uploads the adapter (or the weights), the tokenizer with its chat template, the recipe,
the metrics and the card; ``hub_strategy: checkpoint`` also uploads each checkpoint once it has
been published.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers.trainer import PushInProgress
from transformers.trainer_utils import HubStrategy

from . import hub


class PublishingMixin:
    """Mixed into LOOPTrainer, before GRPOTrainer."""

    recipe_path: str | dict[str, Any] | None = None
    """The recipe the run came from (a path, or the effective values); uploaded as recipe.yaml."""
    _checkpoint_push_pending = False

    def _hub_card_kwargs(self) -> dict[str, Any]:
        model = self.accelerator.unwrap_model(self.model)
        return dict(base_model=getattr(model.config, "_name_or_path", None) or None,
                    hub_model_id=self.hub_model_id or self.args.hub_model_id, args=self.args,
                    peft_config=getattr(model, "peft_config", None), environment=self.env.name,
                    iterations_done=self.state.global_step, history=self.history,
                    eval_metrics=getattr(self, "latest_eval", None), recipe_path=self.recipe_path)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: list[str] | None = None, license: str | None = None, **_: Any) -> None:
        # GRPOTrainer._save_checkpoint calls this before every checkpoint; push_to_hub calls it too.
        if not self.is_world_process_zero():
            return
        hub.write_model_card(self.args.output_dir, model_name=model_name, tags=tags, license=license,
                             **self._hub_card_kwargs())

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    merge_adapter: bool = False, **kwargs: Any):
        """Upload the adapter (merged weights only with ``merge_adapter=True``), the tokenizer and
        its chat template, the recipe, the metrics and the model card."""
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        self.create_model_card(**kwargs)
        self._finish_current_push()
        card = {**self._hub_card_kwargs(), **{k: v for k, v in kwargs.items() if k in ("model_name", "tags", "license")}}
        return hub.upload_folder_contents(
            self.args.output_dir, repo_id=self.hub_model_id, commit_message=commit_message or "End of training",
            token=token, revision=revision if revision is not None else self.args.hub_revision,
            create_repo=False, merge_adapter=merge_adapter, card_kwargs=card, run_as_future=not blocking)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # Called inside Trainer._save_checkpoint with the *staging* folder: push the model files
        # now; the whole checkpoint is uploaded only once published (_push_published_checkpoint).
        self._checkpoint_push_pending = False
        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return
        if not self.args.hub_always_push and self.push_in_progress is not None and not self.push_in_progress.is_done():
            return
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        hub.copy_model_files(checkpoint_folder, self.args.output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(self.args.output_dir)
        job = hub.upload_folder_contents(
            self.args.output_dir, repo_id=self.hub_model_id, token=self.args.hub_token,
            commit_message=f"Training in progress, iteration {self.state.global_step}",
            revision=self.args.hub_revision, create_repo=False, run_as_future=True)
        self._add_push_jobs([job])
        self._checkpoint_push_pending = self.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS)

    def _push_published_checkpoint(self, checkpoint: Path) -> None:
        if not self._checkpoint_push_pending:
            return
        self._checkpoint_push_pending = False
        path_in_repo = "last-checkpoint" if self.args.hub_strategy == HubStrategy.CHECKPOINT else checkpoint.name
        self._add_push_jobs([hub.upload_checkpoint(
            checkpoint, repo_id=self.hub_model_id, path_in_repo=path_in_repo, token=self.args.hub_token,
            revision=self.args.hub_revision, run_as_future=True,
            commit_message=f"Training in progress, iteration {self.state.global_step}, checkpoint")])

    def _add_push_jobs(self, jobs: list[Any]) -> None:
        if self.push_in_progress is None or self.push_in_progress.is_done():
            self.push_in_progress = PushInProgress(jobs)
        else:
            self.push_in_progress.jobs.extend(jobs)
