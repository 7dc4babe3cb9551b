"""The policy LOOPTrainer trains: a model loaded from an id (ZeRO-3-aware), its tokenizer, the LoRA
adapter, and TRL's fused log-prob head.

``LOOPConfig`` is a ``TrainingArguments``: when it names a DeepSpeed ZeRO-3 config (or ``accelerate launch``
set one), constructing it registers that config with transformers (``HfDeepSpeedConfig``), so
``from_pretrained`` below loads the weights already partitioned across the processes. That is why the
config is built before the model, never after.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoProcessor, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin
from trl.trainer import add_fused_lm_head

from ..config import LOOPConfig, mapping_setting
from ..envs.base import Environment
from ..evaluation import GreedySuccessOnTrainingTasks
from ..models.packaged import resolve_model_path
from ..models.tiny import INSTRUCT_PREFIX, build_tiny_from_spec, is_tiny_spec, warm_up_is_probed
from .activation_checkpointing import get_peft_model, update_checkpointing_kwargs
from .reference import AdapterDisabled, ReferencePolicy, frozen_copy
from .settings import episode_settings

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_model(name: str, args: LOOPConfig, quantization_config: Any = None) -> PreTrainedModel:
    """``from_pretrained(name, **args.model_init_kwargs)``: float32 unless ``dtype`` says otherwise; on one
    device of this process (DDP and DeepSpeed place it themselves)."""
    kwargs = mapping_setting(args.model_init_kwargs, "model_init_kwargs")
    dtype = kwargs.get("dtype", "float32")
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"model_init_kwargs: dtype must be 'auto' or one of {', '.join(DTYPES)}, got {dtype!r}")
        kwargs["dtype"] = DTYPES[dtype]
    if quantization_config is not None:
        if "quantization_config" in kwargs:
            raise ValueError("quantization_config is given both to LOOPTrainer and in model_init_kwargs: give it once")
        kwargs["quantization_config"] = quantization_config
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    if "device_map" not in kwargs:
        distributed = args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED")
        kwargs["device_map"] = None if distributed or PartialState().device.type in ("cpu", "mps") else "auto"
    return AutoModelForCausalLM.from_pretrained(name, **kwargs)


def load_tokenizer(model: PreTrainedModel, processing_class: Any = None) -> PreTrainedTokenizerBase:
    """The tokenizer (given, or the model's own); a pad token (the EOS token where there is none) that the
    model's config and generation config agree on."""
    if processing_class is None:
        processing_class = AutoProcessor.from_pretrained(model.config._name_or_path, padding_side="left")
    tokenizer = processing_class.tokenizer if isinstance(processing_class, ProcessorMixin) else processing_class
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(
            f"processing_class must be a tokenizer (or a processor holding one), got {type(processing_class).__name__}"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def build_tiny_model(
    name: str, env: Environment, args: LOOPConfig, report: Callable[[str], None] | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and word tokenizer a ``tiny:<env>`` / ``tiny-instruct:<env>`` spec names, built for ``env``
    with the run's seed, ``env_timeout`` and ``tiny_instruct_steps`` (the warm-up's progress goes to ``report``,
    default the log); a warm-up until fitted where ``env`` names a ``warm_up_success`` probes greedy success on
    its training tasks under the run's episode limits. The same model from the Python API and ``loop-train``."""
    return build_tiny_from_spec(
        name,
        env,
        seed=args.seed,
        env_timeout=args.env_timeout,
        warm_up_steps=args.tiny_instruct_steps,
        report=report,
        greedy_success=GreedySuccessOnTrainingTasks(env, args),
    )


def tiny_lora_base(model: str | PreTrainedModel, env: Environment, args: LOOPConfig, peft_config: Any) -> Any:
    """Where ``model`` is a tiny spec that a LoRA adapter (``peft_config``) trains on, what :func:`build_tiny_model`
    builds its weights from besides the environment and its code: the run's ``seed``, a ``tiny-instruct:`` model's
    ``tiny_instruct_steps`` and, where a greedy probe ends its warm-up, the episode settings the probe runs under;
    else None. The run records it (``resume.TINY_BASE``): its checkpoints hold only the adapter, and a resume builds
    the base again."""
    if not isinstance(model, str) or not is_tiny_spec(model) or peft_config is None:
        return None
    inputs: dict[str, Any] = {"seed": args.seed}
    if model.startswith(INSTRUCT_PREFIX):
        inputs["tiny_instruct_steps"] = args.tiny_instruct_steps
    if warm_up_is_probed(model, env, args.tiny_instruct_steps):
        inputs.update(dataclasses.asdict(episode_settings(args)))
    return inputs


def load_policy(
    model: str | PreTrainedModel,
    args: LOOPConfig,
    processing_class: Any = None,
    quantization_config: Any = None,
    peft_config: Any = None,
    env: Environment | None = None,
) -> tuple[Any, PreTrainedTokenizerBase, ReferencePolicy | None]:
    """The model LOOPTrainer trains (loaded if ``model`` is an id, then :func:`wrap_for_training`), its
    tokenizer (:func:`load_tokenizer`) and, when ``beta > 0``, the KL penalty's reference policy
    (:mod:`.reference`: the adapter disabled, or a frozen copy of the starting weights without one).
    ``model`` may be any name ``loop-train`` takes: an id or directory, ``packaged:<model>``
    (:mod:`loop_trainer.models.packaged`), or ``tiny:<env>`` / ``tiny-instruct:<env>``
    (:mod:`loop_trainer.models.tiny`, built for ``env``)."""
    if isinstance(model, str) and is_tiny_spec(model):
        for given, what in ((processing_class, "processing_class"), (quantization_config, "quantization_config")):
            if given is not None:
                raise ValueError(f"'{model}' is built with its own word tokenizer in float32: give it no {what}")
        if env is None:
            raise ValueError(f"'{model}' is built for an environment: give LOOPTrainer the environment too")
        model, processing_class = build_tiny_model(model, env, args)
    elif isinstance(model, str):
        model = load_model(resolve_model_path(model), args, quantization_config)
    elif quantization_config is not None:
        raise ValueError(
            "quantization_config applies when LOOPTrainer loads the model from an id; this model is already loaded"
        )
    tokenizer = load_tokenizer(model, processing_class)
    adapter = peft_config is not None or hasattr(model, "disable_adapter")
    reference: ReferencePolicy | None = None
    if args.beta > 0 and not adapter:  # copied before the policy gets its fused head
        reference = frozen_copy(model, args.temperature, zero3=is_zero3(args))
    policy = wrap_for_training(model, args, peft_config)
    if args.beta > 0 and adapter:
        reference = AdapterDisabled(policy)
    return policy, tokenizer, reference


def wrap_for_training(model: PreTrainedModel, args: LOOPConfig, peft_config: Any = None) -> Any:
    """Add the fused log-prob head (at the sampling temperature), then the LoRA adapter; switch dropout off
    if asked. ZeRO-3 with checkpointing and an adapter needs reentrant checkpointing (as in TRL)."""
    # Per-token log-probs without [tokens x vocab] logits: model(..., labels=..., fused_lm_head=True).
    add_fused_lm_head(model, temperature=args.temperature, outputs=("log_probs", "entropy"))
    zero3 = is_zero3(args)
    policy: Any = model  # the model, or the PeftModel around it
    if peft_config is not None:
        from peft import PeftConfig

        if not isinstance(peft_config, PeftConfig):
            raise TypeError(
                f"peft_config must be a peft.PeftConfig (e.g. peft.LoraConfig), got {type(peft_config).__name__}"
            )
        if hasattr(model, "peft_config"):
            raise ValueError(
                "LOOPTrainer got a PeftModel and a peft_config: merge the existing adapter first, or give "
                "the base model with the peft_config"
            )
        quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
        # The adapter's initial weights are drawn (LoRA's A matrices) before Trainer seeds the run: seeded here,
        # they are the run's seed's, not whatever the random state was (two runs of one seed would start apart).
        # On a random state of their own: the caller's is left as it was.
        devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(args.seed)
            if zero3 and not quantized:
                policy = get_peft_model(model, peft_config, autocast_adapter_dtype=False)
            else:
                policy = get_peft_model(model, peft_config)
    if hasattr(policy, "peft_config") and args.activation_checkpointing:
        if zero3:
            update_checkpointing_kwargs(args, use_reentrant=True)
        policy.enable_input_require_grads()  # the frozen embeddings' outputs need grads for checkpointed layers
    if args.disable_dropout:
        for module in policy.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    warn_of_active_dropout(policy)
    return policy


def is_zero3(args: LOOPConfig) -> bool:
    return args.deepspeed_plugin is not None and args.deepspeed_plugin.zero_stage == 3


def warn_of_active_dropout(policy: torch.nn.Module) -> None:
    """One line when the policy trains with dropout on. The old policy's log-probs (and the sampler's) are taken
    without dropout, the update's with it, so the PPO ratio is not 1 on policy and clipping acts on noise. PEFT's
    ``lora_dropout`` (TRL's default 0.05) is the usual source: it grows with the adapter. Measured on ``errands``
    (LoRA r 32, rate 1e-3): RLOO's single on-policy step, whose ratio should be exactly 1, clipped 0 % of the
    trajectories at iteration 1, 6 % at 7 and 10-20 % from 13 on (docs/long-horizon.md)."""
    rates = [module.p for module in policy.modules() if isinstance(module, torch.nn.Dropout) and module.p > 0]
    if rates:
        logger.warning(
            "%d dropout layers are on (p up to %g, e.g. the adapter's lora_dropout): the PPO ratio compares a "
            "dropout forward with the dropout-free old policy, so it is not 1 on policy; set disable_dropout: true "
            "(or lora_dropout: 0)",
            len(rates),
            max(rates),
        )
