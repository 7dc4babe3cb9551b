"""What a context policy costs and saves on ``errands``' long episodes, measured through the rollout
engine and the training rows it makes: a perfect agent (``errands.solve``) replays every test task
of the three levels, once append-only and once under each policy, and the table counts segments per
episode, the longest context the model is shown, and the tokens the update trains (every segment's
row, cut at nothing).

The plain-English form with Qwen2.5's tokenizer and chat template is where histories are long
(records with a dozen fields, 1.1-2.1k tokens a perfect episode); the compact form with the tiny
model's word tokenizer is what the CPU recipe trains. A scripted agent needs no model, so this is
exact and takes seconds; what a policy does to learning is measured by training
(docs/long-horizon.md, "Context policies, measured").

    python -m benchmarks.context_policies            # writes benchmarks/results/context_policies.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.common import RESULTS, command_line
from loop_trainer.chat import ChatFormatter
from loop_trainer.envs.base import Environment
from loop_trainer.envs.errands import ErrandsEnv, solve
from loop_trainer.rollout import EpisodeLimits, RolloutEngine
from loop_trainer.rollout.context import ContextPolicy
from loop_trainer.rollout.records import Completion
from loop_trainer.training.batching import training_samples

POLICIES: dict[str, dict[str, ContextPolicy]] = {
    "english": {
        "append-only": ContextPolicy(),
        "keep the last 4 observations": ContextPolicy(keep_observations=4),
        "observation budget 1024": ContextPolicy(observation_budget=1024),
        "observation budget 512": ContextPolicy(observation_budget=512),
    },
    "compact": {
        "append-only": ContextPolicy(),
        "keep the last 4 observations": ContextPolicy(keep_observations=4),
        "observation budget 32": ContextPolicy(observation_budget=32),
    },
}


class Replay:
    """A generation backend that answers with the next of ``replies``, tokenised, then the stop token."""

    def __init__(self, tokenizer: Any, replies: Sequence[str], stop_id: int):
        self.tokenizer, self.replies, self.stop_id, self.turn = tokenizer, list(replies), stop_id, 0

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        text = self.replies[min(self.turn, len(self.replies) - 1)]
        self.turn += 1
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.stop_id]
        return Completion(token_ids=ids, logprobs=[0.0] * len(ids), stopped=True)


def tokenizer_for(form: str, env: ErrandsEnv) -> tuple[Any, int]:
    if form == "english":
        from benchmarks.multiturn_throughput import build_tokenizer

        tokenizer = build_tokenizer()
        return tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>")
    from loop_trainer.models.tiny import build_word_tokenizer

    tokenizer = build_word_tokenizer(env.vocabulary())
    return tokenizer, tokenizer.eos_token_id


def measure(
    env: Environment, tasks: list[dict[str, Any]], tokenizer: Any, stop_id: int, form: str, policy: ContextPolicy
) -> dict[str, float]:
    formatter = ChatFormatter(tokenizer)
    episodes = []
    for task in tasks:
        backend = Replay(tokenizer, solve(task, form), stop_id)
        limits = EpisodeLimits(max_turns=40, max_new_tokens_per_turn=256, max_trajectory_tokens=32000)
        with RolloutEngine(env, backend, formatter, limits, show_progress=False, context_policy=policy) as engine:
            (trajectory,) = engine.collect([task], 1).trajectories
        rows = training_samples(trajectory, 1.0, 10**9, 0)
        episodes.append(
            {
                "success": bool(trajectory.success),
                "segments": len(trajectory.segments),
                "longest_context": max(end - start for start, end in trajectory.segments),
                "trained_tokens": sum(len(row.token_ids) for row in rows),
                "sampled_tokens": trajectory.num_sampled_tokens,
            }
        )
    mean = lambda key: statistics.fmean(e[key] for e in episodes)  # noqa: E731
    return {
        "episodes": len(episodes),
        "success_rate": mean("success"),
        "segments_mean": mean("segments"),
        "longest_context_mean": mean("longest_context"),
        "longest_context_max": max(e["longest_context"] for e in episodes),
        "trained_tokens_mean": mean("trained_tokens"),
        "sampled_tokens_mean": mean("sampled_tokens"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-tasks", type=int, default=16, help="test tasks per level")
    parser.add_argument("--out", default=str(RESULTS / "context_policies.json"))
    options = parser.parse_args(argv)
    results: dict[str, Any] = {"command": command_line("benchmarks.context_policies", argv), "forms": {}}
    for form, policies in POLICIES.items():
        env = ErrandsEnv(num_tasks=options.num_tasks, levels=[1, 2, 3], form=form)
        tasks = list(env.tasks("test"))
        tokenizer, stop_id = tokenizer_for(form, env)
        rows = {name: measure(env, tasks, tokenizer, stop_id, form, policy) for name, policy in policies.items()}
        base = rows["append-only"]["trained_tokens_mean"]
        print(f"\n{form} form, {len(tasks)} test tasks, a perfect agent:")
        print("| policy | success | segments | longest context (mean / max) | tokens trained | vs append-only |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, row in rows.items():
            row["trained_tokens_ratio"] = ratio = row["trained_tokens_mean"] / base
            context = f"{row['longest_context_mean']:.0f} / {row['longest_context_max']}"
            print(
                f"| {name} | {row['success_rate']:.2f} | {row['segments_mean']:.1f} | {context} | "
                f"{row['trained_tokens_mean']:.0f} | {ratio:.2f}x |"
            )
        results["forms"][form] = rows
    with open(options.out, "w") as file:
        json.dump(results, file, indent=2)
    print(f"\n{options.out}")


if __name__ == "__main__":
    main()
