"""Which loop_trainer runs: the test run imports the checkout it runs in, and a wheel built from
that checkout, installed (not editable) into a fresh environment, trains from a directory outside
the repository."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

import loop_trainer

REPO = Path(__file__).resolve().parents[2]
# Nothing a wheel is built from: virtualenvs, outputs, caches, build leftovers.
NOT_SOURCE = {
    ".git",
    ".venv",
    ".vllm-venv",
    ".appworld-venv",
    ".compat-venv",
    "appworld-root",
    "outputs",
    "build",
    "dist",
    "wandb",
    ".pytest_cache",
}


def declared_entry_points() -> dict[str, dict[str, str]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}


def test_the_test_run_imports_this_checkout():
    assert Path(loop_trainer.__file__).resolve().is_relative_to(REPO / "src")
    # So do the processes the tests start with this interpreter, even with PYTHONPATH replaced.
    script = "import loop_trainer; print(loop_trainer.__file__)"
    environment = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    out = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, check=True)
    assert Path(out.stdout.splitlines()[-1]).resolve().is_relative_to(REPO / "src")  # (imports may print first)


def test_the_installed_metadata_is_this_checkouts():
    # Entry points need installed metadata: every one pyproject.toml declares is visible, pointing
    # where it says (a stale install of another checkout, or of an older pyproject, would not be).
    for group, declared in declared_entry_points().items():
        visible = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group) if ep.name in declared}
        assert visible == declared, group
    # The console scripts beside this interpreter (tests/unit/cli/test_cli.py runs `loop-train`) run it too.
    for script in declared_entry_points()["console_scripts"]:
        path = Path(sys.executable).parent / script
        if path.exists():
            interpreter = Path(path.read_text().splitlines()[0].removeprefix("#!").strip())
            # (the directories resolved, not the interpreter: a venv's python links to the base one)
            assert interpreter.parent.resolve() == Path(sys.executable).parent.resolve(), (path, interpreter)


def dependency_site_dirs() -> list[str]:
    """Where the dependencies are installed (the cached virtualenv), not loop_trainer."""
    import accelerate
    import datasets
    import jinja2
    import matplotlib
    import peft
    import requests
    import torch
    import transformers
    import trl
    import yaml

    modules = (accelerate, datasets, jinja2, matplotlib, peft, requests, torch, transformers, trl, yaml)
    return sorted({str(Path(module.__file__).resolve().parents[1]) for module in modules})


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow
def test_a_wheel_installed_outside_the_repository_trains(tmp_path):
    # Build from a copy of the source, so that the checkout gets no build/ or *.egg-info.
    source = tmp_path / "source"
    shutil.copytree(
        REPO,
        source,
        symlinks=True,
        ignore=lambda directory, names: [
            n for n in names if n in NOT_SOURCE or n == "__pycache__" or n.endswith(".egg-info")
        ],
    )
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheels"),
            str(source),
        ]
    )
    (wheel,) = (tmp_path / "wheels").glob("loop_trainer-*.whl")
    # Every file of the package is in the wheel: Python modules and package data alike.
    package = REPO / "src"
    expected = {
        str(path.relative_to(package))
        for path in (package / "loop_trainer").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert not expected - set(zipfile.ZipFile(wheel).namelist()), "missing from the wheel (package-data?)"

    # A fresh virtualenv that sees the dependencies (through a .pth: their directory's own .pth
    # files, such as an editable loop_trainer's, do not run) and holds the wheel as its only package.
    environment = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(environment)
    python = environment / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    Path(site, "loop-trainer-dependencies.pth").write_text("\n".join(dependency_site_dirs()) + "\n")
    clean = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    clean["HF_HUB_OFFLINE"] = "1"
    run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        env=clean,
    )

    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    assert not workdir.resolve().is_relative_to(REPO)
    imported = run([str(python), "-c", "import loop_trainer; print(loop_trainer.__file__)"], cwd=workdir, env=clean)
    assert Path(imported.stdout.splitlines()[-1]).is_relative_to(site)  # the wheel, not the checkout

    shutil.copy(REPO / "recipes" / "demo.yaml", workdir / "demo.yaml")
    run(
        [
            str(environment / "bin" / "loop-train"),
            "--config",
            "demo.yaml",
            "--iterations",
            "2",
            "--output_dir",
            "out",
            "--disable_tqdm",
            "true",
        ],
        cwd=workdir,
        env=clean,
        timeout=900,
    )
    rows = [json.loads(line) for line in (workdir / "out" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 2 and all("reward_mean" in row for row in rows)
