"""A stand-in for the few endpoints of vLLM's OpenAI server that VLLMServerBackend calls, over HTTP/1.1 keep-alive
as uvicorn serves them, with the ways a real server closes connections: after an answer without saying so (an idle
timeout), as a request arrives (the race with that timeout), or saying so (``Connection: close``)."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any


class FakeVLLMServer(http.server.ThreadingHTTPServer):
    """Counts its connections and keeps every completion request's path and body; completions answer
    ``[7, 8, 9][:max_tokens]`` (with ``varied``, a first id that depends on the seed and the prompt's length)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.connections = 0
        self.paths: list[str] = []
        self.bodies: list[dict] = []
        self.prefix_caching: bool | None = True  # what /server_info says; None: no /server_info (no dev mode)
        self.drop_next = 0  # completion requests read and then dropped unanswered, the connection closed
        self.close_after_answer = False  # close each connection after its answer, without saying so
        self.say_close = False  # answer with "Connection: close" (and close)
        self.cut_next = 0  # completion requests answered with a status line and headers, then the connection closed
        self.status = 200
        self.stall = 0.0  # seconds before answering a completion
        self.varied = False  # answer ids that depend on the request's seed and prompt length (a sampler's stand-in)
        self.closed = threading.Event()  # set whenever the server has closed a connection's socket

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def shutdown_request(self, request: Any) -> None:
        super().shutdown_request(request)  # the socket closed: its FIN is on the way
        self.closed.set()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeVLLMServer

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def _answer(self, body: dict, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.server.say_close:
            self.send_header("Connection", "close")  # http.server then closes the connection too
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def do_GET(self) -> None:
        if self.path.startswith("/server_info"):
            if self.server.prefix_caching is None:
                self.send_error(404)
                return
            self._answer({"vllm_config": {"cache_config": {"enable_prefix_caching": self.server.prefix_caching}}})
            return
        self._answer({"data": [{"id": "fake-model"}]})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if not self.path.endswith("/v1/completions"):
            self._answer({})
            return
        with self.server.lock:
            drop = self.server.drop_next > 0
            self.server.drop_next -= drop
            self.server.paths.append(self.path)
            self.server.bodies.append(request)
        if drop:
            self.close_connection = True
            return
        with self.server.lock:
            cut = self.server.cut_next > 0
            self.server.cut_next -= cut
        if cut:  # the answer begins, then the connection ends: the server had the request
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.flush()
            self.close_connection = True
            return
        time.sleep(self.server.stall)
        if self.server.status != 200:
            self._answer({"error": "the model is asleep"}, self.server.status)
            return
        ids = [7, 8, 9][: request["max_tokens"]]
        if self.server.varied:
            ids = [7 + (int(request["seed"] or 0) + len(request["prompt"])) % 50, 8, 9][: request["max_tokens"]]
        self._answer({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}}]})
        if self.server.close_after_answer:
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serving() -> Iterator[FakeVLLMServer]:
    """A :class:`FakeVLLMServer` answering on a thread until the block ends."""
    server = FakeVLLMServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
