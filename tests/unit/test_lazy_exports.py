"""The names loop_trainer's packages (and loop-train's entry point) export on first use (lazy_exports.py): each is
the object of the module that defines it, listed by dir() before it is read, the light ones read without torch,
submodules read as attributes, and an unknown name is an AttributeError. That the collection child's modules load no
torch: tests/unit/rollout/test_collection_process.py."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import types

import pytest

from loop_trainer.lazy_exports import lazy_exports

LAZY = (
    "loop_trainer",
    "loop_trainer.rollout",
    "loop_trainer.envs",
    "loop_trainer.compat.trl",
    "loop_trainer.cli.train",
)

# Where each name a module exports on first use is defined: every one of them (the fresh interpreter's test checks
# that these are the names not there before they are read), so that a name mapped to a module that only re-exports
# it (a heavy one, say) fails here.
DEFINED_IN = {
    "loop_trainer": {
        "Environment": "loop_trainer.envs.base",
        "Episode": "loop_trainer.envs.base",
        "LOOPConfig": "loop_trainer.config.loop_config",
        "LOOPTrainer": "loop_trainer.training.trainer",
        "Score": "loop_trainer.envs.base",
        "Step": "loop_trainer.envs.base",
        "Trajectory": "loop_trainer.trajectory",
        "advantage_keep_mask": "loop_trainer.objective",
        "leave_one_out_advantages": "loop_trainer.objective",
        "loop_policy_loss": "loop_trainer.objective",
        "make_environment": "loop_trainer.envs",
    },
    "loop_trainer.rollout": {
        "Completion": "loop_trainer.rollout.records",
        "EpisodeLimits": "loop_trainer.rollout.records",
        "GenerationBackend": "loop_trainer.rollout.records",
        "GenerationError": "loop_trainer.rollout.records",
        "RolloutBatch": "loop_trainer.rollout.records",
        "RolloutEngine": "loop_trainer.rollout.engine",
        "RolloutFailureBudgetExceeded": "loop_trainer.rollout.records",
        "TransformersBackend": "loop_trainer.rollout.backend",
        "TransformersSamplingSettings": "loop_trainer.rollout.sampling_parts",
        "build_transformers_backend": "loop_trainer.rollout.backend",
        "mix_seed": "loop_trainer.rollout.records",
        "run_coroutine": "loop_trainer.rollout.collection",
    },
    "loop_trainer.envs": {
        "OpenEnvEnvironment": "loop_trainer.compat.openenv.environment",
        "TRLAgentEnvironment": "loop_trainer.compat.trl.environment",
        "VerifiersEnvironment": "loop_trainer.compat.verifiers",
        "VerifiersTasksetEnvironment": "loop_trainer.compat.verifiers_v1",
        "from_openenv": "loop_trainer.compat.openenv.environment",
        "from_verifiers": "loop_trainer.compat.verifiers",
    },
    "loop_trainer.compat.trl": {"TRLAgentEnvironment": "loop_trainer.compat.trl.environment"},
    "loop_trainer.cli.train": {"main": "loop_trainer.cli.train_run", "make_parser": "loop_trainer.cli.recipe"},
}


@pytest.mark.parametrize("name", LAZY)
def test_every_exported_name_is_the_object_of_the_module_that_defines_it(name):
    module = importlib.import_module(name)
    for export, source in DEFINED_IN[name].items():
        value = getattr(module, export)
        assert value is getattr(importlib.import_module(source), export)
        assert getattr(value, "__module__", source) == source, export


# In a fresh interpreter, before any name is read: which are not there yet (the lazy ones), whether dir() lists
# them; then whether the light ones load torch, and a submodule read as an attribute.
FRESH = """
import json, sys
import loop_trainer, loop_trainer.rollout, loop_trainer.envs, loop_trainer.compat.trl, loop_trainer.cli.train
import loop_trainer.cli.entry_points  # the console scripts: light, so that a Ctrl-C while they import is theirs
modules = (loop_trainer, loop_trainer.rollout, loop_trainer.envs, loop_trainer.compat.trl, loop_trainer.cli.train)
unread = {m.__name__: sorted(set(m.__all__) - set(vars(m))) for m in modules}
listed = all(set(m.__all__) <= set(dir(m)) for m in modules)
from loop_trainer import Environment, Episode, Score, Step, Trajectory, make_environment
from loop_trainer.rollout import (
    Completion, EpisodeLimits, GenerationBackend, GenerationError, RolloutBatch, RolloutEngine,
    RolloutFailureBudgetExceeded, TransformersSamplingSettings, mix_seed, run_coroutine,
)
light = "torch" not in sys.modules
submodule = loop_trainer.objective.loop_policy_loss is loop_trainer.loop_policy_loss
print(json.dumps([unread, listed, light, submodule]))
"""


def test_in_a_fresh_interpreter_the_lazy_names_are_listed_unread_light_ones_load_no_torch_and_submodules_import():
    result = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    unread, listed, light, submodule = json.loads(result.stdout.strip().splitlines()[-1])
    assert unread == {name: sorted(defined) for name, defined in DEFINED_IN.items()}
    assert (listed, light, submodule) == (True, True, True)


def test_an_unknown_name_is_an_attribute_error():
    import loop_trainer.rollout

    with pytest.raises(AttributeError, match="module 'loop_trainer' has no attribute 'LOOPTrainr'"):
        _ = loop_trainer.LOOPTrainr
    assert not hasattr(loop_trainer.rollout, "no_such_name")
    with pytest.raises(ImportError, match="cannot import name 'summary' from 'loop_trainer.cli.train'"):
        from loop_trainer.cli.train import summary  # noqa: F401 - in train_run, not exported by the entry point


def test_a_module_reads_its_names_relative_to_its_package(monkeypatch):
    """A module (not a package's __init__) resolves ``.name`` beside itself, as its own relative imports do."""
    module = types.ModuleType("loop_trainer.cli.example_entry")
    module.__package__ = "loop_trainer.cli"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    getter, lister = lazy_exports(module.__name__, {".recipe": ("parse_recipe",)})
    from loop_trainer.cli.recipe import parse_recipe

    assert "parse_recipe" in lister()
    assert getter("parse_recipe") is parse_recipe
    assert module.parse_recipe is parse_recipe  # kept: the next read does not come back
    with pytest.raises(AttributeError):
        getter("recipe")  # a module has no submodules to read
