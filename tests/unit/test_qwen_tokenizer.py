"""The offline Qwen2.5 tokenizer matches the real one on ids, specials and chat format."""

from __future__ import annotations

from pathlib import Path

import pytest
import regex
from transformers import PreTrainedTokenizerFast

from support.qwen import (
    CACHE_VERSION,
    QWEN2_PRETOKENIZE_REGEX,
    QWEN25_ADDED_TOKENS,
    QWEN25_DEFAULT_SYSTEM_PROMPT,
    build_qwen25_tokenizer,
)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("qwen-tokenizer-cache")


@pytest.fixture(scope="session")
def tokenizer(cache_dir: Path) -> PreTrainedTokenizerFast:
    """The copy loaded back from the cache, which is what callers normally get."""
    build_qwen25_tokenizer(cache_dir)
    return build_qwen25_tokenizer(cache_dir)


def test_cache_folder_is_versioned(tokenizer: PreTrainedTokenizerFast, cache_dir: Path) -> None:
    assert sorted(p.name for p in cache_dir.iterdir()) == [CACHE_VERSION]
    assert (cache_dir / CACHE_VERSION / "tokenizer.json").is_file()


def test_vocab_size_and_special_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    assert len(tokenizer) == 151_665
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 151_643
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 151_644
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 151_645
    assert tokenizer.convert_tokens_to_ids("<|file_sep|>") == 151_664
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [151_644, 872, 151_645]


def test_added_tokens_have_qwen_ids_and_flags(tokenizer: PreTrainedTokenizerFast) -> None:
    decoder = tokenizer.added_tokens_decoder
    for offset, (content, special) in enumerate(QWEN25_ADDED_TOKENS):
        added = decoder[151_643 + offset]
        assert (added.content, added.special) == (content, special)


def test_named_special_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 151_645
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.pad_token_id == 151_643
    assert tokenizer.bos_token is None
    assert tokenizer.model_max_length == 131_072


def test_skip_special_tokens_keeps_non_special_added_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("<|im_start|>x<tool_call>y<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "x<tool_call>y"


def test_known_qwen_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.encode("Hello world") == [9707, 1879]
    assert tokenizer.encode("\n") == [198]
    assert tokenizer.encode("\n\n") == [271]


def test_non_ascii_round_trip(tokenizer: PreTrainedTokenizerFast) -> None:
    for text in ("你好", "naïve café ☕", "Ünïcödé\n\tmixed 你好 🙂"):
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_nfc_normalisation(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.encode("cafe\u0301") == tokenizer.encode("caf\u00e9")


def test_digits_are_split_one_by_one(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("12345")
    assert len(ids) == 5
    assert [tokenizer.decode([i]) for i in ids] == list("12345")


@pytest.mark.parametrize(
    "text", ["a\n\nb", "a\n\n b", "x  \n\n\n  y", "line1\r\nline2", "don't stop 42!!\n", "  lead  trail  "]
)
def test_pretokenisation_follows_qwen2_regex(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    pieces = [piece for piece, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    expected = regex.findall(QWEN2_PRETOKENIZE_REGEX, text)
    byte_level = tokenizer.backend_tokenizer.decoder
    assert [byte_level.decode([p]) for p in pieces] == expected
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_injects_default_system_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == (
        f"<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_uses_given_system_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}],
        add_generation_prompt=False,
        tokenize=False,
    )
    assert rendered == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_cached_copy_matches_fresh_build(tokenizer: PreTrainedTokenizerFast) -> None:
    fresh = build_qwen25_tokenizer()
    text = '<|im_start|>user\nRésumé: 3.14 — 你好 <tool_call>{"a": 1}</tool_call><|im_end|>\n\n'
    assert fresh.encode(text) == tokenizer.encode(text)
    assert fresh.get_vocab() == tokenizer.get_vocab()
    assert fresh.chat_template == tokenizer.chat_template
    assert (fresh.eos_token, fresh.pad_token, fresh.padding_side) == (
        tokenizer.eos_token,
        tokenizer.pad_token,
        tokenizer.padding_side,
    )
