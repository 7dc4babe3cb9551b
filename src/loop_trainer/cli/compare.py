"""The trained policy against the starting one on held-out tasks -- the ``loop-compare`` command.

    loop-compare --config recipes/smollm2-135m-contacts.yaml [--split test --max_tasks 32]

Reads the same recipe ``loop-train`` ran (the model, the environment, the episode limits, and
``output_dir``, where the trained model or LoRA adapter is), then evaluates both policies on
``split`` twice: greedy (one rollout per task) and sampled at ``sampled_temperature`` (the
training temperature by default; ``sampled_rollouts_per_task`` rollouts per task). Each of the four
evaluations is a ``loop-eval`` run (results.jsonl, metrics.json, viewer.html) under
``<output_dir>/compare/``; the table is printed and written to ``compare/compare.{md,json}``, and
``compare/trajectories.md`` shows, for a few tasks where greedy rewards differ, what each policy did.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import ModelConfig

from ..config import EpisodeSettings, LOOPConfig, mapping_setting
from ..envs import EnvironmentSetupError, make_environment
from .evaluate import EvalArguments, evaluate, load_policy, sampling_backend
from .recipe import RecipeError, ScriptArguments, parse_recipe

__all__ = ["CompareArguments", "cli", "compare", "contrasting_trajectories"]


@dataclass
class CompareArguments:
    """What ``loop-compare`` adds to a training recipe."""

    split: str = field(default="test", metadata={"help": "Held-out split both policies are evaluated on."})
    max_tasks: int | None = field(default=None, metadata={"help": "Evaluate only the first N tasks of the split."})
    sampled_rollouts_per_task: int = field(default=4, metadata={"help": "Rollouts per task in the sampled evaluation."})
    sampled_temperature: float | None = field(
        default=None, metadata={"help": "Temperature of the sampled evaluation (default: the recipe's temperature)."}
    )
    trained: str | None = field(
        default=None, metadata={"help": "The trained model or adapter directory (default: the recipe's output_dir)."}
    )
    example_trajectories: int = field(
        default=3, metadata={"help": "Tasks shown side by side in compare/trajectories.md (greedy, start vs trained)."}
    )


def trained_policy(model_args: ModelConfig, directory: str) -> tuple[ModelConfig, str | None]:
    """(model arguments, adapter) of what ``loop-train`` saved in ``directory``: a LoRA adapter on the
    recipe's model, or a full model."""
    path = Path(directory)
    if (path / "adapter_config.json").is_file():
        return model_args, directory
    if (path / "config.json").is_file():
        return dataclasses.replace(model_args, model_name_or_path=directory), None
    raise RecipeError(
        f"{directory} holds no trained model or adapter: run loop-train with this recipe first "
        "(or point --trained at the run's output_dir)"
    )


def compare(
    script: ScriptArguments, training: LOOPConfig, model_args: ModelConfig, options: CompareArguments
) -> list[dict[str, Any]]:
    """Evaluate the starting and the trained policy, greedy and sampled; one row per evaluation."""
    trained_dir = options.trained or training.output_dir
    assert trained_dir is not None  # TrainingArguments.__post_init__ gives output_dir a default
    policies = {
        "start": (copy.deepcopy(model_args), None),
        "trained": trained_policy(copy.deepcopy(model_args), trained_dir),
    }
    temperature = training.temperature if options.sampled_temperature is None else options.sampled_temperature
    decodings = {"greedy": (0.0, 1), f"T={temperature:g}": (temperature, options.sampled_rollouts_per_task)}
    episode = {f.name: getattr(training, f.name) for f in dataclasses.fields(EpisodeSettings)}
    try:
        env = make_environment(script.environment, **mapping_setting(script.environment_kwargs, "environment_kwargs"))
    except (ValueError, EnvironmentSetupError) as error:
        raise RecipeError(str(error)) from None
    rows = []
    try:
        for policy, (policy_args, adapter) in policies.items():
            base = EvalArguments(
                environment=script.environment,
                environment_kwargs=script.environment_kwargs,
                split=options.split,
                adapter=adapter,
                max_tasks=options.max_tasks,
                seed=training.seed,
                tiny_instruct_steps=training.tiny_instruct_steps,  # a tiny model starts as the run's did
                output_dir=str(Path(trained_dir) / "compare" / policy),
                **episode,
            )
            model, tokenizer = load_policy(policy_args, base, env)
            backend = sampling_backend(model, tokenizer, training)
            for decoding, (temp, rollouts) in decodings.items():
                args = dataclasses.replace(
                    base,
                    temperature=temp,
                    rollouts_per_task=rollouts,
                    output_dir=f"{base.output_dir}-{decoding.replace('=', '')}",
                )
                metrics = evaluate(args, policy_args, env=env, generation_backend=backend)
                rows.append(
                    {
                        "policy": policy,
                        "decoding": decoding,
                        "rollouts_per_task": rollouts,
                        **{k: v for k, v in metrics.items() if isinstance(v, float)},
                        "output_dir": args.output_dir,
                    }
                )
            del model, backend
    finally:
        env.close()
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table: one line per (decoding, policy), every metric of the environment's summary
    as a column (the rollout counts as one column)."""
    keys = [k for k in rows[0] if isinstance(rows[0][k], float) and not k.startswith("num_") and k != "temperature"]
    lines = [
        "| decoding | policy | rollouts | " + " | ".join(keys) + " |",
        "| --- | --- | --- |" + " --- |" * len(keys),
    ]
    for row in sorted(rows, key=lambda r: (r["decoding"] != "greedy", r["policy"] != "start")):
        rollouts = f"{row.get('num_rollouts', float('nan')):.0f}"
        lines.append(
            f"| {row['decoding']} | {row['policy']} | {rollouts} | " + " | ".join(f"{row[k]:.3f}" for k in keys) + " |"
        )
    return "\n".join(lines)


def contrasting_trajectories(rows: Sequence[dict[str, Any]], count: int) -> str:
    """Markdown: the greedy episodes of both policies on up to ``count`` tasks where their rewards
    differ most (the opening, identical for both, left out), so a reader sees what changed."""
    greedy = {row["policy"]: row for row in rows if row["decoding"] == "greedy"}
    if set(greedy) != {"start", "trained"}:
        return ""
    results = {policy: {r["task_id"]: r for r in _read_results(row["output_dir"])} for policy, row in greedy.items()}
    shared = [task for task in results["start"] if task in results["trained"]]
    shared.sort(key=lambda task: -abs(results["trained"][task]["reward"] - results["start"][task]["reward"]))
    sections = []
    for task in shared[:count]:
        sections.append(f"## {task}\n")
        for policy in ("start", "trained"):
            result = results[policy][task]
            messages = result["messages"]
            opening = result.get("num_opening_messages", 0)
            sections.append(
                f"**{policy}** (reward {result['reward']:.2f}, {result['ending']}); the last opening "
                f"message: {messages[opening - 1]['content']!r}\n"
                if opening
                else f"**{policy}**\n"
            )
            sections += [f"- {m['role']}: `{m['content']}`" for m in messages[opening:]]
            sections.append("")
    return "\n".join(sections)


def _read_results(directory: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(directory) / "results.jsonl").read_text().splitlines() if line.strip()]


def cli(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        script, training, model_args, options = parse_recipe(
            argv, (ScriptArguments, LOOPConfig, ModelConfig, CompareArguments)
        )
        rows = compare(script, training, model_args, options)
    except (RecipeError, EnvironmentSetupError) as error:
        print(f"loop-compare: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loop-compare: interrupted; no table was written", file=sys.stderr)
        return 130
    text = table(rows)
    out = Path(options.trained or training.output_dir) / "compare"
    (out / "compare.md").write_text(text + "\n")
    (out / "compare.json").write_text(json.dumps(rows, indent=1))
    (out / "trajectories.md").write_text(contrasting_trajectories(rows, options.example_trajectories))
    print(f"\nThe trained policy against the starting one, split '{options.split}':\n{text}")
    print(f"each evaluation's results.jsonl, metrics.json and viewer.html: {out}/; what changed: {out}/trajectories.md")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
