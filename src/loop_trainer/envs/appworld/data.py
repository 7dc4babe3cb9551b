"""AppWorld's task data, read from ``$APPWORLD_ROOT/data`` without importing appworld.

Split names are AppWorld's dataset files (``train``, ``dev``, ``test_normal``,
``test_challenge``, or any ``data/datasets/<name>.txt``), a difficulty subset of one
(``train_difficulty_1``), or a union of those joined by ``_and_`` (the paper trains on
``train_difficulty_1_and_train_difficulty_2``). Tasks on the denylist of their split are left out
and counted (the reference implementation forgot to).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import Dataset

from ..base import EnvironmentSetupError

logger = logging.getLogger(__name__)

DENYLIST: dict[str, frozenset[str]] = {"dev": frozenset({"3ab5b8b_3", "37a8675_1"})}
"""Task ids AppWorld's authors excluded from a split (broken ground truth)."""

_DIFFICULTY = re.compile(r"^(?P<split>.+)_difficulty_(?P<level>[123])$")


class AppWorldDataError(EnvironmentSetupError):
    """The AppWorld data is missing or does not have what was asked for."""


def scenario_id(task_id: str) -> str:
    """The scenario (AppWorld: generator) a task belongs to: the id before ``_``."""
    return task_id.split("_")[0]


def resolve_root(root: str | os.PathLike[str] | None = None) -> Path:
    """``root`` or ``$APPWORLD_ROOT``; it must hold AppWorld's ``data`` directory."""
    value = root if root is not None else os.environ.get("APPWORLD_ROOT")
    if not value:
        raise AppWorldDataError(
            "APPWORLD_ROOT is not set: run `make appworld` (downloads the data into ./appworld-root) "
            "and export APPWORLD_ROOT, or pass environment_kwargs={'root': ...}"
        )
    path = Path(value).expanduser().resolve()
    if not (path / "data" / "tasks").is_dir() or not (path / "data" / "datasets").is_dir():
        raise AppWorldDataError(
            f"no AppWorld data under {path} (expected {path}/data/tasks and data/datasets): "
            "run `make appworld` or point APPWORLD_ROOT at a root that has it"
        )
    return path


@dataclass(frozen=True)
class AppWorldData:
    """Task lists and task specs of one AppWorld root."""

    root: Path

    @classmethod
    def at(cls, root: str | os.PathLike[str] | None = None) -> AppWorldData:
        return cls(resolve_root(root))

    def dataset_names(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "data" / "datasets").glob("*.txt"))

    def _listed(self, name: str) -> list[str]:
        path = self.root / "data" / "datasets" / f"{name}.txt"
        if not path.is_file():
            raise AppWorldDataError(
                f"unknown AppWorld split {name!r}; datasets here: {', '.join(self.dataset_names())} "
                "(also <split>_difficulty_<1|2|3> and unions joined by _and_)"
            )
        ids = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        denied = DENYLIST.get(name, frozenset())
        kept = [task_id for task_id in ids if task_id not in denied]
        if len(kept) != len(ids):
            logger.info(
                "split %s: left out %d denylisted task(s): %s",
                name,
                len(ids) - len(kept),
                ", ".join(sorted(set(ids) & denied)),
            )
        return kept

    def task_ids(self, split: str) -> list[str]:
        """Task ids of ``split`` in file order, unions de-duplicated, denylists applied."""
        ids: list[str] = []
        for part in self._split_parts(split):
            match = _DIFFICULTY.match(part)
            if match and not (self.root / "data" / "datasets" / f"{part}.txt").is_file():
                level = int(match["level"])
                ids += [t for t in self._listed(match["split"]) if self.metadata(t)["difficulty"] == level]
            else:
                ids += self._listed(part)
        return list(dict.fromkeys(ids))

    def _split_parts(self, split: str) -> list[str]:
        # "test_normal" contains no "_and_", but a union's parts may themselves contain "_".
        if (self.root / "data" / "datasets" / f"{split}.txt").is_file():
            return [split]
        return split.split("_and_")

    def _task_dir(self, task_id: str) -> Path:
        path = self.root / "data" / "tasks" / task_id
        if not path.is_dir():
            raise AppWorldDataError(f"task {task_id} is listed but {path} does not exist")
        return path

    def metadata(self, task_id: str) -> dict[str, Any]:
        return json.loads((self._task_dir(task_id) / "ground_truth" / "metadata.json").read_text())

    def specs(self, task_id: str) -> dict[str, Any]:
        return json.loads((self._task_dir(task_id) / "specs.json").read_text())

    def tasks(self, split: str) -> Dataset:
        """One row per task: id, scenario, difficulty, instruction, supervisor and date."""
        rows = []
        for task_id in self.task_ids(split):
            specs = self.specs(task_id)
            supervisor = specs.get("supervisor") or specs.get("main_user") or {}
            rows.append(
                {
                    "task_id": task_id,
                    "scenario_id": scenario_id(task_id),
                    "difficulty": int(self.metadata(task_id).get("difficulty", 0)),
                    "instruction": specs["instruction"],
                    "supervisor": f"{supervisor.get('first_name', '')} {supervisor.get('last_name', '')}".strip(),
                    "datetime": str(specs.get("datetime", "")),
                }
            )
        if not rows:
            raise AppWorldDataError(f"AppWorld split {split!r} has no tasks under {self.root}")
        return Dataset.from_list(rows)
