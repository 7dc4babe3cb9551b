"""Tiny models built from a config, with a word-level ChatML tokenizer: no download needed.

Used by the demo (``model_name_or_path: tiny:vault``) and the tests. The tokenizer knows the words
of one environment plus ChatML's special tokens, so a model of a few hundred thousand parameters
can learn that environment from scratch on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant", "tool")
PREFIX = "tiny:"


def build_word_tokenizer(words: Iterable[str]) -> PreTrainedTokenizerFast:
    """A word-level ChatML tokenizer over ``words`` (split on spaces; newlines are tokens)."""
    vocabulary: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, "<unk>", "\n", *ROLES, *words):
        vocabulary.setdefault(token, len(vocabulary))
    backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"), pre_tokenizers.Split(Regex(r" +"), behavior="removed")]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Qwen2ForCausalLM:
    """A small Qwen2 decoder (head_dim 32, as vLLM's CPU attention needs), randomly initialised."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    return model


def build_tiny_for_environment(words: Iterable[str], seed: int = 0) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    tokenizer = build_word_tokenizer(words)
    model = build_tiny_model(
        len(tokenizer), seed=seed, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model, tokenizer
