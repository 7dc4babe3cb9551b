"""Evaluate a base model or a trained adapter on a split -- the ``loop-eval`` command.

    loop-eval --model_name_or_path Qwen/Qwen2.5-7B-Instruct [--adapter outputs/run] \\
        --environment appworld --split test_normal [--rollouts_per_task 1 --temperature 0]

Writes ``results.jsonl`` (one row per rollout), ``metrics.json`` (success rate, mean reward, and
TGC / SGC overall and per difficulty, computed as ``appworld evaluate`` computes them) and
``viewer.html`` (every rollout, turn by turn) to ``output_dir``. With AppWorld, rollout k's world
states are saved under the experiment ``<experiment_name>`` (k = 0) or ``<experiment_name>_rollout<k>``,
so ``appworld evaluate <experiment> <split>`` can grade them too.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from trl import ModelConfig

from ..chat import ChatFormatter
from ..envs import Environment, EnvironmentSetupError, make_environment
from ..evaluation import evaluation_row, format_report, summarize
from .recipe import RecipeError, ScriptArguments, parse_recipe
from ..rollout import EpisodeLimits, GenerationBackend, RolloutEngine, TransformersBackend
from ..tiny import build_tiny_from_spec, is_tiny_spec, load_tokenizer
from ..viewer import write_viewer

__all__ = ["EvalArguments", "cli", "evaluate"]
logger = logging.getLogger("loop_trainer")


@dataclass
class EvalArguments(ScriptArguments):
    """What to evaluate on and how (the model is TRL's ModelConfig: model_name_or_path, dtype, ...)."""

    environment: str = field(default="appworld", metadata={"help": "Environment name (as in loop-train)."})
    split: str = field(default="dev", metadata={"help": "Split to evaluate (AppWorld: dev, test_normal, ...)."})
    adapter: str | None = field(default=None, metadata={"help": "A PEFT adapter directory to load on the model."})
    rollouts_per_task: int = field(default=1, metadata={"help": "Independent rollouts of every task."})
    temperature: float = field(default=0.0, metadata={"help": "Sampling temperature; 0 is greedy."})
    max_turns: int = field(default=40, metadata={"help": "Model replies per episode."})
    max_new_tokens_per_turn: int = field(default=1500, metadata={"help": "Tokens one reply may have."})
    max_trajectory_tokens: int = field(default=32768, metadata={"help": "Whole-conversation token budget."})
    max_tasks: int | None = field(default=None, metadata={"help": "Evaluate only the first N tasks of the split."})
    output_dir: str = field(default="eval", metadata={"help": "Where results, metrics and the viewer go."})
    experiment_name: str | None = field(
        default=None, metadata={"help": "AppWorld experiment name for the saved outputs (default: output_dir's name)."}
    )
    max_concurrent_episodes: int = field(default=64, metadata={"help": "Episodes in flight at once."})
    env_timeout: float = field(default=300.0, metadata={"help": "Seconds one environment call may take."})
    generation_batch_limit: int = field(default=64, metadata={"help": "Most sequences generated in one batch."})
    seed: int = field(default=0, metadata={"help": "Sampling seed."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollouts_per_task < 1:
            raise RecipeError("rollouts_per_task must be >= 1")
        if self.temperature < 0:
            raise RecipeError("temperature must be >= 0")


def load_policy(model_args: ModelConfig, eval_args: EvalArguments, env: Environment) -> tuple[Any, Any]:
    name = model_args.model_name_or_path
    if not name:
        raise RecipeError("model_name_or_path is not set (a model id or a local directory)")
    if is_tiny_spec(name):
        try:
            model, tokenizer = build_tiny_from_spec(name, env, seed=eval_args.seed)
        except ValueError as error:
            raise RecipeError(str(error)) from None
    else:
        kwargs: dict[str, Any] = {"revision": model_args.model_revision, "trust_remote_code": getattr(model_args, "trust_remote_code", False)}
        try:
            tokenizer = load_tokenizer(eval_args.adapter or name, **kwargs)
        except (OSError, ValueError):
            try:
                tokenizer = load_tokenizer(name, **kwargs)
            except (OSError, ValueError) as error:
                raise RecipeError(f"cannot load a tokenizer from '{name}': {str(error).splitlines()[0]}") from None
        dtype = model_args.dtype if model_args.dtype not in (None, "auto") else "auto"
        try:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
        except (OSError, ValueError) as error:
            raise RecipeError(f"cannot load model '{name}': {str(error).splitlines()[0]}") from None
    if eval_args.adapter:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, eval_args.adapter)
        except (OSError, ValueError, RuntimeError, KeyError) as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            reason = next((line for line in lines if "size mismatch" in line), lines[0] if lines else repr(error))
            raise RecipeError(f"cannot load adapter '{eval_args.adapter}' on '{name}' (is it this model's "
                              f"adapter?): {reason}") from None
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    return model, tokenizer


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return sorted({i for i in [tokenizer.eos_token_id, *configured] if i is not None})


def evaluate(
    eval_args: EvalArguments,
    model_args: ModelConfig,
    *,
    env: Environment | None = None,
    generation_backend: GenerationBackend | None = None,
) -> dict[str, Any]:
    """Run the evaluation; return the metrics (also written to ``output_dir/metrics.json``)."""
    torch.manual_seed(eval_args.seed)
    if env is None:
        try:
            env = make_environment(eval_args.environment, **(eval_args.environment_kwargs or {}))
        except (ValueError, EnvironmentSetupError) as error:
            raise RecipeError(str(error)) from None
    model, tokenizer = load_policy(model_args, eval_args, env)
    tasks = env.tasks(eval_args.split)
    if eval_args.max_tasks is not None:
        tasks = tasks.select(range(min(eval_args.max_tasks, len(tasks))))
    env.set_tokenizer(tokenizer)
    env.prepare()
    backend = generation_backend or TransformersBackend(
        model, stop_token_ids=stop_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        temperature=eval_args.temperature, max_batch_size=eval_args.generation_batch_limit,
    )
    limits = EpisodeLimits(eval_args.max_turns, eval_args.max_new_tokens_per_turn, eval_args.max_trajectory_tokens)
    engine = RolloutEngine(
        env, backend, ChatFormatter(tokenizer), limits, env_timeout=eval_args.env_timeout,
        max_concurrent_episodes=min(eval_args.max_concurrent_episodes,
                                    env.max_concurrent_episodes or eval_args.max_concurrent_episodes),
    )
    output_dir = Path(eval_args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    experiment = eval_args.experiment_name or output_dir.resolve().name
    rows: list[dict[str, Any]] = []
    task_rows = {str(row["task_id"]): row for row in tasks}
    try:
        for k in range(eval_args.rollouts_per_task):
            if hasattr(env, "experiment_name"):
                env.experiment_name = experiment if k == 0 else f"{experiment}_rollout{k}"
            batch = engine.collect(list(tasks), 1, description=f"eval rollout {k + 1}/{eval_args.rollouts_per_task}")
            for trajectory in (*batch.trajectories, *batch.failed):
                trajectory.rollout = k
                rows.append(evaluation_row(trajectory, task_rows[trajectory.task_id],
                                           experiment_name=getattr(env, "experiment_name", None)))
    finally:
        engine.close()
        env.close()
    metrics = summarize(rows, eval_args.rollouts_per_task)
    metrics.update(split=eval_args.split, model=model_args.model_name_or_path, adapter=eval_args.adapter,
                   temperature=eval_args.temperature, experiment_name=experiment)
    with open(output_dir / "results.jsonl", "w") as handle:
        for row in rows:
            handle.write(json.dumps(row, default=str) + "\n")
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    write_viewer(sorted(rows, key=lambda r: (r["task_id"], r["rollout"])), output_dir / "viewer.html",
                 title=f"{env.name} · {eval_args.split} · {model_args.model_name_or_path}")
    return metrics


def cli(argv: Sequence[str] | None = None) -> int:
    """Entry point: one actionable line on user errors, exit status 2."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        eval_args, model_args = parse_recipe(argv, (EvalArguments, ModelConfig))
        metrics = evaluate(eval_args, model_args)
    except (RecipeError, EnvironmentSetupError) as error:
        print(f"loop-eval: error: {error}", file=sys.stderr)
        return 2
    print(format_report(metrics))
    print(f"results, metrics and viewer.html in {eval_args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
