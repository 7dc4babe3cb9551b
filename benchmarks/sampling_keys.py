"""Does a sampling key change what the transformers backend samples? The measurement behind the resume policy's
classification of the sampling keys (src/loop_trainer/config/resume_policy.py).

Seeded two-turn episodes (3 tasks sharing an opening x 3 rollouts) on the tiny vault model with a LoRA adapter,
on the CPU, with each key changed from the default loop; prints whether the sampled tokens are identical and the
largest difference of the sampler's log-probs. Usage: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.sampling_keys
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch
from peft import LoraConfig, get_peft_model

from loop_trainer.envs import VaultEnv
from loop_trainer.models.tiny import build_tiny_for_environment
from loop_trainer.rollout import Completion, TransformersBackend
from loop_trainer.rollout.backend import build_transformers_backend
from loop_trainer.rollout.sampling_parts import TransformersSamplingSettings

Replies = list[tuple[Completion, Completion]]


def episodes(backend: TransformersBackend, encode: Callable[[str], list[int]], rollouts: int = 3) -> Replies:
    system = "<|im_start|>system\n" + " ".join(["tools : find open submit"] * 6) + "<|im_end|>\n"
    observation = encode("<|im_end|>\n<|im_start|>user\nann id k1<|im_end|>\n<|im_start|>assistant\n")

    async def episode(task: str, rollout: int) -> tuple[Completion, Completion]:
        prompt = encode(system + f"<|im_start|>user\nfetch code of {task}<|im_end|>\n<|im_start|>assistant\n")
        first = await backend.generate(prompt, 4, seed=100 * len(task) + 10 * rollout + 1)
        second = await backend.generate(prompt + first.token_ids + observation, 4, seed=10 * rollout + 2)
        return first, second

    async def collect() -> Replies:
        return list(await asyncio.gather(*(episode(t, r) for t in ("ann", "bob", "cy") for r in range(rollouts))))

    return asyncio.run(collect())


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer = build_tiny_for_environment(VaultEnv(num_tasks=16).vocabulary(), seed=0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    policy = get_peft_model(model, lora)

    def run(**parts: Any) -> Replies:
        # every part off unless the variant turns it on (the default loop); 4 rows at most
        settings = TransformersSamplingSettings(
            **{"max_batch_size": 4, "static_decode": False, "compile_decode_step": False, "merge_adapter": False}
            | parts
        )
        backend = build_transformers_backend(policy, settings, stop_token_ids=[], pad_token_id=tokenizer.pad_token_id)
        return episodes(backend, tokenizer.encode)

    base = run()
    variants: dict[str, dict[str, Any]] = {
        "the default loop again": {},
        "static_decode": {"static_decode": True},
        "merge_adapter_for_sampling": {"merge_adapter": True},
        "static_decode + merge_adapter_for_sampling": {"static_decode": True, "merge_adapter": True},
        "static_decode + compile_decode_step": {"static_decode": True, "compile_decode_step": True},
        **{f"generation_batch_limit {limit} (vs 4)": {"max_batch_size": limit} for limit in (1, 2, 9)},
    }
    for name, parts in variants.items():
        other = run(**parts)
        pairs = [(a, b) for turns, others in zip(base, other, strict=True) for a, b in zip(turns, others, strict=True)]
        same_tokens = all(a.token_ids == b.token_ids for a, b in pairs)
        diff = max(abs(x - y) for a, b in pairs for x, y in zip(a.logprobs, b.logprobs, strict=False))
        print(f"{name}: tokens identical {same_tokens}, sampler log-prob max |diff| {diff:.3e}")


if __name__ == "__main__":
    main()
