"""``errands``: a long-horizon world, AppWorld in miniature: errands across five small apps.

Each task has its own world (people with accounts and phones, a shop with items, skus and
prices, order numbers the shop hands out) and asks for a list of errands, e.g.
``pay bob ; text cat ; send tea to dan``. Each errand takes two to four dependent calls across
the apps, and later calls take arguments that only earlier results reveal:

==========================  =========================================================  =====
errand                      calls (``<x>``: a value an earlier result revealed)        calls
==========================  =========================================================  =====
``pay <name>``              ``find <name>`` -> ``bill <account>`` -> ``pay <account> <amount>``  3
``text <name>``             ``find <name>`` -> ``phone <account>`` -> ``text <phone>``   3
``refund <name> <item>``    ``item <item>`` -> ``find <name>`` -> ``pay <account> <price>``  3
``send <item> to <name>``   ``item <item>`` -> ``buy <sku>`` -> ``find <name>`` -> ``ship <order> <account>``  4
==========================  =========================================================  =====

then ``done`` ends the episode. ``doc <app>`` shows an app's calls (``people``, ``shop``,
``bank``, ``msg``, ``post``), as AppWorld's agent looks API docs up. Three levels by the calls a
task needs, ``done`` included: 1 = 10-13, 2 = 14-19, 3 = 20-30.

Grading is by the world's final state, as AppWorld's tests are: one check per errand (its effect
happened: the right account paid the right amount, the right phone texted, an order of the right
item shipped to the right account), ``no_stray_effects`` (nothing was paid, texted, bought or
shipped that no errand asked for: AppWorld's collateral-damage tests) and ``finished`` (the
agent said ``done``). ``success`` = all of them (AppWorld's TGC). The reward is the errands
done, less a quarter for each stray effect, over the number of errands, halved if the agent never
said ``done`` (and never below 0): doing nothing earns nothing. Counting the last two checks as
passed tests, AppWorld's way, paid 2/(n+2) for saying ``done`` at once, more than a warm-started
agent's honest, error-prone attempts earned; LOOP found that in 12 iterations and every group tied.

Two forms of the same worlds and tasks, as ``vault``/``contacts``:

* ``form: compact`` -- a few hundred words and one-line results, for the models built from a
  config (``tiny:errands``, ``tiny-instruct:errands``); a level-3 trajectory is a few hundred
  tokens.
* ``form: english`` -- plain English for a small pretrained model: a system prompt that documents
  every call, calls written as ``find("Bob")``, results as short records; trajectories of 2-8k
  tokens in a BPE tokenizer.

A reply may say anything; its first call runs (one call per turn).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from datasets import Dataset

from .base import Environment, Episode, Message, Score, Step, refuse_unknown_split, success_and_reward

NAMES = ("ann", "bob", "cat", "dan", "eve", "fay", "gus", "hal", "ivy", "jon", "kim", "lee")
ITEMS = ("tea", "jam", "soap", "rice", "milk", "salt", "bread", "eggs")
NUM_IDS = 20  # per kind: accounts k0.., phones p0.., skus s0.., orders o0..
AMOUNTS = tuple(str(n) for n in range(1, 10))
APPS = {
    "people": ("find", "phone"),
    "shop": ("item", "buy"),
    "bank": ("bill", "pay"),
    "msg": ("text",),
    "post": ("ship",),
}
COMMANDS = (*(command for calls in APPS.values() for command in calls), "doc", "done")
ERRANDS = {"pay": 3, "text": 3, "refund": 3, "send": 4}
LEVELS = {1: (10, 13), 2: (14, 19), 3: (20, 30)}
SPLITS = ("train", "test")
FORMS = ("compact", "english")
STRAY = "no_stray_effects"
STRAY_PENALTY = 0.25
FINISHED = "finished"
MESSAGE_WORDS = (
    *APPS,
    *("id", "phone", "sku", "price", "order", "sent", "paid", "shipped", "to", "apps", ";", ":", "no", "such"),
    *("person", "item", "account", "command", "bad", "name", "n", "app"),
)
COMPACT_SYSTEM = "apps : people shop bank msg post ; doc app ; done"
ENGLISH_SYSTEM = (
    "You are an assistant that runs errands for the user through five apps. Call one function per reply; "
    "each reply's first call runs and its result comes back to you.\n"
    "\n"
    "people app:\n"
    '  find("name") -> the person\'s account id, e.g. find("Bob")\n'
    '  phone("account id") -> the phone number on that account, e.g. phone("AC-4182")\n'
    "shop app:\n"
    '  item("item name") -> the item\'s sku and price, e.g. item("tea")\n'
    '  buy("sku") -> buys one and returns the order number, e.g. buy("SKU-311")\n'
    "bank app:\n"
    '  bill("account id") -> the amount the user owes that account, e.g. bill("AC-4182")\n'
    '  pay("account id", amount) -> sends that many dollars to the account, e.g. pay("AC-4182", 5)\n'
    "msg app:\n"
    '  text("phone number") -> sends the user\'s message to that phone, e.g. text("555-0142")\n'
    "post app:\n"
    '  ship("order number", "account id") -> ships an order to the account\'s address, '
    'e.g. ship("ORD-7720", "AC-4182")\n'
    'doc("app") shows an app\'s calls again. done() reports that every errand is finished and ends the task.\n'
    "\n"
    'Errands: "pay NAME" means pay that person\'s bill. "text NAME" means text that person\'s phone. '
    '"refund NAME ITEM" means pay that person the item\'s price. "send ITEM to NAME" means buy the item and '
    "ship the order to that person. Do only what the errands ask: every payment, text, purchase and shipment "
    "is real."
)


@dataclass(frozen=True)
class Call:
    command: str
    arguments: tuple[str, ...]


def compact_errand(errand: Sequence[str]) -> str:
    kind, *rest = errand
    if kind == "send":
        return f"send {rest[0]} to {rest[1]}"
    return " ".join(errand)


def english_errand(errand: Sequence[str]) -> str:
    kind, *rest = errand
    if kind == "pay":
        return f"pay {rest[0].title()}"
    if kind == "text":
        return f"text {rest[0].title()}"
    if kind == "refund":
        return f"refund {rest[0].title()} {rest[1]}"
    return f"send {rest[0]} to {rest[1].title()}"


class World:
    """One task's apps and the effects the agent's calls had on them."""

    def __init__(self, task: Mapping[str, Any]):
        self.accounts: dict[str, str] = dict(zip(task["names"], task["accounts"], strict=True))
        self.phones: dict[str, str] = dict(zip(task["accounts"], task["phones"], strict=True))
        self.bills: dict[str, str] = dict(zip(task["accounts"], task["bills"], strict=True))
        self.skus: dict[str, str] = dict(zip(task["items"], task["skus"], strict=True))
        self.prices: dict[str, str] = dict(zip(task["skus"], task["prices"], strict=True))
        self.order_pool: list[str] = list(task["orders"])
        self.orders: dict[str, str] = {}  # order -> sku
        self.payments: Counter[tuple[str, str]] = Counter()
        self.texts: Counter[str] = Counter()
        self.shipments: Counter[tuple[str, str]] = Counter()
        self.finished = False

    def run(self, call: Call) -> tuple[str, tuple[str, ...]]:
        """Run ``call``: (the result's kind, its values), rendered by the episode's form."""
        command, args = call.command, call.arguments
        first = args[0] if args else ""
        if command == "doc":
            return ("doc", (first,)) if first in APPS else ("no_app", (first,))
        if command == "find":
            return ("account", (first, self.accounts[first])) if first in self.accounts else ("no_person", (first,))
        if command == "bill":
            return ("bill", (first, self.bills[first])) if first in self.bills else ("no_account", (first,))
        if command == "phone":
            return ("phone", (first, self.phones[first])) if first in self.phones else ("no_account", (first,))
        if command == "item":
            if first not in self.skus:
                return ("no_item", (first,))
            return ("item", (first, self.skus[first], self.prices[self.skus[first]]))
        if command == "buy":
            if first not in self.prices:
                return ("no_sku", (first,))
            if not self.order_pool:
                return ("sold_out", ())
            order = self.order_pool.pop(0)
            self.orders[order] = first
            return ("order", (order,))
        if command == "pay":
            amount = args[1] if len(args) > 1 else ""
            if first not in self.phones:
                return ("no_account", (first,))
            if amount not in AMOUNTS:
                return ("bad_amount", (amount,))
            self.payments[(first, amount)] += 1
            return ("paid", (first, amount))
        if command == "text":
            if first not in self.phones.values():
                return ("no_phone", (first,))
            self.texts[first] += 1
            return ("sent", (first,))
        if command == "ship":
            account = args[1] if len(args) > 1 else ""
            if first not in self.orders:
                return ("no_order", (first,))
            if account not in self.phones:
                return ("no_account", (account,))
            if any(order == first for order, _ in self.shipments):
                return ("shipped_already", (first,))
            self.shipments[(first, account)] += 1
            return ("shipped", (first, account))
        raise AssertionError(command)

    def grade(self, errands: Sequence[Sequence[str]]) -> tuple[dict[str, bool], int]:
        """One check per errand, then ``no_stray_effects`` and ``finished``; and the number of
        stray effects."""
        payments, texts = Counter(self.payments), Counter(self.texts)
        shipped = Counter((self.orders[order], account) for order, account in self.shipments.elements())
        bought = Counter(self.orders.values())
        checks: dict[str, bool] = {}
        for index, errand in enumerate(errands):
            kind, *rest = errand
            if kind == "pay":
                wanted: Counter[Any] = payments
                key: Any = (self.accounts[rest[0]], self.bills[self.accounts[rest[0]]])
            elif kind == "refund":
                wanted, key = payments, (self.accounts[rest[0]], self.prices[self.skus[rest[1]]])
            elif kind == "text":
                wanted, key = texts, self.phones[self.accounts[rest[0]]]
            else:
                wanted, key = shipped, (self.skus[rest[0]], self.accounts[rest[1]])
                if bought[key[0]] > 0:
                    bought[key[0]] -= 1
            checks[f"{index}_{kind}"] = wanted[key] > 0
            if wanted[key] > 0:
                wanted[key] -= 1
        stray = sum(payments.values()) + sum(texts.values()) + sum(shipped.values()) + sum(bought.values())
        checks[STRAY] = stray == 0
        checks[FINISHED] = self.finished
        return checks, stray


COMPACT_RESULTS: dict[str, Callable[..., str]] = {
    "doc": lambda app: f"{app} : {' ; '.join(APPS[app])}",
    "account": lambda name, account: f"{name} id {account}",
    "phone": lambda account, phone: f"{account} phone {phone}",
    "bill": lambda account, amount: f"{account} bill {amount}",
    "item": lambda item, sku, price: f"{item} sku {sku} price {price}",
    "order": lambda order: f"order {order}",
    "paid": lambda account, amount: f"paid {account} {amount}",
    "sent": lambda phone: f"sent {phone}",
    "shipped": lambda order, account: f"shipped {order} to {account}",
    "no_app": lambda app: "no such app",
    "no_person": lambda name: "no such person",
    "no_account": lambda account: "bad account",
    "no_item": lambda item: "no such item",
    "no_sku": lambda sku: "bad sku",
    "no_phone": lambda phone: "bad phone",
    "no_order": lambda order: "bad order",
    "sold_out": lambda: "no order",
    "bad_amount": lambda amount: "bad n",
    "shipped_already": lambda order: "bad order",
}


class CompactForm:
    """Words for the tiny models: ``find bob`` -> ``bob id k3``."""

    def system(self) -> str:
        return COMPACT_SYSTEM

    def task(self, errands: Sequence[Sequence[str]]) -> str:
        return " ; ".join(compact_errand(errand) for errand in errands)

    def parse(self, reply: str) -> Call | None:
        words = reply.split()
        position = next((i for i, word in enumerate(words) if word in COMMANDS), None)
        if position is None:
            return None
        return Call(words[position], tuple(words[position + 1 : position + 3]))

    def call(self, call: Call) -> str:
        return " ".join((call.command, *call.arguments))

    def result(self, kind: str, values: tuple[str, ...]) -> str:
        return COMPACT_RESULTS[kind](*values)

    def no_call(self) -> str:
        return "no command"


ENGLISH_RESULTS = {
    "account": "Person: {0}\nAccount id: {1}\nStatus: active\n"
    "Note: use the account id, not the name, with phone(), pay() and ship().",
    "phone": "Account: {0}\nPhone number: {1}\nVerified: yes",
    "bill": "Account: {0}\nAmount owed: {1} dollars\nNote: pay() takes the account id and this amount.",
    "item": "Item: {0}\nSku: {1}\nPrice: {2} dollars\nIn stock: yes\nNote: buy() takes the sku.",
    "order": "Order placed.\nOrder number: {0}\nStatus: waiting to ship\nNote: ship() takes this order number.",
    "paid": "Payment sent.\nTo account: {0}\nAmount: {1} dollars",
    "sent": "Message delivered.\nTo phone: {0}",
    "shipped": "Shipment booked.\nOrder: {0}\nTo account: {1}",
    "no_app": 'Error: there is no app "{0}". The apps are people, shop, bank, msg and post.',
    "no_person": 'Error: no person named "{0}" in your contacts.',
    "no_account": 'Error: "{0}" is not an account id. Account ids look like AC-4182 and come from find().',
    "no_item": 'Error: the shop has no item "{0}".',
    "no_sku": 'Error: "{0}" is not a sku. Skus look like SKU-311 and come from item().',
    "no_phone": 'Error: "{0}" is not a phone number on any account. Phone numbers come from phone().',
    "no_order": 'Error: "{0}" is not one of your orders. Order numbers come from buy().',
    "sold_out": "Error: the shop cannot take more orders today.",
    "bad_amount": 'Error: "{0}" is not an amount. Amounts are whole dollars from 1 to 9.',
    "shipped_already": "Error: order {0} has already been shipped.",
}
DETAILS = {
    "account": ("Email", "Address", "Member since", "Recent activity"),
    "phone": ("Carrier", "Last used"),
    "bill": ("Due", "Reference"),
    "item": ("Category", "Description", "Rating"),
    "order": ("Estimated dispatch",),
    "paid": ("Reference",),
    "shipped": ("Carrier", "Tracking number", "Estimated delivery"),
}
STREETS = ("Oak", "Maple", "Cedar", "Pine", "Elm", "Birch", "Willow", "Lake", "Hill", "Park")
CITIES = ("Denver", "Boston", "Austin", "Chicago", "Seattle", "Miami", "Portland", "Dallas")
DOMAINS = ("mail.test", "post.test", "inbox.test")
CARRIERS = ("Northline", "Bluewave", "Swift Post", "Cargo One")
CATEGORIES = ("pantry", "household", "dairy", "bakery")
DESCRIPTIONS = (
    "A customer favourite, restocked every week and packed in recyclable paper.",
    "Sourced from small farms; the price includes local delivery within the city.",
    "Our own brand, in the standard size. Limit of five per order on busy days.",
    "Imported; quality checked on arrival. Store in a cool, dry place once opened.",
)
ENGLISH_CALL = re.compile(r"\b(" + "|".join(COMMANDS) + r")\s*\(([^)]*)\)", re.IGNORECASE)


class EnglishForm:
    """Plain English over the same world: ids become ``AC-4182``, ``SKU-311``, ``555-0142``, ``ORD-7720``
    (fixed per task), names capitalised, results as short records."""

    def __init__(self, task: Mapping[str, Any]):
        rng = random.Random(f"english-{task['task_id']}")
        self.outward: dict[str, str] = {}
        for prefix, template in (("k", "AC-{}"), ("p", "555-0{}"), ("s", "SKU-{}"), ("o", "ORD-{}")):
            numbers = rng.sample(range(100, 1000), NUM_IDS)
            for index in range(NUM_IDS):
                self.outward[f"{prefix}{index}"] = template.format(numbers[index])
        self.inward = {value.lower(): key for key, value in self.outward.items()}
        self.seed = task["task_id"]

    def system(self) -> str:
        return ENGLISH_SYSTEM

    def task(self, errands: Sequence[Sequence[str]]) -> str:
        listed = "\n".join(f"{n}. {english_errand(errand)}" for n, errand in enumerate(errands, 1))
        return f"Please run these errands, in any order, then call done():\n{listed}"

    def parse(self, reply: str) -> Call | None:
        match = ENGLISH_CALL.search(reply)
        if match is None:
            return None
        arguments = [part.strip().strip("\"'").strip().lower() for part in match.group(2).split(",")]
        inward = tuple(self.inward.get(argument, argument) for argument in arguments if argument)
        return Call(match.group(1).lower(), inward[:2])

    def call(self, call: Call) -> str:
        arguments = [self._show(value) for value in call.arguments]
        quoted = [value if value.isdigit() else f'"{value}"' for value in arguments]
        return f"{call.command}({', '.join(quoted)})"

    def _show(self, value: str) -> str:
        if value in self.outward:
            return self.outward[value]
        return value.title() if value in NAMES else value

    def result(self, kind: str, values: tuple[str, ...]) -> str:
        shown = [self._show(value) for value in values]
        if kind == "doc":
            app = values[0]
            lines = [line for line in ENGLISH_SYSTEM.splitlines() if line.strip().startswith(APPS[app])]
            return f"{app} app:\n" + "\n".join(line.strip() for line in lines)
        text = ENGLISH_RESULTS[kind].format(*shown)
        return f"{text}\n{self._details(kind, values)}" if kind in DETAILS else text

    def _details(self, kind: str, values: tuple[str, ...]) -> str:
        """The rest of the record an app returns, as real APIs return more than the field asked
        for: fixed per task and value, and never needed."""
        rng = random.Random(f"{self.seed}-{kind}-{'-'.join(values)}")
        fields = {
            "Email": f"{values[0]}.{rng.choice(STREETS).lower()}@{rng.choice(DOMAINS)}",
            "Address": f"{rng.randrange(1, 200)} {rng.choice(STREETS)} Street, {rng.choice(CITIES)}",
            "Member since": str(rng.randrange(2009, 2026)),
            "Recent activity": f"{rng.randrange(10)} payments and {rng.randrange(5)} deliveries in the last 30 days",
            "Carrier": rng.choice(CARRIERS),
            "Due": f"in {rng.randrange(2, 15)} days",
            "Last used": f"{rng.randrange(2, 29)} days ago",
            "Category": rng.choice(CATEGORIES),
            "Description": rng.choice(DESCRIPTIONS),
            "Rating": f"{rng.randrange(30, 50) / 10:.1f} out of 5 from {rng.randrange(10, 900)} reviews",
            "Estimated dispatch": f"{rng.randrange(2, 5)} business days",
            "Reference": f"TX-{rng.randrange(100000, 999999)}",
            "Tracking number": f"TRK{rng.randrange(10**7, 10**8)}",
            "Estimated delivery": f"{rng.randrange(2, 8)} days",
        }
        return "\n".join(f"{name}: {fields[name]}" for name in DETAILS[kind])

    def no_call(self) -> str:
        return (
            'No function call found. Reply with one call, such as find("Bob"), or done() when every errand is finished.'
        )


class ErrandsEpisode(Episode):
    def __init__(self, task: Mapping[str, Any], form: str):
        self.task = task
        self.errands = [tuple(errand) for errand in task["errands"]]
        self.world = World(task)
        self.form: CompactForm | EnglishForm = CompactForm() if form == "compact" else EnglishForm(task)
        self.calls = 0

    def start(self) -> list[Message]:
        return [
            {"role": "system", "content": self.form.system()},
            {"role": "user", "content": self.form.task(self.errands)},
        ]

    def step(self, reply: str) -> Step:
        call = self.form.parse(reply)
        if call is None:
            return Step(messages=[{"role": "user", "content": self.form.no_call()}])
        self.calls += 1
        if call.command == "done":
            self.world.finished = True
            return Step(done=True)
        kind, values = self.world.run(call)
        return Step(messages=[{"role": "user", "content": self.form.result(kind, values)}])

    def score(self) -> Score:
        """See the module docstring: errands done less a quarter per stray effect, over the errands;
        halved without ``done``; never below 0."""
        checks, stray = self.world.grade(self.errands)
        done = sum(checks[name] for name in checks if name[0].isdigit())
        reward = max(0.0, done - STRAY_PENALTY * stray) / len(self.errands) * (1.0 if checks[FINISHED] else 0.5)
        return Score(
            reward=reward,
            success=all(checks.values()),
            info={"checks": checks, "stray_effects": stray, "level": self.task["level"], "calls": self.calls},
        )


def solution(task: Mapping[str, Any]) -> list[Call]:
    """A perfect agent's calls, errand by errand, then ``done``."""
    world = World(task)
    calls: list[Call] = []
    for kind, *rest in task["errands"]:
        if kind == "pay":
            account = world.accounts[rest[0]]
            calls += [Call("find", (rest[0],)), Call("bill", (account,)), Call("pay", (account, world.bills[account]))]
        elif kind == "text":
            account = world.accounts[rest[0]]
            calls += [Call("find", (rest[0],)), Call("phone", (account,)), Call("text", (world.phones[account],))]
        elif kind == "refund":
            sku = world.skus[rest[1]]
            calls += [
                Call("item", (rest[1],)),
                Call("find", (rest[0],)),
                Call("pay", (world.accounts[rest[0]], world.prices[sku])),
            ]
        else:
            sku = world.skus[rest[0]]
            order = world.order_pool.pop(0)
            calls += [
                Call("item", (rest[0],)),
                Call("buy", (sku,)),
                Call("find", (rest[1],)),
                Call("ship", (order, world.accounts[rest[1]])),
            ]
    return [*calls, Call("done", ())]


def solve(task: Mapping[str, Any], form: str = "compact") -> list[str]:
    """The replies of a perfect agent, turn by turn, in ``form``."""
    renderer = CompactForm() if form == "compact" else EnglishForm(task)
    return [renderer.call(call) for call in solution(task)]


class ErrandsEnv(Environment):
    """``num_tasks`` worlds per split and level, generated from ``seed`` (train and test worlds and
    tasks are drawn apart). ``levels`` picks the difficulties (1, 2, 3: 10-13, 14-19, 20-30 calls);
    ``form`` is ``compact`` (tiny models) or ``english`` (pretrained ones)."""

    name = "errands"
    default_eval_split = "test"
    warm_up_success = 0.8  # the cliff: greedy 0.00-0.17 below reply accuracy 0.89, 0.97 at 0.91 (docs/long-horizon.md)
    # level 3 binds each call to its place in a task line of 6-7 errands, look-ups on look-ups: with 2 layers
    # LOOP ended at 0.57-0.59 held out at T = 1 on seeds 0 and 3, with 4 at 0.78 and 0.62 (seed 2: 0.77)
    tiny_layers = 4

    def __init__(
        self,
        num_tasks: int = 64,
        levels: Sequence[int] = (1, 2, 3),
        form: str = "compact",
        people_per_task: int = 6,
        items_per_task: int = 4,
        seed: int = 0,
    ):
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"errands: num_tasks (environment_kwargs) must be an integer >= 1, got {num_tasks!r}")
        levels = [levels] if isinstance(levels, int) else list(levels)
        if not levels or any(level not in LEVELS for level in levels):
            raise ValueError(f"errands: levels (environment_kwargs) must be a list of 1, 2 and 3, got {levels!r}")
        if form not in FORMS:
            raise ValueError(f"errands: form (environment_kwargs) must be 'compact' or 'english', got {form!r}")
        if not 2 <= people_per_task <= len(NAMES) or not 2 <= items_per_task <= len(ITEMS):
            raise ValueError(
                f"errands: people_per_task must be 2..{len(NAMES)} and items_per_task 2..{len(ITEMS)} "
                f"(environment_kwargs), got {people_per_task!r} and {items_per_task!r}"
            )
        self.num_tasks, self.levels, self.form = num_tasks, sorted(set(levels)), form
        self.people_per_task, self.items_per_task, self.seed = people_per_task, items_per_task, seed

    def tasks(self, split: str = "train") -> Dataset:
        refuse_unknown_split("errands", split, SPLITS)
        rng = random.Random(f"errands-{self.seed}-{split}")
        rows = [
            self._task(rng, f"{split}-{level}-{index:04d}", level)
            for index in range(self.num_tasks)
            for level in self.levels
        ]
        return Dataset.from_list(rows)

    def _task(self, rng: random.Random, task_id: str, level: int) -> dict[str, Any]:
        names = rng.sample(NAMES, self.people_per_task)
        items = rng.sample(ITEMS, self.items_per_task)
        low, high = LEVELS[level]
        while True:
            errands: list[list[str]] = []
            calls = 1  # done
            while calls < low:
                kind = rng.choice(sorted(ERRANDS))
                if kind == "pay":
                    errand = ["pay", rng.choice(names)]
                elif kind == "text":
                    errand = ["text", rng.choice(names)]
                elif kind == "refund":
                    errand = ["refund", rng.choice(names), rng.choice(items)]
                else:
                    errand = ["send", rng.choice(items), rng.choice(names)]
                # one payment per person (pay or refund): two would differ only by their place in the list
                paid = {other[1] for other in errands if other[0] in ("pay", "refund")}
                if errand not in errands and not (kind in ("pay", "refund") and errand[1] in paid):
                    errands.append(errand)
                    calls += ERRANDS[kind]
            if calls <= high:
                break
        return {
            "task_id": task_id,
            "level": level,
            "errands": errands,
            "names": names,
            "accounts": [f"k{i}" for i in rng.sample(range(NUM_IDS), len(names))],
            "phones": [f"p{i}" for i in rng.sample(range(NUM_IDS), len(names))],
            "bills": [rng.choice(AMOUNTS) for _ in names],
            "items": items,
            "skus": [f"s{i}" for i in rng.sample(range(NUM_IDS), len(items))],
            "prices": [rng.choice(AMOUNTS) for _ in items],
            "orders": [f"o{i}" for i in rng.sample(range(NUM_IDS), NUM_IDS)],
        }

    def episode(self, task: Mapping[str, Any]) -> ErrandsEpisode:
        return ErrandsEpisode(task, self.form)

    def summarize(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Success rate and mean reward overall and per level (``success_rate_level_2`` ...),
        the pass rate of each kind of check (``passed_pay``, ``passed_no_stray_effects`` ...) and
        the mean number of calls."""
        summary = success_and_reward(rows)
        for level in self.levels:
            at_level = [row for row in rows if (row.get("info") or {}).get("level", _level_of(row)) == level]
            for key, value in success_and_reward(at_level).items():
                summary[f"{key}_level_{level}"] = value
        passed: Counter[str] = Counter()
        seen: Counter[str] = Counter()
        for row in rows:
            for name, ok in ((row.get("info") or {}).get("checks") or {}).items():
                kind = name.split("_", 1)[1] if name[0].isdigit() else name
                seen[kind] += 1
                passed[kind] += bool(ok)
        for kind in sorted(seen):
            summary[f"passed_{kind}"] = passed[kind] / seen[kind]
        completed = [row for row in rows if row["status"] == "completed"]
        summary["calls_mean"] = (
            sum((row.get("info") or {}).get("calls", 0) for row in completed) / len(completed)
            if completed
            else float("nan")
        )
        return summary

    def demonstration_tasks(self, num_conversations: int, seed: int = 0) -> list[dict[str, Any]]:
        """The worlds :meth:`demonstrations` plays: one fresh world per conversation, at the
        environment's levels in turn, drawn apart from the train and test splits. Cycling the train
        split's worlds instead (192 of them under the recipe) let a warm-up memorise each world's
        answers, loss far below the demonstrations' own noise, instead of learning to copy them
        (seed 0: held-out accuracy 0.83 on the same worlds, greedy held-out success 0.00)."""
        return [
            self._task(
                random.Random(f"errands-{self.seed}-demonstrations-{seed}-{index}"),
                f"demonstration-{seed}-{index}",
                self.levels[index % len(self.levels)],
            )
            for index in range(num_conversations)
        ]

    def demonstrations(
        self, num_conversations: int, accuracy: float = 0.8, seed: int = 0, reading_accuracy: float = 1.0
    ) -> list[list[Message]]:
        """Conversations of an agent that knows every errand's calls but is unreliable: each value
        it copies out of a result (an id, phone, sku, order or amount) is right with probability
        ``accuracy`` and another of its kind otherwise; before an app's first use
        it looks its doc up one time in five. Each plays a real episode of its own world
        (:meth:`demonstration_tasks`), so a wrong value's consequences are what the world answers.

        ``reading_accuracy``: how often the person or item it reads off the task line (the errand to do next) is
        the right one. Always, by default: the task line is the one thing a model must read in two steps (find the
        errand just finished, take the one after it), and a demonstrator that read it wrong one time in five, or
        in ten, taught a 2-layer model to find a name an earlier errand used: seeds 0 and 3 copied every result
        right and named the next errand's person right 0.71-0.88 of the time, greedy success 0.1-0.3 after 2,400
        steps. Read always right, their greedy success was 0.42-0.56 by step 1,700 (docs/long-horizon.md). The
        values copied out of results stay noisy, so that the warm start, sampling, still gets some wrong."""
        rng = random.Random(seed)
        conversations = []
        for task in self.demonstration_tasks(num_conversations, seed):
            episode = self.episode(task)
            messages = episode.start()
            used: set[str] = set()
            for call in self._unreliable_calls(task, rng, accuracy, reading_accuracy):
                app = next((app for app, calls in APPS.items() if call.command in calls), None)
                if app is not None and app not in used:
                    used.add(app)
                    if rng.random() < 0.2:
                        messages += self._turn(episode, Call("doc", (app,)))
                messages += self._turn(episode, call)
            conversations.append(messages)
        return conversations

    @staticmethod
    def _turn(episode: ErrandsEpisode, call: Call) -> list[Message]:
        reply = episode.form.call(call)
        return [{"role": "assistant", "content": reply}, *episode.step(reply).messages]

    def _unreliable_calls(
        self, task: Mapping[str, Any], rng: random.Random, accuracy: float, reading_accuracy: float
    ) -> Iterator[Call]:
        """The perfect calls with each value copied out of a result replaced, with probability 1 - ``accuracy``
        (a person or item read off the task line: 1 - ``reading_accuracy``), by another value of its kind that this
        world has (another person, another account it showed, ...): the mistakes an LLM makes reading the wrong
        line, which keep the episode going. Later calls copy from what the world actually answered."""
        world = World(task)

        def noisy(value: str, pool: Sequence[str], right: float = accuracy) -> str:
            others = [other for other in pool if other != value]
            return value if rng.random() < right or not others else rng.choice(others)

        names, items = list(task["names"]), list(task["items"])
        accounts, phones, skus = list(task["accounts"]), list(task["phones"]), list(task["skus"])
        shipped: set[str] = set()
        for kind, *rest in task["errands"]:
            if kind == "send":
                item = noisy(rest[0], items, reading_accuracy)
                yield Call("item", (item,))
                sku = noisy(world.skus[item], skus)
                order = world.run(Call("buy", (sku,)))[1][0]  # the order the episode's world hands out
                yield Call("buy", (sku,))
                name = noisy(rest[1], names, reading_accuracy)
                yield Call("find", (name,))
                waiting = [bought for bought in world.orders if bought not in shipped]
                chosen = noisy(order, waiting)
                shipped.add(chosen)
                yield Call("ship", (chosen, noisy(world.accounts[name], accounts)))
                continue
            price = ""
            if kind == "refund":
                item = noisy(rest[1], items, reading_accuracy)
                yield Call("item", (item,))
                price = world.prices[world.skus[item]]
            name = noisy(rest[0], names, reading_accuracy)
            yield Call("find", (name,))
            account = noisy(world.accounts[name], accounts)
            if kind == "text":
                yield Call("phone", (account,))
                yield Call("text", (noisy(world.phones[account], phones),))
                continue
            if kind == "pay":  # the amount comes from the bill of the account it looked up
                yield Call("bill", (account,))
                price = world.bills[account]
                account = noisy(account, accounts)
            yield Call("pay", (account, noisy(price, AMOUNTS)))
        yield Call("done", ())

    @staticmethod
    def vocabulary() -> list[str]:
        """Every word of the compact form's messages and of a perfect agent's replies."""
        ids = [f"{prefix}{i}" for prefix in "kpso" for i in range(NUM_IDS)]
        return [*COMMANDS, *NAMES, *ITEMS, *AMOUNTS, *ids, *ERRANDS, *MESSAGE_WORDS]


def _level_of(row: Mapping[str, Any]) -> int | None:
    parts = str(row.get("task_id", "")).split("-")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
