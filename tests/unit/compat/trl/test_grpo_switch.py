"""A TRL multi-turn script switched from GRPOTrainer to LOOPTrainer: the same environment_factory
class, dataset and reward function run under TRL's own GRPOTrainer (one real training step, its own
tool loop) and under LOOPTrainer (two iterations), with the same tiny model, Qwen2.5's chat template
and the same scripted replies. Both must call the same tools with the same arguments, return the
same tool messages (errors included) and give each rollout the same reward -- a tool call whose JSON does
not parse included (it ends the rollout as plain text under both, unless ``malformed_tool_call: answer``)."""

from __future__ import annotations

import re
import warnings
from collections import Counter as Tally

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.compat.trl.grpo_config import loop_config_from_grpo
from loop_trainer.envs import VaultEnv
from support.helpers import ScriptedBackend, tiny_qwen


class CounterEnv:
    """A TRL-style environment: public methods are tools, get_reward() owns a reward."""

    calls: list[tuple] = []

    def reset(self, **row) -> str:
        self.count = row["start"]
        return f" (the counter starts at {row['start']})"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        CounterEnv.calls.append(("increment", by))
        self.count += by
        return self.count

    def explode(self) -> str:
        """Always fails."""
        CounterEnv.calls.append(("explode",))
        raise RuntimeError("kaput")

    def get_reward(self) -> float:
        return 1.0 if self.count == 10 else 0.0


def said_done(completions, target, **kwargs) -> list[float]:
    said_done.seen.extend(completions)
    return [0.5 if f"Done at {t}" in c[-1]["content"] else 0.0 for c, t in zip(completions, target, strict=True)]


said_done.seen = []
DATASET = Dataset.from_list(
    [
        {"prompt": [{"role": "user", "content": "Bring the counter to 10."}], "start": 4, "target": 10},
        {"prompt": [{"role": "user", "content": "Bring the counter to 10."}], "start": 7, "target": 10},
    ]
)


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


MALFORMED = '<tool_call>\n{"name": "increment", "arguments": {by: 1}}\n</tool_call>'


class Script:
    """The model: the first rollout of each task reaches 10, then calls an unknown tool, a tool that raises,
    and answers; the second adds 1, then makes a tool call whose JSON does not parse (and, if answered,
    answers)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.first_turns = tokenizer, Tally()

    def __call__(self, prompt_ids: list[int]) -> str:
        prompt = self.tokenizer.decode(prompt_ids)
        turn = prompt.count("<|im_start|>assistant") - 1
        start = int(re.search(r"the counter starts at (\d+)", prompt).group(1))
        if turn == 0:
            self.first_turns[start] += 1
            return call("increment", f'{{"by": {10 - start if self.first_turns[start] % 2 else 1}}}')
        if not re.search(r"<tool_response>\s*10\s*</tool_response>", prompt):
            return MALFORMED if turn == 1 else "Done at 10."
        return [call("nope", "{}"), call("explode", "{}"), "Done at 10."][turn - 1]


def rollouts(completions):
    """(tool calls, tool messages, final answer) of each rollout, as sorted tuples: comparable across trainers."""
    out = []
    for messages in completions:
        calls = tuple(
            (c["function"]["name"], tuple(sorted(c["function"]["arguments"].items())))
            for m in messages
            for c in m.get("tool_calls") or []
        )
        tools = tuple(m["content"] for m in messages if m["role"] == "tool")
        out.append((calls, tools, messages[-1]["content"]))
    return sorted(out)


def script_args(output_dir) -> GRPOConfig:
    """The script's GRPOConfig: 2 prompts x 2 completions per optimizer step, 2 steps."""
    return GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        bf16=False,
        num_generations=2,
        per_device_train_batch_size=4,
        max_steps=2,
        max_completion_length=1024,
        learning_rate=1e-4,
        max_tool_calling_iterations=5,
        activation_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )


def run_grpo(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    script = Script(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=tiny_qwen(tokenizer),
            reward_funcs=said_done,
            args=script_args(tmp_path / "grpo"),
            train_dataset=DATASET,
            processing_class=tokenizer,
            environment_factory=CounterEnv,
        )

    def scripted_single_turn(prompt_ids, *_, **__):  # in place of model.generate: TRL's tool loop is untouched
        return [tokenizer.encode(script(list(ids)), add_special_tokens=False) + [end] for ids in prompt_ids], None

    trainer._generate_single_turn = scripted_single_turn
    trainer.train()
    return trainer


def test_the_same_trl_script_runs_under_grpo_trainer_and_loop_trainer(qwen_tokenizer, tmp_path, monkeypatch):
    CounterEnv.calls, said_done.seen = [], []
    grpo = run_grpo(qwen_tokenizer, tmp_path, monkeypatch)
    grpo_calls, grpo_rollouts = Tally(CounterEnv.calls), rollouts(said_done.seen)
    grpo_rewards = [entry["reward"] for entry in grpo.state.log_history if "reward" in entry]
    # 1.5 (reached 10, said done) and 0 (the malformed call ended it) on each task
    assert len(grpo_rollouts) == 8 and grpo_rewards == pytest.approx([0.75, 0.75])
    assert sum(r[2] == MALFORMED for r in grpo_rollouts) == 4

    CounterEnv.calls, said_done.seen = [], []
    # the GRPOTrainer call, word for word, with LOOPTrainer (plus the scripted model in place of sampling)
    trainer = LOOPTrainer(
        model=tiny_qwen(qwen_tokenizer),
        reward_funcs=said_done,
        args=script_args(tmp_path / "loop"),
        train_dataset=DATASET,
        processing_class=qwen_tokenizer,
        environment_factory=CounterEnv,
        generation_backend=ScriptedBackend(qwen_tokenizer, Script(qwen_tokenizer)),
    )
    args = trainer.args
    assert (args.iterations, args.tasks_per_iteration, args.rollouts_per_task, args.minibatch_size) == (2, 2, 2, 4)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    history = trainer.history
    assert [h["iteration"] for h in history] == [1, 2]
    # the same tool calls, tool messages (errors included) and answers as TRL's own loop
    assert rollouts(said_done.seen) == grpo_rollouts
    assert Tally(CounterEnv.calls) == grpo_calls
    assert {m for r in grpo_rollouts for m in r[1]} >= {"{'error': 'Tool nope not found.'}", "{'error': 'kaput'}"}
    # rewards: get_reward() (1 when the counter reached 10) + said_done (0.5), per rollout as in TRL
    assert [h["reward_mean"] for h in history] == pytest.approx(grpo_rewards)
    assert all(h["num_kept"] == 4 and h["optimizer_steps"] == 1 for h in history)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_malformed_tool_call_answer_opts_into_loops_behaviour(qwen_tokenizer, tmp_path):
    CounterEnv.calls, said_done.seen = [], []
    args = LOOPConfig(
        output_dir=str(tmp_path / "answer"),
        report_to=[],
        disable_tqdm=True,
        iterations=1,
        tasks_per_iteration=2,
        rollouts_per_task=2,
        minibatch_size=4,
        max_tool_calling_iterations=5,
        malformed_tool_call="answer",
        memory_stress_test=False,
        activation_checkpointing=False,
        save_strategy="no",
        seed=0,
    )
    trainer = LOOPTrainer(
        tiny_qwen(qwen_tokenizer),
        said_done,
        args,
        DATASET,
        processing_class=qwen_tokenizer,
        environment_factory=CounterEnv,
        generation_backend=ScriptedBackend(qwen_tokenizer, Script(qwen_tokenizer)),
    )
    trainer.train()
    answered = [r for r in rollouts(said_done.seen) if any("malformed tool call" in m for m in r[1])]
    assert len(answered) == 2 and all(r[2] == "Done at 10." for r in answered)  # told, and it went on
    # 1.5 (reached 10) and 0.5 (said done after the answered typo, the counter short of 10) on each task
    assert trainer.history[0]["reward_mean"] == pytest.approx(1.0)


def test_trl_route_arguments_and_keys_are_checked(qwen_tokenizer, tmp_path):
    args = LOOPConfig(output_dir=str(tmp_path / "a"), report_to=[], disable_tqdm=True, reward_weights=[2.0])
    with pytest.raises(ValueError, match=r"reward_weights=\[2.0\] is used only with GRPOTrainer's agent arguments"):
        LOOPTrainer(tiny_qwen(qwen_tokenizer), VaultEnv(), args, processing_class=qwen_tokenizer)
    args = LOOPConfig(output_dir=str(tmp_path / "m"), report_to=[], disable_tqdm=True, malformed_tool_call="answer")
    with pytest.raises(
        ValueError, match="malformed_tool_call='answer' is used only with GRPOTrainer's agent arguments"
    ):
        LOOPTrainer(tiny_qwen(qwen_tokenizer), VaultEnv(), args, processing_class=qwen_tokenizer)
    args = LOOPConfig(output_dir=str(tmp_path / "b"), report_to=[], disable_tqdm=True)
    with pytest.raises(ValueError, match="got an Environment and train_dataset"):
        LOOPTrainer(tiny_qwen(qwen_tokenizer), VaultEnv(), args, train_dataset=DATASET, processing_class=qwen_tokenizer)
    with pytest.raises(ValueError, match="takes no rollout_func"):
        LOOPTrainer(tiny_qwen(qwen_tokenizer), said_done, args, train_dataset=DATASET, rollout_func=lambda *a: None)
    with pytest.raises(ValueError, match="LOOP takes reward functions"):  # GRPOTrainer would load a reward model
        LOOPTrainer(
            tiny_qwen(qwen_tokenizer),
            args=args,
            reward_funcs="org/reward-model",
            train_dataset=DATASET,
            processing_class=qwen_tokenizer,
        )
    with pytest.raises(ValueError, match="LOOP takes reward functions"):
        LOOPTrainer(
            tiny_qwen(qwen_tokenizer), [tiny_qwen(qwen_tokenizer)], args, DATASET, processing_class=qwen_tokenizer
        )
    with pytest.raises(TypeError, match="needs an environment"):
        LOOPTrainer(tiny_qwen(qwen_tokenizer), args=args, processing_class=qwen_tokenizer)
    with pytest.raises(ValueError, match="LOOPConfig: max_tool_calling_iterations must be >= 1 or None, got 0"):
        LOOPConfig(output_dir=str(tmp_path / "c"), max_tool_calling_iterations=0)


def test_a_grpo_config_is_translated_to_loop_terms(qwen_tokenizer, tmp_path):
    grpo = GRPOConfig(
        output_dir=str(tmp_path / "g"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=10,
        logging_steps=2,
        max_completion_length=2048,
        max_tool_calling_iterations=5,
        learning_rate=1e-5,
        seed=3,
    )
    trainer = LOOPTrainer(
        tiny_qwen(qwen_tokenizer),
        said_done,
        grpo,
        DATASET,
        processing_class=qwen_tokenizer,
        environment_factory=CounterEnv,
        generation_backend=ScriptedBackend(qwen_tokenizer, str),
    )
    args = trainer.args
    assert isinstance(args, LOOPConfig)
    # 8 completions per generation (4 x 2 micro-steps) = 2 prompts x 4; one optimizer step per 8 completions
    assert (args.tasks_per_iteration, args.rollouts_per_task, args.minibatch_size, args.ppo_epochs) == (2, 4, 8, 1)
    assert (args.iterations, args.logging_steps, args.per_device_train_batch_size) == (10, 2, 4)
    assert (args.max_completion_tokens, args.max_new_tokens_per_turn, args.max_turns) == (2048, 2048, 6)
    assert not args.memory_stress_test  # GRPOTrainer has none; LOOP's would need max_trajectory_tokens
    assert (args.learning_rate, args.seed, args.max_tool_calling_iterations) == (1e-5, 3, 5)
    assert trainer.env.max_tool_calling_iterations == 5
    trainer.close()
    epochs = GRPOConfig(
        output_dir=str(tmp_path / "e"),
        use_cpu=True,
        bf16=False,
        num_generations=2,
        per_device_train_batch_size=2,
        num_train_epochs=3,
    )
    assert loop_config_from_grpo(epochs, num_tasks=10)[0].iterations == 30  # 3 passes over 10 prompts, 1 per iteration
    _, _, replaced = loop_config_from_grpo(epochs, num_tasks=10)
    assert "learning_rate: GRPO's 1e-06 -> LOOP's 5e-05" in replaced
    with pytest.raises(
        ValueError, match="a generation batch of 8 completions is not a whole number of optimizer steps"
    ):
        loop_config_from_grpo(
            GRPOConfig(
                output_dir=str(tmp_path / "s"),
                use_cpu=True,
                bf16=False,
                gradient_accumulation_steps=4,
                steps_per_generation=1,
            ),
            num_tasks=2,
        )
    evaluating = GRPOConfig(
        output_dir=str(tmp_path / "v"),
        use_cpu=True,
        bf16=False,
        num_generations=2,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=12,
        eval_strategy="steps",
        eval_steps=6,
        num_generations_eval=4,
        temperature=0.7,
    )
    translated = loop_config_from_grpo(evaluating, num_tasks=2)[0]
    assert (translated.eval_split, translated.eval_every, translated.iterations) == ("eval", 6, 12)
    assert (translated.eval_rollouts_per_task, translated.eval_temperature) == (4, 0.7)
    none = loop_config_from_grpo(
        GRPOConfig(output_dir=str(tmp_path / "n"), use_cpu=True, bf16=False, scale_rewards="none"), num_tasks=8
    )
    assert "scale_rewards" not in str(none[2])
    with pytest.raises(ValueError, match=r"^GRPOConfig -> LOOPConfig: .*epsilon=0.3 \(LOOP clips.*top_p=0.9 \("):
        loop_config_from_grpo(
            GRPOConfig(output_dir=str(tmp_path / "r"), use_cpu=True, bf16=False, epsilon=0.3, top_p=0.9), num_tasks=2
        )


def test_max_completion_tokens_bounds_everything_after_the_opening(qwen_tokenizer):
    from loop_trainer.chat import ChatFormatter
    from loop_trainer.rollout import EpisodeLimits, RolloutEngine
    from support.helpers import EchoEnv

    env = EchoEnv([{"task_id": "a", "turns": 10}])
    backend = ScriptedBackend(qwen_tokenizer, lambda ids: "word " * 10)
    limits = EpisodeLimits(
        max_turns=10, max_new_tokens_per_turn=100, max_trajectory_tokens=10_000, max_completion_tokens=25
    )
    env.set_tokenizer(qwen_tokenizer)
    with RolloutEngine(env, backend, ChatFormatter(qwen_tokenizer), limits) as engine:
        [trajectory] = engine.collect(env.tasks(), rollouts_per_task=1).trajectories
    assert trajectory.ending == "trajectory_budget"
    # the second reply gets only the room the first reply and its environment message left; then none is left
    assert trajectory.num_turns == 2 and trajectory.truncated_turns == 1
    assert sum(trajectory.loss_mask) < 25 < len(trajectory.token_ids) - trajectory.prompt_length


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_trls_importance_sampling_keys_become_loops_sampler_correction(tmp_path, mode):
    base = {"output_dir": str(tmp_path / "g"), "use_cpu": True, "bf16": False, "max_steps": 2}
    config, keys, _ = loop_config_from_grpo(
        GRPOConfig(**base, vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.5), num_tasks=2
    )
    # the mode set, TRL's cap (its default 3.0) and floor carried together
    assert (config.sampler_correction, config.sampler_importance_cap, config.sampler_importance_floor) == (
        mode,
        3.0,
        0.5,
    )
    assert {"sampler_correction", "sampler_importance_cap", "sampler_importance_floor"} <= keys.keys()


def test_trls_cap_level_and_correction_switch_translate(tmp_path):
    base = {"output_dir": str(tmp_path / "g"), "use_cpu": True, "bf16": False, "max_steps": 2}
    capped = loop_config_from_grpo(GRPOConfig(**base, vllm_importance_sampling_clip_max=2.0), num_tasks=2)[0]
    # TRL's default mode comes with the cap: sequence_mask
    assert (capped.sampler_correction, capped.sampler_importance_cap) == ("sequence_mask", 2.0)
    with pytest.warns(FutureWarning):  # TRL's deprecated name of clip_max
        deprecated = GRPOConfig(**base, vllm_importance_sampling_cap=4.0, vllm_importance_sampling_mode="token_mask")
    translated = loop_config_from_grpo(deprecated, num_tasks=2)[0]
    assert (translated.sampler_correction, translated.sampler_importance_cap) == ("token_mask", 4.0)
    off = loop_config_from_grpo(
        GRPOConfig(**base, vllm_importance_sampling_correction=False, vllm_importance_sampling_mode="token_mask"),
        num_tasks=2,
    )[0]
    assert (off.sampler_importance_cap, off.sampler_importance_floor, off.sampler_correction) == (
        None,
        None,
        "token_truncate",
    )  # TRL ignores the mode with the correction off: LOOP's default, no weights
    gspo = loop_config_from_grpo(GRPOConfig(**base, importance_sampling_level="sequence"), num_tasks=2)[0]
    assert gspo.ratio_level == "sequence" and gspo.sampler_importance_cap is None
    # left at TRL's defaults: LOOP's (no correction), logged among the replaced defaults where TRL corrects
    _, keys, replaced = loop_config_from_grpo(GRPOConfig(**base, use_vllm=True), num_tasks=2)
    assert "sampler_correction" not in keys
    assert any(line.startswith("vllm_importance_sampling_mode: GRPO's 'sequence_mask'") for line in replaced)
    assert not any("vllm_importance_sampling" in line for line in loop_config_from_grpo(GRPOConfig(**base), 2)[2])
    # a TRL value LOOP cannot honour: one line naming LOOP's key
    with pytest.raises(ValueError, match="sampler_correction: sequence_mask weighs a trajectory"):
        loop_config_from_grpo(
            GRPOConfig(**base, vllm_importance_sampling_clip_max=None, vllm_importance_sampling_clip_min=0.5),
            num_tasks=2,
        )
