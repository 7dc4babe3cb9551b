"""Publishing to the Hub: the model card and the uploaded file set, without network.

The Hub is faked at the HTTP layer: huggingface_hub (2.x, on ``httpx2``) gets a client whose
transport is an ``httpx2.MockTransport`` answering the endpoints an upload uses (create repo,
validate the card's YAML, preupload, LFS batch, commit). The real ``HfApi.create_commit`` code
runs: upload modes, LFS hashing, the commit payload; the tests read back what it sent.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import shutil
import threading
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
import torch
import yaml
from huggingface_hub.utils._http import default_client_factory

from loop_trainer.config import LOOPConfig
from loop_trainer.publishing import hub
from loop_trainer.training.settings import card_settings

REPO = "loop-user/vault-loop"
TOKEN = "hf_fake_token_for_tests"
LFS_SUFFIXES = (".safetensors", ".png")
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
EXTRAS = {"README.md", "recipe.yaml", "metrics.jsonl", "learning_curve.png"}
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}
# The latest evaluation as the trainer passes it: the environment's summary, whatever it reports.
EVAL = {
    "split": "dev",
    "iteration": 10,
    "metrics": {"success_rate": 0.4, "tgc": 41.2, "sgc": 20.0, "tgc_difficulty_1": 66.7, "sgc_difficulty_2": 0.0},
}
HISTORY = [
    {"iteration": 1, "reward_mean": 0.125},
    {"iteration": 2, "reward_mean": 0.25},
    {"iteration": 3, "reward_mean": 0.5},
]


# ------------------------------------------------------------------------------------------------
# A fake Hub at the HTTP layer
# ------------------------------------------------------------------------------------------------
class FakeHub:
    def __init__(self):
        self.requests: list[tuple[str, str]] = []
        self.created: list[dict] = []
        self.commits: list[dict] = []
        self.lfs_batches: list[dict] = []
        self.auth: set[str | None] = set()
        self.preupload_gate: threading.Event | None = None

    def handler(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        self.requests.append((request.method, path))
        self.auth.add(request.headers.get("authorization"))
        if request.method == "POST" and path == "/api/repos/create":
            body = json.loads(request.content)
            self.created.append(body)
            return httpx2.Response(200, json={"url": f"https://huggingface.co/{body['organization']}/{body['name']}"})
        if request.method == "POST" and path == "/api/validate-yaml":
            body = json.loads(request.content)
            yaml.safe_load(body["content"].split("---")[1])  # the front matter must parse
            return httpx2.Response(200, json={"errors": [], "warnings": []})
        if request.method == "POST" and path.startswith(f"/api/models/{REPO}/preupload/"):
            if self.preupload_gate is not None:
                assert self.preupload_gate.wait(30), "the test never opened the gate"
            files = json.loads(request.content)["files"]
            return httpx2.Response(
                200,
                json={
                    "files": [
                        {
                            "path": f["path"],
                            "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES) else "regular",
                            "shouldIgnore": False,
                            "oid": None,
                        }
                        for f in files
                    ]
                },
            )
        if request.method == "POST" and path == f"/{REPO}.git/info/lfs/objects/batch":
            body = json.loads(request.content)
            self.lfs_batches.append(body)
            # No "actions": the Hub already has these objects, so nothing is PUT anywhere.
            return httpx2.Response(
                200,
                json={"transfer": "basic", "objects": [{"oid": o["oid"], "size": o["size"]} for o in body["objects"]]},
            )
        if request.method == "POST" and path.startswith(f"/api/models/{REPO}/commit/"):
            lines = [json.loads(line) for line in request.content.decode().splitlines() if line.strip()]
            commit = {"revision": path.rsplit("/", 1)[-1], "header": lines[0]["value"], "files": {}, "lfs": {}}
            for line in lines[1:]:
                if line["key"] == "file":
                    commit["files"][line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                elif line["key"] == "lfsFile":
                    commit["lfs"][line["value"]["path"]] = line["value"]
                else:
                    raise AssertionError(f"unexpected commit operation {line['key']}")
            self.commits.append(commit)
            oid = f"{len(self.commits):040x}"
            return httpx2.Response(
                200, json={"commitUrl": f"https://huggingface.co/{REPO}/commit/{oid}", "commitOid": oid}
            )
        return httpx2.Response(404, json={"error": f"FakeHub: no route for {request.method} {path}"})

    @property
    def last_paths(self) -> set[str]:
        commit = self.commits[-1]
        return set(commit["files"]) | set(commit["lfs"])


@pytest.fixture()
def fake_hub(monkeypatch):
    fake = FakeHub()
    # The fake's client has no offline-mode hook, so HF_HUB_OFFLINE=1 (conftest) stays set: any
    # request that escaped the fake would still be refused. hf_xet would talk to its own servers:
    # use the plain LFS protocol, which goes through the faked client.
    # (hf_api's upload_folder would take hf_xet's pipeline too: keep it off should anything call it.)
    monkeypatch.setattr(huggingface_hub._commit_api, "is_xet_available", lambda: False)
    monkeypatch.setattr(huggingface_hub.hf_api, "is_xet_available", lambda: False)
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(fake.handler)))
    try:
        yield fake
    finally:
        huggingface_hub.set_client_factory(default_client_factory)


# ------------------------------------------------------------------------------------------------
# A run's output folder: tiny model with a LoRA adapter, its tokenizer, and the junk a run leaves
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loop_trainer.envs import VaultEnv
    from loop_trainer.models.tiny import build_tiny_for_environment

    root = tmp_path_factory.mktemp("built")
    model, tokenizer = build_tiny_for_environment(VaultEnv(num_tasks=16).vocabulary(), seed=0)
    base_dir = root / "base"
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)  # so the adapter config names its base
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapter_dir = root / "adapter-run"
    peft_model.save_pretrained(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)
    return {
        "base_dir": base_dir,
        "adapter_dir": adapter_dir,
        "peft_model": peft_model.eval(),
        "peft_config": peft_model.peft_config["default"],
    }


def add_run_outputs(folder: Path) -> None:
    """What a LOOP run leaves next to the model: metrics, curve, checkpoints, rollouts, ..."""
    (folder / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in HISTORY))
    (folder / "learning_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"curve" * 100)
    (folder / "training_args.bin").write_bytes(b"pickle")
    for junk in (
        "checkpoint-1/optimizer.pt",
        "checkpoint-1/adapter_model.safetensors",
        "checkpoint-1/rng_state.pth",
        ".staging-checkpoint/checkpoint-2/scheduler.pt",
        "rollouts/iteration-00001.jsonl",
        "viewer/iteration-00001.html",
        "runs/events.out.tfevents",
        "appworld-servers/log.txt",
    ):
        (folder / junk).parent.mkdir(parents=True, exist_ok=True)
        (folder / junk).write_bytes(b"junk")
    (folder / "optimizer.pt").write_bytes(b"junk")


@pytest.fixture()
def run_dir(built, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(built["adapter_dir"], folder)
    add_run_outputs(folder)
    return folder


def loop_args(tmp_path) -> LOOPConfig:
    return LOOPConfig(
        output_dir=str(tmp_path / "args"),
        iterations=10,
        tasks_per_iteration=8,
        rollouts_per_task=4,
        minibatch_size=16,
        ppo_epochs=3,
        epsilon=0.2,
        learning_rate=3e-5,
        max_grad_norm=0.5,
        max_turns=12,
        max_new_tokens_per_turn=64,
        max_trajectory_tokens=2048,
        train_split="train",
        seed=7,
        report_to="none",
        disable_tqdm=True,
    )


def card_kwargs(tmp_path, built, **overrides):
    recipe = tmp_path / "my-recipe.yaml"
    recipe.write_text("model_name_or_path: Qwen/Qwen2.5-7B-Instruct\nenvironment: vault\niterations: 10\n")
    kwargs = {
        "base_model": "Qwen/Qwen2.5-7B-Instruct",
        "hub_model_id": REPO,
        "settings": card_settings(loop_args(tmp_path)),
        "peft_config": built["peft_config"],
        "environment": "vault",
        "iterations_done": 3,
        "history": HISTORY,
        "eval_metrics": EVAL,
        "recipe_path": recipe,
    }
    kwargs.update(overrides)
    return kwargs


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------
# The card
# ------------------------------------------------------------------------------------------------
def test_model_card_content(tmp_path, built, run_dir):
    path = hub.write_model_card(run_dir, **card_kwargs(tmp_path, built))
    text = path.read_text()
    meta = front_matter(text)
    assert path == run_dir / "README.md"
    assert meta["base_model"] == "Qwen/Qwen2.5-7B-Instruct"
    assert meta["library_name"] == "peft"
    assert meta["pipeline_tag"] == "text-generation"
    assert {"trl", "loop", "reinforcement-learning", "lora", "vault"} <= set(meta["tags"])
    assert "license" not in meta
    # results: the environment's evaluation summary as reported, in its order, and the training reward
    assert "Latest evaluation: split `dev`, after iteration 10, as the `vault` environment summarises it." in text
    rows = [
        "| `success_rate` | 0.4 |",
        "| `tgc` | 41.2 |",
        "| `sgc` | 20.0 |",
        "| `tgc_difficulty_1` | 66.7 |",
        "| `sgc_difficulty_2` | 0.0 |",
    ]
    assert all(row in text for row in rows) and sorted(rows, key=text.index) == rows
    assert "not evaluated" not in text and "TGC" not in text  # nothing AppWorld-specific in the card's prose
    assert "0.500 at iteration 3 (from 0.125 at iteration 1)" in text
    assert "for 3 LOOP iterations (of 10 planned)" in text and "`vault` environment" in text
    # the run's LOOP settings with the paper's values, and the adapter's
    for row in (
        "| `rollouts_per_task` | 4 | 6 |",
        "| `tasks_per_iteration` | 8 | 40 |",
        "| `minibatch_size` | 16 | 32 |",
        "| `ppo_epochs` | 3 | 2 |",
        "| `epsilon` | 0.2 | 0.1 |",
        "| `learning_rate` | 3e-05 | 5e-05 |",
        "| `max_grad_norm` | 0.5 | 0.1 |",
        "| `weight_decay` | 0.01 | 0.01 |",
        "| `iterations` | 10 | 200 |",
        "| `train_split` | train |  |",
        "| `max_turns` | 12 | 40 |",
        "| `max_new_tokens_per_turn` | 64 | 1500 |",
        "| `max_trajectory_tokens` | 2048 | 32768 |",
        "| `seed` | 7 |  |",
        "| `early_stop_done_fraction` | 1.0 | 0.9 |",
        "| `max_concurrent_episodes` | 256 |  |",
        "| `r` | 4 |",
        "| `target_modules` | `q_proj`, `v_proj` |",
    ):
        assert row in text, row
    # inherited trainer fields LOOP does not use, and local paths, stay out
    assert "| `vllm_sync_dir` |" not in text and "| `output_dir` |" not in text and "| `beta` |" not in text
    # loading with PEFT, serving with vLLM
    assert f'PeftModel.from_pretrained(base, "{REPO}")' in text
    assert 'AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-7B-Instruct"' in text
    assert f'AutoPeftModelForCausalLM.from_pretrained("{REPO}"' in text
    assert "vllm serve Qwen/Qwen2.5-7B-Instruct --enable-lora --max-lora-rank 8" in text
    assert f"--lora-modules vault-loop={REPO}" in text
    assert 'LLM(model="Qwen/Qwen2.5-7B-Instruct", enable_lora=True' in text
    assert 'LoRARequest("vault-loop", 1, adapter)' in text
    # recipe, curve, citations
    assert (run_dir / "recipe.yaml").read_text().startswith("model_name_or_path: Qwen/Qwen2.5-7B-Instruct")
    assert "loop-train --config recipe.yaml" in text
    assert "![Learning curve](learning_curve.png)" in text
    assert "arXiv:2502.01600" in text and "arxiv.org/abs/2502.01600" in text
    assert "Reinforcement Learning for Long-Horizon Interactive LLM Agents" in text
    assert "vonwerra2020trl" in text
    assert "{{ " not in text and "{%" not in text  # all rendered (BibTeX keeps its own {{...}})


def test_model_card_not_evaluated_and_local_base(tmp_path):
    args = LOOPConfig(output_dir=str(tmp_path / "args"), report_to="none", disable_tqdm=True)
    text = hub.write_model_card(
        tmp_path / "out",
        base_model="tiny:vault",
        hub_model_id=None,
        settings=card_settings(args),
        peft_config=None,
        environment="vault",
        iterations_done=0,
        history=[],
        eval_metrics=None,
        recipe_path=None,
        license="apache-2.0",
    ).read_text()
    meta = front_matter(text)
    assert "base_model" not in meta  # not a Hub id: named in the text only
    assert meta["library_name"] == "transformers" and meta["license"] == "apache-2.0"
    assert "**not evaluated**" in text
    assert "| `rollouts_per_task` | 6 | 6 |" in text and "| `learning_rate` | 5e-05 | 5e-05 |" in text  # the defaults
    assert "vllm serve <user>/out" in text and "PeftModel" not in text
    assert "Mean training reward" not in text and "recipe.yaml" not in text
    assert not (tmp_path / "out" / "recipe.yaml").exists()


def test_card_follows_the_config_and_any_environment_summary(tmp_path):
    """The settings table is read off the config (a field LOOP gains shows up by itself) and the
    results table shows whatever the environment's summary reports."""

    @dataclasses.dataclass
    class MazeConfig(LOOPConfig):
        maze_size: int = 9

    args = MazeConfig(output_dir=str(tmp_path / "args"), report_to="none", disable_tqdm=True, minibatch_size=8)
    summary = {"split": "val", "iteration": 4, "metrics": {"solved": 0.125, "steps_mean": 17.5}}
    text = hub.write_model_card(
        tmp_path / "out", base_model=None, settings=card_settings(args), environment="maze", eval_metrics=summary
    ).read_text()
    assert "| `maze_size` | 9 |  |" in text and "| `minibatch_size` | 8 | 32 |" in text
    assert "| `solved` | 0.125 |" in text and "| `steps_mean` | 17.5 |" in text
    with pytest.raises(ValueError, match="eval_metrics must be .*got keys \\['iteration', 'split', 'tgc'\\]"):
        hub.write_model_card(
            tmp_path / "out",
            base_model=None,
            settings=card_settings(args),
            eval_metrics={"split": "dev", "iteration": 1, "tgc": 41.2},
        )


# ------------------------------------------------------------------------------------------------
# The upload
# ------------------------------------------------------------------------------------------------
def test_upload_file_set_is_a_whitelist(run_dir):
    (run_dir / "README.md").write_text("---\nlibrary_name: peft\n---\n")
    (run_dir / "recipe.yaml").write_text("iterations: 1\n")
    assert set(hub.upload_file_set(run_dir)) == ADAPTER_FILES | TOKENIZER_FILES | EXTRAS


def test_push_uploads_adapter_tokenizer_card_and_run_files(tmp_path, built, run_dir, fake_hub):
    hub.write_model_card(run_dir, **card_kwargs(tmp_path, built))
    info = hub.upload_folder_contents(
        run_dir, repo_id=REPO, token=TOKEN, private=True, commit_message="End of training"
    )
    assert info.oid == f"{1:040x}" and info.commit_message == "End of training"
    assert fake_hub.created == [{"name": "vault-loop", "organization": "loop-user", "visibility": "private"}]
    assert fake_hub.auth == {f"Bearer {TOKEN}"}
    assert len(fake_hub.commits) == 1
    commit = fake_hub.commits[0]
    assert commit["revision"] == "main" and commit["header"]["summary"] == "End of training"
    assert fake_hub.last_paths == ADAPTER_FILES | TOKENIZER_FILES | EXTRAS
    # LFS files are committed by hash, the rest inline: both are the local files
    assert set(commit["lfs"]) == {"adapter_model.safetensors", "learning_curve.png"}
    for name, pointer in commit["lfs"].items():
        assert pointer["oid"] == sha256(run_dir / name) and pointer["size"] == (run_dir / name).stat().st_size
    for name, content in commit["files"].items():
        assert content == (run_dir / name).read_bytes(), name
    assert "{% for message in messages %}" in commit["files"]["chat_template.jinja"].decode()
    assert b"41.2" in commit["files"]["README.md"]
    uploaded = " ".join(fake_hub.last_paths)
    for junk in ("checkpoint", "optimizer", "rollouts", "viewer", "runs", "appworld", ".pt", "training_args"):
        assert junk not in uploaded


def test_push_merged_weights(tmp_path, built, run_dir, fake_hub):
    hub.write_model_card(run_dir, **card_kwargs(tmp_path, built))
    info = hub.upload_folder_contents(
        run_dir, repo_id=REPO, token=TOKEN, merge_adapter=True, card_kwargs=card_kwargs(tmp_path, built)
    )
    assert info.oid
    merged = run_dir / "merged"
    assert (
        fake_hub.last_paths == {"model.safetensors", "config.json", "generation_config.json"} | TOKENIZER_FILES | EXTRAS
    )
    commit = fake_hub.commits[-1]
    assert commit["lfs"]["model.safetensors"]["oid"] == sha256(merged / "model.safetensors")
    card = commit["files"]["README.md"].decode()
    meta = front_matter(card)
    assert meta["library_name"] == "transformers" and "lora" not in meta["tags"]
    assert "LoRA adapter\nmerged in" in card or "LoRA adapter merged in" in card.replace("\n", " ")
    assert f"vllm serve {REPO}" in card and "--enable-lora" not in card
    assert "| `r` | 4 |" in card and "| `tgc` | 41.2 |" in card
    # the merged weights compute what base + adapter compute; the adapter run folder is untouched
    from transformers import AutoModelForCausalLM

    merged_model = AutoModelForCausalLM.from_pretrained(merged).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged_model(ids).logits, built["peft_model"](input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )
    assert front_matter((run_dir / "README.md").read_text())["library_name"] == "peft"


def test_push_full_weights_when_no_adapter(tmp_path, built, fake_hub):
    folder = tmp_path / "full-run"
    shutil.copytree(built["base_dir"], folder)
    add_run_outputs(folder)
    hub.write_model_card(folder, **card_kwargs(tmp_path, built, peft_config=None, eval_metrics=None))
    hub.upload_folder_contents(folder, repo_id=REPO, token=TOKEN)
    assert (
        fake_hub.last_paths == {"model.safetensors", "config.json", "generation_config.json"} | TOKENIZER_FILES | EXTRAS
    )
    assert b"not evaluated" in fake_hub.commits[-1]["files"]["README.md"]
    with pytest.raises(ValueError, match="no LoRA adapter"):
        hub.upload_folder_contents(folder, repo_id=REPO, token=TOKEN, merge_adapter=True)


def test_periodic_push_snapshots_files_the_run_keeps_writing(tmp_path, built, run_dir, fake_hub):
    """hub_strategy pushes run in the background while training goes on: what is committed is the
    state at the time of the push, not a half-written later one."""
    checkpoint = run_dir / "checkpoint-1"
    (checkpoint / "adapter_config.json").write_text((run_dir / "adapter_config.json").read_text())
    (checkpoint / "adapter_model.safetensors").write_bytes(b"newer adapter weights")
    assert hub.copy_model_files(checkpoint, run_dir) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (run_dir / "adapter_model.safetensors").read_bytes() == b"newer adapter weights"
    hub.write_model_card(run_dir, **card_kwargs(tmp_path, built))
    metrics_then = (run_dir / "metrics.jsonl").read_bytes()

    fake_hub.preupload_gate = threading.Event()
    future = hub.upload_folder_contents(
        run_dir,
        repo_id=REPO,
        token=TOKEN,
        create_repo=False,
        commit_message="Training in progress, iteration 1",
        run_as_future=True,
    )
    with (run_dir / "metrics.jsonl").open("a") as handle:  # the next iteration is recorded meanwhile
        handle.write(json.dumps({"iteration": 4, "reward_mean": 0.75}) + "\n")
    (run_dir / "README.md").write_text("---\nlibrary_name: peft\n---\nhalf-written")
    fake_hub.preupload_gate.set()
    info = future.result(timeout=60)
    assert info.commit_message == "Training in progress, iteration 1"
    assert fake_hub.created == []
    commit = fake_hub.commits[-1]
    assert fake_hub.last_paths == ADAPTER_FILES | TOKENIZER_FILES | EXTRAS
    assert commit["files"]["metrics.jsonl"] == metrics_then
    assert b"41.2" in commit["files"]["README.md"]
    assert commit["lfs"]["adapter_model.safetensors"]["size"] == len(b"newer adapter weights")


def test_checkpoint_strategy_uploads_the_whole_published_checkpoint(run_dir, fake_hub):
    """hub_strategy="checkpoint": the complete checkpoint (optimizer and LOOP state included, for
    resuming) goes under last-checkpoint/ -- and only there."""
    checkpoint = run_dir / "checkpoint-1"
    (checkpoint / "loop_state.json").write_text("{}")
    hub.upload_checkpoint(checkpoint, repo_id=REPO, token=TOKEN)
    assert fake_hub.last_paths == {
        f"last-checkpoint/{name}"
        for name in ("optimizer.pt", "adapter_model.safetensors", "rng_state.pth", "loop_state.json")
    }


def test_a_short_loop_run_pushes_every_save_then_the_final_adapter(tmp_path, fake_hub, monkeypatch):
    """The trainer's own push path, end to end: hub_strategy every_save during training, then
    push_to_hub(); each upload holds the adapter, tokenizer, recipe, metrics and card, nothing else."""
    from peft import LoraConfig

    from loop_trainer import LOOPTrainer
    from loop_trainer.envs import VaultEnv
    from loop_trainer.models.tiny import build_tiny_for_environment
    from loop_trainer.publishing.publisher import HubPublisher

    # As Trainer, a save skips its push while the last upload runs (test_push_while_busy.py). On a
    # slow machine iteration 1's upload may still run at iteration 2's save: let each finish first,
    # so the count of pushes does not depend on timing.
    monkeypatch.setattr(HubPublisher, "busy", lambda self: self.wait() or False)

    env = VaultEnv(num_tasks=8)
    model, tokenizer = build_tiny_for_environment(env.vocabulary(), seed=0)
    args = LOOPConfig(
        output_dir=str(tmp_path / "run"),
        iterations=2,
        tasks_per_iteration=2,
        rollouts_per_task=2,
        minibatch_size=4,
        max_turns=2,
        max_new_tokens_per_turn=3,
        max_trajectory_tokens=128,
        learning_rate=1e-3,
        activation_checkpointing=False,
        disable_tqdm=True,
        report_to=[],
        push_to_hub=True,
        hub_model_id=REPO,
        hub_token=TOKEN,
        hub_strategy="every_save",
        eval_split="test",
        eval_every=2,
        eval_max_tasks=2,
    )
    trainer = LOOPTrainer(
        model,
        env,
        args,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    trainer.recipe_path = {"environment": "vault", "iterations": 2, "lora_r": 4}
    trainer.train()
    trainer.push_to_hub()
    assert len(fake_hub.commits) == 3  # two checkpoints' pushes, then the final one
    assert [c["header"]["summary"] for c in fake_hub.commits] == [
        "Training in progress, iteration 1",
        "Training in progress, iteration 2",
        "End of training",
    ]
    final = fake_hub.last_paths
    assert final == ADAPTER_FILES | TOKENIZER_FILES | EXTRAS
    card = fake_hub.commits[-1]["files"]["README.md"].decode()
    assert "2502.01600" in card and "PeftModel" in card and "--enable-lora" in card
    assert "not evaluated" not in card and "Latest evaluation: split `test`, after iteration 2" in card
    assert "| `success_rate` |" in card and "| `reward_mean` |" in card  # vault's summary
    assert yaml.safe_load(fake_hub.commits[-1]["files"]["recipe.yaml"]) == {
        "environment": "vault",
        "iterations": 2,
        "lora_r": 4,
    }
