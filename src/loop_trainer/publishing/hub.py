"""Publishing a LOOP policy on the Hugging Face Hub: what is uploaded, and the upload itself.

What a push uploads (and nothing else):

* the weights: the LoRA adapter (``adapter_config.json``, ``adapter_model.safetensors``) when an
  adapter was trained, or full weights (``config.json``, ``generation_config.json``,
  ``model*.safetensors`` and their index) when full weights were trained or a merge was asked for;
* the tokenizer with the chat template used in training (transformers 5 writes it to
  ``chat_template.jinja`` next to ``tokenizer_config.json`` / ``tokenizer.json``);
* ``README.md`` (the model card, see :mod:`.model_card`), ``recipe.yaml`` (the recipe of the
  run), ``metrics.jsonl`` and ``learning_curve.png``.

Never uploaded: ``checkpoint-*/``, ``.staging-checkpoint/``, ``rollouts/``, ``viewer/``,
``appworld-servers/``, ``runs/``, optimizer/scheduler/RNG states (``*.pt``, ``*.pth``) and the
pickled ``training_args.bin``. The file set is an allowlist (``huggingface_hub``'s
``filter_repo_objects`` patterns): anything else in ``output_dir`` stays local.

:func:`upload_folder_contents` is what ``LOOPTrainer.push_to_hub`` and the periodic pushes of
``hub_strategy`` call; with ``run_as_future=True`` the small files (card, metrics, curve, tokenizer)
are snapshotted first, so a training run that keeps writing them cannot race the upload.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from huggingface_hub.utils import filter_repo_objects

from .model_card import CURVE_FILE, LOOP_CITATION, METRICS_FILE, README, RECIPE_FILE, write_model_card

__all__ = [
    "LOOP_CITATION",
    "copy_model_files",
    "merge_adapter_weights",
    "upload_checkpoint",
    "upload_file_set",
    "upload_folder_contents",
    "write_model_card",
]

logger = logging.getLogger(__name__)

ADAPTER_PATTERNS = ("adapter_config.json", "adapter_model.safetensors")
FULL_WEIGHT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
)
WEIGHT_PATTERNS = (*ADAPTER_PATTERNS, *FULL_WEIGHT_PATTERNS)
TOKENIZER_PATTERNS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "processor_config.json",
    "preprocessor_config.json",
)
EXTRA_FILES = (README, RECIPE_FILE, METRICS_FILE, CURVE_FILE)
# Documentation of what stays local, and a second guard behind the allowlist above.
EXCLUDE_PATTERNS = (
    "checkpoint-*",
    ".staging-checkpoint*",
    "rollouts/*",
    "viewer/*",
    "appworld-servers/*",
    "runs/*",
    "merged/*",
    "*.pt",
    "*.pth",
    "training_args.bin",
)
# Sub-folders that may hold files of the upload set (all others are not even listed).
UPLOAD_SUBDIRS = ("additional_chat_templates",)
# With run_as_future, files up to this size are copied aside before the upload starts.
SNAPSHOT_MAX_BYTES = 256 * 1024**2
DEFAULT_MERGED_DIR = "merged"


# ------------------------------------------------------------------------------------------------
# The upload set
# ------------------------------------------------------------------------------------------------
def is_adapter_folder(folder: str | os.PathLike[str]) -> bool:
    return (Path(folder) / "adapter_config.json").is_file()


def _candidate_files(folder: Path) -> Iterator[str]:
    """The folder's own files and those of :data:`UPLOAD_SUBDIRS` (relative, POSIX): checkpoints,
    rollouts and the like are never walked."""
    for entry in folder.iterdir():
        if entry.is_file():
            yield entry.name
        elif entry.name in UPLOAD_SUBDIRS and entry.is_dir():
            yield from (f"{entry.name}/{path.name}" for path in entry.iterdir() if path.is_file())


def upload_file_set(folder: str | os.PathLike[str]) -> list[str]:
    """The paths (relative, POSIX) of ``folder`` that a push uploads: the adapter when the folder
    holds one, else the full weights; the tokenizer and chat template; card, recipe, metrics and
    curve. Sorted."""
    folder = Path(folder)
    weights = ADAPTER_PATTERNS if is_adapter_folder(folder) else FULL_WEIGHT_PATTERNS
    return sorted(
        filter_repo_objects(
            _candidate_files(folder),
            allow_patterns=[*weights, *TOKENIZER_PATTERNS, *EXTRA_FILES],
            ignore_patterns=list(EXCLUDE_PATTERNS),
        )
    )


def copy_model_files(checkpoint_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str]) -> list[str]:
    """Copy the weights of ``checkpoint_dir`` (adapter or full) into ``output_dir``, as
    Trainer's ``_push_from_checkpoint`` does before a periodic push. Returns the copied names."""
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    names = list(filter_repo_objects(upload_file_set(checkpoint_dir), allow_patterns=list(WEIGHT_PATTERNS)))
    for name in names:
        shutil.copyfile(checkpoint_dir / name, output_dir / name)
    return names


# ------------------------------------------------------------------------------------------------
# Merging
# ------------------------------------------------------------------------------------------------
def merge_adapter_weights(
    adapter_dir: str | os.PathLike[str],
    merged_dir: str | os.PathLike[str] | None = None,
    *,
    base_model: str | os.PathLike[str] | None = None,
    dtype: Any = "auto",
) -> Path:
    """Load the base model (``base_model``, else the adapter config's ``base_model_name_or_path``)
    on the CPU, apply the adapter of ``adapter_dir``, ``merge_and_unload()`` it and save full
    weights into ``merged_dir`` (default ``adapter_dir/merged``), with the tokenizer, recipe,
    metrics and curve copied next to them (not the card: it is rewritten for merged weights).
    The model being trained is not touched."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir = Path(adapter_dir)
    merged_dir = Path(merged_dir) if merged_dir is not None else adapter_dir / DEFAULT_MERGED_DIR
    if not is_adapter_folder(adapter_dir):
        raise ValueError(f"{adapter_dir} holds no adapter (adapter_config.json) to merge")
    if base_model is None:
        base_model = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base_model:
        raise ValueError("the adapter config names no base model: pass base_model= to merge the adapter")
    model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=dtype)
    model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    shutil.rmtree(merged_dir, ignore_errors=True)
    merged_dir.mkdir(parents=True)
    model.save_pretrained(merged_dir)
    for name in filter_repo_objects(upload_file_set(adapter_dir), ignore_patterns=[README, *ADAPTER_PATTERNS]):
        (merged_dir / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(adapter_dir / name, merged_dir / name)
    return merged_dir


# ------------------------------------------------------------------------------------------------
# The upload
# ------------------------------------------------------------------------------------------------
def upload_folder_contents(
    output_dir: str | os.PathLike[str],
    *,
    repo_id: str,
    commit_message: str = "Upload LOOP policy",
    commit_description: str | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    private: bool | None = None,
    create_repo: bool = True,
    merge_adapter: bool = False,
    merged_dir: str | os.PathLike[str] | None = None,
    base_model: str | None = None,
    card_kwargs: Mapping[str, Any] | None = None,
    run_as_future: bool = False,
    api: Any = None,
) -> Any:
    """Upload the policy in ``output_dir`` (the set of :func:`upload_file_set`) to ``repo_id`` in
    one commit; returns the ``CommitInfo`` (a ``Future`` of it with ``run_as_future``).

    ``merge_adapter=True`` merges the adapter into full weights in ``merged_dir`` (default
    ``output_dir/merged``) and uploads those instead of the adapter; ``card_kwargs`` (the
    arguments of :func:`write_model_card`) re-render the card there for merged weights.
    ``create_repo`` creates the repo if needed (private per ``private``) and, with a
    ``revision``, the branch. With ``run_as_future`` the small files are snapshotted first, so
    the caller may keep writing ``output_dir`` while the commit is under way."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = api or HfApi()
    folder = Path(output_dir)
    if merge_adapter:
        if not is_adapter_folder(folder):
            raise ValueError(
                "merge_adapter=True, but output_dir holds no LoRA adapter (full weights are uploaded as they are)"
            )
        folder = merge_adapter_weights(folder, merged_dir, base_model=base_model)
        if card_kwargs is not None:
            write_model_card(folder, **{**card_kwargs, "merged": True, "recipe_path": None})
        elif (Path(output_dir) / README).is_file():
            logger.warning("merge_adapter=True without card_kwargs: uploading the adapter's model card unchanged")
            shutil.copyfile(Path(output_dir) / README, folder / README)
    names = upload_file_set(folder)
    if not names:
        raise FileNotFoundError(f"nothing to upload in {folder}")
    if not any(filter_repo_objects(names, allow_patterns=list(WEIGHT_PATTERNS))):
        logger.warning("uploading %s without model weights", folder)

    if create_repo:
        repo_id = api.create_repo(repo_id, token=token, private=private, exist_ok=True).repo_id
        if revision is not None:
            api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)

    snapshot: str | None = None
    sources = {name: folder / name for name in names}
    if run_as_future:
        snapshot = tempfile.mkdtemp(prefix="loop-hub-push-")
        for name, source in sources.items():
            if source.stat().st_size <= SNAPSHOT_MAX_BYTES:
                copy = Path(snapshot) / name
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, copy)
                sources[name] = copy
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)) for name, path in sources.items()]
    try:
        result = api.create_commit(
            repo_id=repo_id,
            operations=operations,
            commit_message=commit_message,
            commit_description=commit_description,
            token=token,
            revision=revision,
            run_as_future=run_as_future,
        )
    except BaseException:
        if snapshot is not None:
            shutil.rmtree(snapshot, ignore_errors=True)
        raise
    if isinstance(result, Future) and snapshot is not None:
        result.add_done_callback(lambda _: shutil.rmtree(snapshot, ignore_errors=True))
    return result


def upload_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    *,
    repo_id: str,
    path_in_repo: str = "last-checkpoint",
    commit_message: str = "Training in progress, checkpoint",
    token: str | bool | None = None,
    revision: str | None = None,
    run_as_future: bool = False,
    api: Any = None,
) -> Any:
    """Upload a whole, published checkpoint folder (weights, optimizer, RNG and LOOP state) under
    ``path_in_repo``, in one commit, for ``hub_strategy="checkpoint"`` / ``"all_checkpoints"``
    (resuming from the Hub). Call it only once the checkpoint is complete (after
    ``checkpointing.publish``); it is read lazily, so keep it until the upload is done."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = api or HfApi()
    folder = Path(checkpoint_dir)
    prefix = path_in_repo.strip("/")
    operations = [
        CommitOperationAdd(path_in_repo=f"{prefix}/{path.relative_to(folder).as_posix()}", path_or_fileobj=str(path))
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    ]
    if not operations:
        raise FileNotFoundError(f"nothing to upload in {folder}")
    # create_commit, not upload_folder: with hf_xet installed, huggingface_hub 2.x's upload_folder
    # may split a folder into several commits.
    return api.create_commit(
        repo_id=repo_id,
        operations=operations,
        commit_message=commit_message,
        token=token,
        revision=revision,
        run_as_future=run_as_future,
    )
