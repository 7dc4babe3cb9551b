"""The server generator's completion requests over keep-alive connections (rollout/keep_alive.py), against an
HTTP/1.1 server that counts its connections and can close them as uvicorn does."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time

import pytest

from loop_trainer.rollout.keep_alive import KeepAliveConnections
from loop_trainer.rollout.vllm_server import GeneratorServerError, VLLMServerBackend


class CountingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.connections = 0
        self.bodies: list[dict] = []
        self.drop_next = 0  # requests read and then dropped without an answer (the connection closed)
        self.close_after_answer = False  # close each connection right after its answer, without saying so
        self.status = 200
        self.stall = 0.0  # seconds before answering
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
    server: CountingServer

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def _answer(self, body: dict, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def do_GET(self) -> None:
        self._answer({"data": [{"id": "fake-model"}]} if self.path == "/v1/models" else {})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path != "/v1/completions":
            self._answer({})
            return
        with self.server.lock:
            drop = self.server.drop_next > 0
            self.server.drop_next -= drop
            self.server.bodies.append(request)
        if drop:
            self.close_connection = True
            return
        time.sleep(self.server.stall)
        if self.server.status != 200:
            self._answer({"error": "the model is asleep"}, self.server.status)
            return
        ids = [7, 8, 9][: request["max_tokens"]]
        self._answer({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}}]})
        if self.server.close_after_answer:
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server():
    server = CountingServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def post(connections: KeepAliveConnections) -> dict:
    status, body, content_type = connections.post_json("/v1/completions", {"max_tokens": 2})
    assert (status, content_type) == (200, "application/json")
    return json.loads(body)


def test_one_thread_reuses_one_connection(server):
    connections = KeepAliveConnections(server.url, timeout=10)
    for _ in range(20):
        assert post(connections)["choices"][0]["token_ids"] == [7, 8]
    assert (server.connections, connections.open_connections, connections.reconnects, connections.resent) == (
        1,
        1,
        0,
        0,
    )
    connections.close()
    assert connections.open_connections == 0
    with pytest.raises(RuntimeError, match="closed"):
        post(connections)


def test_each_thread_has_a_connection_of_its_own(server):
    connections = KeepAliveConnections(server.url, timeout=10)
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait()
        for _ in range(5):
            post(connections)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert server.connections == connections.open_connections == 4 and len(server.bodies) == 20
    connections.close()


def test_a_connection_the_server_closed_while_idle_is_replaced_before_the_request(server):
    """uvicorn closes a keep-alive connection after 5 idle seconds (an update can last longer)."""
    server.close_after_answer = True
    connections = KeepAliveConnections(server.url, timeout=10)
    post(connections)
    time.sleep(0.2)  # the close reaches this side
    post(connections)
    assert (server.connections, connections.reconnects, connections.resent, len(server.bodies)) == (2, 1, 0, 2)


def test_a_request_the_server_drops_on_a_reused_connection_is_sent_once_more(server):
    connections = KeepAliveConnections(server.url, timeout=10)
    post(connections)
    server.drop_next = 1  # the server closes as this request arrives (a race with its idle timeout)
    assert post(connections)["choices"][0]["token_ids"] == [7, 8]
    assert (server.connections, connections.reconnects, connections.resent, len(server.bodies)) == (2, 0, 1, 3)


def test_a_fresh_connection_that_fails_is_an_error_and_not_retried(server):
    connections = KeepAliveConnections(server.url, timeout=10)
    server.drop_next = 2
    with pytest.raises(ConnectionError):
        post(connections)
    assert len(server.bodies) == 1 and connections.open_connections == 0


def test_the_backend_reports_the_servers_errors_and_timeouts_in_one_line(server, tmp_path):
    with VLLMServerBackend(server.url, stop_token_ids=[9], sync_dir=str(tmp_path), timeout=0.5) as backend:
        assert backend.completions is not None
        server.status = 503
        with pytest.raises(GeneratorServerError, match="answered 503: .*the model is asleep"):
            asyncio.run(backend.generate([1, 2, 3], 3))
        server.status, server.stall = 200, 2.0
        with pytest.raises(GeneratorServerError, match="v1/completions: timed out"):
            asyncio.run(backend.generate([1, 2, 3], 3))
        server.stall = 0.0
        assert asyncio.run(backend.generate([1, 2, 3], 3)).token_ids == [7, 8, 9]  # a fresh connection after it
    assert backend.completions.open_connections == 0  # closed with the backend


def test_both_request_paths_send_the_same_body_and_read_the_same_completion(server, tmp_path):
    completions = []
    for keep_alive in (True, False):
        with VLLMServerBackend(
            server.url, stop_token_ids=[9], sync_dir=str(tmp_path), keep_alive=keep_alive
        ) as backend:
            assert (backend.completions is not None) is keep_alive
            completions.append(asyncio.run(backend.generate([1, 2, 3], 3, seed=11)))
    assert server.bodies[0] == server.bodies[1] and server.bodies[0]["seed"] == 11
    assert completions[0] == completions[1] and completions[0].stopped


@pytest.mark.parametrize("no_proxy, keeps_alive", [("", False), ("127.0.0.1", True)])
def test_a_proxy_for_the_servers_url_sends_the_completions_through_requests(
    server, tmp_path, monkeypatch, no_proxy, keeps_alive
):
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("no_proxy", no_proxy)
    monkeypatch.setenv("NO_PROXY", no_proxy)
    # only the choice of path is checked: nothing listens behind the proxy
    monkeypatch.setattr(VLLMServerBackend, "_wait_for_server", lambda self, timeout: "fake-model")
    monkeypatch.setattr(VLLMServerBackend, "_prefix_caching", lambda self: True)
    backend = VLLMServerBackend(server.url, stop_token_ids=[9], sync_dir=str(tmp_path))
    assert (backend.completions is not None) is keeps_alive
    backend.close()
