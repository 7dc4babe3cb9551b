"""A TRL 1.16 multi-turn script, switched from GRPOTrainer to LOOPTrainer by one word.

The environment, dataset, reward function and GRPOConfig are exactly what GRPOTrainer takes
(docs/environments.md, "Coming from GRPOTrainer"). Run it with a tool-calling chat model:

    python examples/trl_environment_factory.py --model Qwen/Qwen2.5-0.5B-Instruct --output_dir out/counter
    python examples/trl_environment_factory.py --model tiny-chat:qwen2.5   # offline smoke run (learns nothing)
    accelerate launch examples/trl_environment_factory.py ...   # the same on several GPUs
"""

import argparse

from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig

from loop_trainer import LOOPTrainer  # was: from trl import GRPOTrainer


class CounterEnv:
    """One instance per rollout. Its public methods are the model's tools; get_reward() is a reward."""

    def reset(self, start: int, target: int, **row) -> str:
        self.count, self.target = start, target
        return f" The counter is at {start}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add (may be negative).
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return 1.0 if self.count == self.target else 0.0


def answered_with_the_target(completions, target, **kwargs) -> list[float]:
    """TRL reward function: extra dataset columns (target) arrive as lists, one entry per completion."""
    return [0.2 if str(t) in c[-1]["content"] else 0.0 for c, t in zip(completions, target, strict=True)]


def build_trainer(model: str, output_dir: str, **config: object) -> LOOPTrainer:
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Use the tools to bring the counter to {t}, then say its value."}],
            "start": s,
            "target": t,
        }
        for s in range(0, 20, 3)
        for t in (10, 25, 42)
    ]
    args = GRPOConfig(
        output_dir=output_dir,
        num_generations=6,
        per_device_train_batch_size=12,
        max_steps=50,
        learning_rate=1e-5,
        max_completion_length=1024,
        max_tool_calling_iterations=6,
        logging_steps=1,
        report_to="none",
        **config,
    )
    return LOOPTrainer(  # was: GRPOTrainer(
        model=model,
        reward_funcs=answered_with_the_target,
        args=args,
        train_dataset=Dataset.from_list(rows),
        environment_factory=CounterEnv,
        peft_config=LoraConfig(r=16, target_modules="all-linear"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--output_dir", default="counter-LOOP")
    cli = parser.parse_args()
    trainer = build_trainer(cli.model, cli.output_dir)
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
