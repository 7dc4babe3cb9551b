"""A checkpoint's push while the last upload still runs: skipped, as Trainer does, unless
``hub_always_push``. (The end-to-end push test in test_hub.py lets each upload finish first, so
its count of pushes does not depend on timing; this is where the skip itself is checked.)"""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from transformers.trainer_utils import HubStrategy

from loop_trainer.publishing.publisher import HubPublisher, PublisherSettings
from loop_trainer.training.trainer import LOOPTrainer


def test_a_save_skips_its_push_while_the_last_upload_runs_unless_hub_always_push():
    publisher = HubPublisher(PublisherSettings(output_dir="unused"), card_context=dict)
    started: list[str] = []

    def upload_checkpoint_model(folder, **_):
        started.append(folder)
        job: Future[None] = Future()
        return job  # still running until set_result

    publisher.upload_checkpoint_model = upload_checkpoint_model

    def save(folder: str, *, always_push: bool = False) -> None:
        trainer = SimpleNamespace(
            is_world_process_zero=lambda: True,
            args=SimpleNamespace(hub_strategy=HubStrategy.EVERY_SAVE, hub_always_push=always_push),
            publisher=publisher,
            callback_handler=SimpleNamespace(on_push_begin=lambda *_: None),
            state=SimpleNamespace(global_step=len(started) + 1),
            control=None,
            hub_model_id="me/loop-run",
            processing_class=None,
        )
        LOOPTrainer._push_from_checkpoint(trainer, folder)

    save("checkpoint-1")
    assert started == ["checkpoint-1"] and publisher.busy()
    save("checkpoint-2")  # checkpoint-1 is still uploading: skipped
    assert started == ["checkpoint-1"]
    save("checkpoint-3", always_push=True)
    assert started == ["checkpoint-1", "checkpoint-3"]
    for job in publisher.jobs:
        job.set_result(None)
    assert not publisher.busy()
    save("checkpoint-4")
    assert started == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]
