"""Shared-prefix prefill: rollout seconds per iteration with the transformers backend, every prompt
prefilled whole (``share_prefixes=False``, before) against each shared opening prefilled once
(``share_prefixes=True``, the default), side by side in one process.

Two workloads, each a few iterations of one ``RolloutEngine.collect`` with the same tasks and seeds
on both sides (the side that goes first alternates):

* ``contacts``: the rollout phase of ``recipes/smollm2-135m-contacts.yaml`` as it was when this was
  first measured (2 examples, ``RECIPE_ENV``; the recipe now opens with 3): SmolLM2-135M-Instruct
  (the packaged model, float32) with the recipe's LoRA adapter freshly initialised (so generation
  pays for the unmerged adapter, as in training), ``contacts`` with the recipe's environment
  kwargs, 4 tasks x 4 rollouts, at most 4 turns of 24 tokens, temperature 1. The K rollouts of a
  task share its ~280-token opening; tasks share only the system prompt.
* ``appworld``: an AppWorld-shaped workload with no AppWorld: a ~6k-token system prompt (API
  descriptions) shared by every task, a short task instruction, 8 tasks x 6 rollouts, 3 turns of
  16 tokens with a short observation between them, on a tiny Qwen2 (Qwen2.5's vocabulary and chat
  template; ``--hidden-size``/``--layers``), float32.

Every side's sampled tokens are compared: sharing must not change them (``same_tokens``).

    OMP_NUM_THREADS=2 python -m benchmarks.shared_prefix --out benchmarks/results/shared-prefix-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, command_line, software

RECIPE_ENV: dict[str, Any] = {"num_tasks": 64, "examples": 2}  # ContactsEnv keyword arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["contacts", "appworld"], choices=["contacts", "appworld"])
    parser.add_argument("--iterations", type=int, default=3, help="collections per side and workload (default 3)")
    parser.add_argument("--opening-tokens", type=int, default=6000, help="appworld: system prompt tokens (~)")
    parser.add_argument("--hidden-size", type=int, default=256, help="appworld: the tiny Qwen2's width")
    parser.add_argument("--layers", type=int, default=4, help="appworld: the tiny Qwen2's layers")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "shared-prefix.json")
    return parser.parse_args(argv)


# --- workloads ----------------------------------------------------------------------------------
@dataclass
class Workload:
    env: Any
    model: Any
    tokenizer: Any
    limits: Any
    iterations: list[list[Any]]
    """The tasks of each iteration."""
    rollouts: int
    shape: dict[str, Any]


def contacts_workload(args: argparse.Namespace) -> Workload:
    from peft import LoraConfig, get_peft_model

    from benchmarks.field_decision import load_policy
    from benchmarks.real_model_capability import TARGETS
    from loop_trainer.envs.contacts import ContactsEnv
    from loop_trainer.rollout import EpisodeLimits

    model, tokenizer = load_policy(None)
    torch.manual_seed(args.seed)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    env = ContactsEnv(**RECIPE_ENV)
    tasks = list(env.tasks("train"))
    return Workload(
        env=env,
        model=model,
        tokenizer=tokenizer,
        limits=EpisodeLimits(max_turns=4, max_new_tokens_per_turn=24, max_trajectory_tokens=640),
        iterations=[tasks[4 * i : 4 * i + 4] for i in range(args.iterations)],
        rollouts=4,
        shape={"model": "SmolLM2-135M-Instruct + LoRA r16 (float32)", "environment_kwargs": RECIPE_ENV},
    )


API_LINE = "apis.{app}.{verb}_{noun}({arg}: str, page_index: int = 0) -> dict: {verb} the {noun} of the {app} account."
APPS = ("spotify", "venmo", "gmail", "amazon", "todoist", "splitwise", "phone", "file_system", "simple_note")
VERBS = ("show", "search", "create", "update", "delete", "like", "follow", "download")
NOUNS = ("songs", "playlists", "payments", "emails", "orders", "tasks", "notes", "contacts", "reviews")


def appworld_opening(tokenizer: Any, tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens in AppWorld's shape: instructions, then API lines."""
    lines = [
        "You are a super-intelligent agent. Use the APIs below to complete the user's task, one code block per turn."
    ]
    index = 0
    while len(tokenizer.encode("\n".join(lines))) < tokens:
        app, verb, noun = APPS[index % 9], VERBS[(index // 9) % 8], NOUNS[(index // 72) % 9]
        lines.append(API_LINE.format(app=app, verb=verb, noun=noun, arg=f"{noun[:-1]}_id"))
        index += 1
    return "\n".join(lines)


def appworld_workload(args: argparse.Namespace) -> Workload:
    from datasets import Dataset

    from benchmarks.multiturn_throughput import build_model, build_tokenizer
    from loop_trainer.envs.base import Environment, Episode, Step
    from loop_trainer.rollout import EpisodeLimits

    tokenizer = build_tokenizer()
    system = appworld_opening(tokenizer, args.opening_tokens)

    class AppEpisode(Episode):
        def __init__(self, task: Any):
            self.task, self.turn = task, 0

        def start(self) -> list[dict[str, str]]:
            instruction = f"Task {self.task['task_id']}: {self.task['instruction']}"
            return [{"role": "system", "content": system}, {"role": "user", "content": instruction}]

        def step(self, reply: str) -> Step:
            self.turn += 1
            return Step(messages=[{"role": "user", "content": f"Output: {{'page': {self.turn}, 'items': []}}"}])

        def score(self) -> float:
            return 0.0

    class AppShaped(Environment):
        name = "appworld-shaped"

        def tasks(self, split: str = "train") -> Dataset:
            return Dataset.from_list(
                [
                    {"task_id": f"t{i}", "instruction": f"Pay back {APPS[i % 9]} friend {i} the money owed for dinner."}
                    for i in range(8 * args.iterations)
                ]
            )

        def episode(self, task: Any) -> Episode:
            return AppEpisode(task)

    # multiturn_throughput's tiny Qwen2 (Qwen2.5's vocabulary and special tokens), 4 heads
    model = build_model(
        argparse.Namespace(hidden_size=args.hidden_size, layers=args.layers, heads=4, kv_heads=4, seed=args.seed)
    )
    env = AppShaped()
    tasks = list(env.tasks("train"))
    return Workload(
        env=env,
        model=model,
        tokenizer=tokenizer,
        limits=EpisodeLimits(max_turns=3, max_new_tokens_per_turn=16, max_trajectory_tokens=8192),
        iterations=[tasks[8 * i : 8 * i + 8] for i in range(args.iterations)],
        rollouts=6,
        shape={
            "model": f"tiny Qwen2 (hidden {args.hidden_size}, {args.layers} layers, float32)",
            "system_prompt_tokens": len(tokenizer.encode(system)),
        },
    )


# --- one collection -----------------------------------------------------------------------------
def collect(workload: Workload, tasks: list[Any], share: bool, seed: int) -> dict[str, Any]:
    from loop_trainer.chat import ChatFormatter, stop_token_ids
    from loop_trainer.rollout import RolloutEngine, TransformersSamplingSettings, build_transformers_backend

    model, tokenizer = workload.model, workload.tokenizer
    # the dynamic decode loop with and without sharing, whatever the device
    settings = TransformersSamplingSettings(
        share_prefixes=share, static_decode=False, compile_decode_step=False, merge_adapter=False
    )
    backend = build_transformers_backend(
        model, settings, stop_token_ids=stop_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id
    )
    rollouts = workload.rollouts
    with RolloutEngine(workload.env, backend, ChatFormatter(tokenizer), workload.limits, show_progress=False) as engine:
        started = time.perf_counter()
        batch = engine.collect(tasks, rollouts, seed=seed)
        seconds = time.perf_counter() - started
    if batch.failed:
        raise RuntimeError(f"{len(batch.failed)} rollouts failed: {[t.error for t in batch.failed][:3]}")
    done = sorted(batch.trajectories, key=lambda t: (t.task_id, t.rollout))
    return {
        "seconds": seconds,
        "generation_seconds": backend.busy_seconds,
        "episodes": len(done),
        "sampled_tokens": sum(t.num_sampled_tokens for t in done),
        "opening_tokens_mean": statistics.mean(t.prompt_length for t in done),
        "shared_prompt_tokens": backend.num_shared_tokens,
        "reused_prompt_tokens": backend.num_reused_tokens,
        "prefills": backend.num_batches,
        "decode_steps": backend.num_steps,
        "token_ids": [list(t.token_ids) for t in done],
    }


def compare(workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"unshared": [], "shared": []}
    same = 0
    for index, tasks in enumerate(workload.iterations):
        order = ["unshared", "shared"] if index % 2 == 0 else ["shared", "unshared"]
        results = {side: collect(workload, tasks, side == "shared", seed=args.seed + index) for side in order}
        same += results["shared"]["token_ids"] == results["unshared"]["token_ids"]
        for side in order:
            run = results[side]
            del run["token_ids"]
            runs[side].append(run)
            print(
                f"  iteration {index + 1} {side:>8}: {run['seconds']:.2f} s "
                f"(shared {run['shared_prompt_tokens']} prompt tokens, {run['prefills']} prefills)",
                flush=True,
            )
    mean = {side: statistics.mean(r["seconds"] for r in side_runs) for side, side_runs in runs.items()}
    return {
        "shape": workload.shape,
        "tasks_per_iteration": len(workload.iterations[0]),
        "rollouts_per_task": workload.rollouts,
        "runs": runs,
        "rollout_seconds_mean": mean,
        "shared_over_unshared": mean["shared"] / mean["unshared"],
        "same_tokens": f"{same} of {len(workload.iterations)} iterations",
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "command": command_line("benchmarks.shared_prefix", argv),
        "software": software(["torch", "transformers", "peft"], host=True, checkout=True),
        "threads": args.threads,
        "workloads": {},
    }
    builders = {"contacts": contacts_workload, "appworld": appworld_workload}
    for name in args.workloads:
        print(f"{name}:", flush=True)
        comparison = compare(builders[name](args), args)
        result["workloads"][name] = comparison
        print(
            f"{name}: rollout s per iteration {comparison['rollout_seconds_mean']['unshared']:.2f} unshared, "
            f"{comparison['rollout_seconds_mean']['shared']:.2f} shared "
            f"(x{comparison['shared_over_unshared']:.2f}); same tokens in {comparison['same_tokens']}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
