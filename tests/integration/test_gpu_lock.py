"""requirements/gpu.lock, the GPU install (README.md, "GPU install"), still agrees with pyproject.toml:
it pins every dependency and every package of the vllm, deepspeed and wandb extras at a version the
pyproject allows, each package once, for the platform its header names. Offline: it reads files only.
A pin changed in pyproject.toml without re-locking fails here, naming the command that re-locks."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements" / "gpu.lock"
RELOCK = "re-lock with `bash tools/lock_gpu.sh`"
EXTRAS = ("vllm", "deepspeed", "wandb")  # what requirements/gpu.in installs besides the dependencies


def lock_header() -> str:
    lines = LOCK.read_text().splitlines()
    end = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return "\n".join(lines[:end])


def lock_pins() -> list[tuple[str, str, str]]:
    """(canonical name, version, line) of every requirement line (comments and `# via` lines skipped)."""
    pins = []
    for line in LOCK.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if not text or line[0].isspace():
            continue
        try:
            requirement = Requirement(text)
        except InvalidRequirement as error:
            pytest.fail(f"requirements/gpu.lock: {line!r} is not a requirement ({error}); {RELOCK}", pytrace=False)
        specifiers = list(requirement.specifier)
        if len(specifiers) != 1 or specifiers[0].operator != "==" or requirement.url or "*" in specifiers[0].version:
            pytest.fail(f"requirements/gpu.lock: {line!r} is not an exact `name==version` pin; {RELOCK}", pytrace=False)
        pins.append((canonicalize_name(requirement.name), specifiers[0].version, line))
    return pins


def target_environment() -> dict[str, str]:
    """The marker environment of the header's target (markers in pyproject are evaluated for it)."""
    python = re.search(r"CPython (3\.\d+)", lock_header())
    assert python, "requirements/gpu.lock: the header names no target CPython version"
    return {
        "python_version": python[1],
        "python_full_version": f"{python[1]}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def pyproject_requirements() -> list[tuple[str, Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    found = [("dependencies", Requirement(text)) for text in project["dependencies"]]
    for extra in EXTRAS:
        assert extra in project["optional-dependencies"], f"pyproject.toml has no [{extra}] extra"
        found += [(f"[{extra}]", Requirement(text)) for text in project["optional-dependencies"][extra]]
    return found


def test_lock_pins_every_pyproject_requirement_at_an_allowed_version():
    pinned = {name: version for name, version, _ in lock_pins()}
    environment = target_environment()
    problems = []
    for where, requirement in pyproject_requirements():
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        name = canonicalize_name(requirement.name)
        if name not in pinned:
            problems.append(f"pyproject.toml {where} requires {requirement}, which requirements/gpu.lock lacks")
        elif not requirement.specifier.contains(pinned[name], prereleases=True):
            problems.append(
                f"pyproject.toml {where} requires {requirement}, but requirements/gpu.lock pins {name}=={pinned[name]}"
            )
    if problems:
        pytest.fail("; ".join(problems) + f"; {RELOCK}", pytrace=False)


def test_lock_pins_each_package_once():
    seen: dict[str, str] = {}
    duplicates = []
    for name, _, line in lock_pins():
        if name in seen:
            duplicates.append(f"{seen[name]!r} and {line!r}")
        seen[name] = line
    if duplicates:
        pytest.fail(f"requirements/gpu.lock pins a package twice: {'; '.join(duplicates)}; {RELOCK}", pytrace=False)


def test_lock_holds_the_gpu_stack():
    pinned = {name for name, _, _ in lock_pins()}
    missing = [name for name in ("torch", "vllm", "deepspeed", "transformers", "trl", "wandb") if name not in pinned]
    # The CUDA runtime comes with torch's default Linux wheel (cuda-toolkit, or nvidia-cuda-runtime[-cuXX]).
    if not any(name == "cuda-toolkit" or name.startswith("nvidia-cuda-runtime") for name in pinned):
        missing.append("the CUDA runtime wheels (a CPU-only torch was locked?)")
    assert not missing, f"requirements/gpu.lock lacks {', '.join(missing)}; {RELOCK}"


def test_lock_header_names_the_platform_and_the_command():
    header = lock_header()
    assert re.search(
        r"Target platform: Linux x86_64 \(manylinux_\d+_\d+, glibc >= \d+\.\d+\), CPython 3\.\d+, "
        r"NVIDIA CUDA \d+\.\d+",
        header,
    ), f"requirements/gpu.lock: the header names no target platform; {RELOCK}"
    assert "bash tools/lock_gpu.sh" in header, "requirements/gpu.lock: the header does not name tools/lock_gpu.sh"
    command = re.search(r"^#   uv pip compile (.+)$", header, re.M)
    assert command, "requirements/gpu.lock: the header does not give the uv command that produced it"
    platform = re.search(r"\((manylinux_\d+_\d+),", header)[1]
    assert f"--python-platform x86_64-{platform}" in command[1], "the header's platform is not the one resolved for"
    python = re.search(r"CPython (3\.\d+)", header)[1]
    assert f"--python-version {python}" in command[1], "the header's Python is not the one resolved for"
