"""``report_to``, checked when the configuration is built: a tracker named there whose package is missing stops
with one line naming the command that installs it, before a model is loaded (transformers' own callbacks fail
only when the trainer is built, after the model and the warm-up, with a traceback); a name that is no tracker
stops the same way, with the one it resembles.

Only the packages are looked for (``importlib.util.find_spec``, as transformers' ``is_*_available`` do):
nothing is imported here."""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TrackerPackage:
    modules: tuple[str, ...]
    """Any one of these importable is enough (transformers' TensorBoard callback takes either writer)."""
    install: str


# The trackers LOOP logs its own extras to (training/trackers.py): each is an extra of loop-trainer.
TRACKER_PACKAGES = {
    "wandb": TrackerPackage(("wandb",), "pip install 'loop-trainer[wandb]'"),
    "tensorboard": TrackerPackage(("tensorboard", "tensorboardX"), "pip install 'loop-trainer[tensorboard]'"),
    "trackio": TrackerPackage(("trackio",), "pip install trackio"),
}


def known_trackers() -> tuple[str, ...]:
    """The names transformers' ``report_to`` takes ("all" and "none" besides)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    return tuple(INTEGRATION_TO_CALLBACK)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed install counts as missing
        return False


def report_to_problem(report_to: str | Sequence[str] | None) -> str | None:
    """What is wrong with ``report_to`` (as ``TrainingArguments.__post_init__`` leaves it: a list, "all" and
    "none" resolved), in one line; None when every tracker it names can be used."""
    known = known_trackers()
    for name in [report_to] if isinstance(report_to, str) else report_to or []:
        if name not in known:
            close = difflib.get_close_matches(name, [*known, "none"], n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            return f"report_to: {name!r} is no tracker{hint}; one or more of {', '.join(known)}, or none"
        package = TRACKER_PACKAGES.get(name)
        if package is not None and not any(_installed(module) for module in package.modules):
            return (
                f"report_to: {name} needs the {package.modules[0]} package, which is not installed: "
                f"{package.install} (or report_to: none)"
            )
    return None
