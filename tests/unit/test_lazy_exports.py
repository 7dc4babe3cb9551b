"""The names loop_trainer's packages (and loop-train's entry point) export on first use: each is the object of the
module that defines it, listed by dir(), and an unknown name is an AttributeError. That importing them loads no
torch: tests/unit/rollout/test_collection_process.py (the collection child's modules)."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

import loop_trainer
from loop_trainer.lazy_exports import lazy_exports

LAZY = ("loop_trainer", "loop_trainer.rollout", "loop_trainer.envs", "loop_trainer.cli.train")

# Where each lazily exported name is defined (the names a module imports eagerly are left out).
DEFINED_IN = {
    "loop_trainer": {
        "LOOPConfig": "loop_trainer.config.loop_config",
        "LOOPTrainer": "loop_trainer.training.trainer",
        "Trajectory": "loop_trainer.trajectory",
        "loop_policy_loss": "loop_trainer.objective",
        "make_environment": "loop_trainer.envs",
        "Environment": "loop_trainer.envs.base",
    },
    "loop_trainer.rollout": {
        "GenerationBackend": "loop_trainer.rollout.records",
        "TransformersBackend": "loop_trainer.rollout.backend",
        "RolloutEngine": "loop_trainer.rollout.engine",
        "run_coroutine": "loop_trainer.rollout.collection",
    },
    "loop_trainer.envs": {
        "TRLAgentEnvironment": "loop_trainer.compat.trl.environment",
        "from_openenv": "loop_trainer.compat.openenv.environment",
        "from_verifiers": "loop_trainer.compat.verifiers",
    },
    "loop_trainer.cli.train": {"main": "loop_trainer.cli.train_run", "make_parser": "loop_trainer.cli.recipe"},
}


@pytest.mark.parametrize("name", LAZY)
def test_every_exported_name_resolves_and_is_listed(name):
    module = importlib.import_module(name)
    for export in module.__all__:
        assert getattr(module, export) is not None, export
    assert set(module.__all__) <= set(dir(module))


@pytest.mark.parametrize("name", LAZY)
def test_a_name_is_the_object_of_the_module_that_defines_it(name):
    module = importlib.import_module(name)
    for export, source in DEFINED_IN[name].items():
        value = getattr(module, export)
        assert value is getattr(importlib.import_module(source), export)
        assert getattr(value, "__module__", source) == source


def test_an_unknown_name_is_an_attribute_error_and_a_submodule_still_imports():
    with pytest.raises(AttributeError, match="module 'loop_trainer' has no attribute 'LOOPTrainr'"):
        _ = loop_trainer.LOOPTrainr
    assert not hasattr(loop_trainer.rollout, "no_such_name")
    from loop_trainer import objective  # a submodule, not an export

    assert objective.__name__ == "loop_trainer.objective"


def test_a_module_reads_its_names_relative_to_its_package(monkeypatch):
    """A module (not a package's __init__) resolves ``.name`` beside itself, as its own relative imports do."""
    module = types.ModuleType("loop_trainer.cli.example_entry")
    module.__package__ = "loop_trainer.cli"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    getter, lister = lazy_exports(module.__name__, {"parse_recipe": ".recipe"})
    from loop_trainer.cli.recipe import parse_recipe

    assert getter("parse_recipe") is parse_recipe
    assert module.parse_recipe is parse_recipe  # kept: the next read does not come back
    assert "parse_recipe" in lister()
