"""What the benchmarks share: where the checkout and its results are, how a result records the
command that made it and the software, machine and commit it was measured on, and measuring only
while no other process takes the CPU.

Every benchmark is a module of the ``benchmarks`` package, run from the repository root with the
checkout's virtualenv, which has ``loop_trainer`` installed editable (benchmarks/README.md)::

    python -m benchmarks.<script> [options]
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

T = TypeVar("T")


# --- what a result records ----------------------------------------------------------------------
def command_line(module: str, argv: Sequence[str] | None = None, python: str = "python") -> str:
    """The command that reruns this measurement: ``python -m <module> <argv>`` (default: this
    process's arguments), ``python`` being the interpreter to name (e.g. ``.vllm-venv/bin/python``)."""
    return shlex.join([python, "-m", module, *(sys.argv[1:] if argv is None else argv)])


def torch_threads(count: int) -> None:
    """Give torch ``count`` threads in this process (a benchmark's worker initializer: one per core it owns)."""
    import torch

    torch.set_num_threads(count)


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Each distribution's installed version (``importlib.metadata``); None where it is not installed."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_model(default: str | None = None) -> str | None:
    """The CPU's model name from ``/proc/cpuinfo``; ``default`` where it names none."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), default)
    except OSError:
        return default


def git_commit() -> str:
    """The short hash of the checkout's HEAD; "unknown" outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tracked_changes() -> bool:
    """Whether tracked files differ from HEAD (untracked files are not counted); False outside git."""
    try:
        return bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=ROOT,
                check=False,
                capture_output=True,
                text=True,
            ).stdout.strip()
        )
    except OSError:
        return False


def software(packages: Iterable[str], *, host: bool = False, checkout: bool = False, **fields: Any) -> dict[str, Any]:
    """What a result was measured with: ``python`` and each of ``packages``' installed version (None
    where it is not installed); with ``host``, ``cpu`` (model name) and ``cpus``; then ``fields`` as
    given; with ``checkout``, ``commit`` and ``tracked_changes`` (whether tracked files had changes)."""
    record: dict[str, Any] = {"python": platform.python_version(), **package_versions(packages)}
    if host:
        record.update(cpu=cpu_model(default=platform.processor()), cpus=os.cpu_count())
    record.update(fields)
    if checkout:
        commit = git_commit()
        record.update(commit=commit, tracked_changes=commit != "unknown" and tracked_changes())
    return record


# --- memory -------------------------------------------------------------------------------------
def proc_status_bytes(field: str) -> int:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


# --- measuring alone ----------------------------------------------------------------------------
def wait_for_load(max_load: float | None, max_wait: float, *, measure_anyway: bool) -> tuple[list[float], bool]:
    """Wait until the 1-minute load average is below ``max_load`` (None: don't wait), checking every
    20 s. Returns (the load averages when done, whether the machine got that idle). After
    ``max_wait`` seconds of waiting it gives up: with ``measure_anyway`` it says so and returns
    (load, False), otherwise it exits (``SystemExit``)."""
    load = list(os.getloadavg())
    if max_load is None:
        return load, True
    deadline = time.monotonic() + max_wait
    while load[0] >= max_load:
        if time.monotonic() > deadline:
            if not measure_anyway:
                raise SystemExit(f"load average {load[0]:.2f} stayed above {max_load} for {max_wait:.0f} s")
            print(
                f"load average {load[0]:.2f} stayed above {max_load} for {max_wait:.0f} s; measuring anyway", flush=True
            )
            return load, False
        print(f"load average {load[0]:.2f} >= {max_load}; waiting", flush=True)
        time.sleep(20)
        load = list(os.getloadavg())
    return load, True


class CpuSeconds(NamedTuple):
    """A reading of :func:`busy_cpu_seconds`; the change between two readings shows how much CPU
    other processes took meanwhile (:func:`other_cpu_seconds`)."""

    all_processes: float
    """CPU seconds every process on the machine spent busy since boot (``/proc/stat``)."""
    this_process: float
    """CPU seconds of this process (user + system)."""


def busy_cpu_seconds() -> CpuSeconds:
    """CPU seconds all processes spent busy since boot, and this process's own."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = os.sysconf("SC_CLK_TCK")
    busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7)) / ticks  # user nice system irq softirq steal
    own = os.times()
    return CpuSeconds(busy, own.user + own.system)


def other_cpu_seconds(before: CpuSeconds, after: CpuSeconds) -> float:
    """CPU seconds processes other than this one took between two readings."""
    return max(0.0, (after.all_processes - before.all_processes) - (after.this_process - before.this_process))


class Alone:
    """``alone(measure, what)`` runs ``measure()`` and, while other processes took more than
    ``max_other_cpu`` CPU seconds per second of it, waits until they are quiet and runs it again, at
    most ``retries`` times. Every disturbed attempt is recorded in ``disturbed``."""

    def __init__(self, max_other_cpu: float, retries: int, max_wait: float, window: float = 10.0):
        self.max_other_cpu, self.retries, self.max_wait, self.window = max_other_cpu, retries, max_wait, window
        self.disturbed: list[dict[str, Any]] = []

    def __call__(self, measure: Callable[[], T], what: str) -> T:
        for attempt in range(self.retries + 1):
            before, started = busy_cpu_seconds(), time.perf_counter()
            value = measure()
            seconds = time.perf_counter() - started
            other = other_cpu_seconds(before, busy_cpu_seconds())
            if other <= self.max_other_cpu * seconds:
                return value
            print(f"{what}: other processes took {other:.1f} CPU s during its {seconds:.1f} s", flush=True)
            self.disturbed.append(
                {
                    "what": what,
                    "attempt": attempt,
                    "seconds": seconds,
                    "other_cpu_s": other,
                    "kept": attempt == self.retries,
                }
            )
            if attempt < self.retries:
                self.wait_until_quiet()
        return value

    def wait_until_quiet(self) -> None:
        """Until other processes take at most ``max_other_cpu`` CPU s per s over ``window`` seconds."""
        deadline = time.monotonic() + self.max_wait
        while True:
            before = busy_cpu_seconds()
            time.sleep(self.window)
            other = other_cpu_seconds(before, busy_cpu_seconds())
            if other <= self.max_other_cpu * self.window:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"other processes kept taking the CPU for {self.max_wait:.0f} s")
            print(f"other processes took {other:.1f} CPU s in {self.window:.0f} s; waiting", flush=True)
