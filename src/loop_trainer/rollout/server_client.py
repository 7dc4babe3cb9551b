"""The HTTP client of a vLLM server: its few control calls (a ``requests`` session) and its completions, one for
every sampled turn of every episode (a keep-alive connection per request thread, :mod:`.keep_alive`), waited on by
request threads so that an event loop never blocks.

:class:`~.vllm_server.VLLMServerBackend` (the generator, and the target of the weight sync) sends through one; so
does a collection in a process of its own (:mod:`.collection_process`), which rebuilds one from its
:class:`ServerEndpoint`: the client's settings, which pickle, where the client (sockets, threads) does not.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests
from requests.adapters import HTTPAdapter
from requests.utils import get_environ_proxies, select_proxy

from .keep_alive import KeepAliveConnections
from .records import Completion

logger = logging.getLogger(__name__)


class GeneratorServerError(RuntimeError):
    """The vLLM server is unreachable or refused a request."""


@dataclass(frozen=True)
class ServerEndpoint:
    """How to reach a server and read its completions: all a :class:`ServerClient` is built from.

    Args:
        base_url: e.g. ``http://gen-node:8000``.
        stop_token_ids: ids that end a reply.
        max_concurrency: completions waited on at once (request threads, and pooled ``requests`` connections).
        timeout: seconds for each request (and each wait on a keep-alive connection's socket).
        keep_alive: send the completions over a keep-alive connection per request thread
            (:class:`~.keep_alive.KeepAliveConnections`: a fraction of ``requests``' CPU a turn). False, an
            ``https://`` URL, or a proxy that applies to the URL (``HTTP_PROXY``, not excluded by ``NO_PROXY``) sends
            them through ``requests``, as the other calls.
    """

    base_url: str
    stop_token_ids: tuple[int, ...]
    max_concurrency: int = 64
    timeout: float = 600.0
    keep_alive: bool = True


class ServerClient:
    """Requests to the server at ``endpoint``. It owns an HTTP session, the keep-alive connections and the threads
    that wait on requests: release them with :meth:`close`."""

    def __init__(self, endpoint: ServerEndpoint):
        parts = urllib.parse.urlsplit(endpoint.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise GeneratorServerError(
                f"the vLLM server's URL {endpoint.base_url!r} is not http(s)://host:port: fix vllm_server_base_url "
                "(or vllm_server_host and vllm_server_port)"
            )
        self.endpoint = endpoint
        self.base_url = endpoint.base_url.rstrip("/")
        self.stop_token_ids = sorted(set(endpoint.stop_token_ids))
        self.timeout = endpoint.timeout
        self.session = requests.Session()
        self.session.mount("http://", HTTPAdapter(pool_maxsize=endpoint.max_concurrency))
        self.session.mount("https://", HTTPAdapter(pool_maxsize=endpoint.max_concurrency))
        self.executor = ThreadPoolExecutor(endpoint.max_concurrency, thread_name_prefix="vllm-server")
        self.completions: KeepAliveConnections | None = None
        if endpoint.keep_alive and parts.scheme == "https":
            logger.info("%s is https: completions go through requests (its certificate bundle)", self.base_url)
        elif endpoint.keep_alive and select_proxy(self.base_url, get_environ_proxies(self.base_url)):
            logger.info("a proxy applies to %s: completions go through it, by requests", self.base_url)
        elif endpoint.keep_alive:
            self.completions = KeepAliveConnections(self.base_url, endpoint.timeout)

    def request(self, method: str, path: str, payload: dict | None = None, timeout: float | None = None) -> dict:
        """One call through the ``requests`` session (on the calling thread); its JSON answer."""
        try:
            response = self.session.request(method, self.base_url + path, json=payload, timeout=timeout or self.timeout)
        except requests.RequestException as error:
            raise GeneratorServerError(f"vLLM server {self.base_url}{path}: {error}") from error
        return _answer(path, response.status_code, response.content, response.headers.get("content-type", ""))

    async def complete(
        self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None, temperature: float, model: str
    ) -> Completion:
        """One turn, sampled by ``model`` (the base model's name, or an adapter's) on a request thread."""
        payload = self.completion_request(prompt_ids, max_new_tokens, seed, temperature, model)
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(self.executor, self._complete, payload)
        if not body.get("choices"):
            raise GeneratorServerError(f"vLLM server /v1/completions answered without choices: {str(body)[:300]}")
        choice = body["choices"][0]
        token_ids = list(choice["token_ids"])
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        if len(logprobs) != len(token_ids):
            raise GeneratorServerError(f"vLLM server returned {len(token_ids)} tokens but {len(logprobs)} log-probs")
        stopped = bool(token_ids) and token_ids[-1] in self.stop_token_ids
        return Completion(token_ids=token_ids, logprobs=logprobs, stopped=stopped)

    def completion_request(
        self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None, temperature: float, model: str
    ) -> dict:
        """The body of one turn's ``/v1/completions`` request: token ids in and out, the sampler's log-probs, the
        reply ended by our stop ids only."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        return {
            "model": model,
            "prompt": list(prompt_ids),
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "seed": seed,
            "logprobs": 0,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": True,  # replies end at our stop ids only
            "return_token_ids": True,
            "skip_special_tokens": False,
        }

    def _complete(self, payload: dict) -> dict:
        """POST ``/v1/completions`` (on a request thread)."""
        if self.completions is None:
            return self.request("POST", "/v1/completions", payload)
        try:
            status, body, content_type = self.completions.post_json("/v1/completions", payload)
        except (OSError, http.client.HTTPException) as error:
            raise GeneratorServerError(f"vLLM server {self.base_url}/v1/completions: {error}") from error
        return _answer("/v1/completions", status, body, content_type)

    def close(self) -> None:
        """Stop the request threads and close the HTTP session and connections. Idempotent."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.session.close()
        if self.completions is not None:
            self.completions.close()


def _answer(path: str, status: int, body: bytes, content_type: str) -> dict:
    """A server's answer to ``path``, parsed: its JSON (``{}`` if it sent none), or a :class:`GeneratorServerError`
    that quotes it."""
    if status != 200:
        text = body.decode("utf-8", errors="replace")
        raise GeneratorServerError(f"vLLM server {path} answered {status}: {text[:300]}")
    if not body or not content_type.startswith("application/json"):
        return {}
    try:
        return json.loads(body)
    except ValueError as error:
        raise GeneratorServerError(f"vLLM server {path} answered malformed JSON ({error}): {body[:300]!r}") from None


@dataclass(frozen=True)
class ServerSampling:
    """What samples a batch on a server, as settings: the endpoint, the model name its requests give (the base
    model, or one policy version's adapter) and the temperature. A collection in another process samples through
    :class:`ServerSampler` built from it."""

    endpoint: ServerEndpoint
    model: str
    temperature: float


class ServerSampler:
    """A :class:`~loop_trainer.rollout.GenerationBackend` sampling ``sampling.model`` at ``sampling.temperature``
    through ``client``."""

    def __init__(self, client: ServerClient, sampling: ServerSampling):
        self.client, self.sampling = client, sampling

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        return await self.client.complete(
            prompt_ids, max_new_tokens, seed, self.sampling.temperature, self.sampling.model
        )
