"""Policy-update throughput and peak memory: ``LOOPTrainer`` vs TRL's ``GRPOTrainer`` on identical trajectories.

Both get the same seeded Qwen2 model (Qwen2.5's 151,665-token vocabulary, a small body), the same
optimizer settings and the same multi-turn trajectories (random token ids; a prompt, then sampled
assistant spans with unsampled observation spans between them; one advantage each, signs mixed).
Each trainer runs in its own subprocess.

* LOOP: ``LOOPTrainer.update_policy(samples)``: old log-probs, then ``ppo_epochs`` epochs of
  ``minibatch_size``-trajectory minibatches, one optimizer step each.
* GRPO: ``GRPOTrainer.train()`` as TRL runs it, with ``_generate_and_score_completions`` replaced by
  the dict it returns for these trajectories: prompt = tokens before the first sampled one
  (left-padded across the generation batch), completion = the rest (right-padded), ``tool_mask`` =
  the loss mask on the completion, the advantages, and ``old_per_token_logps`` as TRL's
  ``_get_per_token_logps_and_entropies`` computes them, through the fused LM head GRPOTrainer adds
  (TRL computes them because ``gradient_accumulation_steps % (steps_per_generation * num_iterations)
  != 0`` here). Buffering/splitting, ``training_step`` ->
  ``_compute_loss``, accumulation, clipping and optimizer steps are TRL's. One optimizer step = one
  LOOP minibatch: same ``per_device_train_batch_size``, ``gradient_accumulation_steps = minibatch /
  micro_batch``, ``steps_per_generation = N / micro_batch``, ``num_iterations = ppo_epochs``,
  ``beta=0``, ``loss_type="grpo"`` (token mean per sequence, mean over the minibatch: LOOP's
  normalisation with divisor = minibatch size) and LOOP's clip range [1/1.1, 1.1].

Timing covers the whole update, old-log-prob pass included, for both; tokens/s = real trajectory
tokens (padding not counted) x ppo_epochs / seconds. Memory on CUDA: ``max_memory_allocated`` and
its rise over ``memory_allocated`` before the update. On CPU: peak RSS (``ru_maxrss``) and its rise
over the RSS before the update, plus the peak of malloc's in-use bytes (``mallinfo2``, sampled).

CPU note: TRL's fused LM head falls back to torch ops on [4096 x 32768] float32 tiles; with glibc's
defaults each temporary is a fresh ``mmap`` and over half the run is page faults. The CPU workers
run with ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` raised (~3x faster, both alike);
freed memory then stays resident, so compare the malloc columns, not RSS (``--plain-malloc``: off).

    python -m benchmarks.update_throughput         # CPU, ~7 min on 2 cores; JSON in benchmarks/results/
    python -m benchmarks.update_throughput --device cuda --lengths 4096 8192 16384 32768 \
        --num-trajectories 8 --minibatch-size 4 --ppo-epochs 2 --hidden-size 1024 --layers 8 --heads 8
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks.common import RESULTS, ROOT, command_line, proc_status_bytes

VOCAB_SIZE = 151_665  # Qwen2.5's tokenizer
LOOP_EPSILON = 0.1  # LOOP clips the ratio to [1/(1+eps), 1+eps]


@dataclass
class Spec:
    """Everything a worker needs; identical for both trainers."""

    device: str
    lengths: list[int]
    minibatch_size: int
    ppo_epochs: int
    micro_batch: int
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    checkpointing: bool
    seed: int
    shape: str | None = None
    """A shipped model shape (``loop_trainer/models/shapes``, e.g. Qwen2.5-1.5B-Instruct): its body replaces
    hidden_size/layers/heads/kv_heads."""
    activation_offloading: bool = False
    """LOOP only (GPU only): ``activation_offloading`` on, as the GPU battery's third memory run."""
    deepspeed: bool = False
    """LOOP only: run under ``accelerate launch`` with a DeepSpeed config (the GPU battery's offload section); on CPU
    the worker then creates the gloo process group accelerate does not, and keeps ``use_cpu`` off (with it
    accelerate never picks DeepSpeed)."""


# --- workload --------------------------------------------------------------------------------
def _split(total: int, parts: int, rng: random.Random) -> list[int]:
    """``total`` cut into ``parts`` positive random pieces."""
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


def make_trajectories(spec: Spec) -> list[dict[str, Any]]:
    """Seeded multi-turn trajectories: prompt, then ``turns`` sampled spans with observations between."""
    rng = random.Random(spec.seed)
    trajectories = []
    for index, length in enumerate(spec.lengths):
        prompt = max(32, int(length * rng.uniform(0.05, 0.12)))
        turns = rng.randint(4, 8)
        sampled = int(length * rng.uniform(0.20, 0.30))
        sampled_spans = _split(sampled, turns, rng)
        observation_spans = _split(length - prompt - sampled, turns - 1, rng)
        mask = [0] * prompt
        for turn in range(turns):
            mask += [1] * sampled_spans[turn]
            if turn < turns - 1:
                mask += [0] * observation_spans[turn]
        sign = 1.0 if index % 2 == 0 else -1.0
        token_ids = [rng.randrange(16, VOCAB_SIZE) for _ in range(length)]
        trajectories.append({"token_ids": token_ids, "loss_mask": mask, "advantage": sign * rng.uniform(0.2, 1.0)})
    return trajectories


def build_model(spec: Spec) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if spec.shape:
        from importlib import resources

        shapes = resources.files("loop_trainer") / "models" / "shapes"
        values = json.loads((shapes / f"{spec.shape}.json").read_text())
        body = {
            key: values[key]
            for key in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "tie_word_embeddings",
            )
        }
    else:
        body = {
            "vocab_size": VOCAB_SIZE,
            "hidden_size": spec.hidden_size,
            "intermediate_size": 4 * spec.hidden_size,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads,
            "tie_word_embeddings": True,
        }
    config = Qwen2Config(**body, max_position_embeddings=max(32768, max(spec.lengths)), pad_token_id=0)
    torch.manual_seed(spec.seed)
    dtype = torch.bfloat16 if spec.device == "cuda" else torch.float32
    # Built on the device it runs on: a 7B body initialised on the CPU would take minutes.
    with torch.device(spec.device):
        # PreTrainedModel.to is functools.wraps(Module.to), which typeshed types without binding self
        return Qwen2ForCausalLM(config).to(dtype)  # type: ignore[arg-type]


# --- measurement --------------------------------------------------------------------------------
class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class HeapSampler(threading.Thread):
    """Peak of glibc's in-use bytes (``mallinfo2``: heap chunks in use + mmapped chunks), sampled every 5 ms.
    Unlike RSS, this does not count freed memory the allocator keeps."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self._mallinfo2 = ctypes.CDLL(None).mallinfo2
        self._mallinfo2.restype = _MallInfo2
        self._done = threading.Event()
        self.baseline = self.peak = self.in_use()

    def in_use(self) -> int:
        info = self._mallinfo2()
        return int(info.uordblks + info.hblkhd)

    def run(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, self.in_use())

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.peak = max(self.peak, self.in_use())


class Meter:
    """Wall and CPU time and peak memory (CUDA allocator; on CPU, RSS and malloc's in-use bytes)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.result: dict[str, float] = {}

    def start(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        else:
            self.baseline = proc_status_bytes("VmRSS")
            self.heap = HeapSampler()
            self.heap.start()
        self.started, self.cpu_started = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        seconds, cpu_seconds = time.perf_counter() - self.started, time.process_time() - self.cpu_started
        mib = 1024.0**2
        if self.cuda:
            peak = torch.cuda.max_memory_allocated()
            heap = {}
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            self.heap.stop()
            heap = {
                "heap_peak_mib": self.heap.peak / mib,
                "heap_delta_mib": (self.heap.peak - self.heap.baseline) / mib,
            }
        self.result = {
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "peak_mib": peak / mib,
            "baseline_mib": self.baseline / mib,
            "peak_delta_mib": (peak - self.baseline) / mib,
            **heap,
        }


def run_loop(spec: Spec, trajectories: list[dict[str, Any]], output_dir: str) -> dict[str, Any]:
    from loop_trainer import LOOPConfig, LOOPTrainer
    from loop_trainer.envs import VaultEnv
    from loop_trainer.models.tiny import build_word_tokenizer
    from loop_trainer.training.batching import TrainingSample

    placement: dict[str, Any] = {"use_cpu": spec.device == "cpu"}
    if spec.deepspeed and spec.device == "cpu":
        from accelerate import PartialState

        PartialState(backend="gloo")  # before the LOOPConfig, which then registers the launch's DeepSpeed config
        placement = {"use_cpu": False, "accelerator_config": {"use_configured_state": True}}
    args = LOOPConfig(
        output_dir=output_dir,
        iterations=1,
        tasks_per_iteration=len(trajectories) // 2,
        rollouts_per_task=2,
        minibatch_size=spec.minibatch_size,
        ppo_epochs=spec.ppo_epochs,
        per_device_train_batch_size=spec.micro_batch,
        activation_checkpointing=spec.checkpointing,
        activation_offloading=spec.activation_offloading,
        bf16=spec.device == "cuda",
        max_trajectory_tokens=max(spec.lengths),
        epsilon=LOOP_EPSILON,
        seed=spec.seed,
        disable_tqdm=True,
        plot_curves=False,
        **placement,
    )
    trainer = LOOPTrainer(build_model(spec), VaultEnv(), args, processing_class=build_word_tokenizer(["x"]))
    samples = [
        TrainingSample(t["token_ids"], t["loss_mask"], [0.0] * len(t["token_ids"]), t["advantage"], False)
        for t in trajectories
    ]
    trainer.prepare_for_iterations()
    check_checkpointing(trainer.model, spec)
    first: dict[str, Any] = {}
    policy_update = trainer.policy_update
    assert policy_update is not None  # prepare_for_iterations built it
    minibatch_step = policy_update.minibatch_step

    def recording_step(samples_: Any, old: Any, minibatch: list[int]) -> Any:
        step = minibatch_step(samples_, old, minibatch)
        if not first and step is not None:
            first.update(loss=step.loss, advantages=[trajectories[i]["advantage"] for i in minibatch])
        return step

    meter = Meter(spec.device)
    with mock.patch.object(policy_update, "minibatch_step", recording_step):
        meter.start()
        record = trainer.update_policy(samples)
        meter.stop()
    return {
        **meter.result,
        "optimizer_steps": record["optimizer_steps"],
        "first_loss": first.get("loss"),
        "first_advantages": first.get("advantages"),
        "padded_width": max(spec.lengths),
    }


def _grpo_inputs(trajectories: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """The dict ``_generate_and_score_completions`` returns, minus ``old_per_token_logps``."""
    import torch
    from trl.trainer.utils import pad

    prompts, completions, tool_masks = [], [], []
    for t in trajectories:
        start = t["loss_mask"].index(1)  # the first sampled token starts the completion
        prompts.append(torch.tensor(t["token_ids"][:start]))
        completions.append(torch.tensor(t["token_ids"][start:]))
        tool_masks.append(torch.tensor(t["loss_mask"][start:]))
    completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right")
    tool_mask = pad(tool_masks, padding_value=1, padding_side="right")
    return {
        "prompt_ids": pad(prompts, padding_value=pad_token_id, padding_side="left"),
        "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
        "completion_ids": pad(completions, padding_value=pad_token_id, padding_side="right"),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([t["advantage"] for t in trajectories], dtype=torch.float32),
        "num_items_in_batch": (completion_mask * tool_mask).sum(),
        "tool_mask": tool_mask,
    }


def completion_logprobs(
    model: Any,
    input_ids: Any,
    attention_mask: Any,
    completion_length: int,
    batch_size: int,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Any:
    """The log-probs of the last ``completion_length`` tokens of each row (prompt and padding scored 0), in
    chunks of ``batch_size`` rows under ``autocast``: what GRPOTrainer's private
    ``_get_per_token_logps_and_entropies`` computes for a text model, here through the public API it uses,
    the fused LM head GRPOTrainer adds to its model (``trl.trainer.add_fused_lm_head``: a forward with
    ``labels`` and ``fused_lm_head=True`` returns per-token log-probs instead of logits)."""
    import torch

    chunks = []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-completion_length] = -100  # only the completion is scored
        with autocast():
            outputs = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        chunks.append(outputs.log_probs[:, -completion_length:])
    return torch.cat(chunks, dim=0)


def run_grpo(spec: Spec, trajectories: list[dict[str, Any]], output_dir: str) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import PreTrainedModel, TrainerCallback, TrainingArguments
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing

    from loop_trainer import LOOPConfig
    from loop_trainer.models.tiny import build_word_tokenizer

    n, p, m = len(trajectories), spec.micro_batch, spec.minibatch_size
    # transformers < 5.18 (the GPU image's 5.17, the one vLLM accepts) has only the older name
    checkpointing_key = (
        "activation_checkpointing"
        if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
        else "gradient_checkpointing"
    )
    # LOOP's optimizer settings (its defaults, which run_loop uses), and checkpointing under that name
    settings: dict[str, Any] = {
        name: LOOPConfig.__dataclass_fields__[name].default
        for name in ("learning_rate", "weight_decay", "max_grad_norm", "lr_scheduler_type")
    }
    settings[checkpointing_key] = spec.checkpointing
    tokenizer = build_word_tokenizer(["x"])
    prebuilt = _grpo_inputs(trajectories, tokenizer.pad_token_id)
    meter = Meter(spec.device)
    first: dict[str, Any] = {"losses": [], "advantages": []}

    class PrebuiltGRPOTrainer(GRPOTrainer):
        args: GRPOConfig

        # GRPOTrainer has no public hook that takes finished completions with their own advantages and
        # loss mask (the experimental rollout_func returns completions only: TRL would compute GRPO's
        # advantages from rewards), so its private generation step is replaced.
        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            model = self.model
            assert isinstance(model, PreTrainedModel)
            check_checkpointing(model, spec)
            meter.start()
            device = self.accelerator.device
            output = {k: v.to(device) for k, v in prebuilt.items()}
            steps_per_generation = self.args.steps_per_generation
            assert steps_per_generation is not None  # GRPOConfig.__post_init__ sets it
            generate_every = steps_per_generation * self.num_iterations
            if self.args.gradient_accumulation_steps % generate_every == 0:
                raise RuntimeError("TRL would not recompute old log-probs for this configuration")
            input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            checkpointing_kwargs = self.args.gradient_checkpointing_kwargs
            assert checkpointing_kwargs is None or isinstance(checkpointing_kwargs, dict)
            with torch.no_grad(), disable_gradient_checkpointing(model, checkpointing_kwargs):
                output["old_per_token_logps"] = completion_logprobs(
                    model,
                    input_ids,
                    attention_mask,
                    output["completion_ids"].size(1),
                    self.args.per_device_train_batch_size,
                    self.accelerator.autocast,
                )
            return output

        def compute_loss(
            self,
            model: torch.nn.Module,
            inputs: dict[str, Any],
            return_outputs: bool = False,
            num_items_in_batch: torch.Tensor | int | None = None,
        ) -> torch.Tensor:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            assert isinstance(loss, torch.Tensor)  # GRPOTrainer returns no outputs
            if self.state.global_step == 0:  # the micro-batches of the first optimizer step
                first["losses"].append(float(loss.detach()))
                first["advantages"] += inputs["advantages"].tolist()
            return loss

    class StopClock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == state.max_steps:
                meter.stop()

    args = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=p,
        gradient_accumulation_steps=m // p,
        steps_per_generation=n // p,
        num_generations=2,
        num_iterations=spec.ppo_epochs,
        max_steps=spec.ppo_epochs * n // m,
        beta=0.0,
        loss_type="grpo",
        epsilon=1 - 1 / (1 + LOOP_EPSILON),
        epsilon_high=LOOP_EPSILON,
        **settings,
        bf16=spec.device == "cuda",
        use_cpu=spec.device == "cpu",
        max_completion_length=int(prebuilt["completion_ids"].size(1)),
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=spec.seed,
    )
    trainer = PrebuiltGRPOTrainer(
        model=build_model(spec),
        reward_funcs=[lambda **_: [0.0] * n],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * n}),
        processing_class=tokenizer,
        callbacks=[StopClock()],
    )
    trainer.train()
    width = int(prebuilt["prompt_ids"].size(1) + prebuilt["completion_ids"].size(1))
    return {
        **meter.result,
        "optimizer_steps": trainer.state.global_step,
        "first_loss": sum(first["losses"]),
        "first_advantages": first["advantages"],
        "padded_width": width,
    }


def check_checkpointing(model: Any, spec: Spec) -> None:
    from loop_trainer.training.activation_checkpointing import is_checkpointing

    if is_checkpointing(model) != spec.checkpointing:
        raise RuntimeError(f"activation checkpointing is {is_checkpointing(model)}, not {spec.checkpointing}")


def worker(trainer: str, spec_path: str, out_path: str) -> None:
    spec = Spec(**json.loads(Path(spec_path).read_text()))
    trajectories = make_trajectories(spec)
    with tempfile.TemporaryDirectory() as output_dir:
        result = (run_loop if trainer == "loop" else run_grpo)(spec, trajectories, output_dir)
    Path(out_path).write_text(json.dumps(result))


# --- driver --------------------------------------------------------------------------------
MEMORY_KEYS = ("peak_mib", "peak_delta_mib", "heap_peak_mib", "heap_delta_mib")


def summarize(trainer: str, spec: Spec, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median times over repeats, largest memory; tokens = real trajectory tokens x ppo_epochs."""
    trained_tokens = sum(spec.lengths) * spec.ppo_epochs
    seconds = statistics.median(r["seconds"] for r in runs)
    first = runs[0]
    row = {
        "trainer": trainer,
        "checkpointing": spec.checkpointing,
        "seconds": seconds,
        "seconds_all": [r["seconds"] for r in runs],
        "tokens_per_s": trained_tokens / seconds,
        "cpu_seconds": statistics.median(r["cpu_seconds"] for r in runs),
        "cpu_seconds_all": [r["cpu_seconds"] for r in runs],
        "trained_tokens": trained_tokens,
        "optimizer_steps": first["optimizer_steps"],
        "padded_width": first["padded_width"],
        # GRPO pads every micro-batch to the generation batch's width; LOOP pads within a micro-batch only.
        "tokens_per_pass": len(spec.lengths) * first["padded_width"]
        if trainer == "grpo"
        else sum(spec.lengths)
        if spec.micro_batch == 1
        else None,
        "first_loss": first["first_loss"],
        "first_loss_expected": -sum(first["first_advantages"]) / spec.minibatch_size,
    }
    row.update({key: max(r[key] for r in runs) for key in MEMORY_KEYS if key in first})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[2048, 2048, 4096, 8192],
        help="trajectory lengths, cycled to --num-trajectories",
    )
    parser.add_argument("--num-trajectories", type=int, default=None, help="default: len(--lengths)")
    parser.add_argument("--minibatch-size", type=int, default=2, help="trajectories per optimizer step")
    parser.add_argument("--ppo-epochs", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=1, help="trajectories per forward (both trainers)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument(
        "--shape",
        default=None,
        help="a shipped model shape (e.g. Qwen2.5-1.5B-Instruct) instead of --hidden-size/--layers/...",
    )
    parser.add_argument("--checkpointing", choices=["on", "off", "both"], default="on")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs per trainer; seconds = median")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plain-malloc",
        action="store_true",
        help="on CPU, keep glibc's default of returning large blocks to the OS (see module doc)",
    )
    parser.add_argument("--out", default=str(RESULTS / "update_throughput.json"))
    parser.add_argument("--_worker", nargs=3, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options._worker:
        worker(*options._worker)
        return
    n, m, p = options.num_trajectories or len(options.lengths), options.minibatch_size, options.micro_batch
    if n % m or m % p or n % 2:
        parser.error("need num_trajectories % minibatch_size == 0, minibatch_size % micro_batch == 0, even N")
    if m == n and options.ppo_epochs == 1:  # GRPO would reuse the live log-probs, LOOP recomputes them
        parser.error("with one minibatch per update and one epoch GRPO skips old log-probs; use more steps")
    lengths = [options.lengths[i % len(options.lengths)] for i in range(n)]
    modes = {"on": [True], "off": [False], "both": [True, False]}[options.checkpointing]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if options.device == "cpu" and not options.plain_malloc:
        env.update(MALLOC_MMAP_THRESHOLD_=str(2**34), MALLOC_TRIM_THRESHOLD_=str(2**34))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for checkpointing in modes:
            spec = Spec(
                options.device,
                lengths,
                m,
                options.ppo_epochs,
                p,
                options.hidden_size,
                options.layers,
                options.heads,
                options.kv_heads,
                checkpointing,
                options.seed,
                options.shape,
            )
            spec_path = Path(tmp) / "spec.json"
            spec_path.write_text(json.dumps(asdict(spec)))
            runs: dict[str, list[dict[str, Any]]] = {"loop": [], "grpo": []}
            for repeat in range(options.repeats):
                for trainer in ("loop", "grpo"):
                    out_path = Path(tmp) / f"{trainer}-{checkpointing}-{repeat}.json"
                    command = [
                        sys.executable,
                        "-m",
                        "benchmarks.update_throughput",
                        "--_worker",
                        trainer,
                        str(spec_path),
                        str(out_path),
                    ]
                    print(f"[{trainer}] checkpointing={checkpointing} run {repeat + 1}/{options.repeats}", flush=True)
                    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
                    if done.returncode:
                        sys.exit(f"{trainer} worker failed:\n{done.stdout[-3000:]}{done.stderr[-6000:]}")
                    runs[trainer].append(json.loads(out_path.read_text()))
            rows += [summarize(trainer, spec, trainer_runs) for trainer, trainer_runs in runs.items()]
    report(options, lengths, rows)


def report(options: argparse.Namespace, lengths: list[int], rows: list[dict[str, Any]]) -> None:
    import torch

    cuda = options.device == "cuda"
    columns = [
        ("trainer", "{trainer}"),
        ("ckpt", "{ckpt}"),
        ("opt steps", "{optimizer_steps}"),
        ("padded width", "{padded_width}"),
        ("tokens/pass", "{tokens_per_pass}"),
        ("update s", "{seconds:.1f}"),
        ("cpu s", "{cpu_seconds:.1f}"),
        ("tokens/s", "{tokens_per_s:.0f}"),
        ("CUDA peak MiB" if cuda else "peak RSS MiB", "{peak_mib:.0f}"),
        ("rise MiB", "{peak_delta_mib:.0f}"),
    ]
    if not cuda:
        columns += [("malloc peak MiB", "{heap_peak_mib:.0f}"), ("malloc rise MiB", "{heap_delta_mib:.0f}")]
    columns += [("1st loss", "{first_loss:+.4f}"), ("expected", "{first_loss_expected:+.4f}")]
    lines = [[name for name, _ in columns]]
    lines += [[fmt.format(ckpt="on" if r["checkpointing"] else "off", **r) for _, fmt in columns] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    print(
        f"\nlengths={lengths} minibatch={options.minibatch_size} ppo_epochs={options.ppo_epochs} "
        f"micro_batch={options.micro_batch} "
        + (f"shape={options.shape} " if options.shape else f"hidden={options.hidden_size} layers={options.layers} ")
        + f"vocab={VOCAB_SIZE} device={options.device} torch threads={torch.get_num_threads()}"
    )
    for i, line in enumerate(lines):
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    ratios = []
    for checkpointing in sorted({r["checkpointing"] for r in rows}, reverse=True):
        loop, grpo = (
            next(r for r in rows if r["trainer"] == t and r["checkpointing"] == checkpointing) for t in ("loop", "grpo")
        )
        ratio = {
            "checkpointing": checkpointing,
            "tokens_per_s": loop["tokens_per_s"] / grpo["tokens_per_s"],
            "tokens_per_cpu_s": grpo["cpu_seconds"] / loop["cpu_seconds"],
        }
        ratio.update({key: loop[key] / grpo[key] for key in MEMORY_KEYS if key in loop})
        ratios.append(ratio)
        print(
            f"LOOP/GRPO (checkpointing {'on' if checkpointing else 'off'}): "
            + ", ".join(f"{key} x{value:.2f}" for key, value in ratio.items() if key != "checkpointing")
        )
    finite = all(abs(r["first_loss"]) < float("inf") for r in rows)
    print(f"first-minibatch losses finite: {finite} (expected = -sum(advantages in minibatch) / minibatch_size)")
    result = {
        "command": command_line("benchmarks.update_throughput"),
        "lengths": lengths,
        "options": vars(options),
        "rows": rows,
        "ratios": ratios,
        "first_losses_finite": finite,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
