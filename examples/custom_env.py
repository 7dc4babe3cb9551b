"""Your own multi-turn environment, trained with LOOP on a CPU in minutes, offline.

    python examples/custom_env.py                    # the Python API: LOOPTrainer("tiny-instruct:courier", env, args)
    cd examples && loop-train --config ../recipes/demo.yaml --environment custom_env:CourierEnv \\
        --model_name_or_path tiny-instruct:courier --environment_kwargs '{}' --output_dir courier-LOOP

A courier brings a parcel to a person: ``where <name>`` answers the street the person lives on, ``go
<street>`` the door code there, ``deliver <code>`` ends the episode. Each task is its own small world,
so the street and the code must be read out of the earlier answers. Reward: the fraction of the three
steps done right; success: all three.

The environment is the contract of docs/environments.md (``tasks``, ``episode``; an episode's ``start``,
``step``, ``score``) plus the tiny models' two hooks, ``vocabulary()`` and ``demonstrations()``:
``tiny-instruct:courier`` is a small model built from a config and warmed up on the demonstrations of an
unreliable courier (each value right half the time), and LOOP makes it reliable. Measured on one CPU core
(``python examples/custom_env.py``, 2 min 16 s in all): held-out success, sampled as in training (64 test
tasks x 4), 0.08 after the warm-up and 0.75 after 30 iterations; training success 0.06 in iteration 1, 0.89
in iteration 30.
"""

from __future__ import annotations

import argparse
import json
import random

from datasets import Dataset

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.envs import Environment, Episode, Score, Step
from loop_trainer.envs.base import refuse_unknown_split

NAMES = ("ann", "bob", "cat", "dan", "eve", "fay")
STREETS = ("elm", "oak", "ash", "fir", "yew", "bay")
CODES = tuple(str(digit) for digit in range(10))
STEPS = ("where", "go", "deliver")


class CourierEpisode(Episode):
    def __init__(self, task):
        self.name = task["name"]
        self.street_of = dict(zip(NAMES, task["streets"], strict=True))
        self.code_of = dict(zip(task["streets"], task["codes"], strict=True))
        self.right = dict.fromkeys(STEPS, False)

    def start(self):
        return [
            {"role": "system", "content": "tools : where go deliver"},
            {"role": "user", "content": f"parcel for {self.name}"},
        ]

    def step(self, reply):
        command, _, argument = reply.strip().partition(" ")
        if command == "deliver":
            self.right["deliver"] = self.right["go"] and argument == self.code_of[self.street_of[self.name]]
            return Step(done=True)
        if command == "where" and argument in self.street_of:
            self.right["where"] |= argument == self.name
            return Step(messages=[{"role": "user", "content": f"{argument} lives on {self.street_of[argument]}"}])
        if command == "go" and argument in self.code_of:
            self.right["go"] |= argument == self.street_of[self.name]
            return Step(messages=[{"role": "user", "content": f"door code {self.code_of[argument]}"}])
        return Step(messages=[{"role": "user", "content": "no such place or person"}])

    def score(self):
        return Score(sum(self.right.values()) / len(STEPS), success=all(self.right.values()))


class CourierEnv(Environment):
    name = "courier"  # tiny-instruct:courier names it
    default_eval_split = "test"

    def __init__(self, num_tasks: int = 64, seed: int = 0):
        self.num_tasks, self.seed = num_tasks, seed

    def tasks(self, split="train"):
        refuse_unknown_split(self.name, split, ("train", "test"))  # one line naming the splits there are
        return Dataset.from_list(self.worlds(split, self.num_tasks))

    def worlds(self, label, count):
        rng = random.Random(f"courier-{self.seed}-{label}")
        return [
            {
                "task_id": f"{label}-{index}",
                "name": rng.choice(NAMES),
                "streets": rng.sample(STREETS, len(NAMES)),
                "codes": [rng.choice(CODES) for _ in NAMES],
            }
            for index in range(count)
        ]

    def episode(self, task):
        return CourierEpisode(task)

    @staticmethod
    def vocabulary():
        """Every word of the messages and of a perfect courier's replies (tiny:/tiny-instruct: models)."""
        words = ["tools", ":", "parcel", "for", "lives", "on", "door", "code", "no", "such", "place", "or", "person"]
        return [*STEPS, *NAMES, *STREETS, *CODES, *words]

    def demonstrations(self, num_conversations, seed=0):
        """Real episodes of an unreliable courier: each value it copies is right half the time
        (tiny-instruct: warms up on these before LOOP)."""
        rng = random.Random(seed)
        worlds = self.worlds(f"demonstrations-{seed}", num_conversations)  # apart from the train and test splits

        def copied(value, pool):
            return value if rng.random() < 0.5 else rng.choice([other for other in pool if other != value])

        conversations = []
        for world in worlds:
            episode = self.episode(world)
            messages = episode.start()
            for command, pool in (("where", NAMES), ("go", STREETS), ("deliver", CODES)):
                right = episode.name if command == "where" else messages[-1]["content"].split()[-1]  # read, copied
                reply = f"{command} {copied(right, pool)}"
                messages += [{"role": "assistant", "content": reply}, *episode.step(reply).messages]
            conversations.append(messages)
        return conversations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--output_dir", default="courier-LOOP")
    options = parser.parse_args()
    args = LOOPConfig(  # the demo's settings (recipes/demo.yaml): a tiny model on a CPU
        output_dir=options.output_dir,
        overwrite_output_dir=True,
        tiny_instruct_steps=400,
        iterations=options.iterations,
        tasks_per_iteration=16,
        rollouts_per_task=6,
        minibatch_size=32,
        ppo_epochs=2,
        epsilon=0.1,
        learning_rate=4e-4,
        max_turns=6,
        max_new_tokens_per_turn=4,
        max_trajectory_tokens=512,
        eval_split="test",
        eval_temperature=1.0,  # sampled, as in training: greedy decoding hides an unreliable policy
        eval_rollouts_per_task=4,
        per_device_train_batch_size=16,
        activation_checkpointing=False,
        report_to="none",
    )
    trainer = LOOPTrainer("tiny-instruct:courier", CourierEnv(), args)
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    print(json.dumps({"success_before": before["eval_success_rate"], "success_after": after["eval_success_rate"]}))


if __name__ == "__main__":
    main()
