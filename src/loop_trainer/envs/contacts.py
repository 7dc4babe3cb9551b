"""``contacts``: a look-it-up-through-calls task in plain English, sized for a small pretrained model.

Where :mod:`vault` is written in a few dozen words for models built from a config, ``contacts``
speaks the way an instruct model was trained to read: a contact book behind three tools,

1. ``search("<name>")`` -- the contacts whose name contains every word of the query, with their
   ids (several people share a first name, so a first-name search returns distractors). The
   ids a search returned are the ones ``get`` may open: server-side session state, as AppWorld's
   APIs need a login token;
2. ``get(<id>)``          -- one contact's card: phone number and city;
3. ``answer("<text>")``   -- the final answer, which ends the episode.

A task asks for one field of one person ("What is Maria Lopez's phone number?"), so solving it
takes three calls, and each call must copy a value out of an earlier message: the name out of the
task, the id out of the search result (the right one of several), the field out of the card.

A reply may say anything; the first tool call in it runs. Calls are read leniently (any case,
quotes optional, a trailing period ignored) because the task is looking things up, not spelling.
A reply without a call, or with a malformed one, gets an observation saying what is wrong.

Reward = fraction of four checks passed (AppWorld's training reward is the fraction of unit tests
passed): searched the book, a search found the person, opened the person's card, answered right.
``success`` is all four. ``field_check: true`` adds a fifth, ``answered_field`` (the answer is the
asked field's kind, copied right or not), so that choosing the field earns credit apart from
copying it: without it a miscopied phone number scores what the wrong field scores, and "always
answer the city" (easy to copy) outscores reading the question while the copying is shaky.
``remind_question: true`` ends the card with the question again ("The question was: ..."), where
the answer is chosen: SmolLM2-135M-Instruct otherwise answers whatever field the last example
answered, several examples and a tool result away from the question.

``examples: N`` puts N solved tasks (of other people) before the task as earlier chat turns: the
opening a small model needs to see the call format. With one example the model can score by
answering whatever field the example answered; with two (one phone, one city, in random order) it
has to read the question to choose the field.
"""

from __future__ import annotations

import difflib
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from datasets import Dataset

from .base import Environment, Episode, Message, Score, Step, check_pass_rates, refuse_unknown_split, success_and_reward

FIRST_NAMES = ("Maria", "James", "Anna", "David", "Sara", "John", "Laura", "Peter", "Emma", "Tom", "Lucy", "Mark")
LAST_NAMES = (
    "Lopez",
    "Chen",
    "Smith",
    "Brown",
    "Garcia",
    "Miller",
    "Wilson",
    "Moore",
    "Taylor",
    "Clark",
    "Hall",
    "Young",
    "King",
    "Wright",
    "Scott",
    "Green",
)
CITIES = ("Denver", "Boston", "Austin", "Chicago", "Seattle", "Miami", "Portland", "Dallas", "Phoenix", "Atlanta")
FIELDS = {"phone": "phone number", "city": "city"}
CHECKS = ("searched", "found_person", "opened_card", "answered")
# field_check's fifth check: the answer is the asked field's kind, copied right or not
FIELD_CHECK = "answered_field"
CHECKS_WITH_FIELD = (*CHECKS[:-1], FIELD_CHECK, CHECKS[-1])
SPLITS = ("train", "test")
SYSTEM_PROMPT = (
    "You answer questions about the user's contacts by calling tools, one call per reply.\n"
    'search("name") lists the contacts with that name and their ids.\n'
    "get(id) shows one contact's phone number and city.\n"
    'answer("text") gives your final answer.\n'
    "Reply with a single tool call and nothing else."
)
CALL = re.compile(r"\b(search|get|answer)\s*\(\s*(.*?)\s*\)", re.IGNORECASE | re.DOTALL)


def question(task: Mapping[str, Any]) -> str:
    return f"What is {task['person']}'s {FIELDS[task['field']]}?"


def _normalise(text: str) -> str:
    return " ".join(text.strip().strip("\"'").strip().rstrip(".").split()).lower()


class ContactsEpisode(Episode):
    def __init__(
        self,
        task: Mapping[str, Any],
        examples: Sequence[Mapping[str, Any]] = (),
        *,
        field_check: bool = False,
        remind_question: bool = False,
    ):
        self.task, self.remind_question = task, remind_question
        self.cards = {card["id"]: card for card in task["contacts"]}
        self.target = next(card for card in task["contacts"] if card["name"] == task["person"])
        self.examples = examples
        self.visible: set[str] = set()
        self.passed = dict.fromkeys(CHECKS_WITH_FIELD if field_check else CHECKS, False)
        self.answered_other_field = False

    def start(self) -> list[Message]:
        messages: list[Message] = [{"role": "system", "content": SYSTEM_PROMPT}]
        for example in self.examples:
            messages += solved_conversation(example, remind_question=self.remind_question)[1:]
        return messages + [{"role": "user", "content": question(self.task)}]

    def step(self, reply: str) -> Step:
        call = CALL.search(reply)
        if call is None:
            return Step(
                messages=[
                    {
                        "role": "user",
                        "content": 'No tool call found. Reply with one call: search("name"), get(id) '
                        'or answer("text").',
                    }
                ]
            )
        tool, argument = call.group(1).lower(), _normalise(call.group(2))
        if tool == "answer":
            self.passed["answered"] = argument == _normalise(self.target[self.task["field"]])
            self.answered_other_field = any(
                argument == _normalise(self.target[field]) for field in FIELDS if field != self.task["field"]
            )
            if FIELD_CHECK in self.passed:
                self.passed[FIELD_CHECK] = nearest_field(argument, self.target) == self.task["field"]
            return Step(done=True)
        observation = self._search(argument) if tool == "search" else self._get(argument)
        return Step(messages=[{"role": "user", "content": observation}])

    def _search(self, query: str) -> str:
        self.passed["searched"] = True
        words = query.split()
        if not words:
            return 'search needs a name, like search("Anna").'
        found = [card for card in self.task["contacts"] if all(word in card["name"].lower().split() for word in words)]
        if not found:
            return f"No contacts match {query!r}."
        self.visible.update(card["id"] for card in found)
        self.passed["found_person"] |= self.target in found
        listed = "; ".join(f"{card['name']} (id {card['id']})" for card in found)
        return f"{len(found)} contact{'s' if len(found) > 1 else ''}: {listed}"

    def _get(self, argument: str) -> str:
        contact_id = argument.removeprefix("id").strip().lstrip("#")
        if not contact_id.isdigit():
            return f"get needs a contact id (a number from a search result), like get(123); got {argument!r}."
        if contact_id not in self.visible:
            return f"No contact with id {contact_id} in your search results. Search first."
        card = self.cards[contact_id]
        self.passed["opened_card"] |= card is self.target
        shown = f"{card['name']} (id {card['id']}): phone {card['phone']}, city {card['city']}"
        return f"{shown}\nThe question was: {question(self.task)}" if self.remind_question else shown

    def score(self) -> Score:
        return Score(
            reward=sum(self.passed.values()) / len(self.passed),
            success=all(self.passed.values()),
            info={"checks": dict(self.passed), "answered_other_field": self.answered_other_field},
        )


def nearest_field(answer: str, card: Mapping[str, Any]) -> str | None:
    """The field of ``card`` whose value ``answer`` resembles most (character similarity), or None
    for an empty answer or a tie: a miscopied phone number ("484-4848" for 555-4848) still reads as
    a phone number, not a city."""
    if not answer:
        return None
    similarity = {field: difflib.SequenceMatcher(None, answer, _normalise(card[field])).ratio() for field in FIELDS}
    best = max(similarity.values())
    nearest = [field for field, value in similarity.items() if value == best]
    return nearest[0] if len(nearest) == 1 else None


def solved_conversation(task: Mapping[str, Any], *, remind_question: bool = False) -> list[Message]:
    """A perfect agent's conversation on ``task`` (the ``examples`` opening, tests, demonstrations)."""
    episode = ContactsEpisode(task, remind_question=remind_question)
    messages = episode.start()
    for reply in solve(task):
        messages.append({"role": "assistant", "content": reply})
        messages.extend(episode.step(reply).messages)
    return messages


def solve(task: Mapping[str, Any]) -> list[str]:
    """The replies of a perfect agent, turn by turn."""
    card = next(card for card in task["contacts"] if card["name"] == task["person"])
    return [f'search("{task["person"]}")', f"get({card['id']})", f'answer("{card[task["field"]]}")']


class ContactsEnv(Environment):
    """``num_tasks`` contact books per split, generated from ``seed``. Each book has
    ``contacts_per_task`` people, ``namesakes`` of whom share the asked-about person's first name.
    ``field_check`` adds a fifth check between opening the card and answering right,
    ``answered_field``: the answer is the asked field's kind (:func:`nearest_field`).
    ``remind_question`` ends every card ``get`` shows with the question again, next to the fields
    it asks to choose from."""

    name = "contacts"
    default_eval_split = "test"

    def __init__(
        self,
        num_tasks: int = 64,
        contacts_per_task: int = 6,
        namesakes: int = 2,
        examples: int = 1,
        seed: int = 0,
        field_check: bool = False,
        remind_question: bool = False,
    ):
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"contacts: num_tasks (environment_kwargs) must be an integer >= 1, got {num_tasks!r}")
        if not 0 <= namesakes < contacts_per_task <= len(LAST_NAMES):
            raise ValueError(
                "contacts: environment_kwargs need 0 <= namesakes < contacts_per_task <= "
                f"{len(LAST_NAMES)}, got namesakes={namesakes!r}, contacts_per_task={contacts_per_task!r}"
            )
        if isinstance(examples, bool) or not isinstance(examples, int) or examples < 0:
            raise ValueError(f"contacts: examples (environment_kwargs) must be an integer >= 0, got {examples!r}")
        for key, value in (("field_check", field_check), ("remind_question", remind_question)):
            if not isinstance(value, bool):
                raise ValueError(f"contacts: {key} (environment_kwargs) must be true or false, got {value!r}")
        self.field_check, self.remind_question = field_check, remind_question
        self.num_tasks, self.contacts_per_task, self.namesakes = num_tasks, contacts_per_task, namesakes
        self.examples, self.seed = examples, seed

    def tasks(self, split: str = "train") -> Dataset:
        refuse_unknown_split("contacts", split, SPLITS)
        rng = random.Random(f"contacts-{self.seed}-{split}")
        rows = []
        for index in range(self.num_tasks):
            row = {"task_id": f"{split}-{index:04d}", **self._book(rng)}
            if self.examples:
                # every field is shown before any repeats, in a random order
                fields = rng.sample(sorted(FIELDS), len(FIELDS))
                row["examples"] = [self._book(rng, fields[i % len(fields)]) for i in range(self.examples)]
            rows.append(row)
        return Dataset.from_list(rows)

    def _book(self, rng: random.Random, field: str | None = None) -> dict[str, Any]:
        first = rng.choice(FIRST_NAMES)
        last_names = rng.sample(LAST_NAMES, self.contacts_per_task)
        others = [name for name in FIRST_NAMES if name != first]
        firsts = [first] * (self.namesakes + 1) + [
            rng.choice(others) for _ in range(self.contacts_per_task - self.namesakes - 1)
        ]
        ids = rng.sample(range(100, 1000), self.contacts_per_task)
        contacts = [
            {
                "id": str(i),
                "name": f"{f} {last}",
                "phone": f"555-{rng.randrange(10000):04d}",
                "city": rng.choice(CITIES),
            }
            for i, f, last in zip(ids, firsts, last_names, strict=True)
        ]
        rng.shuffle(contacts)
        person = f"{first} {last_names[0]}"
        return {"person": person, "field": field or rng.choice(sorted(FIELDS)), "contacts": contacts}

    def episode(self, task: Mapping[str, Any]) -> ContactsEpisode:
        return ContactsEpisode(
            task, task.get("examples") or (), field_check=self.field_check, remind_question=self.remind_question
        )

    def summarize(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Success rate and mean reward, plus how often each check passed (``passed_opened_card``
        ...): which step the agent gets wrong. Failed rollouts passed none. ``answered_other_field``:
        how often the answer was the person's *other* field (a city for a phone question): the
        policy found the card but did not read which field the question asks for."""
        other = sum(bool((row.get("info") or {}).get("answered_other_field")) for row in rows)
        return {
            **success_and_reward(rows),
            **check_pass_rates(rows, CHECKS_WITH_FIELD if self.field_check else CHECKS),
            "answered_other_field": other / len(rows) if rows else float("nan"),
        }
