"""``AppWorldRolloutEnv``: LOOP's flagship environment, AppWorld's real engine over HTTP.

An episode leases one server of the pool, initialises its task there under an experiment name no
concurrent rollout shares, and plays the paper's ReAct code agent (``agent.py``): each reply's
python blocks run in the world, the output comes back as the next user message, and the episode
ends when the task is marked complete (or at the turn limit). The score is AppWorld's own test
run: reward = fraction of the task's tests passed, success = all of them.

Infrastructure failures (a crashed or hung server) are not the agent's fault: the server is
restarted, the world is rebuilt by re-initialising the task and re-running the code the episode
already ran, and the failed call is tried again -- up to ``max_infra_retries`` times per episode,
counted in ``pool.stats`` and the trajectory's ``info``. The trajectory itself loses nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from datasets import Dataset

from ..base import Environment, Episode, Message, Score, Step, success_and_reward
from .agent import ReActPrompts, extract_code
from .data import AppWorldData
from .metrics import evaluation_summary
from .pool import AppWorldCallError, AppWorldServer, AppWorldServerError, AppWorldServerPool

logger = logging.getLogger(__name__)


class AppWorldRolloutEnv(Environment):
    """AppWorld tasks, run in a pool of AppWorld servers.

    Args:
        root: the AppWorld root holding ``data/`` (default ``$APPWORLD_ROOT``).
        num_servers: local servers to start; also the most episodes that run at once.
        server_urls: use these running servers instead of starting local ones.
        python: the AppWorld virtualenv's python (default: found by ``find_appworld_python``).
        prompt_dir: a directory of agent templates replacing the built-in ones (see ``agent.py``).
        max_observation_tokens: longer code outputs are cut at a line boundary, with a note.
        execution_timeout: seconds AppWorld lets one code block run before reporting a timeout
            to the agent (the agent's fault; the episode goes on).
        request_timeout: seconds one HTTP call may take before the server counts as hung (must
            exceed ``execution_timeout``).
        initialize_timeout: seconds a task's initialisation may take (a fresh server's first one
            loads the apps: several seconds).
        max_infra_retries: server restarts one episode may use before it is reported failed.
        experiment_name: a fixed AppWorld experiment name (evaluation: ``appworld evaluate`` can
            then grade the saved outputs); by default each server gets its own per run.
    """

    name = "appworld"
    default_eval_split = "dev"

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        num_servers: int = 4,
        server_urls: list[str] | None = None,
        python: str | None = None,
        prompt_dir: str | None = None,
        max_observation_tokens: int = 3000,
        execution_timeout: int = 60,
        request_timeout: float = 120.0,
        startup_timeout: float = 180.0,
        initialize_timeout: float = 120.0,
        max_infra_retries: int = 2,
        experiment_name: str | None = None,
        log_dir: str | None = None,
    ):
        if request_timeout <= execution_timeout:
            raise ValueError(f"request_timeout ({request_timeout}) must exceed execution_timeout ({execution_timeout})")
        self.data = AppWorldData.at(root)
        self.prompts = ReActPrompts.load(prompt_dir, max_observation_tokens=max_observation_tokens)
        self.pool = AppWorldServerPool(
            self.data.root,
            num_servers,
            urls=server_urls,
            python=python,
            request_timeout=request_timeout,
            startup_timeout=startup_timeout,
            log_dir=log_dir,
        )
        self.execution_timeout = execution_timeout
        self.initialize_timeout = initialize_timeout
        self.max_infra_retries = max_infra_retries
        self.experiment_name = experiment_name
        self._run_id = uuid.uuid4().hex[:8]
        self._active: set[tuple[str, str]] = set()
        self._active_lock = threading.Lock()

    @property
    def max_concurrent_episodes(self) -> int:  # type: ignore[override]
        """Each episode holds a server, so more at once would only wait."""
        return self.pool.size

    def prepare(self) -> None:
        self.pool.start()

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Count observation tokens with the policy's own tokenizer."""
        self.prompts.count_tokens = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def tasks(self, split: str = "train") -> Dataset:
        return self.data.tasks(split)

    def episode(self, task: Mapping[str, Any]) -> AppWorldEpisode:
        return AppWorldEpisode(self, task)

    def experiment_for(self, server: AppWorldServer) -> str:
        # One name per server: a server runs one world at a time, so concurrent rollouts of the
        # same task never share an output directory, and disk use stays bounded.
        return self.experiment_name or f"loop_{self._run_id}_server{server.index}"

    def claim(self, experiment: str, task_id: str) -> None:
        with self._active_lock:
            if (experiment, task_id) in self._active:
                raise RuntimeError(
                    f"two concurrent rollouts of {task_id} would share experiment {experiment!r}: "
                    "a fixed experiment_name allows one rollout per task at a time"
                )
            self._active.add((experiment, task_id))

    def unclaim(self, experiment: str, task_id: str) -> None:
        with self._active_lock:
            self._active.discard((experiment, task_id))

    def summarize(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Success rate and mean reward, and TGC / SGC overall and per difficulty (``tgc``,
        ``sgc``, ``tgc_difficulty_1`` ...), as ``appworld evaluate`` computes them."""
        difficulty_of = {}
        for task_id in {str(row["task_id"]) for row in rows}:  # from the data: failed rows have no score
            difficulty_of[task_id] = int(self.data.metadata(task_id).get("difficulty", 0))
        return {**success_and_reward(rows), **evaluation_summary(rows, difficulty_of)}

    def metrics(self) -> dict[str, float]:
        keys = ("restarts", "timeouts", "connection_errors", "server_errors", "episode_retries")
        return {f"appworld_{key}": float(self.pool.stats[key]) for key in keys}

    def close(self) -> None:
        self.pool.close()


class AppWorldEpisode(Episode):
    """One rollout of one AppWorld task on one leased server."""

    def __init__(self, env: AppWorldRolloutEnv, task: Mapping[str, Any]):
        self.env = env
        self.task_id = str(task["task_id"])
        self.instruction = str(task.get("instruction", ""))
        self.server: AppWorldServer | None = None
        self.experiment: str | None = None
        self.executed: list[str] = []
        self.outputs: list[str] = []
        self.world_ready = False
        self.infra_retries = 0
        self.replay_mismatches = 0
        self.claimed = False

    # -- world calls, with recovery ---------------------------------------------------------

    def _restore_world(self) -> None:
        assert self.server is not None and self.experiment is not None
        self.task = self.env.pool.call(
            self.server,
            "/initialize",
            {
                "task_id": self.task_id,
                "experiment_name": self.experiment,
                "timeout_seconds": self.env.execution_timeout,
            },
            timeout=max(self.env.pool.request_timeout, self.env.initialize_timeout),
        )
        for code, expected in zip(self.executed, self.outputs, strict=True):
            output = self.env.pool.call(self.server, "/execute", {"task_id": self.task_id, "code": code})
            if output != expected:
                self.replay_mismatches += 1
                logger.warning("task %s: replayed code gave a different output than the first time", self.task_id)
        self.world_ready = True

    def _call(self, endpoint: str | None, payload: dict[str, Any] | None = None) -> Any:
        assert self.server is not None
        attempt = 0
        while True:
            try:
                if not self.world_ready:
                    self._restore_world()
                if endpoint is None:
                    return None
                return self.env.pool.call(self.server, endpoint, {"task_id": self.task_id, **(payload or {})})
            except AppWorldServerError as error:
                self.world_ready = False
                if attempt >= self.env.max_infra_retries:
                    raise AppWorldServerError(f"{error} (gave up after {attempt} server restart(s))") from None
                attempt += 1
                self.infra_retries += 1
                self.env.pool.stats["episode_retries"] += 1
                self.env.pool.recover(self.server, str(error))

    # -- the episode ------------------------------------------------------------------------

    def start(self) -> list[Message]:
        self.server = self.env.pool.acquire()
        self.experiment = self.env.experiment_for(self.server)
        self.env.claim(self.experiment, self.task_id)
        self.claimed = True
        self._call(None)
        self.instruction = self.task["instruction"]
        supervisor = self.task["supervisor"]
        date = str(self.task["datetime"]).split("T")[0].split(" ")[0]
        return self.env.prompts.opening_messages(supervisor, date, self.instruction)

    def step(self, reply: str) -> Step:
        code = extract_code(reply)
        if code is None:
            return Step([{"role": "user", "content": self.env.prompts.no_code(self.instruction)}])
        output = self._call("/execute", {"code": code})
        self.executed.append(code)
        self.outputs.append(output)
        if self._call("/task_completed"):
            return Step(done=True)
        return Step([{"role": "user", "content": self.env.prompts.observation(output, self.instruction)}])

    def score(self) -> Score:
        result = self._call("/evaluate", {"suppress_errors": True})
        passes, failures = result.get("passes", []), result.get("failures", [])
        num_tests = int(result.get("num_tests") or len(passes) + len(failures))
        return Score(
            reward=len(passes) / num_tests if num_tests else 0.0,
            success=bool(result["success"]),
            info={
                "difficulty": result.get("difficulty"),
                "num_tests": num_tests,
                "passes": [p.get("requirement", "") for p in passes],
                "failures": [
                    {"requirement": f.get("requirement", ""), "trace": str(f.get("trace", ""))[:2000]} for f in failures
                ],
                "experiment_name": self.experiment,
                "infra_retries": self.infra_retries,
                "replay_mismatches": self.replay_mismatches,
                "executions": [{"code": c, "output": o} for c, o in zip(self.executed, self.outputs, strict=True)],
            },
        )

    def close(self) -> None:
        if self.server is None:
            return
        try:
            if self.world_ready:
                self.env.pool.call(self.server, "/close", {"task_id": self.task_id}, timeout=30)
        except AppWorldCallError as error:  # the next /initialize replaces the world anyway
            logger.warning("closing task %s on %s failed: %s", self.task_id, self.server.url, error)
        except AppWorldServerError as error:  # dead or hung: bring it back before the next lease
            logger.warning("closing task %s on %s failed: %s", self.task_id, self.server.url, error)
            try:
                self.env.pool.recover(self.server, str(error))
            except AppWorldServerError as restart_error:
                logger.error("AppWorld server %s could not be restarted: %s", self.server.url, restart_error)
        finally:
            if self.claimed:
                assert self.experiment is not None  # named before the task was claimed
                self.env.unclaim(self.experiment, self.task_id)
            self.env.pool.release(self.server)
            self.server = None
