"""A package's public names, each imported from its module the first time it is read (PEP 562).

Why: importing a package runs its ``__init__``, and importing any module inside it imports the package first. Were
``loop_trainer``'s ``__init__`` to import :class:`~loop_trainer.LOOPTrainer` eagerly, every process that needs one
light module would load torch, transformers' trainer, PEFT and TRL: a collection child (``collection_process:
true``), which needs the environment, the tokenizer and the rollout engine, held 610 MiB and took 6.8 s to start
with them, 328 MiB and 2.4 s without (``benchmarks/collection_child.py``). So ``loop_trainer``,
``loop_trainer.rollout``, ``loop_trainer.envs`` and ``loop_trainer.compat.trl`` (the adapters of other libraries)
and loop-train's entry point name their exports here, and ``from loop_trainer import LOOPTrainer`` imports the
trainer when it runs, as before.

Type checkers read the module's ``if TYPE_CHECKING:`` imports of the same names, and do not see ``__getattr__`` (it
is assigned under ``if not TYPE_CHECKING:``): a module-level ``__getattr__`` would make mypy take any name imported
from the module, a misspelt one too, as ``Any``.

A package's submodules are read as attributes too (``import loop_trainer`` then ``loop_trainer.rollout``): they are
imported on first read, as the eager ``__init__`` used to import them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(
    module: str, exports: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the module named ``module`` (a package's ``__init__`` or a module:
    its ``__name__``), whose public names ``exports`` lists by the module they are imported from, relative to the
    module's package as its own relative imports are: as its ``if TYPE_CHECKING:`` imports read. A name read once
    is kept in the module's namespace."""
    source_of = {name: source for source, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        namespace = sys.modules[module]
        source = source_of.get(name)
        if source is not None:
            value = getattr(importlib.import_module(source, namespace.__package__), name)
        elif "__path__" in vars(namespace) and not name.startswith("__") and _is_submodule(f"{module}.{name}"):
            value = importlib.import_module(f"{module}.{name}")  # a submodule, read as an attribute
        else:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        setattr(namespace, name, value)  # the next read finds it without coming here
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[module]), *source_of})

    return __getattr__, __dir__


def _is_submodule(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # ModuleNotFoundError, or a parent that cannot be imported: not a submodule to read
        return False
