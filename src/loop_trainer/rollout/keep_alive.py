"""Keep-alive HTTP connections, one per thread, through the standard library's ``http.client``: how a server
generator sends its completion requests, one for every sampled turn of every episode.

Why not ``requests`` for these (it still sends the server's few other calls): its per-request machinery (building
and preparing the request, merging the session's settings, reading ``.netrc`` and the proxy variables) costs the
training process several times the CPU of the request itself. On this project's CPU machine a completion request
cost the process about three times the CPU through a ``requests`` session that it costs here, and a turn of
errands 2.4 times (1.7 in English, where tokenising the answers weighs more): ``benchmarks/server_requests.py``,
docs/benchmarks.md "A server generator's requests". That CPU is the interpreter lock's: an overlapped update
(``max_staleness``) runs its kernel launches in the same process, beside the collection.

Plain ``http://`` only: a server behind TLS keeps ``requests``, whose certificate bundle (certifi,
``REQUESTS_CA_BUNDLE``) the server's other calls use too.

A server closes a connection that stays idle (uvicorn, under vLLM's OpenAI server: after 5 s), e.g. through an
update. A connection found closed before a request is replaced; one the server closes as a request goes out,
before any answer comes, is replaced and the request sent once more (a completion with a seed samples the same
tokens again). A connection that fails once an answer has begun is an error: the server had the request.
"""

from __future__ import annotations

import http.client
import json
import select
import threading
import urllib.parse
from typing import Any

CLOSED_BEFORE_ANSWER = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
"""What sending a request, or waiting for its status line, raises on a connection the server has just closed
(``http.client.RemoteDisconnected`` is a ``ConnectionResetError``)."""


class KeepAliveConnections:
    """POSTs of JSON to one ``http://`` server, each thread over a keep-alive connection of its own.

    Args:
        base_url: ``http://host:port[/path]``; request paths are appended to it.
        timeout: seconds for connecting and for each wait on the socket (``requests``' ``timeout`` too).

    Errors reach the caller as ``OSError`` or ``http.client.HTTPException``; an answer that is not 200 is returned
    as it is (:meth:`post_json` returns the status). ``reconnects`` counts the idle connections found closed by the
    server and replaced, ``resent`` the requests sent once more because the server closed their connection as they
    went out. Close it once its requests have returned (:meth:`close`).
    """

    def __init__(self, base_url: str, timeout: float):
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"KeepAliveConnections takes an http://host:port URL; got {base_url!r}")
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self.reconnects = 0
        self.resent = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()
        self._closed = False

    def post_json(self, path: str, payload: Any) -> tuple[int, bytes, str]:
        """POST ``payload`` as JSON to ``path``: (status, body, content type)."""
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        for attempt in range(2):
            connection, reused = self._connection()
            try:
                connection.request("POST", self._prefix + path, body, headers)
                response = connection.getresponse()
            except CLOSED_BEFORE_ANSWER:
                self._discard(connection)
                if reused and attempt == 0:  # closed by the server as the request went out: once more, afresh
                    with self._lock:
                        self.resent += 1
                    continue
                raise
            except BaseException:
                self._discard(connection)  # its state is unknown (a timeout): never reuse it
                raise
            try:
                data = response.read()
            except BaseException:
                self._discard(connection)  # cut during the answer: the server had the request; not sent again
                raise
            if response.will_close:  # the server said it closes this connection (HTTP/1.0, Connection: close)
                self._discard(connection)
            return response.status, data, response.getheader("Content-Type", "")
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it has served a request before (a new one if the server closed
        it meanwhile)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("KeepAliveConnections is closed")
        connection: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        if connection is not None:
            if connection.sock is not None and not _closed_by_peer(connection.sock):
                return connection, True
            self._discard(connection)  # the server closed it while it was idle
            with self._lock:
                self.reconnects += 1
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        with self._lock:
            self._open.add(connection)
        self._local.connection = connection
        return connection, False

    def _discard(self, connection: http.client.HTTPConnection) -> None:
        connection.close()
        with self._lock:
            self._open.discard(connection)
        if getattr(self._local, "connection", None) is connection:
            self._local.connection = None

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        """Close every thread's connection; later requests raise. Idempotent. A request still in flight on another
        thread fails: close once the requests have returned, as :meth:`.vllm_server.VLLMServerBackend.close` is."""
        with self._lock:
            self._closed = True
            connections, self._open = list(self._open), set()
        for connection in connections:
            connection.close()


def _closed_by_peer(sock: Any) -> bool:
    """Whether an idle connection's socket has something to read: the server's close (or bytes nobody asked for;
    either way the connection is done). ``poll``, not ``select``: a training process may hold descriptors past
    ``select``'s 1024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))
