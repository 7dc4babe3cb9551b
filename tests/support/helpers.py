"""Shared test doubles: a scripted generation backend and small environments."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from datasets import Dataset
from transformers import Qwen2ForCausalLM

from loop_trainer import LOOPConfig
from loop_trainer.envs.base import Environment, Episode, Message, Score, Step
from loop_trainer.models.tiny import build_tiny_model
from loop_trainer.models.tiny_chat import tiny_qwen_config
from loop_trainer.rollout.records import Completion


def tiny_qwen(tokenizer, seed=0) -> Qwen2ForCausalLM:
    """A one-layer Qwen2 with ``tokenizer``'s vocabulary (Qwen2.5's: tool-call templates), randomly initialised:
    ``tiny-chat:qwen2.5``'s model (loop_trainer.models.tiny_chat)."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_qwen_config(tokenizer))


class ScriptedBackend:
    """Replies with ``reply(prompt_ids) -> text``, tokenised, plus the stop token; log-prob -1."""

    def __init__(self, tokenizer, reply: Callable[[list[int]], str], stop: bool = True, delay: float = 0.0):
        self.tokenizer = tokenizer
        self.reply = reply
        self.stop = stop
        self.delay = delay
        self.calls = 0

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        self.calls += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        ids = self.tokenizer.encode(self.reply(list(prompt_ids)), add_special_tokens=False)
        if self.stop:
            ids = ids + [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        stopped = self.stop and len(ids) <= max_new_tokens
        ids = ids[:max_new_tokens]
        return Completion(token_ids=ids, logprobs=[-1.0] * len(ids), stopped=stopped)


class EchoEpisode(Episode):
    """Answers every reply with ``obs <n>``; done after ``turns`` replies. Records its life cycle."""

    def __init__(self, env: EchoEnv, task: Mapping[str, Any]):
        self.env, self.task, self.turn = env, task, 0

    async def start(self) -> list[Message]:
        self.env.events.append(("start", self.task["task_id"]))
        if self.task.get("fail_at") == "start":
            raise RuntimeError("boom at start")
        return [{"role": "system", "content": "sys"}, {"role": "user", "content": f"task {self.task['task_id']}"}]

    async def step(self, reply: str) -> Step:
        self.turn += 1
        await asyncio.sleep(self.task.get("step_seconds", 0.0))
        if self.task.get("fail_at") == "step":
            raise RuntimeError("boom at step")
        return Step(messages=[{"role": "user", "content": f"obs {self.turn}"}], done=self.turn >= self.task["turns"])

    async def score(self) -> Score:
        return Score(reward=float(self.task.get("reward", 1.0)), success=True)

    async def close(self) -> None:
        self.env.events.append(("close", self.task["task_id"]))


class EchoEnv(Environment):
    name = "echo"

    def __init__(self, rows: list[dict[str, Any]]):
        self.rows = rows
        self.events: list[tuple[str, str]] = []

    def tasks(self, split: str = "train") -> Dataset:
        return Dataset.from_list(self.rows)

    def episode(self, task: Mapping[str, Any]) -> EchoEpisode:
        return EchoEpisode(self, task)


class FaultyEpisode(Episode):
    """Misbehaves as its task's ``kind`` says, at the first reply; otherwise two turns, a reward
    that depends on the reply (so LOOP has something to learn)."""

    def __init__(self, task: Mapping[str, Any]):
        self.kind, self.turn, self.replies = task["kind"], 0, []

    def start(self) -> list[Message]:
        return [{"role": "user", "content": f"fetch code of ann ({self.kind})"}]

    def step(self, reply: str) -> Step:
        import time

        self.turn += 1
        self.replies.append(reply)
        if self.turn == 1:
            if self.kind == "raises":
                raise RuntimeError("the tool crashed")
            if self.kind == "hangs":
                time.sleep(3)
            if self.kind == "dies":
                raise ConnectionResetError("environment server went away")
            if self.kind == "bytes":
                return Step([{"role": "user", "content": b"ann \xff\xfe code \x80"}])
            if self.kind == "surrogates":
                return Step([{"role": "user", "content": "ann code \udcff"}])
            if self.kind == "enormous":
                return Step([{"role": "user", "content": "ann " * 5_000_000}])
        return Step([{"role": "user", "content": "ok"}], done=self.turn >= 2)

    def score(self) -> Score:
        return Score(reward=sum(len(r) for r in self.replies) % 5 / 4)


class FaultyEnv(Environment):
    """One task per kind of fault, plus healthy ones."""

    name = "faulty"
    KINDS = ("healthy", "healthy", "raises", "hangs", "dies", "bytes", "surrogates", "enormous")

    def tasks(self, split: str = "train") -> Dataset:
        return Dataset.from_list([{"task_id": f"{kind}-{i}", "kind": kind} for i, kind in enumerate(self.KINDS)])

    def episode(self, task: Mapping[str, Any]) -> Episode:
        return FaultyEpisode(task)

    def vocabulary(self) -> list[str]:
        return ["fetch", "code", "of", "ann", "ok", "find", "open", "submit", *self.KINDS]


class AnyTemperature:
    """A scripted backend for code that asks for a sampling temperature (loop-eval): a script samples
    nothing, so every temperature gives the same replies."""

    def __init__(self, backend: ScriptedBackend):
        self.backend = backend

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        return await self.backend.generate(prompt_ids, max_new_tokens, seed)

    def with_temperature(self, temperature: float) -> AnyTemperature:
        return self


class PreferFindEpisode(Episode):
    """One turn; reward 1 if the reply starts with 'find', else 0."""

    def __init__(self):
        self.reward = 0.0

    def start(self):
        return [{"role": "user", "content": "fetch code of ann"}]

    def step(self, reply: str) -> Step:
        self.reward = float(reply.startswith("find"))
        return Step(done=True)

    def score(self) -> Score:
        return Score(self.reward)


class PreferFindEnv(Environment):
    name = "prefer-find"

    def tasks(self, split: str = "train") -> Dataset:
        return Dataset.from_list([{"task_id": f"t{i}"} for i in range(2)])

    def episode(self, task: Mapping[str, Any]) -> Episode:
        return PreferFindEpisode()


def two_iterations_on_a_qwen_vocabulary(tokenizer, tmp_path, **episode) -> tuple[Any, Any]:
    """A one-layer tiny model over ``tokenizer``'s (Qwen2.5's) vocabulary and the LOOPConfig of two small
    iterations (2 tasks x 3 rollouts, one PPO epoch) with the ``episode`` limits: the adapters' training tests."""
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        seed=0,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    args = LOOPConfig(
        output_dir=str(tmp_path / "run"),
        iterations=2,
        tasks_per_iteration=2,
        rollouts_per_task=3,
        minibatch_size=6,
        ppo_epochs=1,
        per_device_train_batch_size=6,
        memory_stress_test=False,
        activation_checkpointing=False,
        disable_tqdm=True,
        seed=0,
        learning_rate=1e-3,
        report_to=[],
        **episode,
    )
    return model, args
