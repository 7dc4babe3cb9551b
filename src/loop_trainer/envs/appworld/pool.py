"""A pool of AppWorld environment servers, one world per server process, on 127.0.0.1.

AppWorld pins pydantic<2 and freezes its process's clock while a world is open, so the trainer
never imports it: each server is ``uvicorn appworld.serve.environment:app`` run by the AppWorld
virtualenv's python, bound to loopback (appworld's own CLI binds 0.0.0.0), and exits by itself if
the trainer dies. An episode leases one
server for its whole life. A server that stops answering (crashed, hung past ``request_timeout``,
answering 5xx) is killed and started again; the episode then restores its world on it (see
``episode.py``). Remote servers (``urls``) replace the local ones for environments on other hosts;
they cannot be restarted from here, only waited for.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from ...net import free_local_port
from ..base import EnvironmentSetupError

logger = logging.getLogger(__name__)


class AppWorldServerError(EnvironmentSetupError):
    """A server did not start or answer properly: an infrastructure failure, not the agent's doing."""


class AppWorldCallError(RuntimeError):
    """A healthy server refused a call (an unknown task, a task without ground truth, ...): that
    rollout fails, but restarting the server would not help."""


def find_appworld_python(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The AppWorld virtualenv's python: ``explicit``, ``$APPWORLD_PYTHON``, or the ``.appworld-venv``
    link that ``make appworld`` leaves in the project (looked up from the working directory and
    its parents; never from this file's location, which is site-packages once installed)."""
    candidates = [explicit, os.environ.get("APPWORLD_PYTHON")]
    for directory in (Path.cwd(), *Path.cwd().parents):
        candidates.append(directory / ".appworld-venv" / "bin" / "python")
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise AppWorldServerError(
        "AppWorld's virtualenv was not found: run `make appworld`, or set APPWORLD_PYTHON to the python "
        "of a virtualenv where `pip install appworld && appworld install` was done"
    )


# A server that outlives its trainer (killed, crashed) would hold memory and a port forever: each
# one watches its parent and exits when it is gone.
_SERVER_MAIN = """
import os, sys, threading, time
import uvicorn
host, port, parent = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def watch_parent():
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)
threading.Thread(target=watch_parent, daemon=True).start()
uvicorn.run("appworld.serve.environment:app", host=host, port=port, log_level="warning")
"""


@dataclass
class AppWorldServer:
    """One server: its address, and its process when it is ours."""

    index: int
    url: str
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def local(self) -> bool:
        return self.log_path is not None

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class AppWorldServerPool:
    """Starts, leases, health-checks and restarts AppWorld servers.

    :meth:`close` stops our servers and removes the log directory the pool made for them (a
    ``log_dir`` given by the caller is left in place); it also runs at interpreter exit.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        num_servers: int = 4,
        *,
        urls: list[str] | None = None,
        python: str | os.PathLike[str] | None = None,
        request_timeout: float = 120.0,
        startup_timeout: float = 180.0,
        log_dir: str | os.PathLike[str] | None = None,
    ):
        if urls is not None and not urls:
            raise ValueError("server_urls is empty")
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        self.root = Path(root)
        self.urls = [url.rstrip("/") for url in urls] if urls else None
        self.size = len(self.urls) if self.urls else num_servers
        self.python = None if self.urls else find_appworld_python(python)
        self.request_timeout = request_timeout
        self.startup_timeout = startup_timeout
        self._log_dir = Path(log_dir) if log_dir else None
        self._owns_log_dir = log_dir is None
        self._servers: list[AppWorldServer] = []
        self._idle: queue.Queue[AppWorldServer] = queue.Queue()
        self._started = False
        self._start_lock = threading.Lock()
        self._local = threading.local()  # requests.Session is not thread-safe: one per thread
        self.stats: Counter[str] = Counter()

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start (or reach) every server and wait until all answer. Idempotent."""
        with self._start_lock:
            if self._started:
                return
            atexit.register(self.close)
            if self._owns_log_dir:
                self._log_dir = Path(tempfile.mkdtemp(prefix=f"loop-appworld-{os.getpid()}-"))
            log_dir = self._log_dir
            assert log_dir is not None  # given, or made just now
            log_dir.mkdir(parents=True, exist_ok=True)
            if self.urls:
                self._servers = [AppWorldServer(i, url) for i, url in enumerate(self.urls)]
            else:
                self._servers = [AppWorldServer(i, "", log_path=log_dir / f"server-{i}.log") for i in range(self.size)]
                for server in self._servers:
                    self._launch(server)
            try:
                for server in self._servers:
                    self._wait_ready(server)
            except BaseException:
                self._terminate_all()
                raise
            for server in self._servers:
                self._idle.put(server)
            self._started = True
            logger.info("AppWorld servers ready: %s", ", ".join(s.url for s in self._servers))

    def _launch(self, server: AppWorldServer) -> None:
        port = free_local_port()
        server.url = f"http://127.0.0.1:{port}"
        command = [str(self.python), "-c", _SERVER_MAIN, "127.0.0.1", str(port), str(os.getpid())]
        environment = {**os.environ, "APPWORLD_ROOT": str(self.root), "PYTHONUNBUFFERED": "1"}
        assert server.log_path is not None
        with open(server.log_path, "ab") as log:
            server.process = subprocess.Popen(
                command,
                cwd=self.root,
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _wait_ready(self, server: AppWorldServer, relaunches: int = 2) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if server.process is not None and server.process.poll() is not None:
                if relaunches > 0:  # most likely its port was taken between probing and binding
                    relaunches -= 1
                    self._launch(server)
                    continue
                raise AppWorldServerError(
                    f"AppWorld server {server.index} exited with code {server.process.returncode} while "
                    f"starting; its log ({server.log_path}) ends with:\n{server.log_tail()}"
                )
            try:
                if self._http().get(server.url + "/", timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        where = f"; log: {server.log_path}" if server.log_path else ""
        raise AppWorldServerError(
            f"AppWorld server {server.url} did not answer within {self.startup_timeout:.0f}s{where}"
        )

    def _terminate(self, server: AppWorldServer) -> None:
        process = server.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def _terminate_all(self) -> None:
        for server in self._servers:
            self._terminate(server)

    def close(self) -> None:
        """Stop our servers (remote ones are left running) and remove the log directory the pool
        made. Idempotent; the pool starts again on the next :meth:`acquire`."""
        with self._start_lock:
            self._terminate_all()
            self._servers, self._idle = [], queue.Queue()
            self._started = False
            if self._owns_log_dir and self._log_dir is not None:
                shutil.rmtree(self._log_dir, ignore_errors=True)
                self._log_dir = None
            atexit.unregister(self.close)

    def __del__(self) -> None:  # a crashed trainer must not leave orphan servers behind
        try:  # noqa: SIM105 - not contextlib.suppress: module globals may be gone at interpreter shutdown
            self._terminate_all()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _http(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    # -- leasing ----------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None) -> AppWorldServer:
        self.start()
        try:
            return self._idle.get(timeout=timeout)
        except queue.Empty:
            raise AppWorldServerError(f"no AppWorld server became free within {timeout:.0f}s") from None

    def release(self, server: AppWorldServer) -> None:
        self._idle.put(server)

    @property
    def servers(self) -> list[AppWorldServer]:
        return list(self._servers)

    # -- calls ------------------------------------------------------------------------------

    def call(self, server: AppWorldServer, endpoint: str, payload: dict[str, Any], timeout: float | None = None) -> Any:
        """POST ``payload`` to ``endpoint`` and return the response's ``output``. A connection
        failure, a timeout or a 5xx raise :class:`AppWorldServerError`."""
        timeout = timeout or self.request_timeout
        try:
            response = self._http().post(server.url + endpoint, json=payload, timeout=(5, timeout))
        except requests.Timeout:
            self.stats["timeouts"] += 1
            raise AppWorldServerError(f"{endpoint} on {server.url} timed out after {timeout:.0f}s") from None
        except requests.RequestException as error:
            self.stats["connection_errors"] += 1
            raise AppWorldServerError(f"{endpoint} on {server.url} failed: {type(error).__name__}") from None
        if response.status_code >= 500:
            message = f"{endpoint} on {server.url} answered {response.status_code}: {response.text[:300]}"
            if self._healthy(server):  # the task or its data is at fault, not the server: no restart
                raise AppWorldCallError(message)
            self.stats["server_errors"] += 1
            raise AppWorldServerError(message)
        if not response.ok:
            raise AppWorldCallError(
                f"{endpoint} on {server.url} answered {response.status_code}: {response.text[:300]}"
            )
        return response.json()["output"]

    def _healthy(self, server: AppWorldServer, attempts: int = 3) -> bool:
        # A fresh connection each time: after an error response the server may have closed the
        # pooled one, which says nothing about its health.
        for attempt in range(attempts):
            try:
                if requests.get(server.url + "/", timeout=5).ok:
                    return True
            except requests.RequestException:
                pass
            time.sleep(0.5 * (attempt + 1))
        return False

    def recover(self, server: AppWorldServer, reason: str) -> None:
        """Bring ``server`` back after a failure: restart ours, wait for a remote one."""
        with server.lock:
            logger.warning(
                "AppWorld server %d (%s) failed (%s); %s",
                server.index,
                server.url,
                reason,
                "restarting it" if server.local else "waiting for it",
            )
            if server.local:
                self._terminate(server)
                self._launch(server)
                self.stats["restarts"] += 1
            self._wait_ready(server)
