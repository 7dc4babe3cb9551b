"""Which parts of the transformers backend's decode loop a run uses, decided in one place.

Three parts make sampling with the training model fast on a GPU (docs/benchmarks.md, issue 27's H200
rounds): ``static_decode`` (fixed-shape KV slots, one CUDA graph per decode step), ``compile_decode_step``
(that step through ``torch.compile`` before it is captured) and ``merge_adapter`` (sampling from a view
of the policy with its LoRA adapter merged: ``merge_adapter_for_sampling``). Each setting is

- ``None`` (auto): on with CUDA where the part applies, off on a CPU; a part that cannot apply falls back
  (off) with one note saying why;
- ``True``: required; refused in one actionable line where it cannot apply;
- ``False``: off.

:func:`resolve_sampling_parts` is pure (the facts about the device and the model are its arguments), so
every case is tested on a CPU; :func:`~loop_trainer.rollout.backend.build_transformers_backend` gathers
those facts and applies it. What only the first prefill can tell (a KV cache that cannot be cut per row
turns static_decode off, :class:`~.kv_layout.KVLayout`) and what only compiling can tell (torch.compile
failing: the step runs uncompiled) fall back at run time, with one log line each.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

COMPILE_NEEDS_STATIC = (
    "compile_decode_step compiles the fixed-shape decode step of static_decode: set static_decode: true, or remove "
    "compile_decode_step"
)
MERGE_NEEDS_WHOLE_WEIGHTS = (
    "merge_adapter_for_sampling needs whole weights on each process, and ZeRO-3 partitions them: remove "
    "merge_adapter_for_sampling, or use a ZeRO stage below 3"
)


class SamplingPartsError(ValueError):
    """A part asked for (``True``) that cannot apply: one actionable line."""


@dataclass(frozen=True)
class TransformersSamplingSettings:
    """How a :class:`~loop_trainer.rollout.backend.TransformersBackend` samples."""

    temperature: float = 1.0
    """0 is greedy (evaluation only)."""
    max_batch_size: int = 64
    """Most rows decoded at once (``generation_batch_limit``)."""
    share_prefixes: bool = True
    """Prefixes that several prompts share are prefilled once per weights version."""
    static_decode: bool | None = None
    """Fixed-shape KV slots, one CUDA graph per decode step on a GPU. None: on with CUDA."""
    compile_decode_step: bool | None = None
    """The fixed-shape step through ``torch.compile`` first; needs static_decode. None: on with CUDA and
    static_decode, if torch.compile can run."""
    merge_adapter: bool | None = None
    """Sample from a view of the policy with its LoRA adapter merged (``merge_adapter_for_sampling``).
    None: on with CUDA if the policy has a LoRA adapter that can be merged and is not ZeRO-3 partitioned."""


@dataclass(frozen=True)
class ResolvedSampling:
    """:func:`resolve_sampling_parts`'s answer."""

    settings: TransformersSamplingSettings
    """The settings with every part True or False."""
    notes: tuple[str, ...] = ()
    """One line per part that was left to auto and could not apply (log them)."""
    compile_falls_back: bool = False
    """compile_decode_step is on by default, not asked for: if torch.compile fails when the step is first
    compiled, the step runs uncompiled (one log line) instead of failing the rows."""


def resolve_sampling_parts(
    settings: TransformersSamplingSettings,
    *,
    device_is_cuda: bool,
    merge_problem: str | None = None,
    zero3: bool = False,
    compile_problem: str | None = None,
) -> ResolvedSampling:
    """Each part of ``settings`` True or False, with a note per auto part that could not apply.

    ``device_is_cuda``: the policy samples on a CUDA device. ``merge_problem``: why the policy's adapter
    cannot be merged (no LoRA adapter, a kind that does not merge, accelerate dispatch hooks; one
    line, as :func:`~.merged_adapter.merge_problem` says it), None if it can. ``zero3``: the weights are
    ZeRO-3 partitioned. ``compile_problem``: why torch.compile cannot run here, None if it can.

    Raises :class:`SamplingPartsError` for a part set to True that cannot apply."""
    notes: list[str] = []

    static = settings.static_decode
    if static is None:  # a ZeRO-3 forward gathers its parameters through hooks: nothing to capture in a graph
        static = device_is_cuda and not zero3
        if device_is_cuda and zero3:
            notes.append("static_decode and compile_decode_step off: ZeRO-3 gathers the weights at every forward")

    compile_step = settings.compile_decode_step
    falls_back = False
    if compile_step is True:
        if not static:
            raise SamplingPartsError(COMPILE_NEEDS_STATIC)
        if compile_problem is not None:
            raise SamplingPartsError(f"compile_decode_step: {compile_problem}: set compile_decode_step: false")
    elif compile_step is None:
        compile_step = device_is_cuda and static and compile_problem is None
        falls_back = compile_step
        if device_is_cuda and static and compile_problem is not None:
            notes.append(f"compile_decode_step off: {compile_problem}")

    merge = settings.merge_adapter
    if merge is True:
        if zero3:
            raise SamplingPartsError(MERGE_NEEDS_WHOLE_WEIGHTS)
        if merge_problem is not None:
            raise SamplingPartsError(merge_problem)
    elif merge is None:
        merge = device_is_cuda and not zero3 and merge_problem is None
        if device_is_cuda and zero3:
            notes.append("merge_adapter_for_sampling off: ZeRO-3 partitions the weights it would merge")
        elif device_is_cuda and merge_problem is not None:
            notes.append(f"merge_adapter_for_sampling off (its default applies only where it can): {merge_problem}")

    return ResolvedSampling(
        replace(settings, static_decode=static, compile_decode_step=compile_step, merge_adapter=merge),
        tuple(notes),
        falls_back,
    )


def compile_problem(device_is_cuda: bool) -> str | None:
    """Why ``torch.compile`` cannot compile the decode step here, or None: on CUDA its inductor backend
    generates triton kernels."""
    if device_is_cuda and importlib.util.find_spec("triton") is None:
        return "torch.compile needs triton on CUDA, which is not installed"
    return None
