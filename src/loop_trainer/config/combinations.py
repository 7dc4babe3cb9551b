"""Every check that combines keys (or a key and the launch), in one place, run at config time.

``LOOPConfig.__post_init__`` runs :func:`check_combinations` with what a config knows of its launch (the
``WORLD_SIZE`` the launcher set, the DeepSpeed config, whether CUDA is visible), so a recipe that cannot run
stops before any model loads, in ``--dry-run`` too. ``LOOPTrainer`` runs it again with what only it knows: the
accelerator's process count and a ``generation_backend`` passed in Python. Each refusal is one line naming the
keys and the fix. A single key's range is checked on its field (:mod:`.ranges`); a key against the model
(``merge_adapter_for_sampling`` without a LoRA adapter) where the model is.

The sampling parts (``static_decode``, ``compile_decode_step``, ``merge_adapter_for_sampling``) are refused
here only when set ``true``; unset (``None``) they are decided where the generator is built, on where they
apply, and fall back with a log line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from ..rollout.sampling_parts import COMPILE_NEEDS_STATIC, MERGE_NEEDS_WHOLE_WEIGHTS

if TYPE_CHECKING:
    from .loop_config import LOOPConfig


class ConfigCombinationError(ValueError):
    """Keys that cannot go together (or cannot run on this launch); the message is one actionable line."""


class Generator(Enum):
    """What will sample, as far as the check knows."""

    BUILT_IN = "built-in"  # the transformers backend or vLLM, as the keys say
    OWN_WEIGHTS = "own-weights"  # a generation_backend holding a copy of the policy (holds_own_weights)
    SHARED_WEIGHTS = "shared-weights"  # a generation_backend sampling the training model itself
    UNKNOWN = "unknown"  # a LOOPConfig built in Python: LOOPTrainer may yet be given a generation_backend


@dataclass(frozen=True)
class Launch:
    """What the checks know of where the config runs."""

    num_processes: int = 1
    zero_stage: int | None = None
    cuda: bool = False
    generator: Generator = Generator.UNKNOWN
    lora: bool | None = None
    """Whether a LoRA adapter is trained (None: not known yet, e.g. a LOOPConfig built before its model)."""


Rule = Callable[["LOOPConfig", Launch], "str | None"]

# ``loop-train --dry-run`` checks a recipe for the GPU launch it plans, on whatever machine runs it (a laptop
# with no GPU, typically): a recipe key that needs a GPU (activation_offloading) is not refused there.
_PLANNING_A_GPU_LAUNCH: ContextVar[bool] = ContextVar("planning_a_gpu_launch", default=False)


@contextmanager
def planning_a_gpu_launch() -> Iterator[None]:
    """Configs built inside see CUDA as visible (unless ``use_cpu``): the launch they are checked for is the
    planned one, not this machine."""
    token = _PLANNING_A_GPU_LAUNCH.set(True)
    try:
        yield
    finally:
        _PLANNING_A_GPU_LAUNCH.reset(token)


def planning_gpu_launch() -> bool:
    return _PLANNING_A_GPU_LAUNCH.get()


COLOCATED_TP_ONLY = (
    "vllm_tensor_parallel_size must be 1 with vllm_mode: colocate (every process runs its own engine on its own "
    "episodes); for a model that needs tensor parallelism, generate on a vLLM server (vllm_mode: server)"
)


def _samples_with_training_model(config: LOOPConfig, launch: Launch) -> bool:
    """Known to: the built-in generator without vLLM (the transformers backend's forward passes). A
    generation_backend of the user's is theirs to run: it may call no model of this process at all."""
    return launch.generator is Generator.BUILT_IN and not config.use_vllm


def _overlap_with_colocated_vllm(config: LOOPConfig, launch: Launch) -> str | None:
    if config.max_staleness and config.use_vllm and config.vllm_mode == "colocate" and _built_in(launch):
        return (
            "max_staleness overlaps the next collection with the update, and a colocated vLLM engine shares the "
            "training GPU: set vllm_mode: server (a vLLM server on GPUs of its own), or max_staleness: 0"
        )
    return None


def _overlap_with_dynamic_sampling(config: LOOPConfig, launch: Launch) -> str | None:
    if config.max_staleness and config.dynamic_sampling_rounds:
        return (
            "max_staleness collects the next iteration ahead, and dynamic_sampling_rounds decides its rounds from "
            "the rewards of this one: set one of them to 0"
        )
    return None


def _overlap_needs_a_generator_with_its_own_weights(config: LOOPConfig, launch: Launch) -> str | None:
    if not config.max_staleness or (launch.generator is Generator.UNKNOWN and not config.use_vllm):
        return None  # a generation_backend holding its own weights may yet be passed to LOOPTrainer
    if launch.generator is Generator.SHARED_WEIGHTS:
        why = "this generation_backend samples the training model (it has no holds_own_weights = True)"
    elif _built_in(launch) and not config.use_vllm:
        why = "the transformers backend samples with the training model itself (set use_vllm: true, vllm_mode: server)"
    else:
        return None
    return f"max_staleness overlaps the next collection with the update, but {why}: or set max_staleness: 0"


def _several_versions_on_a_server_need_adapters(config: LOOPConfig, launch: Launch) -> str | None:
    server = config.use_vllm and config.vllm_mode == "server" and _built_in(launch)
    if config.max_staleness > 1 and server and launch.lora is False:
        return (
            f"max_staleness: {config.max_staleness} keeps several policy versions on the vLLM server at once, each a "
            "LoRA adapter, and a server holds one set of full weights: train an adapter (use_peft: true), or set "
            "max_staleness: 1"
        )
    return None


def _partial_rollouts_need_overlap_and_a_cut(config: LOOPConfig, launch: Launch) -> str | None:
    if not config.partial_rollouts:
        return None
    if not config.max_staleness:
        return (
            "partial_rollouts continues the episodes running at a batch's cut while the update runs, on the "
            "overlapped collection: set max_staleness: 1 or more, or partial_rollouts: false"
        )
    if config.early_stop_done_fraction >= 1 and config.early_stop_task_fraction >= 1:
        return (
            "partial_rollouts carries the episodes running at a batch's straggler cut into the next batch, and "
            "with early_stop_done_fraction and early_stop_task_fraction at 1.0 every episode is waited for: set "
            "early_stop_done_fraction: 0.9 (the paper's), or partial_rollouts: false"
        )
    return None


def _collection_process_needs_overlap_on_a_server(config: LOOPConfig, launch: Launch) -> str | None:
    if not config.collection_process:
        return None
    if not config.max_staleness:
        return (
            "collection_process collects the batches queued ahead (max_staleness) in a process of its own: set "
            "max_staleness: 1 or more, or collection_process: false"
        )
    if not (config.use_vllm and config.vllm_mode == "server" and _built_in(launch)):
        return (
            "collection_process samples through a vLLM server the child process reaches by itself: set use_vllm: "
            "true and vllm_mode: server, or collection_process: false"
        )
    return None


def _offloading_needs_a_gpu(config: LOOPConfig, launch: Launch) -> str | None:
    if config.activation_offloading and (config.use_cpu or not launch.cuda):
        return (
            "activation_offloading moves the update's saved activations from the GPU to CPU memory, and this run "
            "has no GPU (use_cpu, or none visible): remove activation_offloading"
        )
    return None


def _compile_needs_static(config: LOOPConfig, launch: Launch) -> str | None:
    # static_decode unset is on only with CUDA (rollout/sampling_parts.py decides it where the generator is built)
    if config.compile_decode_step is True and (
        config.static_decode is False or (config.static_decode is None and not launch.cuda)
    ):
        return COMPILE_NEEDS_STATIC
    return None


def _transformers_parts_with_vllm(config: LOOPConfig, launch: Launch) -> str | None:
    if not config.use_vllm or not _built_in(launch):
        return None
    if config.merge_adapter_for_sampling is True:
        return (
            "merge_adapter_for_sampling applies to the transformers backend; vLLM applies the LoRA adapter itself: "
            "remove merge_adapter_for_sampling or set use_vllm: false"
        )
    if config.static_decode is True or config.compile_decode_step is True:
        key = "static_decode" if config.static_decode is True else "compile_decode_step"
        return (
            f"{key} applies to the transformers backend; with use_vllm: true vLLM decodes with its own CUDA "
            f"graphs: remove {key} or set use_vllm: false"
        )
    return None


def _merge_needs_whole_weights(config: LOOPConfig, launch: Launch) -> str | None:
    if config.merge_adapter_for_sampling is True and not config.use_vllm and launch.zero_stage == 3:
        return MERGE_NEEDS_WHOLE_WEIGHTS
    return None


def _colocated_vllm_is_one_gpu(config: LOOPConfig, launch: Launch) -> str | None:
    if config.use_vllm and config.vllm_mode == "colocate" and config.vllm_tensor_parallel_size != 1:
        return COLOCATED_TP_ONLY
    return None


def _zero3_cannot_sample_with_the_training_model(config: LOOPConfig, launch: Launch) -> str | None:
    # Each decode step would be a collective forward, and episodes of different processes take different
    # numbers of turns and tokens: the processes would deadlock.
    if launch.zero_stage == 3 and launch.num_processes > 1 and _samples_with_training_model(config, launch):
        return (
            f"ZeRO-3 on {launch.num_processes} processes cannot sample with the training model (every forward is "
            "collective and episodes differ in length): set use_vllm: true, or use ZeRO-2/DDP"
        )
    return None


KL_COPY_NEEDS_WHOLE_WEIGHTS = (
    "beta > 0 with full fine-tuning keeps a frozen copy of the starting weights as the KL reference, which "
    "ZeRO-3's sharded weights do not allow: train a LoRA adapter (use_peft: true; the reference is then the base "
    "model with the adapter disabled), or set beta: 0"
)


def _kl_reference_copy_needs_whole_weights(config: LOOPConfig, launch: Launch) -> str | None:
    if config.beta > 0 and launch.lora is False and launch.zero_stage == 3:
        return KL_COPY_NEEDS_WHOLE_WEIGHTS
    return None


STALENESS_DEFAULT_CAP = 2.0
"""The cap of the weights toward the sampler when ``max_staleness`` > 0 and ``sampler_importance_cap`` is unset
(:data:`loop_trainer.training.update.STALE_IMPORTANCE_CAP`, which a test keeps equal to this)."""


def _sampler_correction_needs_its_bounds(config: LOOPConfig, launch: Launch) -> str | None:
    mode, cap, floor = config.sampler_correction, config.sampler_importance_cap, config.sampler_importance_floor
    if mode == "token_truncate" or config.max_staleness:  # the default, off without a bound; staleness caps at 2
        return None
    if cap is None and floor is None:
        return (
            f"sampler_correction: {mode} bounds the weights pi_old/pi_sampler, and no bound is set: set "
            "sampler_importance_cap (TRL's default is 3.0) and/or sampler_importance_floor, or remove "
            "sampler_correction"
        )
    if cap is None and mode.startswith("sequence"):
        return (
            f"sampler_correction: {mode} weighs a trajectory by the product of its token weights, unbounded above "
            "without a cap: set sampler_importance_cap (TRL's default is 3.0)"
        )
    return None


def _sampler_floor_below_the_cap(config: LOOPConfig, launch: Launch) -> str | None:
    floor = config.sampler_importance_floor
    cap = config.sampler_importance_cap
    if cap is None and config.max_staleness:
        cap = STALENESS_DEFAULT_CAP
    if floor is not None and cap is not None and floor >= cap:
        return (
            f"sampler_importance_floor ({floor}) must be below the cap of the weights toward the sampler ({cap}: "
            "sampler_importance_cap, or 2 with max_staleness): lower sampler_importance_floor or raise "
            "sampler_importance_cap"
        )
    return None


def _built_in(launch: Launch) -> bool:
    return launch.generator in (Generator.BUILT_IN, Generator.UNKNOWN)


RULES: tuple[Rule, ...] = (
    _overlap_with_colocated_vllm,
    _overlap_with_dynamic_sampling,
    _overlap_needs_a_generator_with_its_own_weights,
    _several_versions_on_a_server_need_adapters,
    _partial_rollouts_need_overlap_and_a_cut,
    _collection_process_needs_overlap_on_a_server,
    _offloading_needs_a_gpu,
    _compile_needs_static,
    _transformers_parts_with_vllm,
    _merge_needs_whole_weights,
    _colocated_vllm_is_one_gpu,
    _zero3_cannot_sample_with_the_training_model,
    _kl_reference_copy_needs_whole_weights,
    _sampler_correction_needs_its_bounds,
    _sampler_floor_below_the_cap,
)


def problems(config: LOOPConfig, launch: Launch) -> list[str]:
    """Every rule's refusal for ``config`` on ``launch``, in the order of :data:`RULES`."""
    return [problem for rule in RULES if (problem := rule(config, launch)) is not None]


def check_combinations(config: LOOPConfig, launch: Launch) -> None:
    """Raise :class:`ConfigCombinationError` with the first refusal, if any."""
    found = problems(config, launch)
    if found:
        raise ConfigCombinationError(found[0])
