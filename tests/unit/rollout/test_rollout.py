"""The rollout engine: token-exact trajectories, loss masks, limits, concurrency, failures."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from types import ModuleType, SimpleNamespace

import pytest
import torch

from loop_trainer.chat import ChatFormatter
from loop_trainer.envs.base import Episode, Score, Step
from loop_trainer.models.tiny import build_word_tokenizer
from loop_trainer.rollout import EpisodeLimits, RolloutEngine, RolloutFailureBudgetExceeded, TransformersBackend
from loop_trainer.rollout.vllm_backend import VLLMBackend
from loop_trainer.rollout.vllm_server import VLLMServerBackend
from loop_trainer.rollout.weight_sync import WeightSync, WeightSyncError
from support.fake_vllm_server import serving
from support.helpers import EchoEnv, EchoEpisode, ScriptedBackend
from support.qwen import QWEN25_DEFAULT_SYSTEM_PROMPT

REPLIES = ["print(apis.api_docs.show_app_descriptions())", "x = 1\n\n  y = 2 ", "done ✓ 你好"]


def run(engine: RolloutEngine, rows, k=1, **kwargs):
    return engine.collect(rows, k, **kwargs)


def scripted_engine(tokenizer, rows, limits=EpisodeLimits(max_turns=10), reply=None, **kwargs):
    env = EchoEnv(rows)
    calls = iter(range(10**6))
    backend = ScriptedBackend(tokenizer, reply or (lambda prompt: REPLIES[next(calls) % len(REPLIES)]))
    engine = RolloutEngine(env, backend, ChatFormatter(tokenizer), limits, show_progress=False, **kwargs)
    return env, engine


@pytest.mark.parametrize("with_system", [True, False])
def test_qwen_trajectory_is_token_exact_and_append_only(qwen_tokenizer, with_system):
    tok = qwen_tokenizer
    env, engine = scripted_engine(tok, [{"task_id": "t0", "turns": 3}])
    if not with_system:  # Qwen2.5 injects its default system prompt: exactly once, at the start
        original = type(env.episode(env.rows[0])).start

        async def start_without_system(self):
            return (await original(self))[1:]

        type(env.episode(env.rows[0])).start = start_without_system
    try:
        (trajectory,) = run(engine, env.rows).trajectories
    finally:
        if not with_system:
            type(env.episode(env.rows[0])).start = original
    # The whole conversation, rendered at once by the real template, gives the very same ids.
    full = tok.apply_chat_template(trajectory.messages, tokenize=False)
    rendered = tok.encode(full, add_special_tokens=False)
    # (the episode ended on the last reply's <|im_end|>; the template would add a newline after it)
    assert trajectory.token_ids + tok.encode("\n") == rendered
    assert full.count(QWEN25_DEFAULT_SYSTEM_PROMPT) == (0 if with_system else 1)
    # Loss mask: exactly the sampled reply tokens, each ending with <|im_end|>.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    sampled = [i for i, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m]
    expected = []
    for reply in REPLIES:
        expected += tok.encode(reply, add_special_tokens=False) + [im_end]
    assert sampled == expected
    assert trajectory.num_turns == 3 and trajectory.ending == "done" and trajectory.truncated_turns == 0
    assert trajectory.sampler_logprobs == [-1.0 if m else 0.0 for m in trajectory.loss_mask]
    # Nothing before the first reply is trained on, not even the assistant header.
    assert sum(trajectory.loss_mask[: trajectory.prompt_length]) == 0
    assert (
        tok.decode(trajectory.token_ids[trajectory.prompt_length - 3 : trajectory.prompt_length])
        == "<|im_start|>assistant\n"
    )


def test_chatml_word_tokenizer_is_token_exact():
    tok = build_word_tokenizer(["find", "ann", "obs", "1", "2", "3", "task", "t0", "sys"])
    env, engine = scripted_engine(tok, [{"task_id": "t0", "turns": 2}], reply=lambda p: "find ann")
    (trajectory,) = run(engine, env.rows).trajectories
    full = tok.apply_chat_template(trajectory.messages, tokenize=False)
    assert trajectory.token_ids + tok.encode("\n") == tok.encode(full, add_special_tokens=False)
    assert sum(trajectory.loss_mask) == 2 * 3  # "find ann <|im_end|>" twice


def test_turn_ids_label_each_reply_with_its_turn_and_nothing_else(qwen_tokenizer):
    """A 3-turn episode: the sampled tokens of reply k are labelled k, every other token -1; the
    labels reach the training batch. A reply cut by the per-turn limit keeps its label; the stop
    token appended after it (not sampled) gets none."""
    from loop_trainer.training.batching import TrainingSample, collate

    tok = qwen_tokenizer
    env, engine = scripted_engine(tok, [{"task_id": "t0", "turns": 3}])
    (t,) = run(engine, env.rows).trajectories
    assert len(t.turn_ids) == len(t.token_ids) and t.num_turns == 3
    assert [k for k, m in zip(t.turn_ids, t.loss_mask, strict=True) if not m] == [-1] * (
        len(t.token_ids) - sum(t.loss_mask)
    )
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for k, reply in enumerate(REPLIES):
        labelled = [i for i, label in zip(t.token_ids, t.turn_ids, strict=True) if label == k]
        assert labelled == tok.encode(reply, add_special_tokens=False) + [im_end]
    positions = [p for p, label in enumerate(t.turn_ids) if label >= 0]
    assert sorted(set(t.turn_ids)) == [-1, 0, 1, 2]
    assert t.to_dict()["turn_ids"] == t.turn_ids
    batch = collate([TrainingSample.from_trajectory(t, 1.0, max_tokens=10_000)], tok.pad_token_id or 0)
    assert batch.turn_ids[0, : positions[-1] + 1].tolist() == t.turn_ids[: positions[-1] + 1]

    env, engine = scripted_engine(tok, [{"task_id": "t0", "turns": 3}], EpisodeLimits(max_new_tokens_per_turn=3))
    (t,) = run(engine, env.rows).trajectories
    assert t.truncated_turns == 3
    assert [label for label in t.turn_ids if label >= 0] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(label == -1 for label, m in zip(t.turn_ids, t.loss_mask, strict=True) if not m)


def test_sampled_ids_are_kept_even_when_they_are_not_the_canonical_tokenisation(qwen_tokenizer):
    tok = qwen_tokenizer
    weird = tok.encode(" he", add_special_tokens=False) + tok.encode("llo", add_special_tokens=False)
    assert weird != tok.encode(" hello", add_special_tokens=False)

    class WeirdBackend(ScriptedBackend):
        async def generate(self, prompt_ids, max_new_tokens, seed=None):
            completion = await super().generate(prompt_ids, max_new_tokens)
            return type(completion)(
                weird + completion.token_ids, [-1.0] * (len(weird) + len(completion.token_ids)), True
            )

    env = EchoEnv([{"task_id": "t0", "turns": 2}])
    engine = RolloutEngine(env, WeirdBackend(tok, lambda p: "ok"), ChatFormatter(tok), show_progress=False)
    (trajectory,) = run(engine, env.rows).trajectories
    sampled = [i for i, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert sampled == (weird + tok.encode("ok", add_special_tokens=False) + [im_end]) * 2


def test_limits_are_recorded_not_silent(qwen_tokenizer):
    tok = qwen_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    # per-turn limit: the reply is cut, a stop token is appended with mask 0
    env, engine = scripted_engine(tok, [{"task_id": "t0", "turns": 2}], EpisodeLimits(max_new_tokens_per_turn=3))
    (t,) = run(engine, env.rows).trajectories
    assert t.truncated_turns == 2 and t.ending == "done"
    first_reply_end = t.loss_mask.index(1) + 3
    assert t.token_ids[first_reply_end] == im_end and t.loss_mask[first_reply_end] == 0
    # turn limit
    env, engine = scripted_engine(tok, [{"task_id": "t0", "turns": 99}], EpisodeLimits(max_turns=4))
    (t,) = run(engine, env.rows).trajectories
    assert (t.ending, t.num_turns) == ("turn_limit", 4)
    # trajectory budget: the episode ends when no room is left, and is still scored
    env, engine = scripted_engine(
        tok, [{"task_id": "t0", "turns": 99, "reward": 0.5}], EpisodeLimits(max_turns=99, max_trajectory_tokens=80)
    )
    (t,) = run(engine, env.rows).trajectories
    assert t.ending == "trajectory_budget" and t.reward == 0.5 and t.status == "completed"
    assert sum(t.loss_mask) > 0 and len(t.token_ids) <= 80 + 40


class GatedEpisode(EchoEpisode):
    """An echo episode that records what happened, not how long it took: how many episodes are
    inside an environment step at once, and when each step returned. A step waits for
    ``env.gate(task_id)`` (an asyncio.Event, or None; called once the step has counted itself in)
    before it answers."""

    async def step(self, reply):
        env, task_id = self.env, self.task["task_id"]
        env.in_step += 1
        env.most_in_step = max(env.most_in_step, env.in_step)
        try:
            gate = env.gate(task_id)
            if gate is not None:
                await gate.wait()
            result = await super().step(reply)
        finally:
            env.in_step -= 1
        env.events.append(("stepped", task_id))
        return result

    async def close(self):
        await super().close()
        self.env.closed(self.task["task_id"])


class GatedEnv(EchoEnv):
    def __init__(self, rows, gate=lambda task_id: None, closed=lambda task_id: None):
        super().__init__(rows)
        self.gate, self.closed = gate, closed
        self.in_step = self.most_in_step = 0

    def episode(self, task):
        return GatedEpisode(self, task)


def gated_engine(tokenizer, env, **kwargs):
    # A generous timeout: here it only stops a broken engine from hanging the test.
    backend = ScriptedBackend(tokenizer, lambda prompt: "ok")
    return RolloutEngine(
        env,
        backend,
        ChatFormatter(tokenizer),
        EpisodeLimits(max_turns=10),
        show_progress=False,
        env_timeout=kwargs.pop("env_timeout", 120.0),
        **kwargs,
    )


def test_episodes_overlap_no_per_turn_barrier(qwen_tokenizer):
    # 16 episodes, 3 turns each. The first step of every episode waits until all 16 are inside a
    # step at once: run one after another, the first would wait until its timeout and fail.
    rows = [{"task_id": f"t{i}", "turns": 3} for i in range(16)]
    all_in = asyncio.Event()

    def gate(task_id):
        if env.in_step == len(rows):
            all_in.set()
        return all_in

    env = GatedEnv(rows, gate=gate)
    with gated_engine(qwen_tokenizer, env) as engine:
        batch = run(engine, rows)
    assert len(batch.trajectories) == 16 and not batch.failed
    assert env.most_in_step == 16


def test_a_slow_episode_does_not_hold_back_the_others(qwen_tokenizer):
    # The slow episode's first step returns only once every fast episode has run all 5 turns and
    # been closed: with a per-turn barrier across episodes that could never happen.
    rows = [{"task_id": "slow", "turns": 2}] + [{"task_id": f"fast{i}", "turns": 5} for i in range(4)]
    fast_closed = asyncio.Event()
    closed = set()

    def on_close(task_id):
        closed.add(task_id)
        if closed >= {f"fast{i}" for i in range(4)}:
            fast_closed.set()

    env = GatedEnv(rows, gate=lambda task_id: fast_closed if task_id == "slow" else None, closed=on_close)
    with gated_engine(qwen_tokenizer, env) as engine:
        batch = run(engine, rows)
    by_id = {t.task_id: t for t in batch.trajectories}
    assert not batch.failed and sorted(by_id) == ["fast0", "fast1", "fast2", "fast3", "slow"]
    assert all(by_id[f"fast{i}"].num_turns == 5 for i in range(4)) and by_id["slow"].num_turns == 2
    slow_first_step = env.events.index(("stepped", "slow"))
    assert all(env.events.index(("close", f"fast{i}")) < slow_first_step for i in range(4))


def test_failures_are_isolated_counted_and_closed(qwen_tokenizer):
    rows = [
        {"task_id": "ok", "turns": 2},
        {"task_id": "bad-step", "turns": 2, "fail_at": "step"},
        {"task_id": "bad-start", "turns": 2, "fail_at": "start"},
        {"task_id": "ok2", "turns": 1},
    ]
    env, engine = scripted_engine(qwen_tokenizer, rows)
    batch = run(engine, rows, 2, max_failed_fraction=0.5)
    assert sorted({t.task_id for t in batch.trajectories}) == ["ok", "ok2"]
    assert len(batch.failed) == 4 and batch.stats()["num_failed"] == 4
    assert {t.error for t in batch.failed} == {"RuntimeError: boom at step", "RuntimeError: boom at start"}
    # close runs on every path, once per episode
    assert sorted(e for e in env.events if e[0] == "close") == sorted(
        ("close", r["task_id"]) for r in rows for _ in range(2)
    )
    # over budget: one clear error
    with pytest.raises(RolloutFailureBudgetExceeded, match="4 of 8 rollouts failed"):
        run(engine, rows, 2, max_failed_fraction=0.25)


def test_a_hung_environment_times_out(qwen_tokenizer):
    # The hung step waits on an event nobody sets: only the timeout can end it, however loaded the
    # machine; the healthy episode's steps answer at once, far inside the timeout.
    rows = [{"task_id": "hang", "turns": 2}, {"task_id": "ok", "turns": 1}]
    never = asyncio.Event()
    env = GatedEnv(rows, gate=lambda task_id: never if task_id == "hang" else None)
    with gated_engine(qwen_tokenizer, env, env_timeout=5.0) as engine:
        batch = run(engine, rows, max_failed_fraction=0.5)
    assert [t.task_id for t in batch.failed] == ["hang"] and batch.failed[0].error.startswith("TimeoutError")
    assert [t.task_id for t in batch.trajectories] == ["ok"]
    assert ("stepped", "hang") not in env.events and ("close", "hang") in env.events


def test_early_stop_cancels_stragglers(qwen_tokenizer):
    rows = [{"task_id": f"t{i}", "turns": 1, "step_seconds": 0.0} for i in range(2)]
    env, engine = scripted_engine(qwen_tokenizer, rows)
    slow = iter([0.0, 0.0, 0.0, 30.0, 0.0, 0.0, 0.0, 30.0])  # one slow rollout per task
    original = env.episode

    def episode(task):
        ep = original(task)
        ep.task = {**task, "step_seconds": next(slow)}
        return ep

    env.episode = episode
    batch = run(engine, rows, 4, done_fraction=0.75, task_fraction=0.75)
    # The 30 s steps were cancelled, not awaited: they never finished.
    assert len(batch.trajectories) == 6 and batch.num_cancelled == 2
    assert sum(1 for e in env.events if e[0] == "close") == 8  # cancelled ones are closed too


def test_transformers_backend_logprobs_match_the_model(vault_tiny):
    env, model, tok = vault_tiny
    backend = TransformersBackend(model, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    prompts = [
        tok.encode("<|im_start|>user\nfetch code of ann<|im_end|>\n<|im_start|>assistant\n"),
        tok.encode("<|im_start|>assistant\nfind"),
    ]
    torch.manual_seed(0)
    out = backend.sample(prompts, [6, 3])
    assert len(out[1].token_ids) <= 3
    for prompt, completion in zip(prompts, out, strict=True):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-5)
        assert completion.stopped == (completion.token_ids[-1] == tok.eos_token_id)


def test_transformers_backend_batches_concurrent_requests(vault_tiny):
    env, model, tok = vault_tiny
    backend = TransformersBackend(model, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)

    async def many():
        return await asyncio.gather(*(backend.generate(tok.encode("<|im_start|>assistant\n"), 4) for _ in range(12)))

    results = asyncio.run(many())
    assert len(results) == 12 and backend.num_batches == 1 and backend.num_sequences == 12


def test_a_seeded_reply_does_not_depend_on_its_batch(vault_tiny):
    env, model, tok = vault_tiny
    backend = TransformersBackend(model, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    prompt = tok.encode("<|im_start|>user\nfetch code of ann<|im_end|>\n<|im_start|>assistant\n")
    other = tok.encode("<|im_start|>assistant\nfind ann")
    alone = backend.sample([prompt], [8], [123])[0]
    torch.manual_seed(99)  # the global RNG must not matter
    batched = backend.sample([other, prompt, other], [3, 8, 8], [7, 123, None])[1]
    assert batched.token_ids == alone.token_ids
    assert torch.allclose(torch.tensor(batched.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    replies = {tuple(backend.sample([prompt], [8], [seed])[0].token_ids) for seed in range(8)}
    assert len(replies) > 1  # different seeds, different samples


def test_seeded_collections_repeat_whatever_the_timing(vault_tiny):
    env, model, tok = vault_tiny
    tasks = [env.tasks()[i] for i in range(3)]

    def collect(delay_first: float):
        class Jittery(TransformersBackend):
            async def generate(self, prompt_ids, max_new_tokens, seed=None):
                await asyncio.sleep(delay_first if seed % 2 else 0.0)
                return await super().generate(prompt_ids, max_new_tokens, seed=seed)

        backend = Jittery(model, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
        engine = RolloutEngine(env, backend, ChatFormatter(tok), EpisodeLimits(3, 4, 256), show_progress=False)
        return [t.token_ids for t in engine.collect(tasks, 2, seed=5).trajectories]

    assert collect(0.0) == collect(0.05)


class FlakyBackend(ScriptedBackend):
    def __init__(self, tokenizer, failures: int):
        super().__init__(tokenizer, lambda prompt: "ok")
        self.failures = failures

    async def generate(self, prompt_ids, max_new_tokens, seed=None):
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("CUDA out of memory (simulated)")
        return await super().generate(prompt_ids, max_new_tokens, seed)


def test_a_generator_failure_is_retried_once_then_reported(qwen_tokenizer):
    env = EchoEnv([{"task_id": "t0", "turns": 2}])
    engine = RolloutEngine(
        env, FlakyBackend(qwen_tokenizer, failures=1), ChatFormatter(qwen_tokenizer), show_progress=False
    )
    batch = run(engine, env.rows)
    assert len(batch.trajectories) == 1 and not batch.failed and engine.generation_retries == 1
    engine = RolloutEngine(
        env, FlakyBackend(qwen_tokenizer, failures=2), ChatFormatter(qwen_tokenizer), show_progress=False
    )
    batch = run(engine, env.rows)
    assert not batch.trajectories and batch.failed[0].error.startswith("GenerationError: generation failed twice")


# -- releasing what was opened ------------------------------------------------------------------


class SyncEpisode(Episode):
    """Synchronous methods: the engine runs them in its thread pool."""

    def __init__(self, task):
        self.turns = task["turns"]

    def start(self):
        return [{"role": "user", "content": "go"}]

    def step(self, reply):
        self.turns -= 1
        return Step([{"role": "user", "content": "ok"}], done=self.turns <= 0)

    def score(self):
        return Score(reward=1.0)


class SyncEnv(EchoEnv):
    def episode(self, task):
        return SyncEpisode(task)


def assert_threads_end(threads):
    assert threads, "nothing ran in the pool"
    for thread in threads:
        thread.join(timeout=60)  # a bound for a broken close() only; each thread is idle here
    assert not [thread.name for thread in threads if thread.is_alive()]


def test_the_engine_releases_its_threads_on_close(qwen_tokenizer):
    rows = [{"task_id": f"t{i}", "turns": 2} for i in range(4)]
    with RolloutEngine(
        SyncEnv(rows),
        ScriptedBackend(qwen_tokenizer, lambda prompt: "ok"),
        ChatFormatter(qwen_tokenizer),
        show_progress=False,
    ) as engine:
        assert len(run(engine, rows).trajectories) == 4
        threads = list(engine._threads._threads)
    assert_threads_end(threads)
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="this RolloutEngine was closed"):
        run(engine, rows)


class BlockingEpisode(SyncEpisode):
    """Synchronous; the "hang" task's step blocks until the test sets ``env.release``. Records
    each method's start and end, whether the thread running it is a daemon, and whether another
    method of the same episode was running at the time."""

    def __init__(self, env, task):
        super().__init__(task)
        self.env, self.task_id, self.running = env, task["task_id"], 0

    def _enter(self, name):
        self.env.events.append(
            (name, self.task_id, "concurrent" if self.running else "alone", threading.current_thread().daemon)
        )
        self.running += 1

    def step(self, reply):
        self._enter("step")
        try:
            if self.task_id == "hang":
                self.env.hang_stepping.set()
                self.env.release.wait()
                raise RuntimeError("released")
            # the other task finishes (and so early-stops the batch) only once the hung step is running,
            # however the threads are scheduled
            assert self.env.hang_stepping.wait(timeout=60)
            return super().step(reply)
        finally:
            self.running -= 1
            self.env.events.append(("step returned", self.task_id))

    def close(self):
        self._enter("close")
        self.running -= 1
        if self.task_id == "hang":
            self.env.closed.set()


class BlockingEnv(EchoEnv):
    """``release`` lets the hung step return; ``closed`` is set once the hung episode is closed;
    ``hang_stepping`` once the hung step has begun."""

    def __init__(self, rows):
        super().__init__(rows)
        self.release, self.closed, self.hang_stepping = threading.Event(), threading.Event(), threading.Event()

    def episode(self, task):
        return BlockingEpisode(self, task)


def blocking_engine(tokenizer, env, env_timeout):
    return RolloutEngine(
        env,
        ScriptedBackend(tokenizer, lambda prompt: "ok"),
        ChatFormatter(tokenizer),
        EpisodeLimits(max_turns=3),
        env_timeout=env_timeout,
        show_progress=False,
    )


def test_a_hung_synchronous_call_is_abandoned_and_its_episode_closed_only_after_it_returns(qwen_tokenizer):
    # The hung step never answers while the test waits: only the timeout ends its rollout; the
    # healthy steps answer at once, far inside it.
    rows = [{"task_id": "hang", "turns": 2}, {"task_id": "ok", "turns": 2}]
    env = BlockingEnv(rows)
    try:
        with blocking_engine(qwen_tokenizer, env, env_timeout=3.0) as engine:
            batch = run(engine, rows, max_failed_fraction=0.5)
            assert [t.task_id for t in batch.trajectories] == ["ok"] and [t.task_id for t in batch.failed] == ["hang"]
            assert batch.failed[0].error == (
                "TimeoutError: Episode.step() did not return within env_timeout (3s); it is "
                "still running in its thread (abandoned: Python cannot stop a thread)"
            )
            assert (engine.abandoned_calls, engine.abandoned_calls_running) == (1, 1)
            assert not [e for e in env.events if e[0] == "close" and e[1] == "hang"]  # not beside the running step
    finally:
        env.release.set()
    assert env.closed.wait(timeout=60)  # a bound for a broken engine only
    hung = [e for e in env.events if e[1] == "hang"]
    # close ran once the step had returned (in the daemon thread the step had), never beside it
    assert hung == [("step", "hang", "alone", True), ("step returned", "hang"), ("close", "hang", "alone", True)]
    assert engine.abandoned_calls_running == 0 and engine.abandoned_calls == 1
    assert not [e for e in env.events if e[2:3] == ("concurrent",)]


def test_a_cancelled_straggler_inside_a_synchronous_call_is_abandoned_too(qwen_tokenizer):
    # Early stop cancels the hung rollout at once (no timeout involved); its step keeps running.
    rows = [{"task_id": "hang", "turns": 2}, {"task_id": "ok", "turns": 2}]
    env = BlockingEnv(rows)
    try:
        with blocking_engine(qwen_tokenizer, env, env_timeout=120.0) as engine:
            batch = run(engine, rows, done_fraction=0.5, task_fraction=0.0)
            assert [t.task_id for t in batch.trajectories] == ["ok"] and batch.num_cancelled == 1
            assert (engine.abandoned_calls, engine.abandoned_calls_running) == (1, 1)
            assert ("close", "hang") not in [e[:2] for e in env.events]
    finally:
        env.release.set()
    assert env.closed.wait(timeout=60)
    assert [e[0] for e in env.events if e[1] == "hang"] == ["step", "step returned", "close"]


def test_a_timeout_error_of_the_environment_is_its_own_not_env_timeout(qwen_tokenizer):
    class RaisingEpisode(SyncEpisode):
        def step(self, reply):
            raise TimeoutError("the tool server timed out")

    class RaisingEnv(EchoEnv):
        def episode(self, task):
            return RaisingEpisode(task)

    rows = [{"task_id": "t", "turns": 2}]
    with blocking_engine(qwen_tokenizer, RaisingEnv(rows), env_timeout=120.0) as engine:
        batch = run(engine, rows)
    assert batch.failed[0].error == "TimeoutError: the tool server timed out" and engine.abandoned_calls == 0


@pytest.fixture()
def fake_vllm_server():
    with serving() as server:
        yield server


def test_the_server_backend_releases_its_threads_and_session_on_close(fake_vllm_server, tmp_path):
    with VLLMServerBackend(fake_vllm_server.url, stop_token_ids=[9], sync_dir=str(tmp_path)) as backend:
        completion = asyncio.run(backend.generate([1, 2, 3], 3))
        assert (completion.token_ids, completion.stopped) == ([7, 8, 9], True)
        threads = list(backend.client.executor._threads)
    assert_threads_end(threads)
    assert not backend.client.session.adapters["http://"].poolmanager.pools  # connections closed
    assert backend.client.completions is not None and backend.client.completions.open_connections == 0
    backend.close()  # idempotent
    with pytest.raises(RuntimeError, match="shutdown"):
        asyncio.run(backend.generate([1, 2, 3], 3))


@pytest.mark.parametrize("enabled", [True, False, None])
def test_the_server_backend_reads_whether_the_server_caches_prefixes(
    fake_vllm_server, tmp_path, caplog, monkeypatch, enabled
):
    fake_vllm_server.prefix_caching = enabled
    with VLLMServerBackend(fake_vllm_server.url, stop_token_ids=[9], sync_dir=str(tmp_path)) as backend:
        assert backend.prefix_caching is enabled
    warned = [r.getMessage() for r in caplog.records if "prefix caching" in r.getMessage()]
    assert len(warned) == (enabled is False) and all("--enable-prefix-caching" in m for m in warned)


def test_server_weight_shards_are_at_most_shard_bytes(fake_vllm_server, tmp_path):
    from safetensors.torch import load_file

    weights = [(f"layer{i}.weight", torch.ones(100)) for i in range(5)]  # 400 bytes each
    weights.insert(2, ("big.weight", torch.ones(600)))  # 2400 bytes: over the limit alone
    with VLLMServerBackend(
        fake_vllm_server.url, stop_token_ids=[9], sync_dir=str(tmp_path), shard_bytes=1000
    ) as backend:
        backend.load_weights(iter(weights))
    shards = [load_file(path) for path in sorted((tmp_path / "weights").glob("part-*.safetensors"))]
    sizes = [sum(t.numel() * t.element_size() for t in shard.values()) for shard in shards]
    assert sizes == [800, 2400, 800, 400]  # the big tensor alone; no other shard over 1000 bytes
    assert sorted(name for shard in shards for name in shard) == sorted(name for name, _ in weights)
    assert json.loads((tmp_path / "weights" / "loop_weights.json").read_text()) == {"shards": 4}


def test_server_weight_shards_hold_tied_weights_each_as_its_own_tensor(fake_vllm_server, tmp_path):
    """A tied head is sent as well as the embedding it shares memory with (layerwise_weights does so for
    vLLM): safetensors refuses two tensors sharing memory in one file, so the shard holds a copy."""
    from safetensors.torch import load_file

    embedding = torch.arange(12.0).reshape(4, 3)
    weights = [("model.embed_tokens.weight", embedding), ("lm_head.weight", embedding), ("norm.weight", torch.ones(3))]
    with VLLMServerBackend(fake_vllm_server.url, stop_token_ids=[9], sync_dir=str(tmp_path)) as backend:
        backend.load_weights(iter(weights))
    (shard,) = [load_file(path) for path in (tmp_path / "weights").glob("part-*.safetensors")]
    assert torch.equal(shard["lm_head.weight"], embedding) and torch.equal(
        shard["model.embed_tokens.weight"], embedding
    )
    assert embedding.untyped_storage().data_ptr() != shard["lm_head.weight"].untyped_storage().data_ptr()


def test_weight_sync_removes_its_temporary_directory_on_close(tmp_path):
    model = torch.nn.Linear(2, 2)
    with WeightSync(model, object(), lambda ids: torch.zeros(len(ids) - 1), [1, 2], tolerance=None) as sync:
        workdir = sync._workdir
        assert workdir.is_dir()
    assert not workdir.exists()
    sync.close()  # idempotent
    given = tmp_path / "sync"
    given.mkdir()
    WeightSync(
        model, object(), lambda ids: torch.zeros(len(ids) - 1), [1, 2], tolerance=None, workdir=str(given)
    ).close()
    assert given.is_dir()  # the caller's directory is the caller's


class _GappedGenerator:
    """A full-weight generator whose probe log-probs are the trainer's plus ``gap`` (what a sync left)."""

    def __init__(self):
        self.gap, self.loads = 0.0, 0

    def wake_up(self, tags=None):
        pass

    def load_weights(self, weights):
        assert [name for name, _ in weights] == ["weight", "bias"]
        self.loads += 1

    def probe_logprobs(self, ids):
        return torch.full((len(ids) - 1,), -2.0 + self.gap)


def _gapped_sync(tolerance=0.25):
    generator = _GappedGenerator()
    model = torch.nn.Linear(2, 2)
    return generator, WeightSync(model, generator, lambda ids: torch.full((len(ids) - 1,), -2.0), [1, 2, 3], tolerance)


def test_one_sync_over_the_tolerance_warns_and_two_in_a_row_stop_the_run(caplog):
    generator, sync = _gapped_sync()
    with sync:
        assert sync(0).metrics()["weight_sync_over_tolerance"] == 0.0
        generator.gap = 0.3  # bf16 noise can reach this once
        with caplog.at_level("WARNING", logger="loop_trainer.rollout.weight_sync"):
            report = sync(1)
        assert report.over_tolerance and report.metrics()["weight_sync_over_tolerance"] == 1.0
        assert report.logprob_diff_max == pytest.approx(0.3)
        assert "syncing policy 1" in caplog.text and "stops if the next sync is over it too" in caplog.text
        generator.gap = 0.1
        assert not sync(2).over_tolerance  # back within it: the next one over it is a first again
        generator.gap = 0.3
        assert sync(3).over_tolerance
        with pytest.raises(WeightSyncError, match=r"policy 4 \(and 3's before it\).*up to 0\.3 \(tolerance 0\.25\)"):
            sync(4)
    assert generator.loads == 5  # every sync pushed the weights before it was checked


def test_a_probe_gap_that_is_not_a_number_stops_the_run_at_once():
    generator, sync = _gapped_sync()
    with sync:
        generator.gap = float("nan")
        with pytest.raises(WeightSyncError, match="after syncing policy 0 the generator"):
            sync(0)


def test_without_a_tolerance_no_gap_stops_the_run():
    generator, sync = _gapped_sync(tolerance=None)
    with sync:
        generator.gap = 5.0
        assert [sync(version).over_tolerance for version in range(3)] == [False, False, False]


class FakeColocatedEngine:
    """vllm.LLM's engine as VLLMBackend drives it; ``finish=False`` never finishes a request."""

    def __init__(self, finish=True):
        self.finish, self.requests, self.aborted = finish, {}, []

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.requests[request_id] = prompt

    def abort_request(self, request_ids):
        self.aborted += list(request_ids)
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def step(self):
        if not self.finish:
            return []
        outputs = [
            SimpleNamespace(
                request_id=rid,
                finished=True,
                outputs=[
                    SimpleNamespace(
                        token_ids=[5, 9],
                        logprobs=[{5: SimpleNamespace(logprob=-1.0)}, {9: SimpleNamespace(logprob=-2.0)}],
                    )
                ],
            )
            for rid in self.requests
        ]
        self.requests.clear()
        return outputs


@pytest.fixture()
def fake_vllm_modules(monkeypatch):
    vllm = ModuleType("vllm")
    vllm.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    inputs = ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


@pytest.mark.usefixtures("fake_vllm_modules")
def test_the_colocated_backend_stops_its_driver_thread_on_close():
    backend = VLLMBackend(SimpleNamespace(llm_engine=FakeColocatedEngine()), stop_token_ids=[9])
    completion = asyncio.run(backend.generate([1, 2], 4))
    assert (completion.token_ids, completion.logprobs, completion.stopped) == ([5, 9], [-1.0, -2.0], True)
    driver = backend._driver
    assert driver.is_alive()
    backend.close()
    assert not driver.is_alive()
    backend.close()  # idempotent

    # A reply still being generated fails with a clear error, and the engine drops its request.
    engine = FakeColocatedEngine(finish=False)
    backend = VLLMBackend(SimpleNamespace(llm_engine=engine), stop_token_ids=[9])

    async def close_while_generating():
        reply = asyncio.ensure_future(backend.generate([1, 2], 4))
        await asyncio.sleep(0)  # the request is submitted
        await asyncio.to_thread(backend.close)
        with pytest.raises(RuntimeError, match="closed while this reply was being generated"):
            await reply

    with VLLMBackend(SimpleNamespace(llm_engine=FakeColocatedEngine()), stop_token_ids=[9]):
        pass  # a backend that never generated closes too
    asyncio.run(close_while_generating())
    assert backend._driver is None and engine.requests == {}


# A stand-in for `uvicorn appworld.serve.environment:app`: answers GET / until killed.
FAKE_APPWORLD_SERVER = """
import http.server, sys
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Ok).serve_forever()
"""


def test_the_appworld_pool_stops_its_servers_and_removes_its_log_directory(tmp_path, monkeypatch):
    from loop_trainer.envs.appworld import pool as pool_module

    monkeypatch.setattr(pool_module, "_SERVER_MAIN", FAKE_APPWORLD_SERVER)
    pool = pool_module.AppWorldServerPool(tmp_path, num_servers=2, python=sys.executable)
    pool.start()
    processes = [server.process for server in pool.servers]
    log_dir = pool.servers[0].log_path.parent
    assert log_dir.is_dir() and log_dir.name.startswith(f"loop-appworld-{os.getpid()}-")
    assert all(process.poll() is None for process in processes)
    pool.close()
    assert all(process.poll() is not None for process in processes)  # close() waits for them
    assert not log_dir.exists() and not pool.servers
    pool.close()  # idempotent

    given = tmp_path / "logs"
    pool = pool_module.AppWorldServerPool(tmp_path, num_servers=1, python=sys.executable, log_dir=given)
    pool.start()
    process = pool.servers[0].process
    pool.close()
    assert process.poll() is not None and (given / "server-0.log").is_file()  # the caller's logs stay
