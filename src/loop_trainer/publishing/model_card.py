"""The model card of a LOOP policy: ``README.md`` with the Hub's YAML front matter
(:class:`huggingface_hub.ModelCardData`), rendered from ``templates/model_card.md.j2``.

The card says what the weights are (adapter, merged or full) and how to load and serve them, the
latest evaluation as the environment summarised it, the training reward, the run's LOOP settings
next to the paper's, and the citations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import yaml
from huggingface_hub import ModelCard, ModelCardData

if TYPE_CHECKING:
    from ..config import LOOPConfig

README = "README.md"
RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"  # = training.run_log.METRICS_FILE (not imported: keeps this module light)
CURVE_FILE = "learning_curve.png"  # = training.run_log.CURVE_FILE

LOOP_CITATION = """\
@article{chen2025reinforcement,
    title   = {{Reinforcement Learning for Long-Horizon Interactive LLM Agents}},
    author  = {Kevin Chen and Marco Cusumano-Towner and Brody Huval and Aleksei Petrenko and Jackson Hamburger and Vladlen Koltun and Philipp Kr{\\"a}henb{\\"u}hl},
    year    = 2025,
    eprint  = {arXiv:2502.01600}
}"""  # noqa: E501 - the BibTeX entry verbatim

TRL_CITATION = """\
@software{vonwerra2020trl,
    title   = {{TRL: Transformers Reinforcement Learning}},
    author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan and Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallou{\\'e}dec, Quentin},
    license = {Apache-2.0},
    url     = {https://github.com/huggingface/trl},
    year    = {2020}
}"""  # noqa: E501 - the BibTeX entry verbatim

# The settings Chen et al. (2025) report for their AppWorld runs (docs/recipes.md, "paper" column):
# the card shows them next to the run's own values. Only what the paper states is here.
PAPER_VALUES: dict[str, Any] = {
    "iterations": 200,
    "tasks_per_iteration": 40,
    "rollouts_per_task": 6,
    "advantage_threshold": 0.01,
    "std_normalize_advantages": False,
    "minibatch_size": 32,
    "ppo_epochs": 2,
    "max_training_tokens": 32000,
    "kl_abort_threshold": 20.0,
    "early_stop_done_fraction": 0.9,
    "early_stop_task_fraction": 0.75,
    "learning_rate": 5e-5,
    "lr_scheduler_type": "constant",
    "weight_decay": 0.01,
    "max_grad_norm": 0.1,
    "epsilon": 0.1,
    "temperature": 1.0,
    "max_turns": 40,
    "max_new_tokens_per_turn": 1500,
    "max_trajectory_tokens": 32768,
}
# Trainer settings that shape a LOOP update, listed with LOOP's own keys (the other TrainingArguments
# fields are left out of the card).
TRAINER_FIELDS = (
    "learning_rate",
    "lr_scheduler_type",
    "weight_decay",
    "max_grad_norm",
    "epsilon",
    "temperature",
    "seed",
)
# LOOPConfig keys that set up the machinery (model loading, vLLM, GRPOTrainer's agent arguments), not the
# algorithm: left out of the card's hyperparameters.
MACHINERY_FIELDS = frozenset(
    {
        "model_init_kwargs",
        "trust_remote_code",
        "disable_dropout",
        "chat_template_kwargs",
        "reward_weights",
        "max_tool_calling_iterations",
        "malformed_tool_call",
        "beta",
        "use_vllm",
        "vllm_mode",
        "vllm_gpu_memory_utilization",
        "vllm_tensor_parallel_size",
        "vllm_enable_sleep_mode",
        "vllm_max_model_length",
        "vllm_server_base_url",
        "vllm_server_host",
        "vllm_server_port",
        "vllm_server_timeout",
    }
)
LORA_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora", "modules_to_save")

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# Markdown, so no HTML escaping; a variable the template names but the code forgot is an error.
_CARDS = jinja2.Environment(
    loader=jinja2.PackageLoader("loop_trainer", "templates"),
    autoescape=False,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
)


def format_value(value: Any) -> str:
    if isinstance(value, enum.Enum):  # SchedulerType, ...
        value = value.value
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        # one decimal where that is exact (0.0, 20.0, 41.2), else up to 6 significant digits (5e-05)
        return f"{value:.1f}" if abs(value) < 1000.0 and value == round(value, 1) else f"{value:g}"
    if isinstance(value, (set, frozenset, list, tuple)):
        return ", ".join(f"`{v}`" for v in sorted(map(str, value))) or "-"
    return str(value)


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


@dataclass(frozen=True)
class CardSettings:
    """What the card shows of the run's settings (``training/settings.py`` builds it from a LOOPConfig)."""

    hyperparameters: tuple[tuple[str, str, str], ...] = ()
    """(name, this run's value, the paper's value or "")."""
    train_split: str = "train"
    iterations_planned: int | None = None
    max_turns: int = PAPER_VALUES["max_turns"]
    max_new_tokens_per_turn: int = PAPER_VALUES["max_new_tokens_per_turn"]
    max_trajectory_tokens: int = PAPER_VALUES["max_trajectory_tokens"]


def hyperparameter_rows(args: LOOPConfig) -> list[tuple[str, str, str]]:
    """(name, this run's value, the paper's value or "") for LOOP's own settings of ``args`` (the
    fields LOOPConfig adds to TrainingArguments but :data:`MACHINERY_FIELDS`, the episode settings) and
    :data:`TRAINER_FIELDS`.
    Local paths (``*_dir``) stay out of a published card."""
    from transformers import TrainingArguments

    from ..config import EpisodeSettings

    left_out = {f.name for f in dataclasses.fields(TrainingArguments)} | MACHINERY_FIELDS | set(TRAINER_FIELDS)
    episode = [f.name for f in dataclasses.fields(EpisodeSettings)]
    own = [f.name for f in dataclasses.fields(args) if f.init and f.name not in left_out and f.name not in episode]
    names = [n for n in (*own, *TRAINER_FIELDS, *episode) if hasattr(args, n) and not n.endswith("_dir")]
    return [
        (n, format_value(getattr(args, n)), format_value(PAPER_VALUES[n]) if n in PAPER_VALUES else "") for n in names
    ]


def evaluation_summary(eval_metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``{"split", "iteration", "metrics": {name: value}}`` (the environment's evaluation summary)
    as the card shows it: metric rows in the environment's order."""
    if eval_metrics is None:
        return None
    if not isinstance(eval_metrics.get("metrics"), Mapping) or "split" not in eval_metrics:
        raise ValueError(
            "eval_metrics must be {'split': str, 'iteration': int, 'metrics': {name: float}}; "
            f"got keys {sorted(eval_metrics)}"
        )
    return {
        "split": eval_metrics["split"],
        "iteration": eval_metrics.get("iteration"),
        "metrics": [(str(name), format_value(value)) for name, value in eval_metrics["metrics"].items()],
    }


def _versions() -> list[tuple[str, str]]:
    found = []
    for name, dist in (
        ("loop_trainer", "loop-trainer"),
        ("TRL", "trl"),
        ("Transformers", "transformers"),
        ("PEFT", "peft"),
        ("PyTorch", "torch"),
        ("huggingface_hub", "huggingface_hub"),
    ):
        with contextlib.suppress(PackageNotFoundError):
            found.append((name, version(dist)))
    return found


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
    settings: CardSettings | None = None,
    peft_config: Any = None,
    environment: str | None = None,
    iterations_done: int | None = None,
    history: Sequence[Mapping[str, Any]] | None = None,
    eval_metrics: Mapping[str, Any] | None = None,
    recipe_path: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    setting_changes: Sequence[Mapping[str, Any]] | None = None,
    merged: bool = False,
    license: str | None = None,
    model_name: str | None = None,
    tags: Iterable[str] | None = None,
) -> Path:
    """Write ``output_dir/README.md`` and return its path.

    ``settings`` are the run's settings as the card shows them (``training/settings.py``'s ``card_settings``);
    ``peft_config`` a LoRA config (object or dict) when an adapter was trained; ``merged`` says
    the adapter was merged into full weights. ``history`` is the per-iteration metrics (the first
    and last ``reward_mean`` go into the card); ``eval_metrics`` the latest evaluation,
    ``{"split": "dev", "iteration": 10, "metrics": {"success_rate": 0.4, ...}}``, or None.
    ``recipe_path`` (a file, or the recipe as a mapping) is written to ``output_dir/recipe.yaml``.
    ``setting_changes`` are settings changed on resume (``{"setting", "old", "new", "from_iteration"}``,
    see ``resume_with_changed_settings``); the card lists them under the settings table.
    """
    from ..rollout.vllm_backend import vllm_lora_rank  # here: keeps this module's import light

    output_dir = Path(output_dir)
    settings = settings or CardSettings()
    output_dir.mkdir(parents=True, exist_ok=True)
    lora = peft_config_dict(peft_config)
    weights = "merged" if (merged and lora) else "adapter" if lora else "full"
    model_name = model_name or (hub_model_id.split("/")[-1] if hub_model_id else output_dir.resolve().name)
    on_hub = is_hub_model_id(base_model)
    environment = environment or "environment"
    if recipe_path is not None:
        _write_recipe(recipe_path, output_dir / RECIPE_FILE)

    card_tags = ["trl", "loop", "reinforcement-learning", "agent", "text-generation"]
    if weights == "adapter":
        card_tags += ["lora", f"base_model:adapter:{base_model}"] if on_hub else ["lora"]
    if re.fullmatch(r"[\w.-]+", environment) and environment != "environment":
        card_tags.append(environment.lower())
    card_tags += [tag for tag in dict.fromkeys(tags or ()) if tag not in card_tags]
    card_data = ModelCardData(
        base_model=base_model if on_hub else None,
        library_name="peft" if weights == "adapter" else "transformers",
        license=license,
        model_name=model_name,
        pipeline_tag="text-generation",
        tags=card_tags,
    )

    rewards = [
        (h.get("iteration", i + 1), h["reward_mean"])
        for i, h in enumerate(history or ())
        if isinstance(h.get("reward_mean"), (int, float))
    ]
    reward = None
    if rewards:
        reward = {
            "first_iteration": rewards[0][0],
            "first": f"{rewards[0][1]:.3f}",
            "last_iteration": rewards[-1][0],
            "last": f"{rewards[-1][1]:.3f}",
        }
    text = _CARDS.get_template("model_card.md.j2").render(
        card_data=card_data.to_yaml(),
        model_name=model_name,
        weights=weights,
        base_model=base_model or "<base-model>",
        base_model_url=f"https://huggingface.co/{base_model}" if on_hub else (base_model or "#"),
        repo_id=hub_model_id or f"<user>/{model_name}",
        lora_name=re.sub(r"[^\w.-]", "-", model_name),
        lora_rank_for_vllm=vllm_lora_rank(int(lora.get("r") or 16) if lora else 16),
        environment=environment,
        train_split=settings.train_split,
        iterations_done=len(history or ()) if iterations_done is None else iterations_done,
        iterations_planned=settings.iterations_planned,
        eval=evaluation_summary(eval_metrics),
        reward=reward,
        has_curve=(output_dir / CURVE_FILE).is_file(),
        has_metrics=(output_dir / METRICS_FILE).is_file(),
        has_recipe=(output_dir / RECIPE_FILE).is_file(),
        hyperparameters=list(settings.hyperparameters),
        setting_changes=[
            (c["setting"], format_value(c["old"]), format_value(c["new"]), c["from_iteration"])
            for c in setting_changes or ()
        ],
        lora=[(name, format_value(lora[name])) for name in LORA_FIELDS if lora and lora.get(name) not in (None, False)],
        max_turns=settings.max_turns,
        max_new_tokens_per_turn=settings.max_new_tokens_per_turn,
        max_trajectory_tokens=settings.max_trajectory_tokens,
        versions=_versions(),
        loop_citation=LOOP_CITATION,
        trl_citation=TRL_CITATION,
    )
    # ModelCard parses the front matter back: a card the Hub would reject fails here, not on upload.
    card = ModelCard(re.sub(r"\n{3,}", "\n\n", text))
    path = output_dir / README
    card.save(path)
    return path
