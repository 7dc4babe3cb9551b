"""Policy update, LOOPTrainer vs GRPOTrainer: ``benchmarks/update_throughput.py`` run as it is, on
CUDA with a real model body (GPU mode) or its tiny CPU body (CPU mode). Each trainer runs in its own
subprocess there; this section only chooses the workload and reads its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from benchmarks.common import ROOT
from benchmarks.gpu_battery.common import TINY_CONFIG, device_for, scratch, sizes_for


def command(mode: str, out: str) -> list[str]:
    sizes = sizes_for(mode)
    body = (
        ["--shape", sizes.update_shape]
        if sizes.update_shape != "tiny"
        else [
            "--hidden-size",
            str(TINY_CONFIG["hidden_size"]),
            "--layers",
            str(TINY_CONFIG["num_hidden_layers"]),
            "--heads",
            str(TINY_CONFIG["num_attention_heads"]),
            "--kv-heads",
            str(TINY_CONFIG["num_key_value_heads"]),
        ]
    )
    return [
        sys.executable,
        "-m",
        "benchmarks.update_throughput",
        "--device",
        device_for(mode),
        "--lengths",
        *map(str, sizes.update_lengths),
        "--num-trajectories",
        str(sizes.update_trajectories),
        "--minibatch-size",
        str(sizes.update_minibatch),
        "--ppo-epochs",
        str(sizes.update_epochs),
        *body,
        "--out",
        out,
    ]


def run(mode: str) -> dict[str, Any]:
    with scratch() as directory:
        out = os.path.join(directory, "update.json")
        argv = command(mode, out)
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        print(done.stdout[-4000:], flush=True)
        if done.returncode:
            raise RuntimeError(
                f"update_throughput.py failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            )
        with open(out) as file:
            result = json.load(file)
    result["command"] = " ".join(["python", *argv[1:]]).replace(out, "OUT.json")
    return result
