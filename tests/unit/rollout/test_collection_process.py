"""A collection in a process of its own: the same batch as on a thread, its errors in the parent, its refusals; the
partial rollouts it holds, driven from the parent."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loop_trainer.chat import ChatFormatter
from loop_trainer.envs.base import Environment
from loop_trainer.envs.errands import ErrandsEnv
from loop_trainer.rollout import EpisodeLimits, RolloutFailureBudgetExceeded
from loop_trainer.rollout.collection_child import _Child, _Leaving
from loop_trainer.rollout.collection_process import CollectionProcess, _ChildProcess
from loop_trainer.rollout.collection_protocol import ChildTotals, CollectionProcessError
from loop_trainer.rollout.engine import EngineSetup
from loop_trainer.rollout.vllm_server import VLLMServerBackend
from loop_trainer.training.overlap import OverlappedRollouts
from loop_trainer.training.trainer import LOOPTrainer
from support.collection_envs import (
    ClosingEnv,
    CountingEnv,
    ForkingThenStuckEpisode,
    GatedEnv,
    MetricsThatFailAfterTheFirstEnv,
    SignalHandlingLoopEnv,
    SleepingCloseEnv,
    SlowClosingEnv,
    StuckEpisodesEnv,
    UnpreparedEnv,
    Unrebuildable,
    UnrebuildableEnv,
    UnsendableEnv,
    UnsendableMetricsEnv,
    VanishingEnv,
)
from support.fake_vllm_server import serving
from support.helpers import ScriptedBackend
from support.stack_watching_env import TRAINING_STACK, StackWatchingEnv
from unit.training.test_rollout_resources import resources as sampling_parts

LIMITS = EpisodeLimits(max_turns=3, max_new_tokens_per_turn=3)


@pytest.fixture(scope="module")
def server():
    with serving() as server:
        server.varied = True
        yield server


@pytest.fixture()
def backend(server, tmp_path):
    server.status = 200
    with VLLMServerBackend(server.url, stop_token_ids=[9], sync_dir=str(tmp_path)) as backend:
        yield backend


def setup_for(
    env: Environment, tokenizer: Any, max_turns: int = LIMITS.max_turns, env_timeout: float = 60.0
) -> EngineSetup:
    limits = EpisodeLimits(max_turns=max_turns, max_new_tokens_per_turn=LIMITS.max_new_tokens_per_turn)
    return EngineSetup(env, ChatFormatter(tokenizer), limits, env_timeout, None, 8)


def fields(trajectories):
    return [
        (t.task_id, t.group, t.rollout, t.token_ids, t.loss_mask, t.sampler_logprobs, t.reward, t.status)
        for t in trajectories
    ]


@pytest.fixture(scope="module")
def child(qwen_tokenizer):
    """One child for the tests that do not break it (a spawn costs seconds)."""
    with CollectionProcess(setup_for(ErrandsEnv(num_tasks=2), qwen_tokenizer)) as process:
        yield process


def test_the_child_collects_the_batch_the_thread_collects(qwen_tokenizer, backend, child, server):
    env = ErrandsEnv(num_tasks=2)
    tasks = list(env.tasks("train"))[:2]
    options = {"seed": 1234, "group_ids": [0, 1], "description": "test"}
    with setup_for(env, qwen_tokenizer).build(backend) as engine:
        on_thread = engine.collect(tasks, 3, backend=backend, **options)
    server.bodies.clear()
    in_child = child.collect(tasks, 3, backend=backend, **options)
    assert child.pid != os.getpid() and len(server.bodies) > 6  # the child sent the turns' requests
    assert len(in_child.trajectories) == 6
    assert fields(in_child.trajectories) == fields(on_thread.trajectories)
    assert len({tuple(t.token_ids) for t in in_child.trajectories}) > 1  # the seeds made the episodes differ


def test_a_versions_requests_name_its_adapter(qwen_tokenizer, backend, child, server):
    backend.keep_versions = True
    backend._versions[3] = "loop-run-policy-3"
    server.bodies.clear()
    tasks = list(ErrandsEnv(num_tasks=2).tasks("train"))[:1]
    child.collect(tasks, 1, backend=backend.at_version(3), seed=1)
    assert server.bodies and {body["model"] for body in server.bodies} == {"loop-run-policy-3"}
    server.bodies.clear()
    child.collect(tasks, 1, backend=backend, seed=1)
    assert {body["model"] for body in server.bodies} == {"fake-model"}


def test_an_error_of_the_batch_is_raised_in_the_parent_and_the_child_goes_on(qwen_tokenizer, backend, child, server):
    tasks = list(ErrandsEnv(num_tasks=2).tasks("train"))[:2]
    server.status = 503  # every turn fails: more than the failure budget
    with pytest.raises(RolloutFailureBudgetExceeded, match="4 of 4 rollouts failed") as raised:
        child.collect(tasks, 2, backend=backend, seed=1, max_failed_fraction=0.5)
    assert "check_failure_budget" in str(raised.value.__cause__)  # the child's traceback
    server.status = 200
    assert len(child.collect(tasks, 2, backend=backend, seed=1).trajectories) == 4


def test_a_job_that_does_not_pickle_is_raised_and_the_child_goes_on(qwen_tokenizer, backend, child):
    tasks = list(ErrandsEnv(num_tasks=2).tasks("train"))[:1]
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        child.collect([{**tasks[0], "hook": lambda: None}], 1, backend=backend, seed=1)
    assert len(child.collect(tasks, 1, backend=backend, seed=1).trajectories) == 1  # not broken


def test_only_a_server_backend_can_sample_in_the_child(qwen_tokenizer, child):
    with pytest.raises(CollectionProcessError, match="samples through a vLLM server, not ScriptedBackend"):
        child.collect([{}], 1, backend=ScriptedBackend(qwen_tokenizer, lambda prompt: "x"))


class UnpicklableEnv(ErrandsEnv):
    def __init__(self) -> None:
        super().__init__(num_tasks=1)
        self.callback = lambda: None


def test_an_environment_that_does_not_pickle_is_refused_in_one_line(qwen_tokenizer):
    with pytest.raises(CollectionProcessError, match="UnpicklableEnv .* cannot be sent .*collection_process: false"):
        CollectionProcess(setup_for(UnpicklableEnv(), qwen_tokenizer))


def test_an_environment_the_child_cannot_rebuild_is_refused_as_it_starts(qwen_tokenizer):
    refusal = "could not rebuild the environment UnrebuildableEnv .*my_private_env.*importable module"
    with pytest.raises(CollectionProcessError, match=refusal) as refused:
        CollectionProcess(setup_for(UnrebuildableEnv(num_tasks=1), qwen_tokenizer))
    assert "cannot_rebuild" in str(refused.value.__cause__)  # the child's traceback


def test_the_child_prepares_its_copy_and_a_failure_is_refused_as_it_starts(qwen_tokenizer):
    with pytest.raises(CollectionProcessError, match="UnpreparedEnv's prepare\\(\\) failed .*:9000 does not answer"):
        CollectionProcess(setup_for(UnpreparedEnv(num_tasks=1), qwen_tokenizer))


def test_a_child_that_dies_as_it_starts_is_refused_naming_the_main_guard(qwen_tokenizer):
    with pytest.raises(CollectionProcessError, match="died as it started \\(exit code 3\\).*__name__ == "):
        CollectionProcess(setup_for(VanishingEnv(num_tasks=1), qwen_tokenizer))


class ParentOnlyEnv(ErrandsEnv):
    in_process_only = "its episodes share a cache with the trainer"


def test_an_environment_that_runs_in_the_trainers_process_only_is_refused_with_its_reason(qwen_tokenizer):
    with pytest.raises(CollectionProcessError, match="ParentOnlyEnv runs in the trainer's process only .*a cache"):
        CollectionProcess(setup_for(ParentOnlyEnv(num_tasks=1), qwen_tokenizer))


def test_a_child_that_dies_is_an_error_that_says_so(qwen_tokenizer, backend):
    tasks = list(ErrandsEnv(num_tasks=1).tasks("train"))[:1]
    with CollectionProcess(setup_for(ErrandsEnv(num_tasks=1), qwen_tokenizer)) as process:
        assert len(process.collect(tasks, 1, backend=backend, seed=1).trajectories) == 1
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(CollectionProcessError, match="died \\(exit code -9\\).*collection_process: false"):
            process.collect(tasks, 1, backend=backend, seed=1)
    process.close()  # idempotent


def test_threads_that_wait_for_the_child_at_once_all_see_its_end():
    """The batch's wait, the control pipe's and a close may each wait for the child as it ends. With
    multiprocessing's waits alone, the first reaps it and a concurrent one takes it for running (CPython gh-130895):
    in about one trial in three here a thread saw it alive, exit code None, after its join."""
    # Forked, not spawned as the trainer's child is: milliseconds to start, and a child that only sleeps, so the
    # parent's threads (pytest-xdist's, the fake server's) cannot leave it a lock held. A daemon, and killed if it
    # outlives the test: multiprocessing's exit would wait for it otherwise.
    context = multiprocessing.get_context("fork")
    for _ in range(30):
        child = _ChildProcess(context.Process(target=time.sleep, args=(0.02,), daemon=True))
        child.start()
        seen: list[tuple[bool, int | None]] = []

        def wait(child: _ChildProcess = child, seen: list = seen) -> None:
            child.join(5)
            seen.append((child.is_alive(), child.exitcode))

        waits = [threading.Thread(target=wait) for _ in range(3)]
        try:
            for thread in waits:
                thread.start()
            for thread in waits:
                thread.join(10)
        finally:
            if child.is_alive():
                child.kill()
        assert seen == [(False, 0)] * 3


def test_the_childs_running_totals_come_back_with_each_batch(qwen_tokenizer, backend):
    tasks = list(CountingEnv().tasks("train"))[:1]
    with CollectionProcess(setup_for(CountingEnv(), qwen_tokenizer)) as process:
        process.collect(tasks, 2, backend=backend, seed=1)
        assert process.totals.env_metrics == {"episodes": 2.0, "prepared": 1.0}
        process.collect(tasks, 3, backend=backend, seed=2)
        assert process.totals.env_metrics == {"episodes": 5.0, "prepared": 1.0}
        assert (process.totals.generation_retries, process.totals.abandoned_calls) == (0, 0)


@pytest.mark.parametrize("failure", ["raises", "hangs"])
def test_a_failing_metrics_in_the_child_keeps_its_last_answer_and_is_counted(qwen_tokenizer, backend, capfd, failure):
    """One that hangs is bounded by env_timeout (here 2 s), once."""
    tasks = list(CountingEnv().tasks("train"))[:1]
    setup = setup_for(MetricsThatFailAfterTheFirstEnv(hang=failure == "hangs"), qwen_tokenizer, env_timeout=2.0)
    with CollectionProcess(setup) as process:
        process.collect(tasks, 2, backend=backend, seed=1)
        answered = {"episodes": 2.0, "prepared": 1.0}
        assert (process.totals.env_metrics, process.totals.metrics_call_failures) == (answered, 0)
        for failed in (1, 2):  # the batches still come back
            assert len(process.collect(tasks, 1, backend=backend, seed=2).trajectories) == 1
            assert (process.totals.env_metrics, process.totals.metrics_call_failures) == (answered, failed)
    assert process._process.exitcode == 0  # ended by its own close (a hung call's thread left behind)
    logged = capfd.readouterr().err  # the child's log lines
    hung = logged.count("metrics() did not return within env_timeout (2s) in the collection process")
    assert hung == (1 if failure == "hangs" else 0)


class GatedMetricsEnv(ErrandsEnv):
    """metrics() answers its n-th call with n, once the test lets it (``release``); ``called`` says it started."""

    def __init__(self) -> None:
        super().__init__(num_tasks=1)
        self.called, self.release = threading.Event(), threading.Event()
        self.calls = 0

    def metrics(self) -> dict[str, float]:
        self.calls += 1
        self.called.set()
        assert self.release.wait(60)
        return {"calls": float(self.calls)}


def test_an_answer_does_not_wait_for_the_metrics_the_childs_other_thread_is_reading(qwen_tokenizer):
    """The child's two threads each send their totals with their answer: the control thread's (around a weight
    change) carries the last read while the batch thread waits for a slow or hung metrics(), instead of waiting
    behind it; then the batch thread's, numbered after it, carries the new read (the parent keeps the newest)."""
    env = GatedMetricsEnv()
    child = _Child(setup_for(env, qwen_tokenizer, env_timeout=60.0), _Leaving())
    env.release.set()
    assert child.totals().env_metrics == {"calls": 1.0}
    env.called.clear()
    env.release.clear()
    batch_answer: list[ChildTotals] = []
    reading = threading.Thread(target=lambda: batch_answer.append(child.totals()), daemon=True)
    reading.start()
    try:
        assert env.called.wait(60)
        control_answer = child.totals()  # while the batch thread's read waits for metrics() to return
        assert reading.is_alive()  # still waiting: released only below
        assert (control_answer.env_metrics, control_answer.metrics_call_failures) == ({"calls": 1.0}, 0)
        assert env.calls == 2  # no second call started beside the one running
    finally:
        env.release.set()
        reading.join(60)
    assert batch_answer[0].env_metrics == {"calls": 2.0}
    assert batch_answer[0].taken > control_answer.taken


def test_a_batch_that_does_not_pickle_is_an_error_and_the_child_goes_on(qwen_tokenizer, backend):
    tasks = list(ErrandsEnv(num_tasks=1).tasks("train"))[:1]
    with CollectionProcess(setup_for(UnsendableEnv(num_tasks=1), qwen_tokenizer)) as process:
        with pytest.raises(CollectionProcessError, match="batch cannot be sent back .*does not pickle"):
            process.collect(tasks, 1, backend=backend, seed=1)
        with pytest.raises(CollectionProcessError, match="batch cannot be sent back"):
            process.collect(tasks, 1, backend=backend, seed=1)  # the child still answers
        assert process._process.is_alive()


def test_metrics_that_do_not_pickle_are_named_as_what_cannot_be_sent(qwen_tokenizer, backend):
    tasks = list(ErrandsEnv(num_tasks=1).tasks("train"))[:1]
    with CollectionProcess(setup_for(UnsendableMetricsEnv(num_tasks=1), qwen_tokenizer)) as process:
        with pytest.raises(CollectionProcessError, match="metrics\\(\\) returned a value that does not pickle"):
            process.collect(tasks, 1, backend=backend, seed=1)
        assert process.totals == ChildTotals()  # none came back: the parent keeps what it had


def test_an_interrupted_wait_leaves_the_process_broken_not_out_of_step(qwen_tokenizer, backend, monkeypatch):
    tasks = list(ErrandsEnv(num_tasks=1).tasks("train"))[:1]
    with CollectionProcess(setup_for(ErrandsEnv(num_tasks=1), qwen_tokenizer)) as process:

        def interrupted():
            raise KeyboardInterrupt

        monkeypatch.setattr(
            process, "_connection", SimpleNamespace(send_bytes=process._connection.send_bytes, recv=interrupted)
        )
        with pytest.raises(KeyboardInterrupt):
            process.collect(tasks, 1, backend=backend, seed=1)
        monkeypatch.undo()
        with pytest.raises(CollectionProcessError, match="the collection process is broken"):
            process.collect(tasks, 1, backend=backend, seed=1)


@pytest.fixture(scope="module")
def gated_child(qwen_tokenizer):
    with CollectionProcess(setup_for(GatedEnv(), qwen_tokenizer, max_turns=6)) as process:
        yield process


@pytest.fixture()
def versions(backend):
    """The server backend with policies 0 and 1 loaded under their own names."""
    backend.keep_versions = True
    backend._versions.update({0: "policy-0", 1: "policy-1"})
    return backend.at_version(0), backend.at_version(1)


CUT = {"done_fraction": 0.5, "task_fraction": 0.0, "show_progress": False}
WHOLE = {"done_fraction": 1.0, "task_fraction": 1.0, "show_progress": False}


def within(seconds: float, call: Any, *args: Any, process: CollectionProcess) -> Any:
    """``call(*args)``'s result, or a test failure if it has not returned within ``seconds``: ``process`` (the child
    it waits on) is then ended, so the wait, and what the test's cleanup sends it, fail instead of hanging."""
    results: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(call(*args))
        except BaseException as error:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        process._broken = True  # its pipes are out of step: the cleanup's calls are refused, not waited on
        process._process.terminate()
        pytest.fail(f"{getattr(call, '__name__', call)}() did not return within {seconds:g} s")
    if errors:
        raise errors[0]
    return results[0]


def wait_for_requests(server: Any, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(server.bodies) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(server.bodies) >= count, f"{len(server.bodies)} of {count} requests reached the server"


def test_partial_rollouts_in_the_child_change_policy_between_turns_while_a_batch_is_collected(
    gated_child, versions, server, tmp_path
):
    """hold() and release() are answered while the child collects a batch (over the other pipe), and the episode's
    turns after release() are sampled by the new policy, each recorded with its version."""
    gate = tmp_path / "go"
    task = {"task_id": "long", "turns": 4, "wait_after": 2, "gate": str(gate)}
    server.bodies.clear()
    continuing = gated_child.continuing(1, versions[0])
    try:
        continuing.release(0, versions[0])
        collected: list[Any] = []
        options = {"iteration": 0, "task_indices": [0], "num_tasks": 1, "seed": 1, **WHOLE}
        thread = threading.Thread(
            target=lambda: collected.append(continuing.collect([task], 1, **options)), daemon=True
        )
        thread.start()
        wait_for_requests(server, 2)  # its two turns before the gate
        within(60, continuing.hold, process=gated_child)
        within(60, continuing.release, 1, versions[1], process=gated_child)
        assert thread.is_alive() and len(server.bodies) == 2  # answered while the batch waits at the gate
        gate.touch()
        thread.join(60)
        (trajectory,) = collected[0].trajectories
        assert trajectory.turn_versions == [0, 0, 1, 1]
        assert [body["model"] for body in server.bodies] == ["policy-0"] * 2 + ["policy-1"] * 2
        assert trajectory.reward == 0.4 and sum(trajectory.loss_mask) > 0
    finally:
        continuing.close()


def test_partial_rollouts_in_the_child_carry_finish_save_restore_and_cancel(gated_child, versions, server, tmp_path):
    """The checkpoint's path through the child: a group running at the cut is carried, finished by the newest
    policy, fetched whole; a new collection takes it back (restore) into its next batch; what still runs at the
    end is cancelled and counted."""
    gate = tmp_path / "go"
    short = {"task_id": "short", "turns": 2}
    long = {"task_id": "long", "turns": 4, "wait_after": 2, "gate": str(gate)}
    server.bodies.clear()
    continuing = gated_child.continuing(1, versions[0])
    continuing.release(0, versions[0])
    first = continuing.collect([short, long], 2, iteration=0, task_indices=[0, 1], num_tasks=2, seed=1, **CUT)
    assert [(t.task_id, t.group) for t in first.trajectories] == [("short", 0)] * 2 and first.num_carried == 2
    wait_for_requests(server, 8)  # the long episodes' two turns before their gate, as the short ones' four
    continuing.hold()
    continuing.release(1, versions[1])
    gate.touch()
    continuing.finish_in_flight()
    (group,) = continuing.carried()
    assert (group.iteration, group.task_index, sorted(group.ended), group.running) == (0, 1, [0, 1], {})
    assert [t.turn_versions for t in group.ended.values()] == [[0, 0, 1, 1]] * 2
    continuing.close()  # as a run that stops after its checkpoint; the resumed one opens another

    resumed = gated_child.continuing(1, versions[1])
    try:
        resumed.release(1, versions[1])
        resumed.restore([group])
        second = resumed.collect([short], 2, iteration=1, task_indices=[0], num_tasks=1, seed=2, **WHOLE)
        assert [(t.task_id, t.group, t.rollout) for t in second.trajectories] == [
            ("short", 0, 0),
            ("short", 0, 1),
            ("long", 2, 0),  # carried from iteration 0's task 1: past every new task's group
            ("long", 2, 1),
        ]
        stuck = {**long, "gate": str(tmp_path / "never")}
        third = resumed.collect([short, stuck], 2, iteration=2, task_indices=[0, 1], num_tasks=2, seed=3, **CUT)
        assert third.num_carried == 2
        assert resumed.cancel_in_flight() == 2
    finally:
        resumed.close()
    assert gated_child.is_usable


def test_the_child_runs_batches_and_partial_rollouts_without_importing_the_training_stack(
    qwen_tokenizer, backend, versions
):
    """The child imports the environment, the tokenizer and the rollout engine (loop_trainer's packages export
    their names on first use: lazy_exports.py); pytest's main module, which a spawned child imports again, is
    light too. That loop-train's is: test_the_modules_a_collection_child_imports_load_no_torch."""
    imported_none = dict.fromkeys(TRAINING_STACK, 0.0)
    env = StackWatchingEnv(num_tasks=1)
    short = list(env.tasks("train"))[0]
    with CollectionProcess(setup_for(env, qwen_tokenizer)) as process:
        process.collect([short], 2, backend=backend, seed=1)
        assert process.totals.env_metrics == imported_none
        continuing = process.continuing(1, versions[0])
        try:
            continuing.release(0, versions[0])
            batch = continuing.collect([short], 2, iteration=0, task_indices=[0], num_tasks=1, seed=2, **WHOLE)
            assert len(batch.trajectories) == 2
            continuing.hold()
            continuing.release(1, versions[1])
            continuing.finish_in_flight()
            assert continuing.carried() == []
        finally:
            continuing.close()
        process.collect([short], 1, backend=backend, seed=3)  # metrics are read as a batch ends
        assert process.totals.env_metrics == imported_none


def test_the_modules_a_collection_child_imports_load_no_torch():
    """The child's own modules; loop-train's entry points (``-m loop_trainer.cli.train``, and the console scripts'
    module), which a spawned child imports again with its main module; and the adapters of the environments that may
    run in a child (verifiers' and OpenEnv's; TRL's runs in the trainer's process only)."""
    code = (
        "import sys, loop_trainer.cli.train, loop_trainer.cli.entry_points, loop_trainer.rollout.collection_child, "
        "loop_trainer.compat.verifiers, "
        "loop_trainer.compat.verifiers_v1, loop_trainer.compat.openenv, support.collection_envs; "
        f"print([m for m in {TRAINING_STACK!r} if m in sys.modules])"
    )
    tests = {"PYTHONPATH": os.pathsep.join(sys.path)}  # support.collection_envs: what this file's children import
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **tests}
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_a_call_the_child_cannot_read_is_an_error_and_the_control_pipe_stays_in_step(gated_child, versions):
    continuing = gated_child.continuing(1, versions[0])
    try:
        with pytest.raises(RuntimeError, match="cannot be rebuilt in the child"):
            within(60, continuing.restore, [Unrebuildable()], process=gated_child)
        assert within(60, continuing.cancel_in_flight, process=gated_child) == 0  # the next call gets its own answer
    finally:
        continuing.close()


def test_partial_rollouts_sample_through_a_vllm_server_only(gated_child, qwen_tokenizer):
    with pytest.raises(CollectionProcessError, match="samples through a vLLM server, not ScriptedBackend"):
        gated_child.continuing(1, ScriptedBackend(qwen_tokenizer, lambda prompt: "x"))


LEFT_BEHIND = """
import os, pickle, signal, sys, threading, time
from loop_trainer.envs.errands import ErrandsEnv
from loop_trainer.rollout.collection_process import CollectionProcess
from loop_trainer.rollout.vllm_server import VLLMServerBackend
if __name__ == "__main__":
    setup_file, how, url, sync_dir = sys.argv[1:]
    with open(setup_file, "rb") as file:
        process = CollectionProcess(pickle.load(file))
    print("CHILD", process.pid, flush=True)
    if how == "mid-batch":  # killed while the child waits for a stalling server
        backend = VLLMServerBackend(url, stop_token_ids=[9], sync_dir=sync_dir)
        tasks = list(ErrandsEnv(num_tasks=1).tasks("train"))[:1]
        threading.Thread(target=process.collect, args=(tasks, 1), kwargs={"backend": backend}, daemon=True).start()
        time.sleep(1.0)
    if how != "exits":
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("how", ["exits without close", "mid-batch", "killed when idle"])
def test_the_child_does_not_outlive_its_trainer(qwen_tokenizer, tmp_path, how, server):
    """A trainer that exits without closing it does not hang on it, and one that is killed, even while its child
    collects a batch (here one of several 4-second turns), does not leave it. Either way the child closes its copy
    of the environment before it ends, once, and to the end: killed when idle, the child's main thread (its pipe
    closed) and its watch on the trainer both end it, here with a close that takes 3 s."""
    marker = tmp_path / "closed"
    env = SlowClosingEnv(marker) if how == "killed when idle" else ClosingEnv(marker)
    (tmp_path / "setup.pkl").write_bytes(pickle.dumps(setup_for(env, qwen_tokenizer)))
    (tmp_path / "script.py").write_text(LEFT_BEHIND)
    server.stall = 4.0 if how == "mid-batch" else 0.0
    try:
        # Into files, not pipes: the child inherits them, and a pipe would hold run() until the child had left too.
        with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
            run = subprocess.run(
                [sys.executable, str(tmp_path / "script.py"), str(tmp_path / "setup.pkl"), how.split()[0], server.url]
                + [str(tmp_path)],
                stdout=out,
                stderr=err,
                timeout=120,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
        assert run.returncode == (0 if how.startswith("exits") else -signal.SIGKILL), (tmp_path / "err").read_text()
        child = int((tmp_path / "out").read_text().split("CHILD ")[1].split()[0])
        deadline = time.monotonic() + 8  # before the batch could end (three 4-second turns): not a timing
        while Path(f"/proc/{child}").exists() and "zombie" not in _state(child) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        server.stall = 0.0
    while Path(f"/proc/{child}").exists() and "zombie" not in _state(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "zombie" in _state(child)
    assert marker.read_text().splitlines()[0].split()[0] == str(child)  # closed by the child, to the end
    assert len(marker.read_text().splitlines()) == 1  # once


def test_a_child_closed_by_its_trainer_closes_its_environment_once(qwen_tokenizer, tmp_path):
    marker = tmp_path / "closed"
    process = CollectionProcess(setup_for(ClosingEnv(marker), qwen_tokenizer))
    process.close()
    assert marker.read_text().split() == [str(process.pid)]


def test_a_child_told_to_end_closes_its_environment_first(qwen_tokenizer, tmp_path):
    """SIGTERM: what the trainer's close() sends a child that did not end in time, and what multiprocessing sends
    a daemon child as its parent exits."""
    marker = tmp_path / "closed"
    process = CollectionProcess(setup_for(ClosingEnv(marker), qwen_tokenizer))
    os.kill(process.pid, signal.SIGTERM)
    process._process.join(60)
    assert process._process.exitcode == 1  # os._exit(1), not the signal's default end (-15)
    assert marker.read_text().split() == [str(process.pid)]
    process.close()


def test_a_child_stuck_in_native_code_still_ends_on_sigterm_closing_its_environment(qwen_tokenizer, backend, tmp_path):
    """A Python handler would wait for the main thread to come back to Python, for ever here: then multiprocessing's
    exit (SIGTERM, then a join without a bound) would hang the trainer's. The child sees it on a thread instead."""
    marker, stuck = tmp_path / "closed", tmp_path / "stuck"
    process = CollectionProcess(setup_for(StuckEpisodesEnv(marker, stuck), qwen_tokenizer))
    try:
        tasks = list(ErrandsEnv(num_tasks=1).tasks("train"))[:1]
        collecting = threading.Thread(target=_collect_ignoring_errors, args=(process, tasks, backend), daemon=True)
        collecting.start()
        deadline = time.monotonic() + 60
        while not stuck.exists():
            assert time.monotonic() < deadline and process._process.is_alive(), "the episode never got stuck"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGTERM)
        process._process.join(30)  # CLOSE_WHEN_LEAVING_S (10 s) and more; unbounded without the fix
        assert process._process.exitcode == 1  # os._exit(1) after the close, not killed
        assert marker.read_text().split() == [str(process.pid)]
    finally:
        if process._process.is_alive():
            process._process.kill()
        process.close(timeout=1)


@pytest.mark.parametrize("interrupted", [False, True], ids=["waits", "interrupted"])
def test_a_trainer_closing_with_a_batch_stuck_in_its_child_ends_the_child_and_starts_no_other(
    qwen_tokenizer, backend, tmp_path, interrupted
):
    """A run stopped mid-way (an error, Ctrl-C) closes with batches queued ahead: here the one its child collects is
    stuck in C, where no bound reaches it, and the next has not started. The trainer's close waits for the stuck one
    a bounded time (``close_timeout``), then ends the child, which closes its environment; the next never starts.
    Before, the close waited for the stuck batch for ever. ``interrupted``: a second Ctrl-C during that wait ends
    the child at once, and the close still returns (raising it)."""
    marker, stuck = tmp_path / "closed", tmp_path / "stuck"
    resources = sampling_parts(qwen_tokenizer, backend=backend)
    process = CollectionProcess(setup_for(StuckEpisodesEnv(marker, stuck), qwen_tokenizer), close_timeout=1.0)
    resources._collection_process = process
    if interrupted:
        close_collection_process = resources.close_collection_process

        def interrupted_wait(timeout: float | None = None) -> None:
            if timeout is None:  # the wait for the stuck batch
                raise KeyboardInterrupt
            close_collection_process(timeout)

        resources.close_collection_process = interrupted_wait  # type: ignore[method-assign]
    overlap = OverlappedRollouts(max_staleness=2)
    tasks = list(ErrandsEnv(num_tasks=1).tasks("train"))[:1]
    started: list[int] = []

    def collect(iteration: int) -> Any:
        started.append(iteration)
        return process.collect(tasks, 1, backend=backend)

    trainer = SimpleNamespace(overlap=overlap, _continuing=None, rollout_resources=resources)
    trainer._close_collections = functools.partial(LOOPTrainer._close_collections, trainer)
    raised: list[BaseException] = []

    def close() -> None:
        try:
            LOOPTrainer.close(trainer)  # type: ignore[arg-type]
        except BaseException as error:  # noqa: BLE001 - checked below
            raised.append(error)

    closing = threading.Thread(target=close, daemon=True)
    try:
        overlap.start(1, 0, lambda: collect(1))
        overlap.start(2, 0, lambda: collect(2))
        first = overlap._queue[0].share
        _until(stuck.exists, 60)
        closing.start()
        closing.join(60)  # close_timeout (1 s), then the child's own close (CLOSE_WHEN_LEAVING_S, 10 s) and more
        assert not closing.is_alive(), "the trainer's close waited for the stuck batch"
        assert [type(error) for error in raised] == ([KeyboardInterrupt] if interrupted else [])
        assert started == [1]  # the second batch was cancelled before it started
        assert overlap.iterations == [] and resources._collection_process is None
        assert first is not None and "ended by close() while collecting a batch" in str(first.exception(0))
        assert process._process.exitcode == 1  # SIGTERM: os._exit(1) after the child closed its environment
        assert marker.read_text().split() == [str(process.pid)]
    finally:
        if process._process.is_alive():  # the stuck batch's thread then ends, and the closing one with it
            process._process.kill()
        if closing.is_alive():
            closing.join(60)
        process.close(timeout=1)


def test_a_close_interrupted_before_it_ended_the_child_ends_it_when_called_again(qwen_tokenizer):
    """Ctrl-C during close()'s wait for the child to end (here its environment's close never returns): the next
    close() ends it, instead of returning at once because the first had begun."""
    process = CollectionProcess(setup_for(SleepingCloseEnv(num_tasks=1), qwen_tokenizer))
    child = process._process._process  # multiprocessing's Process: interrupted inside the wrapper's lock
    join = child.join
    interrupts = [KeyboardInterrupt()]

    def interrupted_join(timeout: float | None = None) -> None:
        if interrupts:
            raise interrupts.pop()
        join(timeout)

    child.join = interrupted_join  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            process.close(timeout=1)
        assert process._process.is_alive()  # told to end, in its environment's close
        process.close(timeout=1)
        assert not process._process.is_alive()
        assert process._process.exitcode == 1  # SIGTERM: the child waited for its close a bounded time, then left
    finally:
        if process._process.is_alive():
            process._process.kill()


def test_a_batch_that_starts_after_its_collection_process_closed_opens_no_other(qwen_tokenizer, backend):
    """The batches queued ahead are bound to the collection process open when they were queued: one that starts
    only as the run closes (taken off the queue just before the cancel) finds it closed, instead of spawning a new
    child on the collection thread while the trainer's close waits for that thread."""
    resources = sampling_parts(qwen_tokenizer, backend=backend)
    process = CollectionProcess(setup_for(ErrandsEnv(num_tasks=1), qwen_tokenizer))
    resources._collection_process = process
    gate = threading.Event()

    def share(tasks, iteration, sampler=None, collector=None):
        assert gate.wait(60)
        return collector.collect(tasks, 1, backend=sampler)

    trainer = SimpleNamespace(
        args=SimpleNamespace(iterations=4, tasks_per_iteration=1),
        overlap=OverlappedRollouts(max_staleness=2),
        train_dataset=list(ErrandsEnv(num_tasks=1).tasks("train")),
        task_sampler=SimpleNamespace(next=lambda count: [0] * count),
        generator=SimpleNamespace(sampler=lambda version: backend, release_versions_below=lambda version: None),
        collection_settings=SimpleNamespace(collection_process=True),
        rollout_resources=resources,
        _share=share,
    )
    trainer._collect_share = functools.partial(LOOPTrainer._collect_share, trainer)
    try:
        LOOPTrainer._queue_ahead(trainer, 0)
        shares = [queued.share for queued in trainer.overlap._queue]
        resources.close_collection_process()
        gate.set()  # the queued batches start now, the process closed
        errors = [share.exception(60) for share in shares]
        assert [str(error) for error in errors] == ["the collection process is closed"] * 2
        assert resources._collection_process is None  # none opened anew
    finally:
        gate.set()
        trainer.overlap.close()
        resources.close()


def test_closing_stops_waiting_for_a_stuck_batch_even_where_a_grandchild_holds_the_childs_pipe(
    qwen_tokenizer, backend, tmp_path
):
    """Ending the child does not end the batch's wait while a process the environment forked holds the child's end
    of the pipe open: the close shuts the trainer's end down, so the wait reads its end instead of waiting for ever."""
    marker, forked = tmp_path / "closed", tmp_path / "forked"
    env = StuckEpisodesEnv(marker, forked, ForkingThenStuckEpisode)
    process = CollectionProcess(setup_for(env, qwen_tokenizer), close_timeout=1.0)
    tasks = list(ErrandsEnv(num_tasks=1).tasks("train"))[:1]
    errors: list[BaseException] = []

    def collect() -> None:
        try:
            process.collect(tasks, 1, backend=backend)
        except CollectionProcessError as error:
            errors.append(error)

    collecting = threading.Thread(target=collect, daemon=True)
    closing = threading.Thread(target=process.close, daemon=True)
    grandchild = 0
    try:
        collecting.start()
        _until(lambda: forked.exists() and forked.read_text() != "", 60)
        grandchild = int(forked.read_text())
        closing.start()
        closing.join(60)  # close_timeout (1 s), then the child's own close (CLOSE_WHEN_LEAVING_S, 10 s) and more
        assert not closing.is_alive(), "the close waited for a batch whose pipe a grandchild holds open"
        collecting.join(5)
        ended = "the collection process was ended by close() while collecting a batch"
        assert [str(error) for error in errors] == [ended]
        assert Path(f"/proc/{grandchild}").exists()  # still holding the pipe: the wait ended without it closing
        assert process._process.exitcode == 1 and marker.read_text().split() == [str(process.pid)]
    finally:
        if grandchild:
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)
        if process._process.is_alive():
            process._process.kill()
        if closing.is_alive():
            closing.join(60)
        process.close(timeout=1)


def _until(condition: Any, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the time given"
        time.sleep(0.01)


@pytest.mark.parametrize("wakeup_fd", ["the watch's", "taken over"])
def test_the_childs_first_sigterm_ends_it_through_its_close_a_second_at_once(monkeypatch, wakeup_fd):
    """What reaches the watch's pipe: the C handler's signal numbers while the wakeup fd is the watch's (every signal
    with a Python handler, the Python handler's own mark after a SIGTERM); only the Python handler's mark once code on
    the main thread has taken the wakeup fd over. Either way one close, and a second SIGTERM the C handler wrote ends
    the process at once."""
    from loop_trainer.rollout import collection_child

    exits: list[int] = []
    monkeypatch.setattr(collection_child.os, "_exit", exits.append)
    nows: list[str] = []
    watch = collection_child._SigtermWatch(SimpleNamespace(now=nows.append))
    watcher = threading.Thread(target=watch.watch, daemon=True)
    watcher.start()
    before = signal.signal(signal.SIGTERM, watch.on_sigterm)  # as start() installs it
    try:
        if wakeup_fd == "the watch's":
            os.write(watch._write_end, bytes([signal.SIGINT, signal.SIGTERM]))
        watch.on_sigterm(signal.SIGTERM, None)  # on this (main) thread, as the interpreter calls it
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a second SIGTERM: the kernel's default end
        _until(lambda: nows)
        time.sleep(0.2)  # the watch has read both marks by now: still one close
        assert nows == ["it was told to end (SIGTERM)"] and exits == []
        os.write(watch._write_end, bytes([signal.SIGTERM] * (2 if wakeup_fd == "taken over" else 1)))
        _until(lambda: exits)
        assert exits == [1] and len(nows) == 1
    finally:
        signal.signal(signal.SIGTERM, before)
        os.close(watch._write_end)
        watcher.join(5)
        os.close(watch._read_end)
    assert not watcher.is_alive()


def test_a_child_whose_wakeup_fd_was_taken_over_still_ends_on_sigterm_closing_its_environment(qwen_tokenizer, tmp_path):
    marker = tmp_path / "closed"
    process = CollectionProcess(setup_for(SignalHandlingLoopEnv(marker), qwen_tokenizer))
    try:
        os.kill(process.pid, signal.SIGTERM)
        process._process.join(30)
        assert process._process.exitcode == 1  # os._exit(1) after the close
        assert marker.read_text().split() == [str(process.pid)]
    finally:
        if process._process.is_alive():
            process._process.kill()
        process.close(timeout=1)


def _collect_ignoring_errors(process: CollectionProcess, tasks: list, backend: Any) -> None:
    with contextlib.suppress(CollectionProcessError):  # the child ends mid-batch
        process.collect(tasks, 1, backend=backend)


def test_an_early_end_waits_for_a_prepare_under_way_before_it_closes(monkeypatch, caplog):
    """A close while prepare() runs would release what prepare() then starts: the early end waits for it first
    (within the same bound), and one that does not end in time is ended without a close."""
    from loop_trainer.rollout import collection_child

    exits: list[int] = []
    monkeypatch.setattr(collection_child.os, "_exit", exits.append)
    env = HangingCloseEnv()
    closing = threading.Event()
    monkeypatch.setattr(env, "close", lambda: closing.set())
    leaving = collection_child._Leaving()
    assert leaving.hold(env)
    ending = threading.Thread(target=leaving.now, args=("the trainer's process is gone",))
    ending.start()
    assert not closing.wait(0.5)  # prepare() under way: no close yet
    leaving.prepared()
    assert closing.wait(5)
    ending.join(5)
    assert exits == [1]
    assert not leaving.hold(env)  # ending: a later hold takes nothing, and the child prepares nothing

    monkeypatch.setattr(collection_child, "CLOSE_WHEN_LEAVING_S", 0.2)
    never = collection_child._Leaving()
    never.hold(HangingCloseEnv())  # its prepare() never returns
    never.now("the trainer's process is gone")
    assert exits == [1, 1] and "prepare() did not return within 0.2 s: ending without closing it" in caplog.text


def test_the_childs_own_close_waits_for_the_close_an_early_end_started(monkeypatch, tmp_path):
    """Killed when idle, the child's main thread (its pipe closed) may find the environment already taken by the
    watch on the trainer: it waits for that close, since returning would end the interpreter, and the close's
    thread with it, part-way."""
    from loop_trainer.rollout import collection_child

    exits: list[int] = []
    monkeypatch.setattr(collection_child.os, "_exit", exits.append)
    marker = tmp_path / "closed"
    leaving = collection_child._Leaving()
    leaving.hold(SlowClosingEnv(marker))
    leaving.prepared()
    ending = threading.Thread(target=leaving.now, args=("the trainer's process is gone",))
    ending.start()
    deadline = time.monotonic() + 10
    while not any(t.name == "loop-collection-close" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "now() started no close"
        time.sleep(0.01)
    leaving.close_env()  # the main thread's own close: the environment is taken already
    assert marker.read_text().split()[1] == "loop-collection-close"  # returned only once that close had
    ending.join(5)
    assert exits == [1]


def test_a_sigterm_during_the_childs_own_close_lets_that_close_finish(qwen_tokenizer, tmp_path):
    """The trainer's close waits 2 s here, then terminates the child, which is still closing its environment on its
    main thread (3 s): that close is not cut short, and not run twice; the child ends on its own, not killed."""
    marker = tmp_path / "closed"
    process = CollectionProcess(setup_for(SlowClosingEnv(marker), qwen_tokenizer))
    process.close(timeout=2.0)
    assert process._process.exitcode in (0, 1)  # returned from its close, or ended by the SIGTERM's thread after it
    assert marker.read_text().split() == [str(process.pid), "MainThread"]


class HangingCloseEnv(ErrandsEnv):
    def __init__(self) -> None:
        super().__init__(num_tasks=1)
        self.release = threading.Event()

    def close(self) -> None:
        self.release.wait()


def test_leaving_waits_a_bounded_time_for_a_close_that_hangs(monkeypatch, caplog):
    from loop_trainer.rollout import collection_child

    exits = []
    monkeypatch.setattr(collection_child, "CLOSE_WHEN_LEAVING_S", 0.2)
    monkeypatch.setattr(collection_child.os, "_exit", exits.append)
    env = HangingCloseEnv()
    leaving = collection_child._Leaving()
    leaving.hold(env)
    leaving.prepared()
    try:
        leaving.now("the trainer's process is gone")
        assert exits == [1]
        assert "close() did not return within 0.2 s: ending without closing it" in caplog.text
        leaving.now("again")  # waits for the same close, starts no other
        assert exits == [1, 1] and sum(t.name == "loop-collection-close" for t in threading.enumerate()) == 1
    finally:
        env.release.set()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "gone"
