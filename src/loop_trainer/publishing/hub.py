"""Publishing a LOOP policy on the Hugging Face Hub: the model card and the upload.

What a push uploads (and nothing else):

* the weights: the LoRA adapter (``adapter_config.json``, ``adapter_model.safetensors``) when an
  adapter was trained, or full weights (``config.json``, ``generation_config.json``,
  ``model*.safetensors`` and their index) when full weights were trained or a merge was asked for;
* the tokenizer with the chat template used in training (transformers 5 writes it to
  ``chat_template.jinja`` next to ``tokenizer_config.json`` / ``tokenizer.json``);
* ``README.md`` (the model card, see :func:`write_model_card`), ``recipe.yaml`` (the recipe of the
  run), ``metrics.jsonl`` and ``learning_curve.png``.

Never uploaded: ``checkpoint-*/``, ``.staging-checkpoint/``, ``rollouts/``, ``viewer/``,
``appworld-servers/``, ``runs/``, optimizer/scheduler/RNG states (``*.pt``, ``*.pth``) and the
pickled ``training_args.bin``. The file set is a whitelist: anything else in ``output_dir`` stays
local.

:func:`upload_folder_contents` is what ``LOOPTrainer.push_to_hub`` and the periodic pushes of
``hub_strategy`` call; with ``run_as_future=True`` the small files (card, metrics, curve, tokenizer)
are snapshotted first, so a training run that keeps writing them cannot race the upload.
"""

from __future__ import annotations

import enum
import fnmatch
import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from importlib import resources
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

README = "README.md"
RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"  # = reporting.METRICS_FILE (not imported: keeps this module light)
CURVE_FILE = "learning_curve.png"  # = reporting.CURVE_FILE

ADAPTER_PATTERNS = ("adapter_config.json", "adapter_model.safetensors")
FULL_WEIGHT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
)
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
# Documentation of what stays local, and a second guard behind the whitelist above.
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
_UPLOAD_SUBDIRS = {"additional_chat_templates"}
# With run_as_future, files up to this size are copied aside before the upload starts.
SNAPSHOT_MAX_BYTES = 256 * 1024**2
DEFAULT_MERGED_DIR = "merged"

LOOP_CITATION = """\
@article{chen2025reinforcement,
    title   = {{Reinforcement Learning for Long-Horizon Interactive LLM Agents}},
    author  = {Kevin Chen and Marco Cusumano-Towner and Brody Huval and Aleksei Petrenko and Jackson Hamburger and Vladlen Koltun and Philipp Kr{\\"a}henb{\\"u}hl},
    year    = 2025,
    eprint  = {arXiv:2502.01600}
}"""

TRL_CITATION = """\
@software{vonwerra2020trl,
    title   = {{TRL: Transformers Reinforcement Learning}},
    author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan and Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallou{\\'e}dec, Quentin},
    license = {Apache-2.0},
    url     = {https://github.com/huggingface/trl},
    year    = {2020}
}"""

# (attribute, default when the config lacks it): LOOPConfig's defaults, the paper's settings.
HYPERPARAMETERS: tuple[tuple[str, Any], ...] = (
    ("iterations", 200),
    ("tasks_per_iteration", 40),
    ("rollouts_per_task", 6),
    ("advantage_threshold", 0.01),
    ("std_normalize_advantages", False),
    ("minibatch_size", 32),
    ("ppo_epochs", 2),
    ("epsilon", 0.1),
    ("learning_rate", 5e-5),
    ("lr_scheduler_type", "constant"),
    ("weight_decay", 0.01),
    ("max_grad_norm", 0.1),
    ("temperature", 1.0),
    ("train_split", "train"),
    ("max_turns", 40),
    ("max_new_tokens_per_turn", 1500),
    ("max_trajectory_tokens", 32000),
    ("early_stop_done_fraction", 1.0),
    ("early_stop_task_fraction", 1.0),
    ("kl_abort_threshold", 20.0),
    ("seed", 42),
)
LORA_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora", "modules_to_save")

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# ------------------------------------------------------------------------------------------------
# The model card
# ------------------------------------------------------------------------------------------------
def _format(value: Any) -> str:
    if isinstance(value, enum.Enum):  # SchedulerType, ...
        value = value.value
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.1f}" if 1.0 <= abs(value) < 1000.0 and value == round(value, 1) else f"{value:g}"
    if isinstance(value, (set, frozenset, list, tuple)):
        return ", ".join(f"`{v}`" for v in sorted(map(str, value))) or "-"
    return str(value)


def _percent(value: Any) -> str:
    return f"{float(value):.1f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def peft_config_dict(peft_config: Any) -> dict[str, Any] | None:
    """A PEFT config (object or dict, or a model's ``{name: config}`` mapping) as a plain dict."""
    if peft_config is None:
        return None
    if isinstance(peft_config, Mapping) and "default" in peft_config and hasattr(peft_config["default"], "to_dict"):
        peft_config = peft_config["default"]
    if hasattr(peft_config, "to_dict"):
        peft_config = peft_config.to_dict()
    return dict(peft_config)


def is_hub_model_id(name: str | None) -> bool:
    """Whether ``name`` can be a Hub model id (not a local folder, not a ``tiny:`` spec)."""
    return bool(name) and _REPO_ID.match(str(name)) is not None and not os.path.isdir(str(name))


def _versions() -> list[tuple[str, str]]:
    found = []
    for name, dist in (("loop_trainer", "loop-trainer"), ("TRL", "trl"), ("Transformers", "transformers"),
                       ("PEFT", "peft"), ("PyTorch", "torch"), ("huggingface_hub", "huggingface_hub")):
        try:
            found.append((name, version(dist)))
        except PackageNotFoundError:
            pass
    return found


def _render(template: str, **context: Any) -> str:
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    text = env.from_string(template).render(**context)
    return re.sub(r"\n{3,}", "\n\n", text)


def _write_recipe(recipe: str | os.PathLike[str] | Mapping[str, Any], destination: Path) -> None:
    if isinstance(recipe, Mapping):
        destination.write_text(yaml.safe_dump(dict(recipe), sort_keys=False), encoding="utf-8")
        return
    source = Path(recipe)
    if not source.is_file():
        raise FileNotFoundError(f"recipe not found: {source}")
    if not destination.exists() or not os.path.samefile(source, destination):
        shutil.copyfile(source, destination)


def write_model_card(
    output_dir: str | os.PathLike[str],
    *,
    base_model: str | None,
    hub_model_id: str | None = None,
    args: Any = None,
    peft_config: Any = None,
    environment: str | None = None,
    iterations_done: int | None = None,
    history: Sequence[Mapping[str, Any]] | None = None,
    eval_metrics: Mapping[str, Any] | None = None,
    recipe_path: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    merged: bool = False,
    license: str | None = None,
    model_name: str | None = None,
    tags: Iterable[str] | None = None,
) -> Path:
    """Write ``output_dir/README.md``: YAML front matter, what the model is, results (the latest
    dev TGC/SGC, or "not evaluated"), how to load it with PEFT and serve it with vLLM, the LOOP
    hyperparameters, the training procedure and the citations. Returns the card's path.

    ``args`` is a LOOPConfig (any object: missing attributes fall back to LOOPConfig's defaults);
    ``peft_config`` a LoRA config (object or dict) when an adapter was trained; ``merged`` says
    the adapter was merged into full weights. ``history`` is the per-iteration metrics (the last
    ``reward_mean`` goes into the card); ``eval_metrics`` e.g. ``{"split": "dev", "iteration":
    10, "tgc": 41.2, "sgc": 20.0, "per_difficulty": {"difficulty_1": {"tgc": .., "sgc": ..}}}``.
    ``recipe_path`` (a file, or the recipe as a mapping) is written to ``output_dir/recipe.yaml``.
    """
    from huggingface_hub import ModelCardData

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    lora = peft_config_dict(peft_config)
    weights = "merged" if (merged and lora) else "adapter" if lora else "full"
    repo_id = hub_model_id or f"<user>/{model_name or output_dir.resolve().name}"
    model_name = model_name or (hub_model_id.split("/")[-1] if hub_model_id else output_dir.resolve().name)
    base_name = base_model or "<base-model>"
    on_hub = is_hub_model_id(base_model)
    environment = environment or "environment"

    if recipe_path is not None:
        _write_recipe(recipe_path, output_dir / RECIPE_FILE)

    card_tags = ["trl", "loop", "reinforcement-learning", "agent", "text-generation"]
    if weights == "adapter":
        card_tags.append("lora")
        if on_hub:
            card_tags.append(f"base_model:adapter:{base_model}")
    if re.fullmatch(r"[\w.-]+", environment) and environment != "environment":
        card_tags.append(environment.lower())
    for tag in tags or ():
        if tag not in card_tags:
            card_tags.append(tag)
    card_data = ModelCardData(
        base_model=base_model if on_hub else None,
        library_name="peft" if weights == "adapter" else "transformers",
        license=license,
        model_name=model_name,
        pipeline_tag="text-generation",
        tags=card_tags,
    )

    hyperparameters = [(name, _format(getattr(args, name, default))) for name, default in HYPERPARAMETERS]
    lora_rows = [(name, _format(lora[name])) for name in LORA_FIELDS if lora and lora.get(name) not in (None, False)]
    rank = int(lora.get("r") or 16) if lora else 16
    from ..rollout.vllm_backend import vllm_lora_rank  # here: keeps this module's import light

    lora_rank_for_vllm = vllm_lora_rank(rank)

    eval_context = None
    if eval_metrics and eval_metrics.get("tgc") is not None:
        per_difficulty = [
            (str(level).replace("difficulty_", "difficulty "), {"tgc": _percent(v.get("tgc")), "sgc": _percent(v.get("sgc"))})
            for level, v in sorted((eval_metrics.get("per_difficulty") or {}).items())
        ]
        success = eval_metrics.get("success_rate")
        eval_context = {
            "split": eval_metrics.get("split", "dev"),
            "iteration": eval_metrics.get("iteration"),
            "tgc": _percent(eval_metrics["tgc"]),
            "sgc": _percent(eval_metrics.get("sgc", "n/a")),
            "per_difficulty": per_difficulty,
            "success_rate": f"{float(success):.3f}" if success is not None else None,
        }

    rewards = [(h.get("iteration", i + 1), h["reward_mean"]) for i, h in enumerate(history or ())
               if isinstance(h.get("reward_mean"), (int, float))]
    reward = None
    if rewards:
        reward = {"first_iteration": rewards[0][0], "first": f"{rewards[0][1]:.3f}",
                  "last_iteration": rewards[-1][0], "last": f"{rewards[-1][1]:.3f}"}
    if iterations_done is None:
        iterations_done = len(history or ())

    template = resources.files(__package__).joinpath("templates/model_card.md").read_text(encoding="utf-8")
    text = _render(
        template,
        card_data=card_data.to_yaml(),
        model_name=model_name,
        weights=weights,
        base_model=base_name,
        base_model_url=f"https://huggingface.co/{base_model}" if on_hub else (base_model or "#"),
        repo_id=repo_id,
        lora_name=re.sub(r"[^\w.-]", "-", model_name),
        lora_rank_for_vllm=lora_rank_for_vllm,
        environment=environment,
        train_split=getattr(args, "train_split", "train"),
        iterations_done=iterations_done,
        iterations_planned=getattr(args, "iterations", None),
        eval=eval_context,
        reward=reward,
        has_curve=(output_dir / CURVE_FILE).is_file(),
        has_metrics=(output_dir / METRICS_FILE).is_file(),
        has_recipe=(output_dir / RECIPE_FILE).is_file(),
        hyperparameters=hyperparameters,
        lora=lora_rows,
        max_turns=getattr(args, "max_turns", 40),
        max_new_tokens_per_turn=getattr(args, "max_new_tokens_per_turn", 1500),
        max_trajectory_tokens=getattr(args, "max_trajectory_tokens", 32000),
        versions=_versions(),
        loop_citation=LOOP_CITATION,
        trl_citation=TRL_CITATION,
    )
    path = output_dir / README
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------
# The upload set
# ------------------------------------------------------------------------------------------------
def _matches(path: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns)


def is_adapter_folder(folder: str | os.PathLike[str]) -> bool:
    return (Path(folder) / "adapter_config.json").is_file()


def upload_file_set(folder: str | os.PathLike[str]) -> list[str]:
    """The paths (relative, POSIX) of ``folder`` that a push uploads: the adapter when the folder
    holds one, else the full weights; the tokenizer and chat template; card, recipe, metrics and
    curve. Sorted."""
    folder = Path(folder)
    weights = ADAPTER_PATTERNS if is_adapter_folder(folder) else FULL_WEIGHT_PATTERNS
    include = (*weights, *TOKENIZER_PATTERNS, *EXTRA_FILES)
    selected = []
    for root, dirs, files in os.walk(folder):
        relative_root = Path(root).relative_to(folder)
        if relative_root == Path("."):
            dirs[:] = sorted(d for d in dirs if d in _UPLOAD_SUBDIRS)
        else:
            dirs[:] = []
        for name in files:
            relative = (relative_root / name).as_posix()
            if _matches(relative, include) and not _matches(relative, EXCLUDE_PATTERNS):
                selected.append(relative)
    return sorted(selected)


def copy_model_files(checkpoint_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str]) -> list[str]:
    """Copy the weights of ``checkpoint_dir`` (adapter or full) into ``output_dir``, as
    Trainer's ``_push_from_checkpoint`` does before a periodic push. Returns the copied names."""
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    names = [n for n in upload_file_set(checkpoint_dir) if _matches(n, (*ADAPTER_PATTERNS, *FULL_WEIGHT_PATTERNS))]
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
    for name in upload_file_set(adapter_dir):
        if name == README or _matches(name, ADAPTER_PATTERNS):
            continue
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
            raise ValueError("merge_adapter=True, but output_dir holds no LoRA adapter (full weights are uploaded as they are)")
        folder = merge_adapter_weights(folder, merged_dir, base_model=base_model)
        if card_kwargs is not None:
            write_model_card(folder, **{**card_kwargs, "merged": True, "recipe_path": None})
        elif (Path(output_dir) / README).is_file():
            logger.warning("merge_adapter=True without card_kwargs: uploading the adapter's model card unchanged")
            shutil.copyfile(Path(output_dir) / README, folder / README)
    names = upload_file_set(folder)
    if not names:
        raise FileNotFoundError(f"nothing to upload in {folder}")
    if not any(_matches(n, (*ADAPTER_PATTERNS, *FULL_WEIGHT_PATTERNS)) for n in names):
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
        for path in sorted(folder.rglob("*")) if path.is_file()
    ]
    if not operations:
        raise FileNotFoundError(f"nothing to upload in {folder}")
    # create_commit, not upload_folder: with hf_xet installed, huggingface_hub 2.x's upload_folder
    # may split a folder into several commits.
    return api.create_commit(repo_id=repo_id, operations=operations, commit_message=commit_message,
                             token=token, revision=revision, run_as_future=run_as_future)
