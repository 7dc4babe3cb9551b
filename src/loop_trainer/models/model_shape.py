"""The model shapes the memory plan (:mod:`.memory_plan`) computes with: a decoder's dimensions and
parameter counts, from a local config.json or from the shapes shipped in ``models/shapes/`` (counted on
a meta-device model: no weights, no GPU)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LinearLayer:
    """One ``nn.Linear`` of the model: its short name (as LoRA's ``target_modules`` names it) and shape."""

    name: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder: its dimensions (from the config) and its parameter counts
    (counted on the model transformers builds from that config, on the meta device)."""

    name: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    max_position_embeddings: int | None
    num_params: int
    """Every parameter once (tied input/output embeddings count once)."""
    embedding_params: int
    """The input embedding: the largest single tensor ZeRO-3 gathers."""
    layer_params: int
    """The largest decoder layer."""
    linear_layers: tuple[LinearLayer, ...]
    """Every linear layer but the output head: what ``all-linear`` LoRA adapts."""

    @classmethod
    def from_config(cls, config: dict[str, Any] | Any, name: str) -> ModelShape:
        """``config``: a config.json's contents or a transformers config."""
        import torch
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

        if not isinstance(config, PretrainedConfig):
            values = dict(config)
            model_type = values.pop("model_type", None)
            if not model_type:
                raise ValueError(f"memory plan: {name}'s config.json has no model_type")
            try:
                config = AutoConfig.for_model(model_type, **values)
            except (KeyError, ValueError) as error:
                raise ValueError(
                    f"memory plan: transformers does not know model_type {model_type!r} of {name}: {error}".replace(
                        "\n", " "
                    )
                ) from None
        text = config.get_text_config()  # multimodal configs nest the decoder
        try:
            with init_empty_weights(), _no_zero3_init():
                model = AutoModelForCausalLM.from_config(text)
        except (KeyError, ValueError) as error:
            raise ValueError(
                f"memory plan: transformers cannot build a causal LM from {name}'s config "
                f"(model_type {text.model_type!r}): {error}".replace("\n", " ")
            ) from None
        # init_empty_weights re-registers every parameter, which undoes the input/output embedding tie.
        model.tie_weights()
        output = model.get_output_embeddings()
        linears = tuple(
            LinearLayer(module_name.rsplit(".", 1)[-1], module.in_features, module.out_features)
            for module_name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not output
        )
        layer_lists = [
            m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == text.num_hidden_layers
        ]
        if not layer_lists:
            raise ValueError(
                f"memory plan: found no list of {text.num_hidden_layers} decoder layers in {type(model).__name__}"
            )
        heads = text.num_attention_heads
        return cls(
            name=name,
            model_type=text.model_type,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_hidden_layers=text.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            vocab_size=text.vocab_size,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            max_position_embeddings=getattr(text, "max_position_embeddings", None),
            num_params=sum(p.numel() for p in model.parameters()),
            embedding_params=model.get_input_embeddings().weight.numel(),
            layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in layer_lists[0]),
            linear_layers=linears,
        )

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each kind of linear layer, by short name."""
        return {layer.name: (layer.in_features, layer.out_features) for layer in self.linear_layers}

    def lora_params(self, r: int, target_modules: str | list[str]) -> int:
        """r x (in + out) per targeted linear layer ("all-linear": every one but the output head)."""
        known = self.linear_shapes()
        targets = set(known) if target_modules == "all-linear" else {t.split(".")[-1] for t in target_modules}
        unknown = sorted(targets - set(known))
        if unknown:
            raise ValueError(
                f"memory plan: unknown LoRA target_modules {unknown}; use 'all-linear' or names from {sorted(known)}"
            )
        return sum(
            r * (layer.in_features + layer.out_features) for layer in self.linear_layers if layer.name in targets
        )

    def kv_bytes_per_token(self, tensor_parallel_size: int = 1, dtype_bytes: int = 2) -> int:
        """K and V, every layer: 2 x layers x kv_heads x head_dim x bytes (heads split over TP ranks,
        replicated when TP exceeds the KV-head count)."""
        kv_heads = max(1, self.num_key_value_heads // tensor_parallel_size)
        return 2 * self.num_hidden_layers * kv_heads * self.head_dim * dtype_bytes


@contextlib.contextmanager
def _no_zero3_init() -> Iterator[None]:
    """Build the counted model outside DeepSpeed's ``zero.Init``: under a ZeRO-3 launch the training arguments register
    DeepSpeed's config with transformers, whose ``from_config`` would then partition the meta-device model (and start
    a process group to do it). ``set_zero3_state`` is transformers' own guard against a nested ``zero.Init``."""
    try:
        from transformers.modeling_utils import set_zero3_state
    except ImportError:  # a transformers without the guard: nothing to guard against either
        yield
        return
    with set_zero3_state():
        yield


def shipped_shapes() -> list[str]:
    folder = resources.files("loop_trainer") / "models" / "shapes"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_model_shape(name_or_path: str) -> ModelShape:
    """A local directory's config.json, else the shipped shape named like the model id's last part
    ("Qwen/Qwen2.5-7B-Instruct" -> models/shapes/Qwen2.5-7B-Instruct.json)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"memory plan: {name_or_path!r} is a directory without config.json; pass the model's directory"
            )
        return ModelShape.from_config(json.loads((path / "config.json").read_text()), path.name)
    key = str(name_or_path).rstrip("/").split("/")[-1]
    matches = [n for n in shipped_shapes() if n.lower() == key.lower()]
    if not matches:
        raise ValueError(
            f"memory plan: no model shape for {name_or_path!r}; shipped shapes: {', '.join(shipped_shapes())}; "
            "or pass a local directory containing the model's config.json"
        )
    text = (resources.files("loop_trainer") / "models" / "shapes" / f"{matches[0]}.json").read_text()
    return ModelShape.from_config(json.loads(text), matches[0])
