"""The Hub publisher: the model card and exactly what gets uploaded (see :mod:`.hub`).

Trainer's stock push uploads the whole output folder (rollouts, viewer pages, staging
checkpoints) and pushes checkpoints from the staging directory before they are complete. Here a
push uploads the adapter (or the weights), the tokenizer with its chat template, the recipe, the
metrics and the card; ``hub_strategy: checkpoint`` also uploads each checkpoint once it has been
published (renamed into place).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers.trainer_utils import HubStrategy

from . import hub

CardContext = Callable[[], dict[str, Any]]
"""Returns what the model card describes: base_model, settings, peft_config, environment, history, ..."""


@dataclass(frozen=True)
class PublisherSettings:
    output_dir: str
    """Where the run's files are (the model files of each published checkpoint are copied there)."""
    hub_strategy: HubStrategy = HubStrategy.EVERY_SAVE
    hub_token: str | None = None
    hub_revision: str | None = None


class HubPublisher:
    """Writes the card, starts uploads and keeps track of those still running; the trainer owns the
    repository id."""

    def __init__(self, settings: PublisherSettings, card_context: CardContext):
        self.settings = settings
        self.card_context = card_context
        self._checkpoint_pending = False
        self.jobs: list[Any] = []
        """Uploads started in the background (``concurrent.futures.Future``), oldest first."""

    def track(self, job: Any | None) -> None:
        if job is not None:
            self.jobs.append(job)

    def busy(self) -> bool:
        """Whether an upload started in the background is still running."""
        return any(not job.done() for job in self.jobs)

    def wait(self) -> None:
        """Block until every background upload has finished (raising the first one's error)."""
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job.result()

    def write_card(self, output_dir: str, **overrides: Any) -> None:
        card = {"model_name": None, "tags": None, "license": None, **self.card_context()}
        card.update({k: v for k, v in overrides.items() if k in ("model_name", "tags", "license")})
        hub.write_model_card(output_dir, **card)

    def upload_run(
        self,
        *,
        repo_id: str,
        token: str | None,
        revision: str | None,
        commit_message: str,
        merge_adapter: bool,
        blocking: bool,
        **card_overrides: Any,
    ) -> Any:
        """The end-of-training (or on-demand) upload of ``output_dir``'s model files."""
        self.write_card(self.settings.output_dir, **card_overrides)
        card = {
            **self.card_context(),
            **{k: v for k, v in card_overrides.items() if k in ("model_name", "tags", "license")},
        }
        return hub.upload_folder_contents(
            self.settings.output_dir,
            repo_id=repo_id,
            commit_message=commit_message,
            token=token,
            revision=revision,
            create_repo=False,
            merge_adapter=merge_adapter,
            card_kwargs=card,
            run_as_future=not blocking,
        )

    def upload_checkpoint_model(
        self, staging_folder: str, *, repo_id: str, iteration: int, tokenizer: Any | None
    ) -> Any | None:
        """While a checkpoint is written (from the staging folder): upload its model files now; the
        whole checkpoint follows once published (:meth:`upload_published_checkpoint`)."""
        settings = self.settings
        self._checkpoint_pending = False
        if settings.hub_strategy == HubStrategy.END:
            return None
        hub.copy_model_files(staging_folder, settings.output_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(settings.output_dir)
        self._checkpoint_pending = settings.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS)
        return hub.upload_folder_contents(
            settings.output_dir,
            repo_id=repo_id,
            token=settings.hub_token,
            commit_message=f"Training in progress, iteration {iteration}",
            revision=settings.hub_revision,
            create_repo=False,
            run_as_future=True,
        )

    def upload_published_checkpoint(self, checkpoint: Path, *, repo_id: str, iteration: int) -> Any | None:
        if not self._checkpoint_pending:
            return None
        self._checkpoint_pending = False
        path_in_repo = "last-checkpoint" if self.settings.hub_strategy == HubStrategy.CHECKPOINT else checkpoint.name
        return hub.upload_checkpoint(
            checkpoint,
            repo_id=repo_id,
            path_in_repo=path_in_repo,
            token=self.settings.hub_token,
            revision=self.settings.hub_revision,
            run_as_future=True,
            commit_message=f"Training in progress, iteration {iteration}, checkpoint",
        )
