"""The offline Qwen2.5-Instruct tokenizer, which the package builds for ``tiny-chat:qwen2.5``
(:mod:`loop_trainer.models.tiny_chat`): re-exported for the tests that use it directly."""

from loop_trainer.models.tiny_chat import (
    CACHE_VERSION,
    QWEN2_PRETOKENIZE_REGEX,
    QWEN25_ADDED_TOKENS,
    QWEN25_DEFAULT_SYSTEM_PROMPT,
    build_qwen25_tokenizer,
)

__all__ = [
    "CACHE_VERSION",
    "QWEN2_PRETOKENIZE_REGEX",
    "QWEN25_ADDED_TOKENS",
    "QWEN25_DEFAULT_SYSTEM_PROMPT",
    "build_qwen25_tokenizer",
]
