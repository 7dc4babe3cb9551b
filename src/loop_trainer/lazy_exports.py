"""A package's public names, each imported from its module the first time it is read (PEP 562).

Why: importing a package runs its ``__init__``, and importing any module inside it imports the package first. Were
``loop_trainer``'s ``__init__`` to import :class:`~loop_trainer.LOOPTrainer` eagerly, every process that needs one
light module would load torch, transformers' trainer, PEFT and TRL: a collection child (``collection_process:
true``), which needs the environment, the tokenizer and the rollout engine, paid 610 MiB and about 5 s for them.
So ``loop_trainer``, ``loop_trainer.rollout`` and ``loop_trainer.envs`` (for its adapters of other libraries) name
their exports here, and ``from loop_trainer import LOOPTrainer`` imports the trainer when it runs, as before.

Type checkers read the package's ``if TYPE_CHECKING:`` imports of the same names.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(module: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the module named ``module`` (a package's ``__init__`` or a module:
    its ``__name__``), whose public names ``exports`` maps to the module that defines each, relative to the
    module's package as its own relative imports are. A name read once is kept in the module's namespace."""

    def __getattr__(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        namespace = sys.modules[module]
        value = getattr(importlib.import_module(source, namespace.__package__), name)
        setattr(namespace, name, value)  # the next read finds it without coming here
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[module]), *exports})

    return __getattr__, __dir__
