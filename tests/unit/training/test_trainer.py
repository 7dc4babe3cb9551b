"""LOOPTrainer on CPU with a tiny model: the update direction, the loop, its outputs."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.envs.base import Episode
from loop_trainer.models.tiny import load_tokenizer
from loop_trainer.training.activation_checkpointing import is_checkpointing
from loop_trainer.training.run_log import read_metrics
from support.helpers import PreferFindEnv, PreferFindEpisode, ScriptedBackend

REQUIRED_METRICS = {
    "iteration",
    "reward_mean",
    "reward_std",
    "num_rollouts",
    "num_kept",
    "tokens",
    "clip_frac",
    "kl",
    "grad_norm",
    "seconds",
    "sampler_logprob_diff",
    "rollout_seconds",
    # the learning signals
    "entropy",
    "tied_group_fraction",
    "kept_fraction",
    "turns_mean",
    "reply_tokens_mean",
    "truncated_fraction",
    "train_passed_found_person",  # vault's per-check pass rates over the training rollouts
    "update_seconds",
}


def tiny_args(tmp_path, **overrides) -> LOOPConfig:
    base = {
        "output_dir": str(tmp_path / "run"),
        "iterations": 2,
        "tasks_per_iteration": 4,
        "rollouts_per_task": 4,
        "minibatch_size": 8,
        "max_turns": 4,
        "max_new_tokens_per_turn": 4,
        "max_trajectory_tokens": 256,
        "learning_rate": 3e-3,
        "activation_checkpointing": False,
        "per_device_train_batch_size": 8,
        "disable_tqdm": True,
        "seed": 0,
    }
    base.update(overrides)
    return LOOPConfig(**base)


def reply_logprob(model, tok, reply: str) -> float:
    prompt = tok.apply_chat_template([{"role": "user", "content": "fetch code of ann"}], add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, Mapping) else prompt
    target = tok.encode(reply) + [tok.eos_token_id]
    ids = torch.tensor([list(prompt) + target])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(target)[:, None]).sum().item()


def alternating_trainer(tmp_path, vault_tiny):
    """One iteration of 2 tasks x 4 rollouts whose replies alternate "find ann" (reward 1) and "open k3" (0)."""
    _, model, tok = vault_tiny
    calls = iter(range(10**6))
    backend = ScriptedBackend(tok, lambda prompt: "find ann" if next(calls) % 2 == 0 else "open k3")
    args = tiny_args(tmp_path, tasks_per_iteration=2, rollouts_per_task=4, minibatch_size=4, iterations=1)
    return LOOPTrainer(model, PreferFindEnv(), args, processing_class=tok, generation_backend=backend), model, tok


def test_one_iteration_moves_probability_toward_positive_advantage(tmp_path, vault_tiny):
    trainer, model, tok = alternating_trainer(tmp_path, vault_tiny)
    before = {r: reply_logprob(model, tok, r) for r in ("find ann", "open k3")}
    record = trainer.run_iteration()
    after = {r: reply_logprob(model, tok, r) for r in ("find ann", "open k3")}
    assert record["num_rollouts"] == 8 and record["num_kept"] == 8 and record["reward_mean"] == 0.5
    assert record["optimizer_steps"] == 2 * 2  # 2 epochs x ceil(8 / 4)
    assert after["find ann"] > before["find ann"] + 0.05
    assert after["open k3"] < before["open k3"] - 0.05


def test_driving_iterations_by_hand_still_checkpoints_activations(tmp_path, vault_tiny):
    # train() enables checkpointing itself; run_iteration() without train() must not silently skip it.
    _, model, tok = vault_tiny
    backend = ScriptedBackend(tok, lambda prompt: "find ann")
    args = tiny_args(tmp_path, activation_checkpointing=True, iterations=1)
    trainer = LOOPTrainer(model, PreferFindEnv(), args, processing_class=tok, generation_backend=backend)
    assert not is_checkpointing(model)
    trainer.run_iteration()
    assert is_checkpointing(model)


def test_every_n_layers_checkpoints_the_layers_it_names(tmp_path, vault_tiny):
    # transformers' own key, through the recipe's checkpointing kwargs: the memory plan counts the layers it leaves
    from transformers.modeling_layers import GradientCheckpointingLayer

    _, model, tok = vault_tiny
    backend = ScriptedBackend(tok, lambda prompt: "find ann")
    kwargs = {"every_n_layers": 2}
    args = tiny_args(tmp_path, activation_checkpointing=True, iterations=1, activation_checkpointing_kwargs=kwargs)
    trainer = LOOPTrainer(model, PreferFindEnv(), args, processing_class=tok, generation_backend=backend)
    trainer.run_iteration()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) >= 2 and [m.gradient_checkpointing for m in layers] == [i % 2 == 0 for i in range(len(layers))]


def test_iterations_driven_by_hand_sample_each_update_s_weights(tmp_path, vault_tiny):
    # global_step does not move without train(); the training model's sampler must still see each update.
    _, model, tok = vault_tiny
    # advantage_threshold 0 keeps tied groups too: every iteration steps the optimizer (weight decay moves weights)
    args = tiny_args(tmp_path, tasks_per_iteration=2, rollouts_per_task=2, iterations=1, advantage_threshold=0.0)
    trainer = LOOPTrainer(model, PreferFindEnv(), args, processing_class=tok)
    backend = trainer.generator.backend
    versions, steps = [backend.weights_version], []
    for _ in range(2):
        steps.append(trainer.run_iteration()["optimizer_steps"])
        versions.append(backend.weights_version)
        assert steps[-1] == 0 or versions[-1] > versions[-2]
    assert sum(steps) > 0 and trainer.state.global_step == 0
    trainer.close()


def test_a_non_finite_loss_skips_that_step_and_is_counted(tmp_path, vault_tiny):
    trainer, model, tok = alternating_trainer(tmp_path, vault_tiny)
    forwards = iter(range(10**6))

    def poison_first_training_forward(module, inputs, output):
        if module.training and next(forwards) == 0:
            return output * float("nan")

    handle = model.model.norm.register_forward_hook(poison_first_training_forward)
    record = trainer.run_iteration()
    handle.remove()
    assert record["skipped_nonfinite_steps"] == 1 and record["optimizer_steps"] == 2 * 2 - 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_groups_with_equal_rewards_are_dropped(tmp_path, vault_tiny):
    _, model, tok = vault_tiny
    backend = ScriptedBackend(tok, lambda prompt: "find ann")  # everyone gets reward 1
    args = tiny_args(tmp_path, tasks_per_iteration=2, rollouts_per_task=3, iterations=1)
    trainer = LOOPTrainer(model, PreferFindEnv(), args, processing_class=tok, generation_backend=backend)
    weights = [p.detach().clone() for p in model.parameters()]
    record = trainer.run_iteration()
    assert record["num_kept"] == 0 and record["optimizer_steps"] == 0
    assert record["tied_group_fraction"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


class Counter(TrainerCallback):
    def __init__(self):
        self.steps, self.logs = 0, []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_train_end_to_end_writes_metrics_curve_and_a_loadable_model(tmp_path, vault_tiny):
    env, model, tok = vault_tiny
    counter = Counter()
    args = tiny_args(tmp_path, save_rollouts=True)
    trainer = LOOPTrainer(model, env, args, processing_class=tok, callbacks=[counter])
    output = trainer.train()
    assert output.global_step == 2 and trainer.state.global_step == 2
    records = read_metrics(args.output_dir)
    assert [r["iteration"] for r in records] == [1, 2]
    for record in records:
        assert record.keys() >= REQUIRED_METRICS
        assert record["num_rollouts"] == 16
        assert record["sampler_logprob_diff"] < 1e-4  # sampler and trainer agree on the same policy
    assert (tmp_path / "run" / "learning_curve.png").stat().st_size > 10_000
    assert counter.steps == 2 and len(counter.logs) == 2 and "reward_mean" in counter.logs[0]
    rollouts = sorted((tmp_path / "run" / "rollouts").glob("*.jsonl"))
    assert len(rollouts) == 2
    first = json.loads(rollouts[0].read_text().splitlines()[0])
    assert {"token_ids", "loss_mask", "reward", "advantage", "messages"} <= first.keys()

    trainer.create_model_card(model_name="vault-tiny")
    card = (tmp_path / "run" / "README.md").read_text()
    assert "LOOP" in card and "2502.01600" in card and "Reinforcement Learning for Long-Horizon" in card

    trainer.save_model(str(tmp_path / "saved"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    reloaded_tok = load_tokenizer(str(tmp_path / "saved"))
    assert reloaded_tok.chat_template == tok.chat_template
    assert reloaded_tok.encode("find ann open k3") == tok.encode("find ann open k3")
    checkpoints = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-1", "checkpoint-2"]  # one per iteration, atomically published
    assert (tmp_path / "run" / "checkpoint-2" / "loop_state.json").is_file()
    for (name, a), b in zip(trainer.model.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_lora_trains_only_the_adapter(tmp_path, vault_tiny):
    from peft import LoraConfig

    env, model, tok = vault_tiny
    base = {k: v.clone() for k, v in model.state_dict().items()}
    args = tiny_args(tmp_path, iterations=1, learning_rate=1e-2)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    trainer = LOOPTrainer(model, env, args, processing_class=tok, peft_config=config)
    trainer.train()
    record = trainer.history[-1]
    assert record["optimizer_steps"] > 0
    state = trainer.model.state_dict()
    lora = [k for k in state if "lora_B" in k]
    assert lora and any(state[k].abs().sum() > 0 for k in lora)  # B starts at zero: it moved
    for key, value in base.items():
        module, _, leaf = key.rpartition(".")
        same = state.get(f"base_model.model.{module}.base_layer.{leaf}", state.get(f"base_model.model.{key}"))
        assert same is not None and torch.equal(same, value), key


def test_kl_guard_aborts_the_iteration(tmp_path, vault_tiny):
    env, model, tok = vault_tiny
    args = tiny_args(tmp_path, iterations=1, kl_abort_threshold=1e-9, minibatch_size=2, learning_rate=5e-2)
    trainer = LOOPTrainer(model, env, args, processing_class=tok)
    record = trainer.run_iteration()
    assert record["aborted_on_kl"] == 1
    assert record["optimizer_steps"] < 2 * -(-record["num_kept"] // 2)


def test_long_trajectories_are_trained_on_their_prefix_and_counted(tmp_path, vault_tiny):
    env, model, tok = vault_tiny
    args = tiny_args(tmp_path, iterations=1, max_training_tokens=40, advantage_threshold=0.0)
    trainer = LOOPTrainer(model, env, args, processing_class=tok)
    record = trainer.run_iteration()
    assert record["truncated_for_training"] > 0
    assert record["tokens"] <= 40 * record["num_kept"]


def test_config_rejects_what_loop_does_not_do():
    with pytest.raises(ValueError, match="beta must be >= 0"):
        LOOPConfig(output_dir="x", beta=-0.1)
    with pytest.raises(ValueError, match="rollouts_per_task"):
        LOOPConfig(output_dir="x", rollouts_per_task=1)
    with pytest.raises(TypeError, match="LOOPConfig has no setting 'top_p'; LOOP's equivalent is temperature"):
        LOOPConfig(output_dir="x", top_p=0.9)


def test_config_defaults_are_the_papers_but_early_stopping_is_off():
    # The paper's settings, except that collection waits for every rollout (the paper: 0.9 / 0.75, which the
    # AppWorld recipes set): LOOPConfig's docstring says so.
    args = LOOPConfig(output_dir="x")
    assert (args.tasks_per_iteration, args.rollouts_per_task, args.minibatch_size, args.ppo_epochs) == (40, 6, 32, 2)
    assert (args.epsilon, args.advantage_threshold, args.learning_rate, args.weight_decay) == (0.1, 0.01, 5e-5, 0.01)
    assert (args.max_grad_norm, args.lr_scheduler_type, args.warmup_steps) == (0.1, "constant", 0)
    assert (args.max_turns, args.max_new_tokens_per_turn, args.max_trajectory_tokens) == (40, 1500, 32000)
    assert (args.temperature, args.beta) == (1.0, 0.0) and not hasattr(LOOPConfig, "top_p")
    # every stabiliser off: LOOP as the paper
    assert (args.epsilon_high, args.sampler_importance_cap, args.dynamic_sampling_rounds) == (None, None, 0)
    assert (args.early_stop_done_fraction, args.early_stop_task_fraction) == (1.0, 1.0)
    assert "0.9 / 0.75" in LOOPConfig.__doc__
    assert args.iterations == 200 and not args.std_normalize_advantages


def test_the_memory_stress_test_runs_the_longest_trajectory_before_iteration_one(tmp_path, vault_tiny):
    env, model, tok = vault_tiny
    shapes = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: shapes.append((module.training, tuple(inputs[0].shape)))
    )
    args = tiny_args(tmp_path, iterations=1, max_trajectory_tokens=200, per_device_train_batch_size=2)
    LOOPTrainer(model, env, args, processing_class=tok).train()
    hook.remove()
    assert shapes[0] == (True, (2, 200))  # the first forward of the run: training mode, the largest micro-batch


def test_an_out_of_memory_stress_test_names_the_knobs(tmp_path, vault_tiny, monkeypatch, capsys):
    import loop_trainer.training.stress as stress_module
    from loop_trainer.cli.train import cli
    from loop_trainer.training.stress import MemoryStressTestFailed

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 18.00 GiB")

    monkeypatch.setattr(stress_module, "token_logprobs", out_of_memory)
    env, model, tok = vault_tiny
    trainer = LOOPTrainer(model, env, tiny_args(tmp_path, iterations=1), processing_class=tok)
    with pytest.raises(MemoryStressTestFailed, match="memory stress test: a forward\\+backward of 8 trajectory"):
        trainer.train()
    status = cli(
        [
            "--model_name_or_path",
            "tiny:vault",
            "--output_dir",
            str(tmp_path / "cli"),
            "--iterations",
            "1",
            "--max_trajectory_tokens",
            "300",
            "--disable_tqdm",
            "true",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1
    assert "of 300 tokens ran out of memory on cpu (CUDA out of memory. Tried to allocate 18.00 GiB)" in err[0]
    for knob in (
        "max_training_tokens",
        "activation_checkpointing",
        "use_peft",
        "ZeRO-3",
        "--dry-run",
        "memory_stress_test: false",
    ):
        assert knob in err[0]


def test_periodic_evaluation_logs_the_environments_summary_and_writes_a_viewer(tmp_path, vault_tiny):
    env, model, tok = vault_tiny
    args = tiny_args(tmp_path, iterations=2, eval_split="test", eval_every=2, eval_max_tasks=5)
    trainer = LOOPTrainer(model, env, args, processing_class=tok)
    trainer.train()
    first, second = read_metrics(args.output_dir)
    assert not any(key.startswith("eval_") for key in first)
    # vault's own summary (success, reward, each check), not AppWorld's TGC/SGC
    for key in ("eval_success_rate", "eval_reward_mean", "eval_passed_found_person", "eval_num_rollouts"):
        assert key in second, key
    assert not any("tgc" in key or "sgc" in key for key in second)
    assert second["eval_num_rollouts"] == 5 and second["eval_num_failed_to_run"] == 0
    assert trainer.latest_eval["split"] == "test" and trainer.latest_eval["iteration"] == 2
    assert trainer.latest_eval["metrics"]["reward_mean"] == second["eval_reward_mean"]
    assert (tmp_path / "run" / "viewer" / "eval-test-iteration-00002.html").is_file()
    greedy = trainer.evaluate_policy("test")  # temperature 0: the same answers again
    assert greedy["eval_reward_mean"] == second["eval_reward_mean"]


def test_train_releases_what_it_opened_and_the_trainer_is_a_context_manager(tmp_path, vault_tiny):
    env, model, tok = vault_tiny
    env.close = lambda: pytest.fail("the environment is its creator's to close")
    closed = []
    with LOOPTrainer(
        model, env, tiny_args(tmp_path, iterations=1, save_strategy="no"), processing_class=tok
    ) as trainer:
        engine = trainer.rollout_engine
        engine.close = lambda close=engine.close: (closed.append("engine"), close())
        trainer.train()
        assert closed == ["engine"]  # train() released the rollout engine it opened
        assert trainer.run_iteration()["num_rollouts"] == 16  # ... and opens it again when asked
    assert closed == ["engine"] and not trainer.rollout_resources.is_open
    trainer.close()  # idempotent


def test_the_model_is_tagged_loop_not_grpo(tmp_path, vault_tiny):
    env, model, tok = vault_tiny
    LOOPTrainer(model, env, tiny_args(tmp_path, iterations=1), processing_class=tok)
    assert "loop" in model.model_tags and "grpo" not in model.model_tags


def test_hyperparameter_search_is_refused_in_one_line_that_names_no_model_init(tmp_path, vault_tiny):
    """Trainer's refusal asks for a model_init, which LOOPTrainer takes no argument for."""
    env, model, tok = vault_tiny
    trainer = LOOPTrainer(model, env, tiny_args(tmp_path, iterations=1), processing_class=tok)
    with pytest.raises(NotImplementedError) as refused:
        trainer.hyperparameter_search(n_trials=2)
    message = str(refused.value)
    assert message.startswith("LOOPTrainer does not run hyperparameter_search")
    assert "\n" not in message and "model_init" not in message


def test_the_generator_sleeps_after_a_periodic_evaluation_before_the_checkpoint(tmp_path, vault_tiny):
    """A separate engine (vLLM) woken to evaluate must not stay awake through the save that follows."""
    from types import SimpleNamespace

    env, model, tok = vault_tiny
    calls = []

    class RecordingSync:
        generator = SimpleNamespace(sleep=lambda: calls.append("sleep"))

        def __call__(self, version):
            calls.append(("sync", version))
            return SimpleNamespace(seconds=0.0, logprob_diff_max=0.0, metrics=dict)

        def close(self):
            pass

    class SaveRecorder(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            calls.append("save")

    args = tiny_args(tmp_path, iterations=2, eval_split="test", eval_every=1, eval_max_tasks=2)
    trainer = LOOPTrainer(model, env, args, processing_class=tok, callbacks=[SaveRecorder()])
    trainer.generator.weight_sync = RecordingSync()
    trainer.train()
    assert calls == [("sync", 0), "sleep", ("sync", 1), "sleep", "save", "sleep", ("sync", 2), "sleep", "save"]


def test_a_custom_backend_without_temperature_control_refuses_eval_temperature(tmp_path, vault_tiny):
    from loop_trainer.rollout.generator import GeneratorConfigError

    env, model, tok = vault_tiny
    backend = ScriptedBackend(tok, lambda prompt: "find ann")
    args = tiny_args(tmp_path, eval_split="test", eval_every=1)
    with pytest.raises(GeneratorConfigError, match="eval_temperature"):
        LOOPTrainer(model, env, args, processing_class=tok, generation_backend=backend)


class KindsEnv(PreferFindEnv):
    """Six tasks, four of kind "a" and two of kind "b"; records which tasks each episode plays."""

    name = "kinds"

    def __init__(self):
        self.played: list[str] = []

    def tasks(self, split: str = "train") -> Dataset:
        return Dataset.from_list([{"task_id": f"t{i}", "kind": "b" if i % 3 == 0 else "a"} for i in range(6)])

    def episode(self, task: Mapping[str, Any]) -> Episode:
        self.played.append(task["kind"])
        return PreferFindEpisode()


def test_balance_tasks_by_draws_every_iteration_half_of_each_kind(tmp_path, vault_tiny):
    _, model, tok = vault_tiny
    env = KindsEnv()
    backend = ScriptedBackend(tok, lambda prompt: "find ann")
    args = tiny_args(
        tmp_path, tasks_per_iteration=2, rollouts_per_task=2, minibatch_size=4, iterations=5, balance_tasks_by="kind"
    )
    LOOPTrainer(model, env, args, processing_class=tok, generation_backend=backend).train()
    per_iteration = [sorted(env.played[i : i + 4]) for i in range(0, len(env.played), 4)]
    assert per_iteration == [["a", "a", "b", "b"]] * 5  # a shuffled pass of 4 a's and 2 b's could not

    with pytest.raises(ValueError, match="balance_tasks_by: the training split has no column 'field'"):
        LOOPTrainer(model, KindsEnv(), tiny_args(tmp_path, balance_tasks_by="field"), processing_class=tok)


def test_train_logs_the_collapse_warning_when_every_group_ties(tmp_path, vault_tiny, caplog):
    _, model, tok = vault_tiny
    backend = ScriptedBackend(tok, lambda prompt: "open k3")  # reward 0 everywhere: every group ties
    args = tiny_args(tmp_path, tasks_per_iteration=2, rollouts_per_task=2, iterations=4, report_to="none")
    trainer = LOOPTrainer(model, PreferFindEnv(), args, processing_class=tok, generation_backend=backend)
    with caplog.at_level("WARNING", logger="loop_trainer.training.trainer"):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "learning may be collapsing" in r.getMessage()]
    # once, at the third tied iteration (the signature must hold for 3), naming the keys to try
    assert len(warnings) == 1 and warnings[0].startswith("iteration 3: ")
    assert "tied" in warnings[0] and "dynamic_sampling_rounds" in warnings[0]


def test_the_python_api_takes_the_model_names_loop_train_takes(tmp_path, monkeypatch):
    """``LOOPTrainer("tiny-instruct:vault", env, args)`` builds the model loop-train would (the same warm-up,
    seed and tokenizer) instead of asking the Hub for a repo of that name; ``packaged:`` names resolve to
    their directory; a tiny name without its environment, or with a tokenizer of the user's, is one line."""
    from loop_trainer.envs import VaultEnv
    from loop_trainer.training import model_loading

    monkeypatch.setenv("LOOP_WARM_UP_CACHE", "0")  # two builds, each its own warm-up: not one read back
    env = VaultEnv(num_tasks=4)
    args = tiny_args(tmp_path, iterations=1, tasks_per_iteration=2, rollouts_per_task=2, tiny_instruct_steps=3)
    trainer = LOOPTrainer("tiny-instruct:vault", env, args)
    built, tokenizer = model_loading.build_tiny_model("tiny-instruct:vault", env, args)
    assert trainer.tokenizer.get_vocab() == tokenizer.get_vocab()
    for (name, value), (_, expected) in zip(
        trainer.model.state_dict().items(), built.state_dict().items(), strict=True
    ):
        assert torch.equal(value, expected), name
    trainer.train()
    assert read_metrics(args.output_dir)[-1]["iteration"] == 1
    assert trainer.resume_settings()["tiny_base"] is None  # full weights: every one of them in the checkpoint
    from peft import LoraConfig

    adapter = LoraConfig(r=2, target_modules="all-linear")
    with LOOPTrainer("tiny-instruct:vault", env, args, peft_config=adapter) as lora:
        assert lora.resume_settings()["tiny_base"] == {"seed": args.seed, "tiny_instruct_steps": 3}  # a resume's base

    with pytest.raises(ValueError, match="give it no processing_class"):
        LOOPTrainer("tiny:vault", env, args, processing_class=tokenizer)
    resolved = []
    monkeypatch.setattr(model_loading, "resolve_model_path", lambda name: resolved.append(name) or "/nowhere")
    with pytest.raises(OSError):  # loaded from the resolved directory, which this test leaves empty
        LOOPTrainer("packaged:smollm2-135m-instruct", env, args)
    assert resolved == ["packaged:smollm2-135m-instruct"]
    monkeypatch.chdir(tmp_path)
    assert LOOPTrainer("tiny:vault", env).args.output_dir == "tiny-vault-LOOP"
