"""Trainer -> generator weight sync, once per iteration, and the check that it worked.

* LoRA: only the adapter travels. Its parameters are gathered (under ZeRO-3 they are the only
  ones gathered), saved, and hot-swapped into the generator; the base model is never merged,
  gathered or copied.
* Full fine-tuning: weights stream in layer-sized pieces -- one decoder layer gathered at a time
  under ZeRO-3 -- and a tied ``lm_head`` is sent explicitly (vLLM keeps its own output layer).
* After each sync the generator and the trainer score the same probe sequence; the largest
  log-prob difference is logged, and a difference over the tolerance at two syncs in a row stops the
  run: a generator sampling from stale or mangled weights would silently corrupt every importance
  ratio after it (one sync over it is logged and counted: bf16 noise can reach it once).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from .vllm_backend import WeightLoadable

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The generator's log-probs disagree with the trainer's after a sync."""


def _gathered(params: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager:
    """Materialise ZeRO-3-partitioned parameters (a collective: every rank must enter)."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _is_partitioned(model: nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


def layerwise_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every weight of a (non-PEFT) causal LM, one decoder layer
    (or one top-level tensor) materialised at a time. Under ZeRO-3 every rank must iterate."""
    pieces: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        match = _LAYER.match(name)
        pieces.setdefault(match.group(1) if match else name, []).append((name, param))
    partitioned = _is_partitioned(model)
    for piece in pieces.values():
        with _gathered([p for _, p in piece]):
            for name, param in piece:
                # Under ZeRO-3 the gathered storage is released on exit: hand out a copy.
                yield name, param.data.clone() if partitioned else param.data
    config = getattr(model, "config", None)
    names = {name for name, _ in model.named_parameters()}
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in names:
        embedding = _input_embedding(model)
        with _gathered([embedding]):
            yield "lm_head.weight", embedding.data.clone() if partitioned else embedding.data


def _input_embedding(model: nn.Module) -> torch.Tensor:
    """A causal LM's input embedding matrix. The casts: torch types a Module's attributes as
    ``Tensor | Module``, transformers the module ``get_input_embeddings()`` returns as any Module."""
    embeddings = cast("PreTrainedModel", model).get_input_embeddings()
    return cast(nn.Embedding, embeddings).weight


def save_adapter(model: nn.Module, directory: Path, write: bool = True) -> Path:
    """Save a PEFT model's adapter, gathering only the adapter's parameters under ZeRO-3 (a
    collective: every rank calls this; only those with ``write`` save)."""
    adapter = [p for name, p in model.named_parameters() if "lora_" in name or "modules_to_save" in name]
    with _gathered(adapter):
        if write:
            # a PEFT model (torch types a Module's attributes as Tensor | Module)
            cast("PeftModel", model).save_pretrained(str(directory), safe_serialization=True)
    return directory


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


@dataclass
class SyncReport:
    seconds: float
    logprob_diff_max: float
    logprob_diff_mean: float
    over_tolerance: bool = False  # the probe's gap was over the tolerance (once: logged, not fatal)

    def metrics(self) -> dict[str, float]:
        return {
            "weight_sync_seconds": self.seconds,
            "weight_sync_logprob_diff_max": self.logprob_diff_max,
            "weight_sync_logprob_diff_mean": self.logprob_diff_mean,
            "weight_sync_over_tolerance": float(self.over_tolerance),
        }


class WeightSync:
    """Pushes the trainer's policy into a generator and checks it landed.

    Args:
        model: the unwrapped training model (PEFT or plain causal LM).
        generator: the engine or server receiving the weights.
        trainer_logprobs: scores token ids with the trainer's model (``[len-1]`` log-probs at the
            sampling temperature); under ZeRO-3 every rank calls it.
        probe_ids: the fixed probe sequence.
        tolerance: largest allowed |generator - trainer| log-prob on the probe (None: no check). A gap over it
            at one sync is logged and counted (``weight_sync_over_tolerance``); over it at two syncs in a row,
            or not a number, stops the run (:class:`WeightSyncError`). Stale or mangled weights stay wrong and
            drift further from the policy, so they fail the next sync too; bf16's rounding of a small model's
            large logits reached 0.32 on one sync of 37 (H200, 2026-11-30), never twice in a row.
        workdir: where a colocated engine's adapters are saved; by default a temporary directory
            that :meth:`close` (or leaving ``with WeightSync(...) as sync:``) removes. A given
            ``workdir`` is the caller's and is left in place.
        keep_versions: the generator holds several versions (:class:`~.vllm_backend.HoldsVersions`): an
            adapter's directory stays until :meth:`release_versions_below` (the generator may read it again).
    """

    def __init__(
        self,
        model: nn.Module,
        generator: WeightLoadable,
        trainer_logprobs: Callable[[list[int]], torch.Tensor],
        probe_ids: list[int],
        tolerance: float | None,
        workdir: str | None = None,
        keep_versions: bool = False,
    ):
        self.model = model
        self.keep_versions = keep_versions
        self._kept: dict[int, Path] = {}
        self.generator = generator
        self.trainer_logprobs = trainer_logprobs
        self.probe_ids = probe_ids
        self.tolerance = tolerance
        self.lora = is_peft(model)
        self._owns_workdir = workdir is None
        self._workdir = Path(workdir or tempfile.mkdtemp(prefix="loop-weight-sync-"))
        self._previous: Path | None = None
        self._over_at: int | None = None  # the version whose sync was last over the tolerance, if the last one

    def push(self, version: int) -> None:
        """Send the current weights as policy ``version`` (the iteration that produced them)."""
        self.generator.wake_up(tags=["weights"])
        if self.lora:
            # A server reads adapters from its shared directory, and only the main process writes
            # there; a colocated engine reads this process's own copy.
            shared = getattr(self.generator, "adapter_dir", None)
            directory = Path(shared(version)) if shared else self._workdir / f"adapter-{version}"
            write = getattr(self.generator, "is_main_process", True)
            save_adapter(self.model, directory, write=write)
            self.generator.load_adapter(str(directory), version)
            if self.keep_versions:
                self._kept[version] = directory
            elif write and self._previous is not None and self._previous != directory:
                shutil.rmtree(self._previous, ignore_errors=True)
            self._previous = directory
        elif self.keep_versions:  # a generator holding several versions keeps the earlier ones beside this one
            self.generator.load_weights(layerwise_weights(self.model), version=version)  # type: ignore[call-arg]
        else:
            self.generator.load_weights(layerwise_weights(self.model))
        self.generator.wake_up(tags=["kv_cache"])

    def release_versions_below(self, version: int) -> None:
        """``keep_versions``: the generator forgets the versions below ``version``, and their adapters'
        directories go."""
        release = getattr(self.generator, "release_versions_below", None)
        if release is not None:
            release(version)
        write = getattr(self.generator, "is_main_process", True)
        for old in [v for v in self._kept if v < version]:
            directory = self._kept.pop(old)
            if write:
                shutil.rmtree(directory, ignore_errors=True)

    def compare(self) -> tuple[float, float]:
        """(max, mean) |generator - trainer| log-prob over the probe."""
        generated = self.generator.probe_logprobs(self.probe_ids).double()
        trained = self.trainer_logprobs(self.probe_ids).double().cpu()
        diff = (generated - trained).abs()
        return float(diff.max()), float(diff.mean())

    def __call__(self, version: int) -> SyncReport:
        started = time.perf_counter()
        self.push(version)
        seconds = time.perf_counter() - started
        diff_max, diff_mean = self.compare()
        over = self.tolerance is not None and not diff_max <= self.tolerance
        report = SyncReport(seconds, diff_max, diff_mean, over_tolerance=over)
        earlier, self._over_at = self._over_at, (version if over else None)
        if over and (earlier is not None or not math.isfinite(diff_max)):
            again = f" (and {earlier}'s before it)" if earlier is not None else ""
            raise WeightSyncError(
                f"after syncing policy {version}{again} the generator's log-probs differ from the trainer's by up "
                f"to {diff_max:.3g} (tolerance {self.tolerance:g}) on the probe sequence: the generator is not "
                "sampling from the trained policy. Check the model's parameter names against the engine's, or "
                "raise vllm_sync_tolerance if this is numerical noise (bf16)"
            )
        if over:
            logger.warning(
                "after syncing policy %d the generator's log-probs differ from the trainer's by up to %.3g "
                "(vllm_sync_tolerance %g) on the probe sequence; once may be numerical noise (bf16), and the run "
                "stops if the next sync is over it too",
                version,
                diff_max,
                self.tolerance,
            )
        return report

    def close(self) -> None:
        """Remove the temporary directory this object created. Idempotent."""
        if self._owns_workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def probe_token_ids(vocab_size: int, length: int = 64, seed: int = 0, avoid: set[int] | None = None) -> list[int]:
    """A fixed pseudo-random probe over the vocabulary (the same on every rank and every run)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (length * 2,), generator=generator).tolist()
    avoid = avoid or set()
    return [i for i in ids if i not in avoid][:length]


def default_tolerance(dtype: torch.dtype) -> float:
    # fp32 engines agree with the trainer to ~1e-5; bf16 kernels differ by up to ~0.1 per token.
    return 1e-3 if dtype == torch.float32 else 0.25


__all__ = [
    "SyncReport",
    "WeightSync",
    "WeightSyncError",
    "default_tolerance",
    "layerwise_weights",
    "probe_token_ids",
    "save_adapter",
]
