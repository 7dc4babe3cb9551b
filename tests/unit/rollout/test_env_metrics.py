"""The environment's running totals as the run reads them: a metrics() that raises, or does not return within
env_timeout, costs its answer for that read, is counted, and is logged once per kind of failure, not once per read;
one that hangs is waited for once, and never started again while it runs."""

from __future__ import annotations

import logging
import threading

from loop_trainer.envs.errands import ErrandsEnv
from loop_trainer.rollout.env_metrics import EnvMetricsReader


class ScriptedMetricsEnv(ErrandsEnv):
    """metrics() answers or raises as ``script`` says, one entry per call: a dict, or an exception to raise."""

    def __init__(self, script: list) -> None:
        super().__init__(num_tasks=1)
        self.script = list(script)

    def metrics(self) -> dict[str, float]:
        answer = self.script.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def failure_logs(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "loop_trainer.rollout.env_metrics"]


def test_a_failing_metrics_keeps_the_last_answer_counts_and_logs_once_per_kind(caplog):
    env = ScriptedMetricsEnv(
        [{"restarts": 1.0}, KeyError("a"), KeyError("b"), KeyError("c"), OSError("down"), {"restarts": 2.0}]
    )
    reader = EnvMetricsReader(env, "in the collection process")
    with caplog.at_level(logging.INFO):
        assert reader.read() == {"restarts": 1.0}
        assert [reader.read() for _ in range(3)] == [{"restarts": 1.0}] * 3  # the last answer stands
        assert reader.failures == 3
        logged = failure_logs(caplog)
        assert len(logged) == 1 and logged[0].levelno == logging.ERROR and logged[0].exc_info is not None
        assert "metrics() failed in the collection process" in logged[0].getMessage()
        assert "metrics_call_failures" in logged[0].getMessage()
        assert reader.read() == {"restarts": 1.0}  # another kind of error: logged again
        assert len(failure_logs(caplog)) == 2 and reader.failures == 4
        assert reader.read() == {"restarts": 2.0}
        answered_again = failure_logs(caplog)[2].getMessage()
        assert "answered again in the collection process (4 reads got no answer so far)" in answered_again
        assert reader.failures == 4  # a running total: an answer does not reset it


def test_a_metrics_that_fails_from_the_start_reads_as_empty():
    reader = EnvMetricsReader(ScriptedMetricsEnv([RuntimeError("no server")]))
    assert reader.read() == {} and reader.failures == 1


def test_a_read_is_a_copy_the_caller_may_change():
    reader = EnvMetricsReader(ScriptedMetricsEnv([{"a": 1.0}, ValueError()]))
    reader.read()["a"] = 5.0
    assert reader.read() == {"a": 1.0}


class HangingMetricsEnv(ErrandsEnv):
    """metrics() answers its first call; the later ones wait until ``release`` is set, then answer or raise as
    ``then`` says."""

    def __init__(self, then: dict | BaseException) -> None:
        super().__init__(num_tasks=1)
        self.then = then
        self.release = threading.Event()
        self.calls = 0

    def metrics(self) -> dict[str, float]:
        self.calls += 1
        if self.calls > 1:
            self.release.wait()
            if isinstance(self.then, BaseException):
                raise self.then
            return self.then
        return {"restarts": 1.0}


def test_a_hanging_metrics_is_waited_for_once_within_the_timeout_and_never_started_twice(caplog):
    env = HangingMetricsEnv(then={"restarts": 2.0})
    reader = EnvMetricsReader(env, "in the collection process", timeout=1.0)
    with caplog.at_level(logging.INFO):
        assert reader.read() == {"restarts": 1.0}
        assert [reader.read() for _ in range(3)] == [{"restarts": 1.0}] * 3  # the last answer stands
        assert env.calls == 2  # the hung call is looked at again, not called again
        assert reader.failures == 3
        logged = failure_logs(caplog)
        assert len(logged) == 1 and logged[0].levelno == logging.ERROR and logged[0].exc_info is None
        message = logged[0].getMessage()
        assert "metrics() did not return within env_timeout (1s) in the collection process" in message
        env.release.set()
        assert reader._late is not None and reader._late.returned.wait(5)
        assert reader.read() == {"restarts": 2.0}  # its late answer is taken, without another call
        assert env.calls == 2 and reader.failures == 3
        assert "answered again" in failure_logs(caplog)[1].getMessage()


def test_a_hung_metrics_that_raises_at_last_is_logged_as_its_error(caplog):
    env = HangingMetricsEnv(then=ConnectionError("the server is down"))
    reader = EnvMetricsReader(env, timeout=1.0)
    with caplog.at_level(logging.INFO):
        reader.read()
        assert reader.read() == {"restarts": 1.0} and reader.failures == 1
        env.release.set()
        assert reader._late is not None and reader._late.returned.wait(5)
        assert reader.read() == {"restarts": 1.0} and reader.failures == 2
        assert env.calls == 2
        logged = failure_logs(caplog)
        assert len(logged) == 2 and isinstance(logged[1].exc_info[1], ConnectionError)
        assert "metrics() failed" in logged[1].getMessage()


def test_a_read_with_no_thread_to_call_on_is_counted_not_raised(monkeypatch):
    from loop_trainer.rollout import env_metrics

    def no_thread(env) -> None:
        raise RuntimeError("can't start new thread")  # what Thread.start() raises at the process's limit

    reader = EnvMetricsReader(ScriptedMetricsEnv([{"a": 1.0}, {"a": 2.0}]))
    assert reader.read() == {"a": 1.0}
    monkeypatch.setattr(env_metrics, "_MetricsCall", no_thread)
    assert reader.read() == {"a": 1.0} and reader.failures == 1
    monkeypatch.undo()
    assert reader.read() == {"a": 2.0} and reader.failures == 1
