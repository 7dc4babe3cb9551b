"""``vault``: the built-in environment, a miniature of AppWorld's "look it up through APIs" tasks.

Each task has its own small world: a directory that maps people to account ids and a vault
that maps account ids to codes. The task names a person; the agent must

1. ``find <person>`` -- the directory answers with the person's account id and selects that
   account (server-side session state, like a login token),
2. ``open``          -- the vault answers with the code of the selected account,
3. ``submit <code>`` -- which ends the episode.

The code cannot be known before the calls that reveal it, so solving a task takes several turns,
and the last one must copy a value out of an earlier observation. A reply may contain several
commands; the first one runs (one tool call per turn). A reply without a command gets an
observation saying so.

Reward = fraction of the task's four checks passed (as AppWorld's training reward is the fraction
of unit tests passed): the agent used the directory, looked up the right person, opened the right
account, submitted the right code. ``success`` is all four.

The vocabulary is a few dozen words, so a tiny model built from a config (see
:mod:`loop_trainer.models.tiny`) can learn it from scratch on a CPU in minutes.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from datasets import Dataset

from .base import Environment, Episode, Message, Score, Step, check_pass_rates, refuse_unknown_split, success_and_reward

PEOPLE = ("ann", "bob", "cat", "dan", "eve", "fay", "gus", "hal")
ACCOUNT_IDS = tuple(f"k{i}" for i in range(10))
CODES = tuple(str(i) for i in range(10))
COMMANDS = ("find", "open", "submit")
MESSAGE_WORDS = ("fetch", "code", "of", "id", "no", "such", "person", "account", "command", "tools", ":")
CHECKS = ("used_directory", "found_person", "opened_account", "submitted_code")
SPLITS = ("train", "test")
SYSTEM_PROMPT = "tools : find open submit"


class VaultEpisode(Episode):
    def __init__(self, task: Mapping[str, Any]):
        self.target: str = task["person"]
        self.directory: dict[str, str] = dict(zip(task["people"], task["account_ids"], strict=True))
        self.vault: dict[str, str] = dict(zip(task["account_ids"], task["codes"], strict=True))
        self.passed = dict.fromkeys(CHECKS, False)
        self.selected: str | None = None

    def start(self) -> list[Message]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"fetch code of {self.target}"},
        ]

    def step(self, reply: str) -> Step:
        words = reply.split()
        position = next((i for i, word in enumerate(words) if word in COMMANDS), None)
        if position is None:
            return Step(messages=[{"role": "user", "content": "no command"}])
        command = words[position]
        argument = words[position + 1] if position + 1 < len(words) else ""
        if command == "submit":
            self.passed["submitted_code"] = argument == self.vault[self.directory[self.target]]
            return Step(done=True)
        observation = self._find(argument) if command == "find" else self._open()
        return Step(messages=[{"role": "user", "content": observation}])

    def _find(self, person: str) -> str:
        self.passed["used_directory"] = True
        self.passed["found_person"] |= person == self.target
        if person not in self.directory:
            return f"no such person {person}".strip()
        self.selected = self.directory[person]
        return f"{person} id {self.selected}"

    def _open(self) -> str:
        if self.selected is None:
            return "no account"
        if self.selected == self.directory[self.target]:
            self.passed["opened_account"] = True
        return f"{self.selected} code {self.vault[self.selected]}"

    def score(self) -> Score:
        return Score(
            reward=sum(self.passed.values()) / len(CHECKS),
            success=all(self.passed.values()),
            info={"checks": dict(self.passed)},
        )


class VaultEnv(Environment):
    """The built-in environment. ``num_tasks`` worlds per split, generated from ``seed``."""

    name = "vault"
    default_eval_split = "test"

    def __init__(self, num_tasks: int = 64, people_per_task: int = 4, seed: int = 0):
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(
                f"vault: num_tasks (environment_kwargs) is the number of tasks per split and must be "
                f"an integer >= 1, got {num_tasks!r}"
            )
        if not 1 <= people_per_task <= len(PEOPLE):
            raise ValueError(
                f"vault: people_per_task (environment_kwargs) must be between 1 and {len(PEOPLE)}, "
                f"got {people_per_task!r}"
            )
        self.num_tasks = num_tasks
        self.people_per_task = people_per_task
        self.seed = seed

    def tasks(self, split: str = "train") -> Dataset:
        refuse_unknown_split("vault", split, SPLITS)
        rng = random.Random(f"{self.seed}-{split}")
        rows = []
        for index in range(self.num_tasks):
            people = rng.sample(PEOPLE, self.people_per_task)
            rows.append(
                {
                    "task_id": f"{split}-{index:04d}",
                    "person": rng.choice(people),
                    "people": people,
                    "account_ids": rng.sample(ACCOUNT_IDS, self.people_per_task),
                    "codes": [rng.choice(CODES) for _ in people],
                }
            )
        return Dataset.from_list(rows)

    def episode(self, task: Mapping[str, Any]) -> VaultEpisode:
        return VaultEpisode(task)

    def summarize(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Success rate and mean reward, plus how often each check passed (``passed_found_person``
        ...): which step of the protocol the agent gets wrong. Failed rollouts passed none."""
        return {**success_and_reward(rows), **check_pass_rates(rows, CHECKS)}

    def demonstrations(self, num_conversations: int, accuracy: float = 0.5, seed: int = 0) -> list[list[Message]]:
        """Conversations of an agent that knows the protocol but is unreliable: each argument it
        gives is right with probability ``accuracy`` and a random other value otherwise. The
        observations come from real episodes of the train split."""
        rng = random.Random(seed)
        tasks = self.tasks("train")
        conversations = []
        for index in range(num_conversations):
            task = tasks[index % len(tasks)]
            episode = self.episode(task)
            messages = episode.start()
            target = task["person"]
            person = target if rng.random() < accuracy else rng.choice([p for p in PEOPLE if p != target])
            for reply in (f"find {person}", "open"):
                messages.append({"role": "assistant", "content": reply})
                messages.extend(episode.step(reply).messages)
            seen = messages[-1]["content"].split()[-1]
            code = seen if rng.random() < accuracy else rng.choice([c for c in CODES if c != seen])
            messages.append({"role": "assistant", "content": f"submit {code}"})
            conversations.append(messages)
        return conversations

    @staticmethod
    def vocabulary() -> list[str]:
        """Every word the environment's messages and a perfect agent's replies use."""
        return [*COMMANDS, *PEOPLE, *ACCOUNT_IDS, *CODES, *MESSAGE_WORDS]


def solve(task: Mapping[str, Any]) -> list[str]:
    """The replies of a perfect agent, turn by turn (for tests and sanity checks)."""
    account = dict(zip(task["people"], task["account_ids"], strict=True))[task["person"]]
    code = dict(zip(task["account_ids"], task["codes"], strict=True))[account]
    return [f"find {task['person']}", "open", f"submit {code}"]
