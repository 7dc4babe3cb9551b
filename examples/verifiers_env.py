"""Train a verifiers 0.3.1 ToolEnv with LOOP: `from_verifiers(vf_env)` is the whole adapter.

verifiers runs its own rollout loop, tools and rubric; LOOP samples every reply, appends the tokens
exactly and trains on the rubric's reward (docs/environments.md, "verifiers and OpenEnv environments"). Needs
`pip install 'loop-trainer[verifiers]'` and a tool-calling chat model:

    python examples/verifiers_env.py --model Qwen/Qwen2.5-0.5B-Instruct --output_dir out/vf-arithmetic
"""

import argparse
import random

import verifiers as vf
from datasets import Dataset
from peft import LoraConfig

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.compat.verifiers import from_verifiers


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def correct_answer(completion, answer) -> float:
    """Reward: the last message states the product."""
    return 1.0 if answer in str(completion[-1].content) else 0.0


def build_env() -> vf.ToolEnv:
    rng = random.Random(0)
    pairs = [(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(200)]
    dataset = Dataset.from_dict(
        {"question": [f"What is {a} * {b}?" for a, b in pairs], "answer": [str(a * b) for a, b in pairs]}
    )
    return vf.ToolEnv(
        tools=[multiply],
        dataset=dataset,
        max_turns=4,
        system_prompt="Use the multiply tool, then give the product as a number.",
        rubric=vf.Rubric(funcs=[correct_answer]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--output_dir", default="vf-arithmetic-LOOP")
    cli = parser.parse_args()
    args = LOOPConfig(
        output_dir=cli.output_dir,
        iterations=20,
        tasks_per_iteration=8,
        rollouts_per_task=6,
        minibatch_size=12,
        max_turns=4,
        max_new_tokens_per_turn=256,
        max_trajectory_tokens=4096,
        learning_rate=1e-5,
        report_to=[],
    )
    trainer = LOOPTrainer(
        cli.model, from_verifiers(build_env()), args, peft_config=LoraConfig(r=16, target_modules="all-linear")
    )
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
