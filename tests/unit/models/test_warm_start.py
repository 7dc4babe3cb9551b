"""The supervised warm-up trains on assistant replies and their end-of-turn token only, whatever
the tokenizer splits the reply header into (3 tokens in the tiny vocabulary, 4 in SmolLM2's)."""

from __future__ import annotations

import pytest

from loop_trainer.envs import VaultEnv
from loop_trainer.models.tiny import _assistant_masked_ids, build_word_tokenizer

CONVERSATION = [
    {"role": "system", "content": "tools : find open submit"},
    {"role": "user", "content": "fetch code of ann"},
    {"role": "assistant", "content": "find ann"},
    {"role": "user", "content": "ann id k3"},
    {"role": "assistant", "content": "open"},
]


def trained_spans(tokenizer, messages) -> list[str]:
    ids, mask = _assistant_masked_ids(tokenizer, messages)
    assert len(ids) == len(mask)
    assert ids == tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    spans, current = [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return [tokenizer.decode(span) for span in spans]


def test_the_tiny_tokenizer_trains_on_each_reply_and_its_end_of_turn():
    tokenizer = build_word_tokenizer(VaultEnv.vocabulary())
    assert trained_spans(tokenizer, CONVERSATION) == ["find ann <|im_end|>", "open <|im_end|>"]


def test_smollm2s_four_token_header_is_not_trained_on():
    from loop_trainer.models.packaged import PackagedModelError, resolve_model_path

    try:
        directory = resolve_model_path("packaged:smollm2-135m-instruct")
    except PackagedModelError as error:
        pytest.skip(f"packaged model unavailable: {error}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    header = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    opened = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False)
    assert len(tokenizer.encode(header)) - len(tokenizer.encode(opened)) == 4  # the case the old code got wrong
    assert trained_spans(tokenizer, CONVERSATION) == ["find ann<|im_end|>", "open<|im_end|>"]
