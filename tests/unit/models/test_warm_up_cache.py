"""A ``tiny-instruct:`` warm-up is kept on disk and read back instead of run again: the weights and the random
state a build leaves, bit for bit, under a key that changes with anything the warm-up depends on."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from loop_trainer.config import EpisodeSettings
from loop_trainer.envs import VaultEnv
from loop_trainer.evaluation import GreedySuccessOnTrainingTasks
from loop_trainer.models import tiny, warm_up_cache
from loop_trainer.models.tiny import build_tiny_from_spec
from loop_trainer.models.warm_up_cache import WEIGHTS_FILE

READ = "the warm-up read from"


class ProbedVault(VaultEnv):
    """vault with a greedy-success level: a warm-up until fitted probes it."""

    name = "vault"
    warm_up_success = 0.5


@pytest.fixture
def warm_ups(tmp_path, monkeypatch):
    folder = tmp_path / "warm-ups"
    monkeypatch.setenv("LOOP_WARM_UP_CACHE", str(folder))
    return folder


@pytest.fixture
def counted_warm_ups(monkeypatch):
    """Stands in for the warm-up (fast): counts its runs, changes the weights, and draws from torch's global random
    state, as a warm-up might (a probe's sampling, an environment's demonstrations)."""
    runs: list[int] = []

    def warm_start(model, tokenizer, conversations, **kwargs):
        runs.append(len(conversations))
        torch.rand(3)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
        model.eval()
        return model

    monkeypatch.setattr(tiny, "warm_start", warm_start)
    monkeypatch.setattr(
        tiny, "replay_demonstrations", lambda env, n, seed, timeout: env.demonstrations(min(n, 4), seed=seed)
    )
    return runs


def build(env=None, report=None, **kwargs):
    lines: list[str] = []
    model, _ = build_tiny_from_spec(
        "tiny-instruct:vault", env or VaultEnv(num_tasks=8), report=report or lines.append, **kwargs
    )
    return model, lines, torch.get_rng_state()


def same_weights(a, b) -> bool:
    left, right = a.state_dict(), b.state_dict()
    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


def test_a_kept_warm_up_is_the_one_a_build_makes_bit_for_bit(warm_ups, monkeypatch):
    built, built_lines, built_rng = build(warm_up_steps=5)
    assert any("step 5/5" in line for line in built_lines) and not any(READ in line for line in built_lines)
    (kept,) = [folder for folder in warm_ups.iterdir() if folder.is_dir()]
    assert (kept / WEIGHTS_FILE).is_file()

    read, read_lines, read_rng = build(warm_up_steps=5)
    assert READ in read_lines[-1] and str(kept) in read_lines[-1]
    assert not any("step 5/5" in line for line in read_lines)
    assert same_weights(built, read) and torch.equal(built_rng, read_rng) and not read.training  # rng: untouched

    monkeypatch.setenv("LOOP_WARM_UP_CACHE", "0")  # keeping off: built afresh, and the same
    fresh, fresh_lines, _ = build(warm_up_steps=5)
    assert any("step 5/5" in line for line in fresh_lines) and same_weights(built, fresh)
    assert len([folder for folder in warm_ups.iterdir() if folder.is_dir()]) == 1


def test_a_build_leaves_the_random_state_as_it_found_it_whether_it_warmed_up_or_read(warm_ups, counted_warm_ups):
    """What follows a build (a LoRA adapter's initial weights) draws the same numbers either way."""
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    built, _, after_building = build(warm_up_steps=5)
    torch.manual_seed(1234)
    read, lines, after_reading = build(warm_up_steps=5)
    assert counted_warm_ups == [4] and READ in lines[-1] and same_weights(built, read)
    assert torch.equal(after_building, before) and torch.equal(after_reading, before)


def test_what_the_warm_up_depends_on_is_in_its_key(warm_ups, counted_warm_ups):
    build(warm_up_steps=5)
    build(warm_up_steps=5)
    assert len(counted_warm_ups) == 1
    build(warm_up_steps=6)
    build(warm_up_steps=5, seed=1)

    class OtherVault(VaultEnv):  # another environment class (its module's source is in the key too)
        name = "vault"

    build(OtherVault(num_tasks=8), warm_up_steps=5)
    assert len(counted_warm_ups) == 4


def test_a_probed_warm_up_is_keyed_by_the_probes_episode_settings_and_tasks(warm_ups, counted_warm_ups):
    env = ProbedVault(num_tasks=8)

    def probed(max_turns: int, num_tasks: int = 8):
        probed_env = env if num_tasks == 8 else ProbedVault(num_tasks=num_tasks)
        probe = GreedySuccessOnTrainingTasks(probed_env, EpisodeSettings(max_turns=max_turns))
        return build(probed_env, warm_up_steps=None, greedy_success=probe)

    probed(2)
    probed(2)
    assert len(counted_warm_ups) == 1
    probed(3)  # the probe's episodes end sooner or later: another warm-up
    probed(2, num_tasks=9)  # other training tasks probed
    assert len(counted_warm_ups) == 3
    # a probe that cannot say what its readings depend on: never kept, so never read
    for _ in range(2):
        build(env, warm_up_steps=None, greedy_success=lambda model, tokenizer, tasks: {"success_rate": 1.0})
    assert len(counted_warm_ups) == 5


def test_a_build_asked_not_to_keep_its_warm_up_neither_reads_nor_keeps_one(warm_ups, counted_warm_ups):
    build(warm_up_steps=5)
    build(warm_up_steps=5, keep_warm_up=False)
    build(warm_up_steps=6, keep_warm_up=False)
    assert len(counted_warm_ups) == 3 and len([folder for folder in warm_ups.iterdir() if folder.is_dir()]) == 1


def damage_by_garbage(folder, model) -> None:
    (folder / WEIGHTS_FILE).write_bytes(b"not safetensors")


def damage_by_foreign_weights(folder, model) -> None:
    """A file that parses, holding zeros under the model's names and one tensor of another shape: a read copies
    what fits before it finds what does not."""
    state = {name: torch.zeros_like(value) for name, value in model.state_dict().items()}
    last = sorted(state)[-1]
    state[last] = torch.zeros(3)
    save_file(state, str(folder / WEIGHTS_FILE))


@pytest.mark.parametrize("damage", [damage_by_garbage, damage_by_foreign_weights])
def test_a_damaged_warm_up_is_built_again_from_the_initial_weights_and_replaced(warm_ups, counted_warm_ups, damage):
    built, _, _ = build(warm_up_steps=5)
    (kept,) = [folder for folder in warm_ups.iterdir() if folder.is_dir()]
    damage(kept, built)
    rebuilt, lines, _ = build(warm_up_steps=5)
    assert any("cannot be read" in line and str(kept) in line for line in lines) and len(counted_warm_ups) == 2
    read, lines, _ = build(warm_up_steps=5)
    assert READ in lines[-1] and len(counted_warm_ups) == 2
    assert same_weights(built, rebuilt) and same_weights(built, read)


def test_inputs_without_a_stable_text_are_warmed_up_and_not_kept(warm_ups, counted_warm_ups):
    """A probe whose key holds a set (its order varies from process to process): no key, so nothing kept."""

    class SetProbe:
        def __call__(self, model, tokenizer, tasks):
            return {"success_rate": 1.0}

        def cache_key(self, tasks):
            return {"tasks": {"b", "a"}}

    lines: list[str] = []
    for _ in range(2):
        build(ProbedVault(num_tasks=8), report=lines.append, warm_up_steps=None, greedy_success=SetProbe())
    assert len(counted_warm_ups) == 2 and not warm_ups.exists()
    assert sum("no stable key" in line for line in lines) == 2


def test_a_failed_write_or_no_home_folder_costs_only_the_time(warm_ups, counted_warm_ups, monkeypatch):
    def full_disk(*args, **kwargs):
        raise RuntimeError("Error while serializing: No space left on device")  # safetensors' own, not an OSError

    monkeypatch.setattr(warm_up_cache, "save_model", full_disk)
    built, lines, _ = build(warm_up_steps=5)
    assert any("could not keep the warm-up" in line and "No space left" in line for line in lines)
    assert not [folder for folder in warm_ups.iterdir() if folder.is_dir()]

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("LOOP_WARM_UP_CACHE")
    monkeypatch.delenv("LOOP_CACHE_DIR", raising=False)
    monkeypatch.setattr(warm_up_cache.Path, "home", staticmethod(no_home))
    again, lines, _ = build(warm_up_steps=5)
    assert any("no folder to keep the warm-up in" in line for line in lines) and len(counted_warm_ups) == 2
    assert same_weights(built, again)


def test_a_cache_that_cannot_be_kept_costs_only_the_time(tmp_path, monkeypatch, counted_warm_ups):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("LOOP_WARM_UP_CACHE", str(blocked / "warm-ups"))  # under a file: no folder can be made
    _, lines, _ = build(warm_up_steps=5)
    _, again, _ = build(warm_up_steps=5)
    assert any("cannot keep the warm-up" in line for line in lines + again) and len(counted_warm_ups) == 2


def test_builds_of_one_warm_up_at_once_run_it_once(warm_ups, monkeypatch):
    """Every process of a distributed run builds its model at once: the first warms up, the others wait for it
    (a lock on the key) and read what it kept."""
    runs: list[int] = []

    def slow_warm_start(model, tokenizer, conversations, **kwargs):
        runs.append(1)
        time.sleep(0.5)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        return model

    monkeypatch.setattr(tiny, "warm_start", slow_warm_start)
    monkeypatch.setattr(tiny, "replay_demonstrations", lambda env, n, seed, timeout: env.demonstrations(2, seed=seed))
    lines: list[list[str]] = [[], []]
    models: list = [None, None]

    def one(index: int) -> None:
        models[index], _ = build_tiny_from_spec(
            "tiny-instruct:vault", VaultEnv(num_tasks=8), warm_up_steps=5, report=lines[index].append
        )

    threads = [threading.Thread(target=one, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert runs == [1] and sum(READ in part[-1] for part in lines) == 1
    assert same_weights(models[0], models[1])
