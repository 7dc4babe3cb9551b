"""Overlapped iterations (``max_staleness: 1``) against synchronous LOOP, on one machine with the generator
and the trainer each on a core of their own, side by side in one run.

The generator is a vLLM server (vllm-cpu) pinned to core 0 (``taskset``); this process trains, pinned to
core 1 with one torch thread. The work is the demo recipe's shape (recipes/demo.yaml: the tiny
warm-started vault model, 16 tasks x 6 rollouts, 2 PPO epochs of minibatches of 32) with a LoRA adapter
(r=8, every linear layer, lr 2e-3) hot-swapped into the server every iteration, at most 16 episodes in
flight (vllm-cpu's engine died with all 96). Each mode runs ``--iterations`` iterations from the same
start; reported: wall seconds of ``train()``, iterations per hour, and the ratio.

Each mode runs after one discarded iteration (the server's first requests and adapter load would otherwise
land on the first mode), and the result also gives the ratio after the first iteration, per sampled token,
and the bound the synchronous run's own phases set: (its iteration) / (its longer phase).

    .vllm-venv/bin/python -m benchmarks.overlap --iterations 8 --out benchmarks/results/overlap-cpu.json
    .vllm-venv/bin/python -m benchmarks.overlap --iterations 8 --ppo-epochs 5 \
        --out benchmarks/results/overlap-cpu-balanced.json                  # an update as long as the collection
    .vllm-venv/bin/python -m benchmarks.overlap --recipe recipes/smollm2-135m-contacts.yaml \
        --model-dir ~/.cache/loop_trainer/models/smollm2-135m-instruct-0.1.2   # ~4 min an iteration on 2 cores
    .vllm-venv/bin/python -m benchmarks.overlap --processes 2 --staleness 0 1 2 --trainer-cores 1 \
        --out benchmarks/results/overlap-cpu-2-processes.json    # 2 training processes (torchrun, gloo, DDP)

With ``--processes N`` each mode is a ``torch.distributed.run`` launch of N training processes (DDP over gloo),
all pinned to ``--trainer-cores``, each collecting its share of every batch from the one server.

With ``--gpu`` both share one GPU: the server (vLLM's CUDA build, bf16, ``--gpu-memory-utilization``
``--server-memory``, CUDA graphs for decode steps without torch.compile; eager with Triton's attention if
that engine fails to start) holds part of its memory and the trainer (``bf16: true``) the rest; nothing is
pinned to a core.
A recipe of full fine-tuning (no ``use_peft``) is served as full weights, which the trainer streams into
the server every iteration and probe-checks (``vllm_sync_tolerance``: ``--sync-tolerance``, default bf16's 0.25)::

    python -m benchmarks.overlap --gpu --recipe recipes/errands.yaml --model-dir WARM_START --iterations 12 \
        --time-limit 300 --out overlap-gpu.json

``--set KEY=VALUE`` changes a recipe key for every mode; a LoRA policy (``--set use_peft=true``) is served as adapters,
which ``max_staleness`` above 1 needs (a server holds one set of full weights, but an adapter per policy version).
``--partial-staleness K`` adds a mode of partial rollouts at ``max_staleness: K`` behind the paper's straggler cut
(:data:`CUT`). The ``--staleness`` modes keep the recipe's cut (none in errands.yaml: every episode is waited for), so
a partial mode against them measures the cut and the carrying together; ``--cut-staleness K`` adds the control, a
mode behind the same cut that cancels its stragglers instead of carrying them (labelled ``K+cut``). The server takes
the deepest mode's ``max_staleness`` + 1 adapters in a batch (``--max-loras``)::

    python -m benchmarks.overlap --gpu --recipe recipes/errands.yaml --model-dir WARM_START --set use_peft=true \
        --set lora_r=16 --set lora_alpha=32 --set lora_dropout=0 --staleness 0 1 2 --cut-staleness 1 \
        --partial-staleness 1 --process-staleness 1 --partial-process-staleness 1 --iterations 12 --time-limit 500 \
        --out overlap-gpu-lora.json

``--process-staleness K`` adds a mode at ``max_staleness: K`` that collects ahead in a child process
(``collection_process: true``, labelled ``K+process``) instead of on a thread of the training process: against the
plain ``K`` mode it measures what the interpreter lock shared with the collection costs the update;
``--partial-process-staleness K`` is the partial mode with its carried episodes held by that child
(``K+partial+process``), measured against ``K+partial``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import command_line, software

CUT = {"early_stop_done_fraction": 0.9, "early_stop_task_fraction": 0.75}  # the paper's straggler cut
DEMO: dict[str, Any] = {  # LOOPConfig keyword arguments
    "tasks_per_iteration": 16,
    "rollouts_per_task": 6,
    "minibatch_size": 32,
    "ppo_epochs": 2,
    "epsilon": 0.1,
    "advantage_threshold": 0.01,
    "learning_rate": 2.0e-3,
    "max_grad_norm": 1.0,
    "weight_decay": 0.01,
    "max_turns": 6,
    "max_new_tokens_per_turn": 4,
    "max_trajectory_tokens": 512,
    "per_device_train_batch_size": 16,
    "activation_checkpointing": False,
    "bf16": False,
    "seed": 0,
}


@dataclass(frozen=True)
class GpuServer:
    """How the server shares one GPU with the trainer (``--gpu``)."""

    memory_fraction: float = 0.2  # vLLM's gpu_memory_utilization: the trainer keeps the rest
    max_num_seqs: int = 128
    # True: the fallback when the first engine fails to start: no CUDA graphs, and Triton's attention kernels
    # instead of FlashAttention 3 (whose build may lack a small model's head size)
    eager: bool = False


def start_server(
    model_dir: str,
    port: int,
    core: int,
    log: Path,
    lora_rank: int | None = 8,
    max_model_len: int = 512,
    gpu: GpuServer | None = None,
    max_loras: int = 1,
) -> subprocess.Popen:
    """vLLM's OpenAI server on ``model_dir``: vllm-cpu pinned to ``core``, or with ``gpu`` on the GPU it shares
    with the trainer. ``lora_rank`` None serves full weights (the trainer reloads them in place every iteration);
    with adapters, ``max_loras`` of them decode in one batch (``max_staleness`` + 1: docs/overlap.md).
    The server leads a process group of its own, so :func:`stop_server` ends its engine process too."""
    from loop_trainer.rollout.vllm_server import SERVER_ENV

    env = {**os.environ, **SERVER_ENV}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", model_dir, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs"]
    command += ["--generation-config", "vllm"]
    if gpu is None:
        # taskset pins the server; vLLM's own OpenMP binding would pick cores itself
        env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        command = ["taskset", "-c", str(core), *command, "--dtype", "float32", "--enforce-eager"]
    else:
        import importlib.util

        if importlib.util.find_spec("flashinfer") is None:
            env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the GPU carry leaves FlashInfer out
        command += ["--dtype", "bfloat16", "--gpu-memory-utilization", str(gpu.memory_fraction)]
        command += ["--max-num-seqs", str(gpu.max_num_seqs)]
        if gpu.eager:
            command += ["--enforce-eager", "--attention-backend", "TRITON_ATTN"]
        else:  # decode steps replayed as CUDA graphs; no Dynamo or Inductor, so the start stays short
            graphs = {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 128}
            command += ["--compilation-config", json.dumps(graphs)]
    if lora_rank is not None:
        from loop_trainer.rollout.vllm_backend import vllm_lora_rank

        command += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(lora_rank)), "--max-loras", str(max_loras)]
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the API server and its engine core), SIGKILL after 60 s."""
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def wait_for(url: str, process: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the vLLM server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(1)


def run_mode(
    model_dir: str,
    url: str,
    staleness: int,
    iterations: int,
    workdir: Path,
    ppo_epochs: int = 2,
    distributed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from loop_trainer import LOOPConfig, LOOPTrainer
    from loop_trainer.envs import VaultEnv
    from loop_trainer.models.tiny import load_tokenizer

    args = LOOPConfig(
        output_dir=str(workdir / f"staleness-{staleness}"),
        iterations=iterations,
        max_staleness=staleness,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_sync_dir=str(workdir / f"sync-{staleness}"),
        max_concurrent_episodes=16,  # vllm-cpu's engine died with all 96 in flight (the server tests run 16)
        save_strategy="no",
        report_to="none",
        plot_curves=False,
        disable_tqdm=True,
        memory_stress_test=False,
        viewer_rollouts_per_iteration=0,
        **{**DEMO, "ppo_epochs": ppo_epochs},
        **(distributed or {}),
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir).float()
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    trainer = LOOPTrainer(
        model, VaultEnv(num_tasks=64), args, processing_class=load_tokenizer(model_dir), peft_config=lora
    )
    started = time.perf_counter()
    trainer.train()
    return summary(staleness, trainer.history, time.perf_counter() - started)


def run_processes(
    processes: int,
    cores: str,
    model_dir: str,
    url: str,
    staleness: int,
    iterations: int,
    workdir: Path,
    ppo_epochs: int,
) -> dict[str, Any]:
    """:func:`run_mode` as ``processes`` training processes (torchrun, gloo), pinned to ``cores``; rank 0's summary."""
    from loop_trainer.net import free_local_port

    where = workdir / f"processes-{staleness}"
    where.mkdir(parents=True, exist_ok=True)
    job = {"model_dir": model_dir, "url": url, "staleness": staleness, "iterations": iterations}
    job |= {"workdir": str(where), "ppo_epochs": ppo_epochs}
    command = ["taskset", "-c", cores, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node"]
    command += [str(processes), "--master_addr", "127.0.0.1", "--master_port", str(free_local_port())]
    command += ["-m", "benchmarks.overlap", "--worker", json.dumps(job)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    subprocess.run(command, check=True, env=environment)
    result = json.loads((where / "summary.json").read_text())
    result["launch_seconds"] = time.perf_counter() - started  # with the processes' start-up and model loading
    return result


def worker(job: dict[str, Any]) -> None:
    """One training process of :func:`run_processes` (its process group set up before the config)."""
    import torch
    from accelerate import PartialState

    from loop_trainer.training.distribution import end_distributed_run

    torch.set_num_threads(1)
    state = PartialState(cpu=True, backend="gloo")
    distributed = {"accelerator_config": {"use_configured_state": True}}
    workdir = Path(job["workdir"])
    result = run_mode(
        job["model_dir"], job["url"], job["staleness"], job["iterations"], workdir, job["ppo_epochs"], distributed
    )
    if state.is_main_process:
        (workdir / "summary.json").write_text(json.dumps({**result, "num_processes": state.num_processes}))
    end_distributed_run()


MODE_KEYS = frozenset(
    {"config", "model_name_or_path", "output_dir", "iterations", "max_staleness", "partial_rollouts", "use_vllm"}
    | {"vllm_mode", "vllm_server_base_url", "vllm_sync_dir", "collection_process"}
)
"""The keys each mode sets itself (:func:`run_recipe_mode`), which ``--set`` may not change."""
LORA_RANK_DEFAULT = 16  # TRL's ModelConfig.lora_r, what loop-train trains when a recipe names no lora_r


def recipe_settings(recipe: str, recipe_keys: dict[str, str]) -> dict[str, Any]:
    """The recipe as the modes run it: its file, with ``--set``'s values read as a recipe file reads them."""
    import yaml

    return yaml.safe_load(Path(recipe).read_text()) | {key: yaml.safe_load(value) for key, value in recipe_keys.items()}


def served_lora_rank(settings: dict[str, Any]) -> int | None:
    """The adapters' rank the server must take for these recipe settings; None: full weights (no ``use_peft``)."""
    return int(settings.get("lora_r", LORA_RANK_DEFAULT)) if settings.get("use_peft") else None


def server_flags(url: str, sync_dir: Path, staleness: int) -> dict[str, Any]:
    """The ``loop-train`` flags that generate on the server at ``url`` with ``max_staleness``, and keep a
    measured run free of checkpoints, plots and viewer pages."""
    return {
        "max_staleness": staleness,
        "use_vllm": "true",
        "vllm_mode": "server",
        "vllm_server_base_url": url,
        "vllm_sync_dir": sync_dir,
        "save_strategy": "no",
        "plot_curves": "false",
        "disable_tqdm": "true",
        "viewer_rollouts_per_iteration": 0,
    }


VARIANTS = ("plain", "cut", "partial", "process", "partial+process")
"""A mode's collection: the recipe's own; behind the paper's straggler cut (:data:`CUT`), the stragglers cancelled;
behind the cut, the stragglers carried into the next batch (partial rollouts); the recipe's own, collected ahead in a
child process (``collection_process: true``) instead of on a thread; partial rollouts held by that child."""


def mode_label(staleness: int, variant: str = "plain") -> str:
    """How a mode is named in the result: its ``max_staleness``, with ``+cut``, ``+partial``, ``+process`` or
    ``+partial+process`` (:data:`VARIANTS`)."""
    return str(staleness) if variant == "plain" else f"{staleness}+{variant}"


def variant_flags(variant: str) -> dict[str, Any]:
    """The ``loop-train`` flags of a variant (:data:`VARIANTS`)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: one of {VARIANTS}")
    if variant == "process":
        return {"collection_process": "true"}
    if variant == "partial+process":
        return {**variant_flags("partial"), "collection_process": "true"}
    return {} if variant == "plain" else {**CUT, "partial_rollouts": str(variant == "partial").lower()}


def run_recipe_mode(
    recipe: str,
    model_dir: str,
    url: str,
    staleness: int,
    iterations: int,
    workdir: Path,
    extra: dict[str, Any] | None = None,
    variant: str = "plain",
) -> dict[str, Any]:
    """A recipe as ``loop-train`` runs it, on the model the server serves, with the server's keys (and
    ``extra`` flags) added; ``variant``: the recipe's collection, or behind the paper's straggler cut (:data:`CUT`)
    with the stragglers cancelled or carried (:data:`VARIANTS`)."""
    from loop_trainer.cli.recipe import parse_recipe
    from loop_trainer.cli.train import main as train

    label = mode_label(staleness, variant).replace("+", "-")
    flags = {
        "config": recipe,
        "model_name_or_path": model_dir,
        "output_dir": workdir / f"staleness-{label}",
        "iterations": iterations,
        **server_flags(url, workdir / f"sync-{label}", staleness),
        "memory_stress_test": "false",
        **(extra or {}),
        **variant_flags(variant),
    }
    started = time.perf_counter()
    trainer = train(*parse_recipe([part for key, value in flags.items() for part in (f"--{key}", str(value))]))
    assert trainer is not None
    return summary(staleness, trainer.history, time.perf_counter() - started, variant)


def summary(staleness: int, history: list[dict[str, Any]], wall: float, variant: str = "plain") -> dict[str, Any]:
    # The steady state: without the first iteration (its start-up, nothing to overlap) and without the last
    # max_staleness ones, whose batches were collected ahead and which queue none (an end effect that favours a
    # deeper queue on a short run).
    steady = history[1 : len(history) - staleness] or history
    return {
        "mode": mode_label(staleness, variant),
        "max_staleness": staleness,
        "straggler_cut": variant in ("cut", "partial", "partial+process"),
        "collection_process": variant in ("process", "partial+process"),
        "partial_rollouts": variant in ("partial", "partial+process"),
        "iterations": len(history),
        "wall_seconds": wall,
        "iterations_per_hour": 3600 * len(history) / wall,
        "iteration_seconds": [r["seconds"] for r in history],
        # the steady state the ratio and the bound are read from (mean and median: single iterations spike)
        "steady_iterations": len(steady),
        "steady_iteration_seconds": statistics.fmean(r["seconds"] for r in steady),
        "steady_iteration_seconds_median": statistics.median(r["seconds"] for r in steady),
        "steady_rollout_seconds": statistics.fmean(r["rollout_seconds"] for r in steady),
        "steady_update_seconds": statistics.fmean(r["update_seconds"] for r in steady),
        "rollout_seconds_mean": sum(r["rollout_seconds"] for r in history) / len(history),
        "update_seconds_mean": sum(r["update_seconds"] for r in history) / len(history),
        # the work: a policy that fails sooner (a wrong early submit) samples fewer turns and tokens
        "sampled_tokens": sum(r["sampled_tokens"] for r in history),
        "sampled_tokens_per_rollout_second": sum(r["sampled_tokens"] for r in history)
        / sum(r["rollout_seconds"] for r in history),
        "turns_mean": [r["turns_mean"] for r in history],
        "reward_mean": [r["reward_mean"] for r in history],
        "policy_staleness": [r["policy_staleness"] for r in history],
        # the straggler cut's work: episodes cancelled, or (partial rollouts) carried and dropped as too stale
        "cancelled_episodes": [r.get("num_cancelled") for r in history],
        "carried_episodes": [r.get("carried_episodes") for r in history],
        "dropped_stale_episodes": [r.get("dropped_stale_episodes") for r in history],
        # each iteration's weight sync into the server (absent where nothing was synced)
        "weight_sync_seconds": [r.get("weight_sync_seconds") for r in history],
        "weight_sync_logprob_diff_max": [r.get("weight_sync_logprob_diff_max") for r in history],
        "weight_sync_logprob_diff_mean": [r.get("weight_sync_logprob_diff_mean") for r in history],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument(
        "--ppo-epochs",
        type=int,
        default=2,
        help="the demo's 2, or more to lengthen the update towards the collection (the gain depends on their ratio)",
    )
    parser.add_argument(
        "--recipe",
        help="instead of the tiny demo model with LoRA: this LoRA recipe through loop-train (e.g. "
        "recipes/smollm2-135m-contacts.yaml), its model served as it is",
    )
    parser.add_argument(
        "--model-dir",
        help="with --recipe: its model as a local directory, e.g. a packaged model's converted copy in "
        "~/.cache/loop_trainer/models/ (.vllm-venv lacks the package that ships it)",
    )
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--processes", type=int, default=1, help="training processes (torchrun, gloo, DDP)")
    parser.add_argument(
        "--trainer-cores",
        default=None,
        help="with --processes: the cores they share, as taskset lists them (default: --trainer-core)",
    )
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="the max_staleness of each mode")
    parser.add_argument(
        "--partial-staleness",
        type=int,
        nargs="+",
        default=[],
        help="with --recipe: modes of partial rollouts at these max_staleness (>= 1), behind the paper's straggler "
        "cut, after the --staleness ones",
    )
    parser.add_argument(
        "--cut-staleness",
        type=int,
        nargs="+",
        default=[],
        help="with --recipe: modes at these max_staleness behind the same cut, its stragglers cancelled, not carried "
        "(the control of --partial-staleness), before the partial ones",
    )
    parser.add_argument(
        "--process-staleness",
        type=int,
        nargs="+",
        default=[],
        help="with --recipe: modes at these max_staleness (>= 1) that collect ahead in a child process "
        "(collection_process: true) instead of on a thread, after the others",
    )
    parser.add_argument(
        "--partial-process-staleness",
        type=int,
        nargs="+",
        default=[],
        help="with --recipe: modes of partial rollouts at these max_staleness (>= 1), held by a child process "
        "(the --partial-staleness ones with collection_process: true), last",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --recipe: a recipe key for every mode, e.g. --set use_peft=true --set lora_r=8 (max_staleness "
        "above 1 needs a LoRA policy on the server)",
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="the server and the trainer share this machine's GPU (vLLM's CUDA build); nothing is pinned to a core",
    )
    parser.add_argument(
        "--server-memory", type=float, default=0.2, help="with --gpu: the server's gpu_memory_utilization"
    )
    parser.add_argument(
        "--sync-tolerance",
        type=float,
        default=0.25,
        help="with --gpu: vllm_sync_tolerance (bf16's default 0.25; each sync's probe gap is reported either way)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds: a mode that would start after this much time is not run (reported), so a short device "
        "call keeps what finished",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a training process of --processes (JSON job)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args(argv)
    if options.worker:
        worker(json.loads(options.worker))
        return
    if options.gpu and (options.processes > 1 or not options.recipe):
        parser.error("--gpu runs a --recipe in one training process (the demo's tiny model is CPU-sized)")
    by_recipe = (options.partial_staleness, options.cut_staleness, options.process_staleness, options.set)
    if (any(by_recipe) or options.partial_process_staleness) and not options.recipe:
        parser.error(
            "--partial-staleness, --cut-staleness, --process-staleness, --partial-process-staleness and --set apply "
            "to a --recipe"
        )
    if any(staleness < 0 for staleness in options.staleness + options.cut_staleness):
        parser.error("--staleness and --cut-staleness: max_staleness is 0 or more")
    if any(staleness < 1 for staleness in options.partial_staleness + options.partial_process_staleness):
        parser.error("--partial-staleness, --partial-process-staleness: partial rollouts need max_staleness >= 1")
    if any(staleness < 1 for staleness in options.process_staleness):
        parser.error("--process-staleness: a collection process collects ahead, which needs max_staleness >= 1")
    if any("=" not in pair for pair in options.set):
        parser.error(f"--set takes KEY=VALUE; got {[pair for pair in options.set if '=' not in pair]}")
    recipe_keys = dict(pair.split("=", 1) for pair in options.set)
    cut_modes = options.partial_staleness or options.cut_staleness or options.partial_process_staleness
    fixed = sorted(set(recipe_keys) & (MODE_KEYS | (set(CUT) if cut_modes else set())))
    if fixed:
        parser.error(
            f"--set cannot change {fixed}: each mode sets them itself (--staleness, --cut-staleness, "
            "--partial-staleness, --process-staleness, --partial-process-staleness)"
        )
    deepest = max(
        options.staleness
        + options.cut_staleness
        + options.partial_staleness
        + options.process_staleness
        + options.partial_process_staleness
    )
    settings = recipe_settings(options.recipe, recipe_keys) if options.recipe else {}
    if options.recipe and deepest > 1 and served_lora_rank(settings) is None:
        parser.error(
            f"max_staleness {deepest} needs a LoRA policy on the server (one set of full weights holds one version): "
            "--set use_peft=true"
        )
    if not options.gpu:
        os.sched_setaffinity(0, {options.trainer_core})  # before any thread: they all inherit it
    import torch

    from loop_trainer.envs import VaultEnv
    from loop_trainer.models.tiny import build_tiny_from_spec
    from loop_trainer.net import free_local_port

    if not options.gpu:
        torch.set_num_threads(1)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="overlap-") as directory:
        workdir = Path(directory)
        if options.recipe:
            from loop_trainer.models.packaged import resolve_model_path

            model_dir = options.model_dir or resolve_model_path(settings["model_name_or_path"])
            lora_rank = served_lora_rank(settings)
            max_model_len = 2 * settings["max_trajectory_tokens"]
            # on the GPU the trainer computes in bf16 like the server, and the probe check allows bf16's noise
            extra = {"bf16": "true", "vllm_sync_tolerance": options.sync_tolerance} if options.gpu else {}
            extra |= recipe_keys

            def run(staleness: int, iterations: int, where: Path, variant: str = "plain") -> dict[str, Any]:
                return run_recipe_mode(options.recipe, model_dir, url, staleness, iterations, where, extra, variant)
        else:
            model, tokenizer = build_tiny_from_spec(
                "tiny-instruct:vault", VaultEnv(num_tasks=64), seed=0, warm_up_steps=400
            )
            model_dir = str(workdir / "model")
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            lora_rank, max_model_len = 8, 512

            def run(staleness: int, iterations: int, where: Path, variant: str = "plain") -> dict[str, Any]:
                if options.processes > 1:
                    cores = options.trainer_cores or str(options.trainer_core)
                    return run_processes(
                        options.processes, cores, model_dir, url, staleness, iterations, where, options.ppo_epochs
                    )
                return run_mode(model_dir, url, staleness, iterations, where, options.ppo_epochs)

        port, log = free_local_port(), workdir / "server.log"
        url = f"http://127.0.0.1:{port}"
        gpu = GpuServer(memory_fraction=options.server_memory) if options.gpu else None
        adapters = deepest + 1  # versions that decode in one batch (docs/overlap.md)
        server = start_server(model_dir, port, options.server_core, log, lora_rank, max_model_len, gpu, adapters)
        runs: list[dict[str, Any]] = []
        not_run: list[str] = []
        try:
            start_timeout = 180 if gpu else 600  # on a GPU a hung start would spend the device call
            try:
                wait_for(url, server, log, start_timeout)
            except RuntimeError:
                if gpu is None or gpu.eager:
                    raise
                print(f"the server with CUDA graphs did not start; eager instead:\n{log.read_text()[-3000:]}")
                if options.out:
                    shutil.copyfile(log, options.out.with_suffix(".server-first-try.log"))
                stop_server(server)
                gpu = GpuServer(memory_fraction=options.server_memory, eager=True)
                core = options.server_core
                server = start_server(model_dir, port, core, log, lora_rank, max_model_len, gpu, adapters)
                wait_for(url, server, log, start_timeout)
            server_seconds = time.perf_counter() - began
            print(f"the vLLM server is up after {server_seconds:.0f} s", flush=True)
            # a discarded iteration first: the server's first requests and adapter load would land on one mode
            run(0, 1, workdir / "warm-up")
            modes = (
                [(k, "plain") for k in options.staleness]
                + [(k, "cut") for k in options.cut_staleness]
                + [(k, "partial") for k in options.partial_staleness]
                + [(k, "process") for k in options.process_staleness]
                + [(k, "partial+process") for k in options.partial_process_staleness]
            )
            for staleness, variant in modes:
                if options.time_limit and runs and time.perf_counter() - began > options.time_limit * 0.55:
                    not_run.append(mode_label(staleness, variant))  # another mode as long as the last would not fit
                    continue
                runs.append(run(staleness, options.iterations, workdir, variant))
        except Exception:
            print(f"the vLLM server's log ends:\n{log.read_text()[-60000:]}", file=sys.stderr)
            raise
        finally:
            stop_server(server)
            if options.out:  # the server's whole log beside the result (a device call's only record of it)
                shutil.copyfile(log, options.out.with_suffix(".server.log"))
    if len(runs) < 2:
        raise SystemExit(f"only {len(runs)} mode finished within --time-limit {options.time_limit} s: {runs}")
    result = {
        "command": command_line("benchmarks.overlap", python="python3" if options.gpu else ".vllm-venv/bin/python"),
        "workload": options.recipe
        or f"the demo's shape, tiny-instruct:vault with LoRA r=8, {options.ppo_epochs} PPO epochs",
        "software": software(("torch", "vllm", "transformers", "trl"), host=True, checkout=True),
        "cores": None
        if options.gpu
        else {
            "server": options.server_core,
            "trainer": options.trainer_cores if options.processes > 1 else options.trainer_core,
        },
        "gpu": None
        if gpu is None
        else {
            "device": torch.cuda.get_device_name(0),
            "server_memory_fraction": gpu.memory_fraction,
            "server_cuda_graphs": not gpu.eager,
            "server_start_seconds": server_seconds,
            "trainer_peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        },
        "served": "full weights" if lora_rank is None else f"LoRA r={lora_rank}",
        # the flags it ran with (--max-loras among them); start_server passes a list
        "server_command": [str(part) for part in server.args] if isinstance(server.args, list) else str(server.args),
        "recipe_keys": recipe_keys,
        "modes_not_run": not_run,
        "num_processes": options.processes,
        "runs": runs,
        "speedup_of": [runs[1]["mode"], runs[0]["mode"]],  # which two modes speedup and steady_speedup compare
        "speedup": runs[1]["iterations_per_hour"] / runs[0]["iterations_per_hour"],
        # every overlapped mode against the synchronous one (runs[0] is the first --staleness, 0 by default)
        "speedups": {mode["mode"]: mode["iterations_per_hour"] / runs[0]["iterations_per_hour"] for mode in runs},
        # the same ratio per sampled token: the two modes' policies differ, and so does their work
        "speedup_per_sampled_token": (runs[1]["sampled_tokens"] / runs[1]["wall_seconds"])
        / (runs[0]["sampled_tokens"] / runs[0]["wall_seconds"]),
        "steady_speedup": runs[0]["steady_iteration_seconds"] / runs[1]["steady_iteration_seconds"],
        "steady_speedups": {
            mode["mode"]: runs[0]["steady_iteration_seconds"] / mode["steady_iteration_seconds"] for mode in runs
        },
        "steady_speedups_median": {
            mode["mode"]: runs[0]["steady_iteration_seconds_median"] / mode["steady_iteration_seconds_median"]
            for mode in runs
        },
        # the most overlap can give, from the synchronous run's steady state: its whole iteration against its
        # longer phase alone (the weight sync and the bookkeeping stay on the critical path either way)
        "phase_bound": runs[0]["steady_iteration_seconds"]
        / max(runs[0]["steady_rollout_seconds"], runs[0]["steady_update_seconds"]),
    }
    for mode in runs:
        print(
            f"max_staleness {mode['mode']}: {mode['iterations']} iterations in {mode['wall_seconds']:.1f} s, "
            f"{mode['iterations_per_hour']:.0f}/hour (rollouts {mode['rollout_seconds_mean']:.2f} s, update "
            f"{mode['update_seconds_mean']:.2f} s per iteration; {mode['sampled_tokens']} sampled tokens, "
            f"{mode['sampled_tokens_per_rollout_second']:.0f} per rollout second)"
        )
    print(
        f"overlapped / synchronous iterations per hour: {result['speedup']:.2f}x; sampled tokens per hour: "
        f"{result['speedup_per_sampled_token']:.2f}x; steady state (after the first iteration, before the last "
        f"max_staleness ones): {result['steady_speedup']:.2f}x, "
        f"against the synchronous phases' bound of {result['phase_bound']:.2f}x"
    )
    if options.out:
        options.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
