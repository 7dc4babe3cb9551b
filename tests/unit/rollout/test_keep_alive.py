"""The server generator's completion requests over keep-alive connections (rollout/keep_alive.py), against an
HTTP/1.1 stand-in that counts its connections and closes them in the ways a real server does."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from loop_trainer.rollout.keep_alive import KeepAliveConnections
from loop_trainer.rollout.vllm_server import GeneratorServerError, VLLMServerBackend
from support.fake_vllm_server import serving

PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


@pytest.fixture()
def server():
    with serving() as server:
        yield server


@pytest.fixture(autouse=True)
def no_proxy_settings(monkeypatch):
    """The machine's proxy variables would choose the request path (one test sets them)."""
    for name in (*PROXY_VARIABLES, "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)


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
    assert connections.reconnects == 0  # a closed client raises; it does not count a reconnect first


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
    assert server.closed.wait(10)  # the server has closed its socket
    time.sleep(0.1)  # for the close to reach this side (loopback: at once, in practice)
    post(connections)
    assert (server.connections, connections.reconnects, connections.resent, len(server.bodies)) == (2, 1, 0, 2)


def test_an_answer_that_says_connection_close_is_followed_by_a_fresh_connection(server):
    server.say_close = True
    connections = KeepAliveConnections(server.url, timeout=10)
    for _ in range(3):
        post(connections)
    # each answer closed its connection, and the client knew: no reconnect counted, nothing sent again
    assert (server.connections, connections.reconnects, connections.resent, connections.open_connections) == (
        3,
        0,
        0,
        0,
    )


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


def test_an_answer_cut_short_is_an_error_and_the_request_is_not_sent_again(server, tmp_path):
    """Once the answer has begun the server had the request: sending it again could sample it twice."""
    with VLLMServerBackend(server.url, stop_token_ids=[9], sync_dir=str(tmp_path)) as backend:
        asyncio.run(backend.generate([1, 2, 3], 3))
        server.cut_next = 1
        with pytest.raises(GeneratorServerError, match="v1/completions: IncompleteRead"):
            asyncio.run(backend.generate([1, 2, 3], 3))
        connections = backend.client.completions
        assert len(server.bodies) == 2 and connections is not None and connections.resent == 0


def test_a_base_url_with_a_path_keeps_it(server, tmp_path):
    with VLLMServerBackend(server.url + "/gen/", stop_token_ids=[9], sync_dir=str(tmp_path)) as backend:
        assert asyncio.run(backend.generate([1, 2, 3], 3)).token_ids == [7, 8, 9]
    assert server.paths == ["/gen/v1/completions"]


def test_the_backend_reports_the_servers_errors_and_timeouts_in_one_line(server, tmp_path):
    with VLLMServerBackend(server.url, stop_token_ids=[9], sync_dir=str(tmp_path), timeout=0.5) as backend:
        assert backend.client.completions is not None
        server.status = 503
        with pytest.raises(GeneratorServerError, match="answered 503: .*the model is asleep"):
            asyncio.run(backend.generate([1, 2, 3], 3))
        server.status, server.stall = 200, 2.0
        with pytest.raises(GeneratorServerError, match="v1/completions: timed out"):
            asyncio.run(backend.generate([1, 2, 3], 3))
        server.stall = 0.0
        assert asyncio.run(backend.generate([1, 2, 3], 3)).token_ids == [7, 8, 9]  # a fresh connection after it
    assert backend.client.completions.open_connections == 0  # closed with the backend


def test_both_request_paths_send_the_same_body_and_read_the_same_completion(server, tmp_path):
    completions = []
    for keep_alive in (True, False):
        with VLLMServerBackend(
            server.url, stop_token_ids=[9], sync_dir=str(tmp_path), keep_alive=keep_alive
        ) as backend:
            assert (backend.client.completions is not None) is keep_alive
            completions.append(asyncio.run(backend.generate([1, 2, 3], 3, seed=11)))
    assert server.bodies[0] == server.bodies[1] and server.bodies[0]["seed"] == 11
    assert completions[0] == completions[1] and completions[0].stopped


@pytest.mark.parametrize(
    ("variables", "keeps_alive"),
    [
        ({}, True),
        ({"NO_PROXY": "localhost"}, True),  # a list of exceptions alone is no proxy
        ({"https_proxy": "http://127.0.0.1:9"}, True),  # a proxy for the other scheme
        ({"http_proxy": "http://127.0.0.1:9", "no_proxy": "127.0.0.1"}, True),  # excluded
        ({"http_proxy": "http://127.0.0.1:9"}, False),  # it applies: requests, which honours it
        ({"ALL_PROXY": "http://127.0.0.1:9"}, False),
    ],
)
def test_completions_go_through_requests_where_a_proxy_applies_to_the_servers_url(
    server, tmp_path, monkeypatch, variables, keeps_alive
):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    # only the choice of path is checked: nothing listens behind the proxy
    monkeypatch.setattr(VLLMServerBackend, "_wait_for_server", lambda self, timeout: "fake-model")
    monkeypatch.setattr(VLLMServerBackend, "_prefix_caching", lambda self: True)
    with VLLMServerBackend(server.url, stop_token_ids=[9], sync_dir=str(tmp_path)) as backend:
        assert (backend.client.completions is not None) is keeps_alive


def test_an_https_server_keeps_requests_and_its_certificate_bundle(tmp_path, monkeypatch):
    monkeypatch.setattr(VLLMServerBackend, "_wait_for_server", lambda self, timeout: "fake-model")
    monkeypatch.setattr(VLLMServerBackend, "_prefix_caching", lambda self: True)
    with VLLMServerBackend("https://gen-node:8443", stop_token_ids=[9], sync_dir=str(tmp_path)) as backend:
        assert backend.client.completions is None


@pytest.mark.parametrize("url", ["gen-node:8000", "ftp://gen-node:8000", "http://"])
def test_a_url_that_is_not_http_is_refused_in_one_line_naming_the_key(url, tmp_path):
    with pytest.raises(GeneratorServerError, match="is not http\\(s\\)://host:port: fix vllm_server_base_url"):
        VLLMServerBackend(url, stop_token_ids=[9], sync_dir=str(tmp_path))
