"""The GPU battery (``make gpu-check``): bf16 correctness, memory plan vs measured, MFU, policy
update vs GRPOTrainer and generation throughput, in one command, with every result in one JSON and
one markdown summary in ``--out`` (``GPU_CHECK_OUT``).

Without CUDA it runs in CPU mode: the same code on tiny shapes, in seconds, so the battery keeps
working between the rare GPU runs (``tests/integration/test_gpu_check.py`` runs it in ``make test``). A CPU-mode
result says so in its first line and in its JSON (``"mode": "cpu"``); it is never a GPU result.

Each section runs in its own process (a crash or an out-of-memory error in one leaves the others'
results, and each measures its own peaks); the JSON and summary are rewritten after every section,
so a run cut off by a time limit keeps what it finished.

    python -m benchmarks.gpu_check --out /tmp/gpu-check              # GPU if there is one, else CPU mode
    python -m benchmarks.gpu_check --mode quick --out /tmp/gpu-quick  # a 2-minute first look at a GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, cpu_model, git_commit, software

SECTIONS = {  # name -> (module, seconds allowed in GPU mode); the memory plan first, it matters most
    "memory": ("benchmarks.gpu_battery.memory", 240),
    "update": ("benchmarks.gpu_battery.update", 200),
    "loop_bf16": ("benchmarks.gpu_battery.loop_bf16", 240),
    "decode": ("benchmarks.gpu_battery.decode", 300),
    "profile": ("benchmarks.gpu_battery.profile", 300),
    "offload": ("benchmarks.gpu_battery.optimizer_offload", 300),
    "zero3": ("benchmarks.gpu_battery.zero3", 240),
    "vllm": ("benchmarks.gpu_battery.vllm_generation", 420),
    "real_model": ("benchmarks.gpu_battery.real_model", 420),
    "long_horizon": ("benchmarks.gpu_battery.long_horizon", 240),
    "long_horizon_english": ("benchmarks.gpu_battery.long_horizon_english", 420),
}
SECTION_LIMIT_VARIABLE = "GPU_CHECK_SECTION_LIMIT"  # a section's own time limit, in seconds, for it to plan by
PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets")


def measured_with() -> dict[str, str | None]:
    """The JSON's ``software``: Python, torch's CUDA and the package versions (``common.software``)."""
    import torch

    versions = software(PACKAGES)
    return {"python": versions.pop("python"), "torch_cuda": torch.version.cuda, **versions}


def host() -> dict[str, object]:
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model()}


def commit() -> str:
    """``LOOP_COMMIT`` where it is set, else the checkout's git commit ("unknown" outside git)."""
    return os.environ.get("LOOP_COMMIT") or git_commit()


def run_section(name: str, mode: str, out: Path) -> None:
    """In the child process: one section, its result as JSON."""
    import importlib

    module = importlib.import_module(SECTIONS[name][0])
    out.write_text(json.dumps(module.run(mode), indent=2, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("GPU_CHECK_OUT") or "gpu-check-out"))
    parser.add_argument(
        "--mode",
        choices=["auto", "gpu", "quick", "cpu"],
        default="auto",
        help="auto: gpu where CUDA is available, else cpu; quick: one shape per section on a GPU",
    )
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument(
        "--seconds",
        type=int,
        default=None,
        help="cap every section's time limit at this (a section that reads its limit plans within it: vllm)",
    )
    parser.add_argument("--_section", nargs=3, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options._section:
        name, mode, out = options._section
        run_section(name, mode, Path(out))
        return 0

    import torch

    from benchmarks.gpu_battery.report import write_summary

    cuda = torch.cuda.is_available()
    mode = options.mode if options.mode != "auto" else ("gpu" if cuda else "cpu")
    if mode != "cpu" and not cuda:
        parser.error(f"--mode {mode} needs a CUDA device; none is visible")
    device = torch.cuda.get_device_name(0) if cuda and mode != "cpu" else None
    if mode == "cpu":
        print(
            "gpu-check: CPU MODE (no CUDA device): tiny shapes on the CPU check that the battery's code runs; "
            "these numbers are NOT a GPU result",
            flush=True,
        )
    else:
        print(f"gpu-check: {mode.upper()} mode on {device}", flush=True)
    options.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {  # the JSON
        "mode": mode,
        "device": device or "cpu",
        "gpu_result": mode != "cpu",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "software": measured_with(),
        "host": host(),
        "sections": {},
        "generation_backend": "the transformers backend in loop_bf16 and decode; vLLM in the vllm section "
        "(vLLM 0.26.0 carried to the GPU machine in two chunks: tools/vllm_chunks.sh, tools/gpu_vllm_unpack.sh)",
    }
    failures = 0
    for name in options.sections:
        started = time.perf_counter()
        section_out = options.out / f".{name}.json"
        section_out.unlink(missing_ok=True)
        limit = SECTIONS[name][1] * (1 if mode != "cpu" else 2)
        limit = min(limit, options.seconds) if options.seconds else limit
        print(f"--- {name} (at most {limit} s)", flush=True)
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--_section", name, mode, str(section_out.resolve())]
        record: dict = {}
        try:
            done = subprocess.run(
                command,
                cwd=ROOT,
                timeout=limit,
                capture_output=True,
                text=True,
                env={
                    **os.environ,
                    "PYTHONUNBUFFERED": "1",
                    "TOKENIZERS_PARALLELISM": "false",
                    SECTION_LIMIT_VARIABLE: str(limit),
                },
            )
            (options.out / f"{name}.log").write_text(done.stdout + done.stderr)
            if done.returncode == 0:
                record = {"status": "ok", "result": json.loads(section_out.read_text())}
            else:
                record = {"status": "failed", "error": (done.stdout[-1500:] + done.stderr[-3000:]).strip()}
        except subprocess.TimeoutExpired as error:
            text = (error.stdout or b"").decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
            record = {"status": "timeout", "error": f"over {limit} s; last output:\n{text[-2000:]}"}
        except Exception:  # noqa: BLE001 - the battery reports a broken section and goes on
            record = {"status": "failed", "error": traceback.format_exc()}
        record["seconds"] = time.perf_counter() - started
        failures += record["status"] != "ok"
        results["sections"][name] = record
        print(
            f"--- {name}: {record['status']} in {record['seconds']:.0f} s"
            + ("" if record["status"] == "ok" else f"\n{record['error'][-3000:]}"),
            flush=True,
        )
        (options.out / "gpu-check.json").write_text(json.dumps(results, indent=2, default=str))
        write_summary(results, options.out / "gpu-check.md")
        section_out.unlink(missing_ok=True)
    print((options.out / "gpu-check.md").read_text())
    print(f"wrote {options.out / 'gpu-check.json'} and {options.out / 'gpu-check.md'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
