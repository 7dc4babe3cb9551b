"""Which field does a policy answer on ``contacts``, and why? A teacher-forced probe, no sampling.

For each task, the perfect agent's conversation is replayed up to the final turn (the opening with
its examples, ``search``, ``get`` and the card, rendered token for token as the rollout engine does),
then the policy scores the two possible final replies: ``answer("<asked field>")`` and
``answer("<other field>")``, each with its end-of-turn token. ``p_right`` = P(asked) / (P(asked) +
P(other)): the policy's field decision on that task at temperature 1, with copying errors and every
other reply factored out. The report breaks it down by the asked field and by the field the *last*
example of the opening answered, which separates "reads the question" (high p_right in all four
cells) from "always the city" or "whatever the last example did" (high in two cells, low in two).

    python -m benchmarks.field_decision                                  # the starting model
    python -m benchmarks.field_decision --adapter outputs/demo-real      # a trained LoRA adapter

Prints one table and writes it, with every task's p_right, to ``--out`` as JSON when given.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.real_model_capability import demonstration
from loop_trainer.chat import ChatFormatter
from loop_trainer.envs.contacts import ContactsEnv, solve
from loop_trainer.models.packaged import resolve_model_path

MODEL = "packaged:smollm2-135m-instruct"


def load_policy(adapter: Path | None) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval(), tokenizer


def final_turn_prefix(
    task: dict[str, Any], formatter: ChatFormatter, stop_id: int, env: ContactsEnv | None = None
) -> list[int]:
    """The ids the policy conditions its final reply on, after a perfect search and get: the
    perfect agent's episode as the rollout engine renders it, less its final reply."""
    ids, _ = demonstration(task, formatter, stop_id, env)
    return ids[: len(ids) - len(formatter._encode(solve(task)[-1])) - 1]  # - 1: the reply's stop token


@torch.no_grad()
def continuation_logprob(model: torch.nn.Module, prefix: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([prefix + continuation])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0, len(prefix) - 1 : -1].float(), dim=-1)
    return float(logprobs.gather(1, torch.tensor(continuation)[:, None]).sum())


def field_decisions(
    model: torch.nn.Module, tokenizer: Any, tasks: list[dict[str, Any]], env: ContactsEnv | None = None
) -> list[dict[str, Any]]:
    formatter = ChatFormatter(tokenizer)
    stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for task in tasks:
        card = next(c for c in task["contacts"] if c["name"] == task["person"])
        other = "city" if task["field"] == "phone" else "phone"
        prefix = final_turn_prefix(task, formatter, stop_id, env)
        right, wrong = (
            continuation_logprob(model, prefix, formatter._encode(f'answer("{card[field]}")') + [stop_id])
            for field in (task["field"], other)
        )
        rows.append(
            {
                "task_id": task["task_id"],
                "asked": task["field"],
                "last_example": task["examples"][-1]["field"] if task.get("examples") else None,
                "p_right": 1.0 / (1.0 + math.exp(wrong - right)),
                "p_either": math.exp(right) + math.exp(wrong),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    cells: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in rows:
        cells[(row["asked"], str(row["last_example"]))].append(row["p_right"])
    lines = [
        "| asked | last example answered | tasks | mean p_right | p_right > 0.5 | undecided (0.05-0.95) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    cells[("all", "")] = [row["p_right"] for row in rows]
    for (asked, last), values in sorted(cells.items(), key=lambda cell: (cell[0][0] == "all", cell[0])):
        lines.append(
            f"| {asked} | {last} | {len(values)} | {sum(values) / len(values):.3f} | "
            f"{sum(v > 0.5 for v in values)} | {sum(0.05 < v < 0.95 for v in values)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", type=Path, help="a trained LoRA adapter (default: the starting model)")
    parser.add_argument("--split", default="test", choices=["train", "test"])
    parser.add_argument("--max-tasks", type=int, default=64)
    parser.add_argument("--env-kwargs", default='{"num_tasks": 64, "examples": 2}', help="the recipe's, as JSON")
    parser.add_argument("--out", type=Path, help="write the table and every task's p_right here (JSON)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_policy(args.adapter)
    env = ContactsEnv(**json.loads(args.env_kwargs))
    tasks = list(env.tasks(args.split))[: args.max_tasks]
    rows = field_decisions(model, tokenizer, tasks, env)
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps({"adapter": str(args.adapter), "split": args.split, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
