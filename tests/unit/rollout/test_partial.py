"""Partial rollouts: the straggler cut carries running groups whole into the next batch, their next turns sampled
by the newest policy (each turn's version and log-probs recorded), episodes spanning too many versions dropped and
counted, weights changed only between turns, and carried episodes finished, saved and restored for a checkpoint."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from loop_trainer.chat import ChatFormatter
from loop_trainer.envs.base import Environment, Episode, Message, Score, Step
from loop_trainer.rollout import EpisodeLimits, RolloutEngine
from loop_trainer.rollout.carried_groups import load_carried, save_carried
from loop_trainer.rollout.partial import ContinuingCollection
from loop_trainer.rollout.records import Completion
from support.helpers import ScriptedBackend


class VersionBackend(ScriptedBackend):
    """Replies ``v<version>``, each token with log-prob ``-(version + 1)``; counts the replies being sampled."""

    def __init__(self, tokenizer, version: int, delay: float = 0.0):
        super().__init__(tokenizer, lambda _: f"v{version}", delay=delay)
        self.version, self.active, self.active_at_hold = version, 0, []

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        self.active += 1
        try:
            completion = await super().generate(prompt_ids, max_new_tokens, seed)
        finally:
            self.active -= 1
        return Completion(completion.token_ids, [-(self.version + 1.0)] * len(completion.token_ids), True)


class LongEpisode(Episode):
    """Done after the task's ``turns`` replies; a task with ``wait_after`` stops after that many steps until the
    environment's ``go`` is set."""

    def __init__(self, env: LongEnv, task: Mapping[str, Any]):
        self.env, self.task, self.turn = env, task, 0

    async def start(self) -> list[Message]:
        return [{"role": "user", "content": f"task {self.task['task_id']}"}]

    async def step(self, reply: str) -> Step:
        self.turn += 1
        if self.turn == self.task.get("wait_after"):
            while not self.env.go.is_set():
                await asyncio.sleep(0.002)
        return Step(messages=[{"role": "user", "content": f"obs {self.turn}"}], done=self.turn >= self.task["turns"])

    async def score(self) -> Score:
        return Score(reward=self.turn / 10, success=True)


class LongEnv(Environment):
    name = "long"

    def __init__(self) -> None:
        self.go = threading.Event()

    def tasks(self, split: str = "train") -> Any:
        raise NotImplementedError

    def episode(self, task: Mapping[str, Any]) -> LongEpisode:
        return LongEpisode(self, task)


SHORT = {"task_id": "short", "turns": 2}
LONG = {"task_id": "long", "turns": 5, "wait_after": 2}


@pytest.fixture
def collection(qwen_tokenizer):
    env = LongEnv()
    engine = RolloutEngine(env, None, ChatFormatter(qwen_tokenizer), EpisodeLimits(max_turns=10), show_progress=False)
    made = ContinuingCollection(engine, max_span=1)
    made.env = env
    yield made
    env.go.set()
    made.close()
    engine.close()


def collect(made: ContinuingCollection, tasks, iteration: int, **kwargs):
    kwargs = {"done_fraction": 0.75, "task_fraction": 0.0, "seed": 7, "show_progress": False, **kwargs}
    return made.collect(tasks, 2, iteration=iteration, task_indices=range(len(tasks)), num_tasks=4, **kwargs)


def wait_until_ended(made: ContinuingCollection) -> None:
    deadline = time.monotonic() + 30
    while made.num_running and time.monotonic() < deadline:
        time.sleep(0.002)


def sampled_logprobs_by_turn(trajectory) -> dict[int, set[float]]:
    by_turn: dict[int, set[float]] = {}
    for turn, logprob in zip(trajectory.turn_ids, trajectory.sampler_logprobs, strict=True):
        if turn >= 0:
            by_turn.setdefault(turn, set()).add(logprob)
    return by_turn


def test_the_cut_carries_running_groups_whole_and_their_next_turns_are_sampled_by_the_new_policy(
    collection, qwen_tokenizer
):
    collection.release(0, VersionBackend(qwen_tokenizer, 0))
    first = collect(collection, [SHORT, SHORT, SHORT, LONG], iteration=0)  # 6 of 8 episodes end: the cut
    assert sorted({t.group for t in first.trajectories}) == [0, 1, 2]
    assert len(first.trajectories) == 6 and first.num_carried == 2 and first.stats()["carried_episodes"] == 2
    assert [(t.group, t.rollout) for t in first.trajectories] == [(g, k) for g in range(3) for k in range(2)]
    assert all(t.turn_versions == [0, 0] for t in first.trajectories)

    collection.hold()  # the weights change between turns
    collection.release(1, VersionBackend(qwen_tokenizer, 1))
    collection.env.go.set()
    wait_until_ended(collection)
    second = collect(collection, [SHORT, SHORT], iteration=1, done_fraction=1.0)
    carried = [t for t in second.trajectories if t.task_id == "long"]
    assert [(t.group, t.rollout) for t in carried] == [(4 * 1 + 3, 0), (4 * 1 + 3, 1)]  # past every new task
    for trajectory in carried:
        assert trajectory.turn_versions == [0, 0, 1, 1, 1] and trajectory.reward == 0.5
        # each sampled token carries the log-prob of the policy that sampled its turn
        assert sampled_logprobs_by_turn(trajectory) == {0: {-1.0}, 1: {-1.0}, 2: {-2.0}, 3: {-2.0}, 4: {-2.0}}
    assert second.num_carried == 0 and len(second.trajectories) == 6


def test_the_cut_waits_for_the_new_episodes_only(collection, qwen_tokenizer):
    collection.release(0, VersionBackend(qwen_tokenizer, 0))
    collect(collection, [SHORT, SHORT, SHORT, LONG], iteration=0)
    second = collect(collection, [SHORT], iteration=1, done_fraction=1.0)  # the long group still waits
    assert [t.task_id for t in second.trajectories] == ["short", "short"] and second.num_carried == 2
    assert {t.group for t in second.trajectories} == {0}


def test_an_episode_spanning_more_than_max_staleness_versions_is_dropped_and_counted(collection, qwen_tokenizer):
    collection.release(0, VersionBackend(qwen_tokenizer, 0))
    collect(collection, [SHORT, SHORT, SHORT, LONG], iteration=0)
    for version in (1, 2):  # two updates while the long episodes wait on their environment
        collection.hold()
        collection.release(version, VersionBackend(qwen_tokenizer, version))
    collection.env.go.set()
    wait_until_ended(collection)
    batch = collect(collection, [SHORT], iteration=2, done_fraction=1.0)
    assert batch.num_dropped_stale == 2 and batch.stats()["dropped_stale_episodes"] == 2
    assert [t.task_id for t in batch.trajectories] == ["short", "short"]  # the group of the long task is gone
    assert collection.num_dropped == 2 and not batch.failed


def test_holding_lets_the_turns_being_sampled_finish_and_starts_no_other(collection, qwen_tokenizer):
    slow = VersionBackend(qwen_tokenizer, 0, delay=0.05)
    collection.release(0, slow)
    collection.env.go.set()
    batch_thread = threading.Thread(target=collect, args=(collection, [SHORT] * 4, 0), kwargs={"done_fraction": 1.0})
    batch_thread.start()
    while not slow.active:
        time.sleep(0.001)
    collection.hold()
    assert slow.active == 0
    calls = slow.calls
    time.sleep(0.15)
    assert slow.calls == calls  # nothing started while held
    collection.release(1, VersionBackend(qwen_tokenizer, 1))
    batch_thread.join()


def test_episodes_in_flight_are_finished_saved_and_restored_for_a_checkpoint(collection, qwen_tokenizer, tmp_path):
    collection.release(0, VersionBackend(qwen_tokenizer, 0))
    collect(collection, [SHORT, LONG, SHORT, LONG], iteration=0, done_fraction=0.5)
    with pytest.raises(RuntimeError, match="still running"):
        collection.carried()
    collection.env.go.set()
    collection.finish_in_flight()
    carried = collection.carried()
    assert [(g.iteration, g.task_index, len(g.ended)) for g in carried] == [(0, 1, 2), (0, 3, 2)]
    save_carried(carried, tmp_path)
    # two processes take their own tasks' groups back (task index modulo the process count)
    assert [g.task_index for g in load_carried(tmp_path, 2, 1)] == [1, 3]
    assert load_carried(tmp_path, 2, 0) == []
    restored = load_carried(tmp_path)
    engine = collection.engine
    fresh = ContinuingCollection(engine, max_span=1)
    try:
        fresh.restore(restored)
        fresh.release(1, VersionBackend(qwen_tokenizer, 1))
        batch = collect(fresh, [SHORT], iteration=1, done_fraction=1.0)
        longs = [t for t in batch.trajectories if t.task_id == "long"]
        originals = [t for g in carried for t in g.ended.values()]
        assert [t.token_ids for t in longs] == [t.token_ids for t in originals]
        assert [t.turn_versions for t in longs] == [[0, 0, 0, 0, 0]] * 4  # finished by the policy of the moment
        assert sorted({t.group for t in longs}) == [4 + 1, 4 + 3]
    finally:
        fresh.close()


def test_closing_cancels_what_still_runs(qwen_tokenizer):
    env = LongEnv()
    engine = RolloutEngine(env, None, ChatFormatter(qwen_tokenizer), EpisodeLimits(max_turns=10), show_progress=False)
    made = ContinuingCollection(engine, max_span=1)
    made.release(0, VersionBackend(qwen_tokenizer, 0))
    batch = collect(made, [SHORT, SHORT, SHORT, LONG], iteration=0)
    assert batch.num_carried == 2 and made.num_running == 2
    made.close()
    made.close()  # idempotent
    assert made.num_running == 0
    engine.close()
