"""The supervised warm-up trains on assistant replies and their end-of-turn token only, whatever
the tokenizer splits the reply header into (3 tokens in the tiny vocabulary, 4 in SmolLM2's)."""

from __future__ import annotations

import pytest

from loop_trainer.envs import VaultEnv
from loop_trainer.models.tiny import assistant_masked_ids, build_word_tokenizer

CONVERSATION = [
    {"role": "system", "content": "tools : find open submit"},
    {"role": "user", "content": "fetch code of ann"},
    {"role": "assistant", "content": "find ann"},
    {"role": "user", "content": "ann id k3"},
    {"role": "assistant", "content": "open"},
]


def trained_spans(tokenizer, messages) -> list[str]:
    ids, mask = assistant_masked_ids(tokenizer, messages)
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


def by_prefix(tokenizer, messages) -> tuple[list[int], list[int]]:
    """The definition, brute force: encode every prefix of the conversation and take what each message adds."""
    ids: list[int] = []
    mask: list[int] = []
    for end in range(1, len(messages) + 1):
        new = tokenizer.encode(tokenizer.apply_chat_template(messages[:end], tokenize=False), add_special_tokens=False)
        new = new[len(ids) :]
        if messages[end - 1]["role"] == "assistant":
            opened = tokenizer.apply_chat_template(messages[: end - 1], tokenize=False, add_generation_prompt=True)
            header = len(tokenizer.encode(opened, add_special_tokens=False)) - len(ids)
            mask.extend([0] * header + [1] * (len(new) - header - 1) + [0])
        else:
            mask.extend([0] * len(new))
        ids.extend(new)
    return ids, mask


@pytest.mark.parametrize("name,tokenizer_of", [("vault", "tiny"), ("errands", "tiny"), ("errands", "smollm2")])
def test_one_pass_over_a_conversation_masks_what_encoding_every_prefix_does(name, tokenizer_of):
    from loop_trainer.envs import make_environment

    env = make_environment(name, num_tasks=8)
    if tokenizer_of == "tiny":
        tokenizer = build_word_tokenizer(env.vocabulary())
    else:  # a byte-level BPE with its own template: offsets of merged tokens, a 4-token header
        from transformers import AutoTokenizer

        from loop_trainer.models.packaged import PackagedModelError, resolve_model_path

        try:
            tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("packaged:smollm2-135m-instruct"))
        except PackagedModelError as error:
            pytest.skip(f"packaged model unavailable: {error}")
    conversations = env.demonstrations(12, seed=3)
    assert max(len(c) for c in conversations) >= 7  # several replies each
    for messages in conversations:
        assert assistant_masked_ids(tokenizer, messages) == by_prefix(tokenizer, messages)
