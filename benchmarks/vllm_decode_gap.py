"""Where does the vLLM decode-only gap of ``multiturn_throughput.py --backend vllm`` come from?

One batch of 64 identical first-turn prompts x 32 tokens (the benchmark's decode-only check), timed
five times per path in rotating order after one warm-up each, in one process:

* ours via VLLMBackend            -- our engine (``build_colocated_llm``), our backend's driver thread
* ours llm.generate               -- our engine, ``LLM.generate`` from the main thread
* ours llm.generate in a thread   -- the same from a worker thread (as our driver runs)
* TRL llm.generate                -- TRL's engine (``VLLMGeneration``), ``LLM.generate``
* TRL via TRL                     -- TRL's own ``_generate_single_turn`` path

    OMP_NUM_THREADS=2 .vllm-venv/bin/python -m benchmarks.vllm_decode_gap --out benchmarks/results/vllm-decode-gap.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import command_line

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from benchmarks import multiturn_throughput as mt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args()
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    args = mt.parse_args(["--backend", "vllm", "--concurrency", str(options.n)])
    torch.set_num_threads(args.threads)
    tokenizer = mt.build_tokenizer()
    model_dir = tempfile.mkdtemp(prefix="vllm-decode-gap-")
    mt.build_model(args).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    def model() -> object:
        built = mt.build_model(args)
        built.name_or_path = model_dir
        return built

    ours, trl = mt.Ours(model(), tokenizer, args), mt.Trl(model(), tokenizer, args, options.n)
    prompt = trl.first_prompt_ids()
    batch = [prompt] * options.n
    engines = {"ours": ours.llm, "trl": trl.trainer.vllm_generation.llm}

    def generate(llm: LLM) -> float:
        params = SamplingParams(
            max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=1.0, logprobs=0, ignore_eos=True
        )
        started = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return time.perf_counter() - started

    worker = concurrent.futures.ThreadPoolExecutor(1)
    paths = {
        "ours via VLLMBackend": lambda: ours.decode_once(batch),
        "ours llm.generate": lambda: generate(engines["ours"]),
        "ours llm.generate in a thread": lambda: worker.submit(generate, engines["ours"]).result(),
        "TRL llm.generate": lambda: generate(engines["trl"]),
        "TRL via TRL": lambda: trl.decode_once(batch),
    }
    for measure in paths.values():
        measure()  # warm-up
    names = list(paths)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(options.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            runs[name].append(paths[name]())
    configs = {
        side: {
            "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": llm.llm_engine.vllm_config.scheduler_config.max_num_seqs,
            "enforce_eager": llm.llm_engine.vllm_config.model_config.enforce_eager,
            "dtype": str(llm.llm_engine.vllm_config.model_config.dtype),
        }
        for side, llm in engines.items()
    }
    result = {
        "command": command_line("benchmarks.vllm_decode_gap"),
        "n": options.n,
        "new_tokens": args.new_tokens,
        "prompt_tokens": len(prompt),
        "engines": configs,
        "software": mt.measured_with(),
        "paths": {name: {"median_s": statistics.median(v), "best_s": min(v), "runs": v} for name, v in runs.items()},
    }
    for name, row in result["paths"].items():
        print(
            f"{name:32} median {row['median_s']:.2f} s  best {row['best_s']:.2f} s  runs "
            f"{[round(v, 2) for v in row['runs']]}"
        )
    print("engines:", configs)
    if options.out:
        options.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
