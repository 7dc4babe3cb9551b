"""vLLM in server mode: generation on GPUs (or nodes) of its own, behind vLLM's OpenAI server.

Start the server with ``trl vllm-serve`` or ``vllm serve`` plus the flags in
:data:`SERVER_FLAGS` and the environment in :data:`SERVER_ENV`. Every training process sends its
episodes' turns as token-id completions requests, concurrently; the server batches them
continuously. Weights travel through a directory both sides can read (``vllm_sync_dir``, e.g. on
the shared filesystem of a cluster):

* LoRA: the main process saves the adapter there and hot-swaps it with ``/v1/load_lora_adapter``. With
  ``keep_versions`` (``max_staleness`` above 1) each policy version stays loaded under its own name beside the
  later ones until the trainer releases it, and a batch's requests name the version it was queued with.
* Full weights: the main process writes the layer-by-layer stream in shards of at most
  ``shard_bytes`` (2 GiB; a single tensor larger than that gets a shard of its own) and the server
  reloads them in place (``/collective_rpc`` ``reload_weights``, a dev-mode endpoint).
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import logging
import shutil
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch
from requests.adapters import HTTPAdapter
from requests.utils import get_environ_proxies, select_proxy

from .backend import Completion, TemperatureView
from .keep_alive import KeepAliveConnections

logger = logging.getLogger(__name__)

SERVER_FLAGS = (
    "--enable-lora --max-lora-rank <r> (LoRA runs), --logprobs-mode processed_logprobs, --generation-config vllm, "
    "--enable-prefix-caching (vLLM's default; every turn reuses the conversation's KV cache)"
)
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


class GeneratorServerError(RuntimeError):
    """The vLLM server is unreachable or refused a request."""


class VLLMServerBackend:
    """A :class:`~loop_trainer.rollout.GenerationBackend` and weight-sync target on a vLLM server.

    Args:
        base_url: e.g. ``http://gen-node:8000``.
        stop_token_ids: ids that end a reply.
        sync_dir: directory the server can read, for adapters and weight shards.
        is_main_process: only the main process writes to ``sync_dir`` and calls the server's
            weight endpoints; the others wait at ``barrier``.
        barrier: blocks until every training process reaches it (``accelerator.wait_for_everyone``).
        shard_bytes: the largest weight shard written for a full reload (a bigger single tensor
            is written alone).
        keep_versions: keep every loaded adapter until :meth:`release_versions_below` (several policy
            versions sampled at once: ``max_staleness`` above 1); full weights are one version only.
        keep_alive: send the completions over a keep-alive connection per request thread
            (:class:`~.keep_alive.KeepAliveConnections`: a fraction of ``requests``' CPU a turn). False, an
            ``https://`` URL, or a proxy that applies to the URL (``HTTP_PROXY``, not excluded by ``NO_PROXY``) sends
            them through ``requests``, as the other calls.

    It owns an HTTP session and the threads that wait on requests: release them with
    :meth:`close` or ``with VLLMServerBackend(...) as backend:``. The server itself is not ours.
    """

    def __init__(
        self,
        base_url: str,
        *,
        stop_token_ids: Sequence[int],
        sync_dir: str,
        temperature: float = 1.0,
        max_concurrency: int = 64,
        timeout: float = 600.0,
        connect_timeout: float = 60.0,
        is_main_process: bool = True,
        barrier: Callable[[], None] = lambda: None,
        shard_bytes: int = 2 << 30,
        keep_versions: bool = False,
        keep_alive: bool = True,
    ):
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise GeneratorServerError(
                f"the vLLM server's URL {base_url!r} is not http(s)://host:port: fix vllm_server_base_url (or "
                "vllm_server_host and vllm_server_port)"
            )
        self.base_url = base_url.rstrip("/")
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.temperature = temperature
        self.timeout = timeout
        self.sync_dir = Path(sync_dir)
        self.is_main_process = is_main_process
        self.barrier = barrier
        self.shard_bytes = shard_bytes
        self.keep_versions = keep_versions
        self._versions: dict[int, str] = {}  # with keep_versions: the adapters loaded, by policy version
        self.session = requests.Session()
        self.session.mount("http://", HTTPAdapter(pool_maxsize=max_concurrency))
        self.session.mount("https://", HTTPAdapter(pool_maxsize=max_concurrency))
        self._executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="vllm-server")
        self.completions: KeepAliveConnections | None = None
        if keep_alive and parts.scheme == "https":
            logger.info("%s is https: completions go through requests (its certificate bundle)", self.base_url)
        elif keep_alive and select_proxy(self.base_url, get_environ_proxies(self.base_url)):
            logger.info("a proxy applies to %s: completions go through it, by requests", self.base_url)
        elif keep_alive:
            self.completions = KeepAliveConnections(self.base_url, timeout)
        try:
            self.base_model = self._wait_for_server(connect_timeout)
            self.prefix_caching = self._prefix_caching()
        except BaseException:
            self.close()
            raise
        self.model = self.base_model
        self._adapter: str | None = None

    def _wait_for_server(self, timeout: float) -> str:
        import time

        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._request("GET", "/v1/models", timeout=10)["data"][0]["id"]
            except GeneratorServerError:
                if time.monotonic() > deadline:
                    raise GeneratorServerError(
                        f"vLLM server at {self.base_url} is not reachable: start it (`trl vllm-serve` or `vllm serve` "
                        f"with {SERVER_FLAGS}) or fix vllm_server_base_url"
                    ) from None
                time.sleep(1.0)

    def _prefix_caching(self) -> bool | None:
        """Whether the server caches prefixes (each turn then prefills only what it adds to the
        conversation, and a group's rollouts share their opening), from its ``/server_info`` (served
        in ``VLLM_SERVER_DEV_MODE``, which the weight sync needs anyway); None where it does not say."""
        try:
            info = self._request("GET", "/server_info?config_format=json", timeout=30)
        except GeneratorServerError:
            return None
        config = info.get("vllm_config")
        cache = config.get("cache_config") if isinstance(config, dict) else None
        enabled = cache.get("enable_prefix_caching") if isinstance(cache, dict) else None
        if enabled is False:
            logger.warning(
                "the vLLM server at %s runs without prefix caching: every turn prefills the whole "
                "conversation again; restart it with --enable-prefix-caching",
                self.base_url,
            )
        return enabled if isinstance(enabled, bool) else None

    def _request(self, method: str, path: str, payload: dict | None = None, timeout: float | None = None) -> dict:
        try:
            response = self.session.request(method, self.base_url + path, json=payload, timeout=timeout or self.timeout)
        except requests.RequestException as error:
            raise GeneratorServerError(f"vLLM server {self.base_url}{path}: {error}") from error
        return _answer(path, response.status_code, response.content, response.headers.get("content-type", ""))

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        return await self._submit(prompt_ids, max_new_tokens, seed, self.temperature)

    def with_temperature(self, temperature: float) -> TemperatureView:
        return TemperatureView(self, temperature)

    def at_version(self, version: int) -> AdapterView:
        """Sampling policy ``version``'s adapter, whatever is loaded after it (``keep_versions``)."""
        name = self._versions.get(version)
        if name is None:
            raise KeyError(
                f"policy version {version} is not loaded on the vLLM server (loaded: {sorted(self._versions)})"
            )
        return AdapterView(self, name)

    def release_versions_below(self, version: int) -> None:
        """Unload the adapters of the versions below ``version`` (their directories are the weight sync's)."""
        for old in [v for v in self._versions if v < version]:
            name = self._versions.pop(old)
            if self.is_main_process:
                self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    async def _submit(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        seed: int | None,
        temperature: float,
        model: str | None = None,
    ) -> Completion:
        payload = self.completion_request(prompt_ids, max_new_tokens, seed, temperature, model)
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(self._executor, self._complete, payload)
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
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        seed: int | None,
        temperature: float,
        model: str | None = None,
    ) -> dict:
        """The body of one turn's ``/v1/completions`` request: token ids in and out, the sampler's log-probs, the
        reply ended by our stop ids only."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        return {
            "model": model or self.model,
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
            return self._request("POST", "/v1/completions", payload)
        try:
            status, body, content_type = self.completions.post_json("/v1/completions", payload)
        except (OSError, http.client.HTTPException) as error:
            raise GeneratorServerError(f"vLLM server {self.base_url}/v1/completions: {error}") from error
        return _answer("/v1/completions", status, body, content_type)

    # -- weights -------------------------------------------------------------------------------
    def adapter_name(self, version: int) -> str:
        # Named after the sync directory too, so runs sharing a long-lived server never collide.
        run = hashlib.sha1(str(self.sync_dir.resolve()).encode()).hexdigest()[:8]
        return f"loop-{run}-policy-{version}"

    def load_adapter(self, adapter_dir: str, version: int) -> None:
        name = self.adapter_name(version)
        if self.is_main_process:
            request = {"lora_name": name, "lora_path": str(adapter_dir)}
            replaced = False
            try:
                self._request("POST", "/v1/load_lora_adapter", request)
            except GeneratorServerError as error:
                if "already" not in str(error):
                    raise
                # A resumed run re-sends a version the server still holds: replace it.
                self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
                self._request("POST", "/v1/load_lora_adapter", request)
                replaced = True
            if self._adapter is not None and self._adapter != name and not self.keep_versions:
                self._request("POST", "/v1/unload_lora_adapter", {"lora_name": self._adapter})
            # Cached prefixes are keyed by adapter: a new name never hits an old one's, and the versions kept
            # (keep_versions) keep theirs. A name reloaded with other weights must not.
            if replaced or not self.keep_versions:
                self._request("POST", "/reset_prefix_cache")
        self.barrier()
        self._adapter = self.model = name
        if self.keep_versions:
            self._versions[version] = name

    def adapter_dir(self, version: int) -> Path:
        return self.sync_dir / f"adapter-{version}"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.keep_versions:
            raise GeneratorServerError(
                "a vLLM server holds one set of full weights, so it cannot keep several policy versions: "
                "train a LoRA adapter (use_peft: true), or set max_staleness: 1"
            )
        target = self.sync_dir / "weights"
        if not self.is_main_process:
            for _ in weights:  # take part in the ZeRO-3 gathers
                pass
            self.barrier()
            return
        from safetensors.torch import save_file

        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        shard: dict[str, torch.Tensor] = {}
        storages: set[int] = set()  # of the shard's tensors: safetensors refuses two that share memory
        size = index = 0
        for name, tensor in weights:
            tensor_bytes = tensor.numel() * tensor.element_size()
            if shard and size + tensor_bytes > self.shard_bytes:  # this tensor would overfill it
                save_file(shard, str(target / f"part-{index:05d}.safetensors"))
                shard, storages, size, index = {}, set(), 0, index + 1
            local = tensor.detach().contiguous().cpu()
            if local.untyped_storage().data_ptr() in storages:  # a tied weight (lm_head is the embedding)
                local = local.clone()
            storages.add(local.untyped_storage().data_ptr())
            shard[name] = local
            size += tensor_bytes
        if shard:
            save_file(shard, str(target / f"part-{index:05d}.safetensors"))
        (target / "loop_weights.json").write_text(json.dumps({"shards": index + bool(shard)}))
        self._request("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(target)}})
        self._request("POST", "/reset_prefix_cache")
        self.barrier()

    def probe_logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        body = self._request(
            "POST",
            "/v1/completions",
            {
                "model": self.model,
                "prompt": list(token_ids),
                "max_tokens": 1,
                "temperature": self.temperature or 1.0,
                "prompt_logprobs": 0,
            },
        )
        steps = body["choices"][0]["prompt_logprobs"]
        return torch.tensor([steps[i][str(token)]["logprob"] for i, token in enumerate(token_ids) if i > 0])

    def sleep(self) -> None:
        """The server's GPUs are not the trainer's: nothing to free."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass

    def close(self) -> None:
        """Stop the request threads and close the HTTP session and connections. Idempotent; the server keeps
        running."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.session.close()
        if self.completions is not None:
            self.completions.close()

    def __enter__(self) -> VLLMServerBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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


class AdapterView:
    """One policy version's adapter on the server, as a :class:`~loop_trainer.rollout.GenerationBackend`: its
    requests name that adapter whatever was loaded after it."""

    def __init__(self, server: VLLMServerBackend, adapter: str):
        self.server, self.adapter = server, adapter

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        return await self.server._submit(prompt_ids, max_new_tokens, seed, self.server.temperature, self.adapter)
