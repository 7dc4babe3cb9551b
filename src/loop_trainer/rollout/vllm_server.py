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

import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from .backend import TemperatureView
from .records import Completion, GenerationBackend
from .server_client import GeneratorServerError, ServerClient, ServerEndpoint, ServerSampling

__all__ = ["SERVER_ENV", "SERVER_FLAGS", "AdapterView", "GeneratorServerError", "VLLMServerBackend", "server_sampling"]

logger = logging.getLogger(__name__)

SERVER_FLAGS = (
    "--enable-lora --max-lora-rank <r> (LoRA runs), --logprobs-mode processed_logprobs, --generation-config vllm, "
    "--enable-prefix-caching (vLLM's default; every turn reuses the conversation's KV cache)"
)
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


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
        keep_alive: send the completions over a keep-alive connection per request thread (as
            :class:`~.server_client.ServerEndpoint` says).

    It owns an HTTP client (:class:`~.server_client.ServerClient`: a session, connections, the threads that wait
    on requests): release it with :meth:`close` or ``with VLLMServerBackend(...) as backend:``. The server itself
    is not ours.
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
        self.client = ServerClient(
            ServerEndpoint(base_url, tuple(stop_token_ids), max_concurrency, timeout, keep_alive)
        )
        self.base_url = self.client.base_url
        self.temperature = temperature
        self.sync_dir = Path(sync_dir)
        self.is_main_process = is_main_process
        self.barrier = barrier
        self.shard_bytes = shard_bytes
        self.keep_versions = keep_versions
        self._versions: dict[int, str] = {}  # with keep_versions: the adapters loaded, by policy version
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
        return self.client.request(method, path, payload, timeout)

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
        return await self.client.complete(prompt_ids, max_new_tokens, seed, temperature, model or self.model)

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
        self.client.close()

    def __enter__(self) -> VLLMServerBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AdapterView:
    """One policy version's adapter on the server, as a :class:`~loop_trainer.rollout.GenerationBackend`: its
    requests name that adapter whatever was loaded after it."""

    def __init__(self, server: VLLMServerBackend, adapter: str):
        self.server, self.adapter = server, adapter

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int | None = None) -> Completion:
        return await self.server._submit(prompt_ids, max_new_tokens, seed, self.server.temperature, self.adapter)

    def sampling(self) -> ServerSampling:
        return ServerSampling(self.server.client.endpoint, self.adapter, self.server.temperature)


def server_sampling(sampler: GenerationBackend) -> ServerSampling | None:
    """What ``sampler`` samples, as settings another process can sample through
    (:class:`~.server_client.ServerSampler`): for the server backend (the policy it holds now) and one version's
    view of it; None for any other backend."""
    if isinstance(sampler, VLLMServerBackend):
        return ServerSampling(sampler.client.endpoint, sampler.model, sampler.temperature)
    if isinstance(sampler, AdapterView):
        return sampler.sampling()
    return None
