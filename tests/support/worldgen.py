"""Build a small synthetic AppWorld-format world, offline, with AppWorld's own code.

Run it as a file under the AppWorld venv's python (it imports ``appworld``; the main
``loop_trainer`` package never imports it, and it imports nothing from ``loop_trainer``)::

    .appworld-venv/bin/python tests/support/worldgen.py --root DIR

It writes ``DIR/data`` (api_docs, base_dbs, tasks/<id>/{specs.json,dbs,ground_truth}, datasets)
so that ``APPWORLD_ROOT=DIR`` works for ``appworld.AppWorld``, the environment server
(``appworld.serve.environment:app``) and ``appworld evaluate <experiment> <split>``, plus
``DIR/synthetic_solutions.json`` (not AppWorld format; for our tests): per task, code that solves
it through ``apis`` as an agent would, and the fraction of tests a do-nothing agent passes.

The world: one supervisor with Simple Note and Phone accounts, eight people in the phone
contacts, and per task its own notes and text messages (saved as changes against base_dbs).
Five scenarios (generators), 2-3 tasks each, difficulties 1-3, answer and state-change tasks.
Everything is seeded and time-frozen, so every build writes the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from datetime import datetime, timedelta
from textwrap import dedent

TASK_DATETIME = datetime(2023, 5, 18, 12, 0, 0)
SUPERVISOR = {
    "first_name": "Avery",
    "last_name": "Quinn",
    "email": "avery.quinn@example.com",
    "phone_number": "5550100100",
    "birthday": "1990-04-12",
    "sex": "female",
}
PASSWORDS = {"simple_note": "note-pass-4821", "phone": "phone-pass-7364"}
PEOPLE = [
    ("Blake", "Rivera", "5550100201", "friend"),
    ("Casey", "Morgan", "5550100202", "sibling"),
    ("Devon", "Patel", "5550100203", "coworker"),
    ("Emery", "Chen", "5550100204", "friend"),
    ("Finley", "Okafor", "5550100205", "parent"),
    ("Harper", "Lindqvist", "5550100206", "coworker"),
    ("Jordan", "Alvarez", "5550100207", "roommate"),
    ("Kendall", "Nakamura", "5550100208", "manager"),
]
TAGS = ["recipe", "travel", "work", "shopping", "ideas", "fitness"]
WORDS = [
    "lemon",
    "harbor",
    "quartz",
    "meadow",
    "orbit",
    "cedar",
    "falcon",
    "velvet",
    "summit",
    "pepper",
    "canyon",
    "maple",
    "ember",
    "lagoon",
    "violet",
    "granite",
    "willow",
    "comet",
]
MESSAGES = [
    "Are we still on for Saturday?",
    "Running ten minutes late.",
    "Can you send me the photos?",
    "Happy to help with the move.",
    "Did you see the game last night?",
    "Call me when free.",
    "Lunch tomorrow at noon?",
    "Thanks for the book recommendation!",
    "The package arrived.",
    "Let's plan the trip next week.",
]

# Split -> scenario ids. 3ab5b8b_3 is on AppWorld's dev denylist: dev keeps other 3ab5b8b tasks.
SPLITS = {
    "train": ["a1c4e02", "9f04a7b"],
    "dev": ["3ab5b8b"],
    "test_normal": ["5c1e9d2"],
    "test_challenge": ["e27d0f6"],
}

# ---------------------------------------------------------------------------------------------
# Evaluation code (one per generator; per-task values live in public/private data). Each
# requirement string appears verbatim in test_data.json.

_HEADER = """\
import json


def _predicted_answer(models):
    task = models.end.supervisor.Task.all()[0]
    try:
        return json.loads(task.answer)
    except (TypeError, ValueError):
        return task.answer


def _sent_texts(models, private_data):
    added, _, _ = models.changed_records("phone.GlobalTextMessage")
    return [
        record
        for record in added
        if record.sender_id == private_data.supervisor_phone_user_id
        and record.receiver_id == private_data.receiver_phone_user_id
    ]
"""

EVALUATIONS: dict[str, tuple[str, list[tuple[str, str]]]] = {}


def _evaluation(name: str, body: str, tests: list[tuple[str, str]]) -> None:
    for requirement, _ in tests:
        assert f'with test("{requirement}")' in body, requirement
    code = _HEADER + "\n\ndef evaluate(test, public_data, private_data, main_user, models, ground_truth_answer):\n"
    code += "    changed_model_names = models.changed_model_names()\n"
    code += "\n".join("    " + line if line else "" for line in dedent(body).strip("\n").splitlines())
    EVALUATIONS[name] = (code + "\n", tests)


_evaluation(
    "count_tagged_notes",
    """
    with test("assert answers match."):
        test.answer(_predicted_answer(models), ground_truth_answer)
    with test("assert no model changes were made."):
        test.case(changed_model_names, "==", set())
    with test("assert no simple_note notes were deleted."):
        _, _, removed = models.changed_records("simple_note.Note")
        test.case(len(removed), "==", 0)
    """,
    [
        ("assert answers match.", "no_op_fail"),
        ("assert no model changes were made.", "no_op_pass"),
        ("assert no simple_note notes were deleted.", "no_op_pass"),
    ],
)
_evaluation(
    "send_text",
    """
    sent = _sent_texts(models, private_data)
    with test("assert exactly one text message was sent to the requested contact."):
        test.case(len(sent), "==", 1)
    with test("assert the text message says what was asked."):
        test.case(sent[0].message, "==", private_data.message, normalize_text=True)
    with test("assert no models other than phone text messages were changed."):
        test.case(sorted(changed_model_names - {"phone.GlobalTextMessage", "phone.UserTextMessage"}), "==", [])
    with test("assert no answer was given."):
        test.case(_predicted_answer(models), "in", [None, "<<NOT_GIVEN>>"])
    """,
    [
        ("assert exactly one text message was sent to the requested contact.", "no_op_fail"),
        ("assert the text message says what was asked.", "no_op_fail"),
        ("assert no models other than phone text messages were changed.", "no_op_pass"),
        ("assert no answer was given.", "no_op_pass"),
    ],
)
_evaluation(
    "text_note_content",
    """
    sent = _sent_texts(models, private_data)
    with test("assert exactly one text message was sent to the requested contact."):
        test.case(len(sent), "==", 1)
    with test("assert the text message is the content of the requested note."):
        test.case(sent[0].message, "==", private_data.note_content, normalize_text=True)
    with test("assert no models other than phone text messages were changed."):
        test.case(sorted(changed_model_names - {"phone.GlobalTextMessage", "phone.UserTextMessage"}), "==", [])
    """,
    [
        ("assert exactly one text message was sent to the requested contact.", "no_op_fail"),
        ("assert the text message is the content of the requested note.", "no_op_fail"),
        ("assert no models other than phone text messages were changed.", "no_op_pass"),
    ],
)
_evaluation(
    "index_note",
    """
    added, updated, removed = models.changed_records("simple_note.Note")
    with test("assert exactly one note was added."):
        test.case(len(added), "==", 1)
    with test("assert the new note has the requested title."):
        test.case(added[0].title, "==", public_data.new_title, normalize_text=True)
    with test("assert the new note lists the tagged note titles, sorted, one per line."):
        lines = [line.strip() for line in added[0].content.strip().splitlines() if line.strip()]
        test.case(lines, "==", private_data.expected_lines)
    with test("assert no existing notes were updated or deleted."):
        test.case(len(updated) + len(removed), "==", 0)
    with test("assert no models other than simple_note.Note were changed."):
        test.case(sorted(changed_model_names - {"simple_note.Note"}), "==", [])
    """,
    [
        ("assert exactly one note was added.", "no_op_fail"),
        ("assert the new note has the requested title.", "no_op_fail"),
        ("assert the new note lists the tagged note titles, sorted, one per line.", "no_op_fail"),
        ("assert no existing notes were updated or deleted.", "no_op_pass"),
        ("assert no models other than simple_note.Note were changed.", "no_op_pass"),
    ],
)
_evaluation(
    "count_received_texts",
    """
    with test("assert answers match."):
        test.answer(_predicted_answer(models), ground_truth_answer)
    with test("assert no model changes were made."):
        test.case(changed_model_names, "==", set())
    with test("assert no text messages were deleted."):
        _, _, removed = models.changed_records("phone.UserTextMessage")
        test.case(len(removed), "==", 0)
    """,
    [
        ("assert answers match.", "no_op_fail"),
        ("assert no model changes were made.", "no_op_pass"),
        ("assert no text messages were deleted.", "no_op_pass"),
    ],
)

# ---------------------------------------------------------------------------------------------
# Solutions, written as an agent would write them in world.execute.

_LOGIN_NOTES = """\
passwords = {p["account_name"]: p["password"] for p in apis.supervisor.show_account_passwords()}
profile = apis.supervisor.show_profile()
note_token = apis.simple_note.login(username=profile["email"], password=passwords["simple_note"])["access_token"]
"""
_LOGIN_PHONE = """\
passwords = {p["account_name"]: p["password"] for p in apis.supervisor.show_account_passwords()}
profile = apis.supervisor.show_profile()
phone_token = apis.phone.login(username=profile["phone_number"], password=passwords["phone"])["access_token"]
"""
_LOGIN_BOTH = _LOGIN_NOTES + (
    'phone_token = apis.phone.login(username=profile["phone_number"], password=passwords["phone"])["access_token"]\n'
)


def _all_pages(call: str) -> str:
    return (
        "items = []\n"
        "page_index = 0\n"
        "while True:\n"
        f"    page = {call.replace('PAGE', 'page_index')}\n"
        "    if not page:\n"
        "        break\n"
        "    items.extend(page)\n"
        "    page_index += 1\n"
    )


# ---------------------------------------------------------------------------------------------


def _person(index: int) -> dict:
    first, last, phone, relationship = PEOPLE[index]
    return {
        "first_name": first,
        "last_name": last,
        "phone_number": phone,
        "relationship": relationship,
        "email": f"{first.lower()}.{last.lower()}@example.com",
    }


def _note_title(rng: random.Random, used: set[str]) -> str:
    while True:
        title = f"{rng.choice(WORDS).title()} {rng.choice(WORDS)} {rng.randint(10, 99)}"
        if title not in used:
            used.add(title)
            return title


def _make_notes(rng: random.Random, count: int, tag: str, num_tagged: int) -> list[dict]:
    """count notes, exactly num_tagged of which carry tag; created over the preceding days."""
    used: set[str] = set()
    tagged_positions = set(rng.sample(range(count), num_tagged))
    notes = []
    for position in range(count):
        tags = [rng.choice([t for t in TAGS if t != tag])]
        if position in tagged_positions:
            tags = [tag] + ([] if rng.random() < 0.5 else tags)
        created = TASK_DATETIME - timedelta(days=count - position, hours=rng.randint(0, 9))
        notes.append(
            {
                "title": _note_title(rng, used),
                "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))),
                "tags": tags,
                "created_at": created,
            }
        )
    return notes


def scenario_specs() -> list[dict]:
    """Every task: id, generator, difficulty, instruction, data to insert, ground truth."""
    specs: list[dict] = []

    def add(task_id: str, **spec) -> None:
        spec["task_id"] = task_id
        specs.append(spec)

    # count_tagged_notes (difficulty 1, answer)
    for n, (tag, count, tagged) in enumerate([("recipe", 7, 3), ("travel", 6, 2), ("work", 9, 4)], 1):
        rng = random.Random(f"a1c4e02_{n}")
        notes = _make_notes(rng, count, tag, tagged)
        solution = (
            _LOGIN_NOTES
            + _all_pages(f'apis.simple_note.search_notes(access_token=note_token, tags=["{tag}"], page_index=PAGE)')
            + "apis.supervisor.complete_task(answer=len(items))\n"
        )
        add(
            f"a1c4e02_{n}",
            generator="count_tagged_notes",
            difficulty=1,
            apps=["simple_note"],
            instruction=f"How many notes tagged '{tag}' do I have in Simple Note?",
            notes=notes,
            texts=[],
            answer=tagged,
            public_data={"tag": tag},
            private_data={},
            solution=solution,
        )

    # text_note_content (difficulty 2, state change, two apps)
    for n, (person_index, tag) in enumerate([(0, "ideas"), (2, "work"), (6, "shopping")], 1):
        rng = random.Random(f"9f04a7b_{n}")
        notes = _make_notes(rng, 8, tag, 2)
        chosen = notes[rng.randrange(len(notes))]
        person = _person(person_index)
        full_name = f"{person['first_name']} {person['last_name']}"
        solution = _LOGIN_BOTH + dedent(
            f"""\
            notes = apis.simple_note.search_notes(access_token=note_token, query={chosen["title"]!r}, page_limit=20)
            note = [n for n in notes if n["title"] == {chosen["title"]!r}][0]
            content = apis.simple_note.show_note(access_token=note_token, note_id=note["note_id"])["content"]
            contacts = apis.phone.search_contacts(access_token=phone_token, query={full_name!r})
            contact = [c for c in contacts if c["first_name"] == {person["first_name"]!r} and c["last_name"] == {person["last_name"]!r}][0]
            apis.phone.send_text_message(access_token=phone_token, phone_number=contact["phone_number"], message=content)
            apis.supervisor.complete_task()
            """  # noqa: E501 - generated solution code, kept verbatim (the synthetic world's data)
        )
        add(
            f"9f04a7b_{n}",
            generator="text_note_content",
            difficulty=2,
            apps=["simple_note", "phone"],
            instruction=f"Text {full_name} the content of my Simple Note note titled '{chosen['title']}'.",
            notes=notes,
            texts=[],
            answer=None,
            public_data={"note_title": chosen["title"], "receiver_name": full_name},
            private_data={"note_content": chosen["content"], "receiver_index": person_index},
            solution=solution,
        )

    # index_note (difficulty 3, state change; dev; 3ab5b8b_3 is on AppWorld's dev denylist)
    for n, (tag, count, tagged) in enumerate([("fitness", 10, 6), ("recipe", 9, 7), ("travel", 8, 3)], 1):
        rng = random.Random(f"3ab5b8b_{n}")
        notes = _make_notes(rng, count, tag, tagged)
        new_title = f"{tag.title()} index"
        expected = sorted(note["title"] for note in notes if tag in note["tags"])
        solution = (
            _LOGIN_NOTES
            + _all_pages(f'apis.simple_note.search_notes(access_token=note_token, tags=["{tag}"], page_index=PAGE)')
            + dedent(
                f"""\
            titles = sorted(item["title"] for item in items)
            apis.simple_note.create_note(access_token=note_token, title={new_title!r}, content="\\n".join(titles))
            apis.supervisor.complete_task()
            """
            )
        )
        add(
            f"3ab5b8b_{n}",
            generator="index_note",
            difficulty=3,
            apps=["simple_note"],
            instruction=(
                f"Create a new Simple Note note titled '{new_title}' whose content lists the titles of "
                f"all my notes tagged '{tag}', sorted alphabetically, one per line."
            ),
            notes=notes,
            texts=[],
            answer=None,
            public_data={"tag": tag, "new_title": new_title},
            private_data={"expected_lines": expected},
            solution=solution,
        )

    # send_text (difficulty 1, state change)
    for n, person_index in enumerate([1, 4], 1):
        rng = random.Random(f"5c1e9d2_{n}")
        person = _person(person_index)
        message = rng.choice(MESSAGES)
        solution = _LOGIN_PHONE + dedent(
            f"""\
            contacts = apis.phone.search_contacts(access_token=phone_token, relationship={person["relationship"]!r}, page_limit=20)
            contact = [c for c in contacts if c["first_name"] == {person["first_name"]!r}][0]
            apis.phone.send_text_message(access_token=phone_token, phone_number=contact["phone_number"], message={message!r})
            apis.supervisor.complete_task()
            """  # noqa: E501 - generated solution code, kept verbatim (the synthetic world's data)
        )
        add(
            f"5c1e9d2_{n}",
            generator="send_text",
            difficulty=1,
            apps=["phone"],
            instruction=(
                f'Send a text message saying "{message}" to my {person["relationship"]} {person["first_name"]}.'
            ),
            notes=[],
            texts=[],
            answer=None,
            public_data={"receiver_first_name": person["first_name"]},
            private_data={"message": message, "receiver_index": person_index},
            solution=solution,
        )

    # count_received_texts (difficulty 2, answer; needs paging past 5 results)
    for n, person_index in enumerate([3, 7], 1):
        rng = random.Random(f"e27d0f6_{n}")
        person = _person(person_index)
        texts = []
        received = 0
        for k in range(14):
            other = person_index if rng.random() < 0.65 else rng.choice([i for i in range(8) if i != person_index])
            incoming = rng.random() < 0.6
            received += int(other == person_index and incoming)
            texts.append(
                {
                    "other": other,
                    "incoming": incoming,
                    "message": rng.choice(MESSAGES),
                    "created_at": TASK_DATETIME - timedelta(hours=3 * (14 - k), minutes=rng.randint(0, 59)),
                }
            )
        full_name = f"{person['first_name']} {person['last_name']}"
        solution = (
            _LOGIN_PHONE
            + dedent(
                f"""\
            contacts = apis.phone.search_contacts(access_token=phone_token, query={full_name!r})
            number = [c for c in contacts if c["first_name"] == {person["first_name"]!r}][0]["phone_number"]
            """
            )
            + _all_pages(
                "apis.phone.search_text_messages(access_token=phone_token, phone_number=number, page_index=PAGE)"
            )
            + dedent(
                """\
            received = [m for m in items if m["sender"]["phone_number"] == number]
            apis.supervisor.complete_task(answer=len(received))
            """
            )
        )
        add(
            f"e27d0f6_{n}",
            generator="count_received_texts",
            difficulty=2,
            apps=["phone"],
            instruction=f"How many text messages have I received from {full_name} on my phone?",
            notes=[],
            texts=texts,
            answer=received,
            public_data={"sender_name": full_name},
            private_data={"sender_index": person_index},
            solution=solution,
        )
    return specs


# ---------------------------------------------------------------------------------------------


def build(root: str) -> None:
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    os.environ["APPWORLD_ROOT"] = root
    os.environ.setdefault("APPWORLD_CACHE", os.path.join(root, ".appworld-cache"))
    data = os.path.join(root, "data")
    shutil.rmtree(data, ignore_errors=True)

    from appworld.apps import get_all_apps
    from appworld.apps.api_lib import set_local_date_and_time, set_local_random_seed
    from appworld.collections.api_docs import ApiDocCollection
    from appworld.collections.models import ModelCollection
    from appworld.common.constants import CANARY_STRING, DB_VERSION
    from appworld.common.path_store import path_store
    from appworld.common.utils import write_json

    path_store.update_root(root)
    random.seed(0)
    set_local_random_seed(0)
    freezer = set_local_date_and_time(TASK_DATETIME)
    all_apps = get_all_apps()

    # 1. API docs: data/api_docs/{standard,function_calling,openapi}/<app>.json.
    api_docs = ApiDocCollection.build(load_apps=tuple(get_all_apps(skip_admin=True)))
    doc_rows = [(app_name, dict(doc)) for app_name, docs in api_docs.items() for doc in docs.values()]
    # ApiDocCollection.save also writes the openapi format, which needs openapi_spec_validator
    # (not an appworld dependency): write the standard and function_calling formats as it does.
    for format_ in ("standard", "function_calling"):
        os.makedirs(os.path.join(data, "api_docs", format_))
    for app_name in api_docs:
        function_calling = api_docs.copy().keep_apps([app_name]).function_calling()
        for doc in function_calling:
            doc["canary_string"] = CANARY_STRING
        write_json(
            function_calling, os.path.join(data, "api_docs", "function_calling", app_name + ".json"), silent=True
        )
        for doc in api_docs[app_name].values():
            doc["canary_string"] = CANARY_STRING
        write_json(
            dict(api_docs[app_name]), os.path.join(data, "api_docs", "standard", app_name + ".json"), silent=True
        )

    # 2. Base databases: every app's schema, the api docs, people and app accounts.
    base = os.path.join(data, "base_dbs")
    os.makedirs(base)
    models = ModelCollection.load(to_db_home_path=base, from_db_home_path=base, load_apps=all_apps, create_db=True)
    ApiDoc = models.api_docs.ApiDoc
    ApiDoc.save_all(
        [
            ApiDoc.create(
                app_name_=app_name,
                api_name=doc["api_name"],
                path=doc["path"],
                method=doc["method"],
                description=doc["description"],
                parameters=doc["parameters"],
                response_schemas=doc["response_schemas"],
            )
            for app_name, doc in doc_rows
        ]
    )
    people = [_person(i) for i in range(len(PEOPLE))]
    MainUser = models.admin.MainUser
    MainUser.save_all(
        [MainUser.create(**SUPERVISOR)]
        + [
            MainUser.create(
                first_name=p["first_name"],
                last_name=p["last_name"],
                email=p["email"],
                phone_number=p["phone_number"],
                birthday=f"19{80 + i}-0{1 + i}-1{i}",
            )
            for i, p in enumerate(people)
        ]
    )
    created = TASK_DATETIME - timedelta(days=400)
    NoteUser = models.simple_note.User
    NoteUser.create(
        first_name=SUPERVISOR["first_name"],
        last_name=SUPERVISOR["last_name"],
        email=SUPERVISOR["email"],
        password=PASSWORDS["simple_note"],
        verified=True,
        created_at=created,
        last_logged_in=created,
    ).save()
    PhoneUser = models.phone.User
    PhoneUser.save_all(
        [
            PhoneUser.create(
                first_name=u["first_name"],
                last_name=u["last_name"],
                phone_number=u["phone_number"],
                password=f"pw-{u['phone_number']}",
                created_at=created,
                last_logged_in=created,
            )
            for u in [SUPERVISOR, *people]
        ]
    )
    supervisor_phone = PhoneUser.find_one(phone_number=SUPERVISOR["phone_number"])
    supervisor_phone.password = PASSWORDS["phone"]
    supervisor_phone.save()
    Contact = models.phone.Contact
    Contact.save_all(
        [
            Contact.create(
                user_id=supervisor_phone.id,
                first_name=p["first_name"],
                last_name=p["last_name"],
                email=p["email"],
                phone_number=p["phone_number"],
                relationships=[p["relationship"]],
                created_at=created,
            )
            for p in people
        ]
    )
    phone_user_ids = {
        p["phone_number"]: PhoneUser.find_one(phone_number=p["phone_number"]).id for p in [SUPERVISOR, *people]
    }
    note_user_id = NoteUser.find_one(email=SUPERVISOR["email"]).id
    models.close()

    # 3. Tasks: the supervisor, its passwords, the task row and the task's own app data,
    # recorded as changes against base_dbs.
    solutions: dict[str, dict] = {}
    split_of = {sid: split for split, sids in SPLITS.items() for sid in sids}
    for spec in scenario_specs():
        task_id = spec["task_id"]
        task_dir = os.path.join(data, "tasks", task_id)
        memory_home = f":memory:worldgen-{task_id}"
        models = ModelCollection.load(to_db_home_path=memory_home, from_db_home_path=base, load_apps=all_apps)
        Supervisor = models.supervisor.Supervisor
        supervisor = Supervisor.create(**SUPERVISOR)
        supervisor.save()
        AccountPassword = models.supervisor.AccountPassword
        AccountPassword.save_all(
            [
                AccountPassword.create(supervisor_id=supervisor.id, account_name=app, password=pw)
                for app, pw in PASSWORDS.items()
            ]
        )
        models.supervisor.Task.create(supervisor_id=supervisor.id, instruction=spec["instruction"]).save()
        Note = models.simple_note.Note
        for note in spec["notes"]:
            Note.create(
                user_id=note_user_id,
                title=note["title"],
                content=note["content"],
                tags=note["tags"],
                pinned=False,
                created_at=note["created_at"],
                updated_at=note["created_at"],
            ).save()
        GlobalText = models.phone.GlobalTextMessage
        UserText = models.phone.UserTextMessage
        me = phone_user_ids[SUPERVISOR["phone_number"]]
        for text in spec["texts"]:
            other = phone_user_ids[people[text["other"]]["phone_number"]]
            sender, receiver = (other, me) if text["incoming"] else (me, other)
            message = GlobalText.create(
                sender_id=sender, receiver_id=receiver, message=text["message"], created_at=text["created_at"]
            )
            message.save()
            for owner in (sender, receiver):
                UserText.create(global_text_message_id=message.id, user_id=owner, created_at=text["created_at"]).save()
        models.save(
            db_home_path=os.path.join(task_dir, "dbs"),
            format="changes",
            app_names=list(all_apps),
            save_model_hashes=True,
        )
        models.close()

        private_data = dict(spec["private_data"])
        private_data["supervisor_phone_user_id"] = me
        for key in ("receiver_index", "sender_index"):
            if key in private_data:
                index = private_data.pop(key)
                private_data[key.replace("index", "phone_user_id")] = phone_user_ids[people[index]["phone_number"]]
        _write_json(
            os.path.join(task_dir, "specs.json"),
            {
                "instruction": spec["instruction"],
                "supervisor": {k: SUPERVISOR[k] for k in ("first_name", "last_name", "email", "phone_number")},
                "datetime": TASK_DATETIME.isoformat(),
                "db_version": DB_VERSION,
                "canary_string": CANARY_STRING,
            },
        )
        evaluation_code, tests = EVALUATIONS[spec["generator"]]
        solution = spec["solution"]
        gt = os.path.join(task_dir, "ground_truth")
        _write_json(os.path.join(gt, "public_data.json"), spec["public_data"])
        _write_json(os.path.join(gt, "private_data.json"), private_data)
        _write_text(os.path.join(gt, "answer.json"), json.dumps(spec["answer"]))
        _write_text(os.path.join(gt, "evaluation.py"), f"# Canary String: {CANARY_STRING}\n" + evaluation_code)
        _write_json(
            os.path.join(gt, "test_data.json"),
            [{"requirement": requirement, "label": label} for requirement, label in tests],
        )
        apis_used = {line.split("apis.", 1)[1].split("(", 1)[0] for line in solution.splitlines() if "apis." in line}
        _write_json(
            os.path.join(gt, "metadata.json"),
            {
                "difficulty": spec["difficulty"],
                "mode": "minimal",
                "num_apps": len(spec["apps"]),
                "num_apis": len(apis_used),
                "num_solution_code_lines": len([line for line in solution.splitlines() if line.strip()]),
            },
        )
        noop_passes = sum(label == "no_op_pass" for _, label in tests)
        solutions[task_id] = {
            "solution_code": solution,
            "noop_pass_fraction": noop_passes / len(tests),
            "num_tests": len(tests),
            "difficulty": spec["difficulty"],
            "split": split_of[task_id.split("_")[0]],
            "instruction": spec["instruction"],
            "answer": spec["answer"],
        }

    # 4. Datasets.
    for split, scenario_ids in SPLITS.items():
        ids = sorted(t for t in solutions if t.split("_")[0] in scenario_ids)
        _write_text(os.path.join(data, "datasets", f"{split}.txt"), "\n".join(ids) + "\n")
    _write_json(os.path.join(root, "synthetic_solutions.json"), solutions)
    freezer.stop()


def _write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as file:
        file.write(text)


def _write_json(path: str, value) -> None:
    _write_text(path, json.dumps(value, indent=2, sort_keys=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="APPWORLD_ROOT to build; data/ is replaced")
    args = parser.parse_args(argv)
    start = time.monotonic()
    build(args.root)
    print(f"built synthetic AppWorld world in {args.root} ({time.monotonic() - start:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
