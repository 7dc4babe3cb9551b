"""The lower bound the multi-turn benchmark reports (benchmarks/multiturn_bound.py): its arithmetic
and its lock-step batching, not any speed."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for the benchmarks package

from benchmarks.multiturn_bound import LockStepBackend, attach_bounds, lower_bound  # noqa: E402


def test_the_bound_is_the_larger_of_generation_and_the_slowest_episodes_critical_path():
    # Generation-limited: 40 s of lock-step generation against 3 s of sleep + 4 s of replies alone.
    bound = lower_bound({"ours": 40.0, "trl": 50.0}, env_sleep_max_episode_s=3.0, generation_alone_s=4.0)
    assert bound["bound_s"] == 40.0 and bound["limited_by"] == "generation"
    assert bound["fastest_decoder"] == "ours" and bound["critical_path_s"] == 7.0
    assert bound["generation_full_ours_s"] == 40.0 and bound["generation_full_trl_s"] == 50.0
    # The faster decoder counts, whichever side it is.
    assert lower_bound({"ours": 40.0, "trl": 30.0}, 3.0, 4.0)["bound_s"] == 30.0
    # Latency-limited: the slowest episode sleeps longer than all the generation takes.
    bound = lower_bound({"ours": 2.0}, env_sleep_max_episode_s=5.5, generation_alone_s=0.5)
    assert bound["bound_s"] == 6.0 and bound["limited_by"] == "slowest episode"


@pytest.mark.parametrize(
    "full, sleep, alone",
    [({}, 1.0, 1.0), ({"ours": 0.0}, 1.0, 1.0), ({"ours": 1.0}, -1.0, 1.0), ({"ours": 1.0}, 1.0, 0.0)],
)
def test_the_bound_refuses_impossible_times(full, sleep, alone):
    with pytest.raises(ValueError):
        lower_bound(full, sleep, alone)


def test_every_run_gets_its_own_bound_from_the_fastest_measurements():
    runs = [
        {"side": "ours", "concurrency": 8, "seconds": 12.0, "env_sleep_max_episode_s": 1.0},
        {"side": "trl", "concurrency": 8, "seconds": 20.0, "env_sleep_max_episode_s": 1.0, "generation_seconds": 9.0},
        {"side": "trl", "concurrency": 8, "seconds": 21.0, "env_sleep_max_episode_s": 6.0, "generation_seconds": 11.0},
        {"side": "ours", "concurrency": 64, "seconds": 60.0, "env_sleep_max_episode_s": 3.0},
    ]
    lock_steps = {
        1: [{"seconds": 2.5}, {"seconds": 2.0}],
        8: [{"seconds": 10.0}, {"seconds": 9.5}],
        64: [{"seconds": 50.0}],
    }
    attach_bounds(runs, lock_steps)
    # n = 8: TRL's fastest lock-step generation (9.0 s) beats our fastest (9.5 s); alone = 2.0 s.
    assert runs[0]["bound"]["bound_s"] == 9.0 and runs[0]["bound"]["fastest_decoder"] == "trl"
    assert runs[0]["over_bound"] == pytest.approx(12.0 / 9.0)
    assert runs[1]["over_bound"] == pytest.approx(20.0 / 9.0)
    # A run whose slowest episode sleeps 6 s is bounded by 6 + 2 = 8 s... still below 9 s.
    assert runs[2]["bound"]["critical_path_s"] == 8.0 and runs[2]["bound"]["bound_s"] == 9.0
    # No TRL run at 64: our decoder alone.
    assert runs[3]["bound"]["bound_s"] == 50.0 and "generation_full_trl_s" not in runs[3]["bound"]


class CountingBackend:
    """A backend that records how many requests were in flight as each one started."""

    def __init__(self, fail: bool = False):
        self.in_flight, self.starts, self.seen, self.fail = 0, [], [], fail

    async def generate(self, prompt_ids, max_new_tokens, seed=None):
        self.in_flight += 1
        self.starts.append(self.in_flight)
        self.seen.append((list(prompt_ids), max_new_tokens, seed))
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        if self.fail:
            raise RuntimeError("out of memory")
        return f"reply to {prompt_ids[0]}"


def test_the_lock_step_backend_submits_exactly_n_requests_at_once():
    inner = CountingBackend()
    backend = LockStepBackend(inner.generate, 3)

    async def episodes():
        async def episode(i):
            first = await backend.generate([i], 4, seed=i)
            await asyncio.sleep(0.01 * i)  # environment steps of different lengths
            return first, await backend.generate([10 + i], 4, seed=None)

        return await asyncio.gather(*(episode(i) for i in range(3)))

    replies = asyncio.run(episodes())
    assert replies == [(f"reply to {i}", f"reply to {10 + i}") for i in range(3)]
    assert backend.batch_sizes == [3, 3] and backend.generation_seconds > 0
    assert inner.starts == [1, 2, 3, 1, 2, 3]  # each turn: all three submitted before any returned
    assert sorted(inner.seen[:3]) == [([0], 4, 0), ([1], 4, 1), ([2], 4, 2)]
    assert [seed for _, _, seed in inner.seen[3:]] == [None, None, None]


def test_the_lock_step_backend_hands_each_error_to_its_episode():
    backend = LockStepBackend(CountingBackend(fail=True).generate, 2)

    async def two():
        return await asyncio.gather(backend.generate([1], 2), backend.generate([2], 2), return_exceptions=True)

    errors = asyncio.run(two())
    assert [str(error) for error in errors] == ["out of memory", "out of memory"]
