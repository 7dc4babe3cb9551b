"""Can SmolLM2-135M-Instruct represent the ``contacts`` skill? A supervised check, no RL.

LOOP on ``contacts`` (docs/real-model.md) learns the three calls but not which field (phone or city)
the question asks for. This asks whether the model *can* do it at all: LoRA (the recipe's: r 16,
alpha 32, every linear projection, float32) trained with a plain causal-LM loss on a perfect agent's
conversations of the train split -- rendered token for token as the rollout engine renders turns
(:class:`loop_trainer.chat.ChatFormatter`), loss on the assistant replies and their end-of-turn
token only -- then ``loop-compare``'s evaluation (the recipe's episode limits and seed) of the
untrained and the trained policy on the first 32 held-out test tasks, greedy and at temperature 1.0.

    python -m benchmarks.real_model_capability --out benchmarks/results/real-model/capability
    python -m benchmarks.real_model_capability --out ... --label small-book \\
        --env-kwargs '{"num_tasks": 64, "examples": 2, "contacts_per_task": 3, "namesakes": 1}'

Each run adds (or replaces) its ``--label`` entry in ``OUT/summary.json`` and writes
``OUT/<label>-compare.md`` / ``-trajectories.md`` / ``-answers.json`` (how each held-out answer
failed), then rewrites ``OUT/README.md``. The adapter and evaluation rows go to ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from trl import ModelConfig

from benchmarks.common import ROOT, command_line, git_commit
from loop_trainer.chat import ChatFormatter
from loop_trainer.cli.compare import CompareArguments, compare, contrasting_trajectories, table
from loop_trainer.cli.recipe import ScriptArguments, parse_recipe
from loop_trainer.config import LOOPConfig
from loop_trainer.envs.contacts import ContactsEnv, solve
from loop_trainer.models.packaged import resolve_model_path

RECIPE = ROOT / "recipes" / "smollm2-135m-contacts.yaml"
MODEL = "packaged:smollm2-135m-instruct"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHECKS = ("searched", "found_person", "opened_card", "answered")


def demonstration(
    task: dict[str, Any], formatter: ChatFormatter, stop_id: int, env: ContactsEnv | None = None
) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a perfect agent's episode on ``task``, as the rollout engine builds it:
    the opening (examples included), then per turn the reply's ids + the stop token (masked in),
    the template's rest of the turn and the observation (masked out). ``env``: the environment
    whose settings render the episode (default: ``ContactsEnv()``'s)."""
    episode = (env or ContactsEnv()).episode(task)
    ids = formatter.opening_ids(episode.start())
    mask = [0] * len(ids)
    for reply in solve(task):
        sampled = formatter._encode(reply) + [stop_id]
        ids, mask = ids + sampled, mask + [1] * len(sampled)
        step = episode.step(reply)
        if step.done:
            break
        rest = formatter.after_reply_ids(sampled, True) + formatter.continuation_ids(step.messages)
        ids, mask = ids + rest, mask + [0] * len(rest)
    assert episode.score().success, f"the demonstration of {task['task_id']} does not solve it"
    return ids, mask


def train(env_kwargs: dict[str, Any], steps: int, lr: float, batch: int, adapter_dir: Path, seed: int) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    path = resolve_model_path(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    policy = get_peft_model(model, lora)
    formatter = ChatFormatter(tokenizer)
    stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(stop_id, int)  # one token in, one id out
    tasks = list(ContactsEnv(**env_kwargs).tasks("train"))
    demos = [demonstration(task, formatter, stop_id) for task in tasks]
    lengths = [len(ids) for ids, _ in demos]
    print(
        f"{len(demos)} demonstrations, {min(lengths)}-{max(lengths)} tokens, "
        f"{sum(sum(m) for _, m in demos) / len(demos):.1f} reply tokens each",
        flush=True,
    )
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    rng = random.Random(seed)
    order: list[int] = []
    losses: list[float] = []
    policy.train()
    started = time.perf_counter()
    for step in range(steps):
        if len(order) < batch:
            order += rng.sample(range(len(demos)), len(demos))
        chosen, order = [demos[i] for i in order[:batch]], order[batch:]
        width = max(len(ids) for ids, _ in chosen)
        input_ids = torch.full((len(chosen), width), tokenizer.pad_token_id or 0)
        labels = torch.full((len(chosen), width), -100)
        attention = torch.zeros((len(chosen), width), dtype=torch.long)
        for row, (ids, mask) in enumerate(chosen):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.tensor([i if m else -100 for i, m in zip(ids, mask, strict=True)])
        loss = policy(input_ids=input_ids, attention_mask=attention, labels=labels).loss  # token mean over replies
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"step {step + 1}/{steps}  loss {losses[-1]:.4f}  {time.perf_counter() - started:.0f}s", flush=True)
    seconds = time.perf_counter() - started
    policy.save_pretrained(str(adapter_dir))
    tokenizer.save_pretrained(adapter_dir)
    epochs = steps * batch / len(demos)
    return {
        "seed": seed,
        "steps": steps,
        "epochs": epochs,
        "lr": lr,
        "batch": batch,
        "train_seconds": seconds,
        "losses": losses,
    }


def answer_kinds(rows: list[dict[str, Any]], env: ContactsEnv) -> dict[str, int]:
    """How each rollout's final answer relates to the asked-about card: right, the other field's
    value (exact or miscopied), a miscopied value of the right field (digits = a phone), or none."""
    tasks = {task["task_id"]: task for task in env.tasks("test")}
    kinds: Counter[str] = Counter()
    for row in rows:
        task = tasks[row["task_id"]]
        card = next(c for c in task["contacts"] if c["name"] == task["person"])
        other = "city" if task["field"] == "phone" else "phone"
        own = row["messages"][row["num_opening_messages"] :]  # the opening's examples answer too
        replies = [m["content"] for m in own if m["role"] == "assistant"]
        answer = next((r for r in reversed(replies) if "answer(" in r.lower()), None)
        if answer is None:
            kinds["no_answer"] += 1
            continue
        text = answer.split("(", 1)[1].rsplit(")", 1)[0].strip().strip("\"'").strip().rstrip(".").lower()
        looks_like = "phone" if any(ch.isdigit() for ch in text) else "city"
        if row["info"]["checks"]["answered"]:
            kinds["right"] += 1
        elif text == card[other].lower():
            kinds[f"other_field_for_{task['field']}_question"] += 1
        elif looks_like == task["field"]:
            kinds[f"miscopied_{task['field']}"] += 1
        else:
            kinds[f"other_field_miscopied_for_{task['field']}_question"] += 1
    return dict(sorted(kinds.items()))


def evaluate(adapter_dir: Path, env_kwargs: dict[str, Any], max_tasks: int, sampled: int) -> tuple[list, float]:
    """``loop-compare --config RECIPE --trained adapter_dir --max_tasks N --sampled_rollouts_per_task K``
    with the environment's kwargs replaced: start and trained policy, greedy and at T=1."""
    argv = [
        "--config",
        str(RECIPE),
        "--trained",
        str(adapter_dir),
        "--max_tasks",
        str(max_tasks),
        "--sampled_rollouts_per_task",
        str(sampled),
        "--output_dir",
        str(adapter_dir),
    ]
    script, training, model_args, options = parse_recipe(
        argv, (ScriptArguments, LOOPConfig, ModelConfig, CompareArguments)
    )
    script.environment_kwargs = env_kwargs
    started = time.perf_counter()
    rows = compare(script, training, model_args, options)
    return rows, time.perf_counter() - started


def readme(summary: dict[str, Any]) -> str:
    lines = [
        "# Can SmolLM2-135M-Instruct represent `contacts`? (supervised LoRA, no RL)",
        "",
        "Written by `benchmarks/real_model_capability.py` (its docstring: the method). The first 32 held-out test",
        "tasks, evaluated as `loop-compare` does (recipe episode limits, eval seed 0): greedy = 1 rollout per",
        "task, T=1 = 2 rollouts per task. `start` is the untrained model (the same numbers as docs/real-model.md's",
        "seed-0 start rows), `trained` the supervised LoRA. Final answers: right, the other field's value (exact",
        "or miscopied), a miscopied value of the asked field, or no answer (details: `<condition>-answers.json`).",
        "Wall seconds on one pinned core (`taskset -c 0`, 1 torch thread).",
        "",
    ]
    head = "| condition | policy | decoding | success | reward | " + " | ".join(CHECKS) + " | final answers |"
    lines += [head, "| " + " | ".join(["---"] * 10) + " |"]
    for label, entry in summary.items():
        for row in entry["compare_rows"]:
            checks = " | ".join(f"{row[f'passed_{c}']:.3f}" for c in CHECKS)
            kinds = ", ".join(f"{k} {n}" for k, n in entry["answers"][f"{row['policy']} {row['decoding']}"].items())
            lines.append(
                f"| {label} | {row['policy']} | {row['decoding']} | "
                f"{row['success_rate']:.3f} | {row['reward_mean']:.3f} | {checks} | {kinds} |"
            )
    lines += [
        "",
        "| condition | env kwargs | seed | steps | epochs | lr | batch | final loss | train s | eval s (2 policies) |",
        "| " + " | ".join(["---"] * 10) + " |",
    ]
    for label, entry in summary.items():
        t = entry["training"]
        lines.append(
            f"| {label} | `{json.dumps(entry['env_kwargs'])}` | {t.get('seed', 0)} | {t['steps']} | "
            f"{t['epochs']:.1f} | {t['lr']:g} | {t['batch']} | {t['losses'][-1]:.4f} | {t['train_seconds']:.0f} | "
            f"{entry['eval_seconds']:.0f} |"
        )
    lines += [
        "",
        "Commands (`PYTHONPATH` = a `git archive` of `src/` at the commit in summary.json, as the working tree's",
        "`src/` was being edited at the time; drop it on a clean checkout):",
        "",
        "```bash",
    ]
    lines += [
        f"OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH=/tmp/lt-head/src taskset -c 0 .venv/bin/{e['command']}"
        for e in summary.values()
    ]
    return "\n".join([*lines, "```", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/real-model/capability")
    parser.add_argument("--work", type=Path, default=ROOT / "outputs/capability", help="adapters and eval rows")
    parser.add_argument("--label", default="recipe-env")
    parser.add_argument(
        "--env-kwargs", default='{"num_tasks": 64, "examples": 2}', help="JSON, the recipe's by default"
    )
    parser.add_argument("--steps", type=int, default=32, help="optimizer steps (32 x 4 = 2 epochs of 64 tasks)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-tasks", type=int, default=32)
    parser.add_argument("--sampled-rollouts", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    env_kwargs = json.loads(args.env_kwargs)
    adapter_dir = args.work / args.label
    shutil.rmtree(adapter_dir, ignore_errors=True)
    training = train(env_kwargs, args.steps, args.lr, args.batch, adapter_dir, args.seed)
    rows, eval_seconds = evaluate(adapter_dir, env_kwargs, args.max_tasks, args.sampled_rollouts)
    env, answers = ContactsEnv(**env_kwargs), {}
    for row in rows:
        results = Path(row["output_dir"]) / "results.jsonl"
        answers[f"{row['policy']} {row['decoding']}"] = answer_kinds(
            [json.loads(line) for line in results.read_text().splitlines()], env
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.label}-compare.md").write_text(table(rows) + "\n")
    (args.out / f"{args.label}-trajectories.md").write_text(contrasting_trajectories(rows, 4))
    (args.out / f"{args.label}-answers.json").write_text(json.dumps(answers, indent=1) + "\n")
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary[args.label] = {
        "command": command_line("benchmarks.real_model_capability"),
        "commit": git_commit(),
        "env_kwargs": env_kwargs,
        "training": training,
        "eval_seconds": eval_seconds,
        "answers": answers,
        "compare_rows": [{k: v for k, v in r.items() if k != "output_dir"} for r in rows],
    }
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "README.md").write_text(readme(summary))
    print(table(rows))
    print(json.dumps(answers, indent=1))


if __name__ == "__main__":
    main()
