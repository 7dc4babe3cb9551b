"""Environments: the interface (:mod:`.base`), the built-in ``vault`` and ``contacts`` worlds, and a registry.

``make_environment(name, **kwargs)`` resolves ``name`` as, in order: a built-in environment, an
entry point in the ``loop_trainer.environments`` group (how a separate package plugs one in), or an
import path ``package.module:ClassName``.

``vault`` (the demo's, in a few dozen words for the tiny models) and ``contacts`` (the same kind of
task in plain English, for a small pretrained model) are built in: they have no dependencies, so
they resolve even from a source tree with no installed metadata. AppWorld
registers through the entry-point group, as a user's package would (see pyproject.toml), and is
imported only when asked for by name.

Environments from elsewhere, unchanged: ``TRLAgentEnvironment`` (GRPOTrainer's ``train_dataset``,
``reward_funcs``, ``tools`` and ``environment_factory``; LOOPTrainer builds it from those
arguments), ``from_verifiers(vf_env)`` and ``from_openenv(client)``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..lazy_exports import lazy_exports
from .base import (
    Environment,
    EnvironmentSetupError,
    Episode,
    EpisodeContractError,
    Message,
    Reply,
    Score,
    Step,
    UnknownSplitError,
    as_score,
    check_pass_rates,
    check_tasks,
    load_tasks,
    success_and_reward,
)
from .contacts import ContactsEnv
from .errands import ErrandsEnv
from .vault import VaultEnv

# The adapters of other libraries import on first use: TRL's imports transformers' trainer (and torch), which a
# process that only runs episodes (a collection child) does not need (lazy_exports.py).
if TYPE_CHECKING:
    from ..compat.openenv import OpenEnvEnvironment, from_openenv
    from ..compat.trl import TRLAgentEnvironment
    from ..compat.verifiers import VerifiersEnvironment, VerifiersTasksetEnvironment, from_verifiers
else:  # not for mypy, which would take any name imported from here as Any (lazy_exports.py)
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            "..compat.openenv": ("OpenEnvEnvironment", "from_openenv"),
            "..compat.trl": ("TRLAgentEnvironment",),
            "..compat.verifiers": ("VerifiersEnvironment", "VerifiersTasksetEnvironment", "from_verifiers"),
        },
    )

__all__ = [
    "Environment",
    "EnvironmentSetupError",
    "Episode",
    "EpisodeContractError",
    "Message",
    "Reply",
    "Score",
    "Step",
    "ContactsEnv",
    "ErrandsEnv",
    "OpenEnvEnvironment",
    "TRLAgentEnvironment",
    "VaultEnv",
    "VerifiersEnvironment",
    "VerifiersTasksetEnvironment",
    "from_openenv",
    "from_verifiers",
    "as_score",
    "UnknownSplitError",
    "available_environments",
    "check_pass_rates",
    "check_tasks",
    "load_tasks",
    "make_environment",
    "success_and_reward",
]

BUILTIN: dict[str, Callable[..., Environment]] = {"vault": VaultEnv, "contacts": ContactsEnv, "errands": ErrandsEnv}
ENTRY_POINT_GROUP = "loop_trainer.environments"


def available_environments() -> list[str]:
    return sorted({*BUILTIN, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})


def import_from_working_directory(module_name: str) -> ModuleType:
    """``importlib.import_module(module_name)``, also finding a module or package in the working directory:
    ``loop-train --environment my_env:MyEnv`` run beside ``my_env.py`` imports it as ``python -m`` would
    (a console script's ``sys.path`` starts at its own ``bin/``, not at the working directory)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        top, here = module_name.split(".")[0], os.getcwd()
        beside = Path(here, f"{top}.py").is_file() or Path(here, top, "__init__.py").is_file()
        if error.name != top or not beside or here in sys.path or "" in sys.path:
            raise
        sys.path.insert(0, here)
        return importlib.import_module(module_name)


def _resolve(name: str) -> Callable[..., Environment]:
    if name in BUILTIN:
        return BUILTIN[name]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            return getattr(import_from_working_directory(module_name), attribute)
        except (ImportError, AttributeError) as error:
            top = module_name.split(".")[0]
            hint = (
                f" (run from the directory that holds {top}.py, or add that directory to PYTHONPATH)"
                if isinstance(error, ModuleNotFoundError) and error.name == top
                else ""
            )
            raise ValueError(f"cannot import environment {name!r}: {error}{hint}") from None
    raise ValueError(
        f"unknown environment {name!r}; available: {', '.join(available_environments())} "
        "(or give an import path 'package.module:ClassName')"
    )


def make_environment(name: str, **kwargs: Any) -> Environment:
    """Build an environment by name (see the module docstring for how names resolve)."""
    factory = _resolve(name)
    try:
        environment = factory(**kwargs)
    except TypeError as error:
        raise ValueError(f"bad arguments for environment {name!r}: {error}") from None
    if not isinstance(environment, Environment):
        raise ValueError(f"{name!r} built a {type(environment).__name__}, not a loop_trainer Environment")
    return environment
