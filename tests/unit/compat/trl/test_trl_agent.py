"""GRPOTrainer's agent arguments (prompt dataset, reward_funcs, tools, environment_factory) as a LOOP
environment, run through the rollout engine with a scripted model that emits Qwen2.5 tool calls."""

from __future__ import annotations

import threading

import pytest
from datasets import Dataset

from loop_trainer.chat import ChatFormatter
from loop_trainer.compat.trl.environment import TRLAgentEnvironment
from loop_trainer.envs import EnvironmentSetupError
from loop_trainer.rollout import EpisodeLimits, RolloutEngine
from support.helpers import ScriptedBackend


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


class Counter:
    """A TRL-style environment: public methods are tools, get_reward() owns a reward."""

    instances = 0

    def __init__(self):
        Counter.instances += 1
        self.resets: list[dict] = []

    def reset(self, **row) -> str:
        self.resets.append(row)
        self.count = row["start"]
        return f" (the counter starts at {row['start']})"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.count += by
        return self.count

    def explode(self) -> str:
        """Always fails."""
        raise RuntimeError("kaput")

    def get_reward(self) -> float:
        return 1.0 if self.count == 10 else 0.0


def double(x: int) -> int:
    """Double a number.

    Args:
        x: The number.
    """
    return 2 * x


SCRIPT = [
    call("increment", '{"by": 3}'),
    call("increment", '{"by": 4,, }'),
    call("nope", "{}"),
    call("explode", "{}"),
    call("double", '{"x": "2"}'),
    call("increment", '{"by": 7}'),
    "Done: 10.",
]


def scripted_model(prompt_ids, tokenizer):
    turn = tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
    return SCRIPT[turn]


def collect(tokenizer, env, rows=None, limits=EpisodeLimits(max_turns=12, max_new_tokens_per_turn=64), k=1):
    env.set_tokenizer(tokenizer)
    backend = ScriptedBackend(tokenizer, lambda prompt: scripted_model(prompt, tokenizer))
    with RolloutEngine(env, backend, ChatFormatter(tokenizer), limits) as engine:
        return engine.collect(env.tasks() if rows is None else rows, rollouts_per_task=k).trajectories


def test_by_default_a_call_that_does_not_parse_ends_the_episode_as_in_grpo_trainer(qwen_tokenizer):
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "Bring the counter to 10."}], "start": 0, "target": 10}]
    )
    env = TRLAgentEnvironment(dataset, tools=[double], environment_factory=Counter)
    [trajectory] = collect(qwen_tokenizer, env)
    assert trajectory.status == "completed", trajectory.error
    assert trajectory.num_turns == 2  # the increment, then the malformed call: plain text, the end
    assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["3"]
    assert trajectory.info["tool_calls"] == 1 and trajectory.info["tool_failures"] == 0


def test_a_trl_environment_factory_episode_runs_with_trls_semantics(qwen_tokenizer):
    seen = {}

    def final_answer(prompts, completions, completion_ids, trainer_state, target, start, environments, **kwargs):
        seen.update(
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids,
            target=target,
            state=trainer_state,
            environments=environments,
            kwargs=set(kwargs),
        )
        kwargs["log_metric"]("answer_length", len(completions[0][-1]["content"]))
        return [0.5 if str(target[0]) in completions[0][-1]["content"] else 0.0]

    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "Bring the counter to 10."}], "start": 0, "target": 10}]
    )
    env = TRLAgentEnvironment(
        dataset,
        [final_answer],
        tools=[double],
        environment_factory=Counter,
        reward_weights=[2.0],
        answer_malformed_calls=True,
    )
    env.trainer_state = "state"
    [trajectory] = collect(qwen_tokenizer, env)
    assert trajectory.status == "completed", trajectory.error
    # the tools were shown in the opening, and reset's observation was appended to the prompt
    opening = qwen_tokenizer.decode(trajectory.token_ids[: trajectory.prompt_length])
    assert all(f'"name": "{name}"' in opening for name in ("increment", "explode", "double"))
    assert '"name": "reset"' not in opening and '"name": "get_reward"' not in opening
    assert "Bring the counter to 10. (the counter starts at 0)<|im_end|>" in opening
    tool_messages = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert tool_messages[0] == "3"
    assert tool_messages[1].startswith("{'error': 'malformed tool call: its JSON does not parse")
    assert tool_messages[2:] == ["{'error': 'Tool nope not found.'}", "{'error': 'kaput'}", "4", "10"]
    # reward: 2.0 x 0.5 (reward_funcs, weighted) + 1.0 (get_reward, weight 1)
    assert trajectory.info["rewards"] == {"final_answer": 0.5, "Counter": 1.0} and trajectory.reward == 2.0
    assert trajectory.info["tool_calls"] == 5 and trajectory.info["tool_failures"] == 3
    # reward functions are called as TRL calls them
    assert seen["target"] == [10] and seen["state"] == "state" and len(seen["environments"]) == 1
    assert seen["prompts"][0][-1]["content"].endswith("(the counter starts at 0)")
    assert [m["role"] for m in seen["completions"][0]] == ["assistant", "tool"] * 6 + ["assistant"]
    assert seen["completions"][0][0]["tool_calls"][0]["function"] == {"name": "increment", "arguments": {"by": 3}}
    assert seen["completion_ids"][0] == trajectory.token_ids[trajectory.prompt_length :]
    assert {"log_extra", "log_metric"} <= seen["kwargs"]
    assert env.metrics() == {"answer_length": float(len("Done: 10."))} and env.metrics() == {}
    # token-exact, tool messages masked out of the loss
    sampled = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m]
    assert "<tool_response>" not in qwen_tokenizer.decode(sampled) and "Done: 10." in qwen_tokenizer.decode(sampled)


def test_max_tool_calling_iterations_ends_the_episode_without_running_the_last_calls(qwen_tokenizer):
    dataset = Dataset.from_list([{"prompt": "Count.", "start": 5}])
    env = TRLAgentEnvironment(dataset, environment_factory=Counter, max_tool_calling_iterations=1)
    [trajectory] = collect(qwen_tokenizer, env)
    assert trajectory.num_turns == 2 and trajectory.ending == "done"
    assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["8"]
    assert trajectory.reward == 0.0  # get_reward alone: the count is 8


def test_instances_are_one_per_rollout_and_reused_across_collections(qwen_tokenizer):
    Counter.instances = 0
    dataset = Dataset.from_list([{"prompt": "Count.", "start": 0}])
    env = TRLAgentEnvironment(dataset, environment_factory=Counter, max_tool_calling_iterations=1)
    assert Counter.instances == 1  # the probe TRL makes too
    for _ in range(2):
        assert len(collect(qwen_tokenizer, env, k=3)) == 3
    assert Counter.instances == 3
    assert all(row == {"prompt": "Count.", "start": 0} for instance in env.pools[None] for row in instance.resets)


def test_a_slow_tool_holds_up_only_its_own_episode(qwen_tokenizer):
    started, released = threading.Event(), threading.Event()

    class Slow(Counter):
        def increment(self, by: int) -> int:
            """Add to the counter.

            Args:
                by: How much to add.
            """
            if self.count == 1:  # the slow episode waits until the other one has run its tool
                started.set()
                assert released.wait(30), "the other episode never ran while this tool was busy"
            elif started.wait(30):
                released.set()
            return super().increment(by)

    dataset = Dataset.from_list([{"prompt": "Count.", "start": 1}, {"prompt": "Count.", "start": 2}])
    env = TRLAgentEnvironment(dataset, environment_factory=Slow, max_tool_calling_iterations=1)
    trajectories = collect(qwen_tokenizer, env)
    assert [t.status for t in trajectories] == ["completed", "completed"] and released.is_set()


def test_setup_errors_are_one_line(qwen_tokenizer):
    from loop_trainer.models.tiny import build_word_tokenizer

    rows = Dataset.from_list([{"prompt": "hi", "environment": "b"}])
    with pytest.raises(ValueError, match="no reward: pass reward_funcs"):
        TRLAgentEnvironment(Dataset.from_list([{"prompt": "hi"}]), tools=[double])
    with pytest.raises(ValueError, match="reward_weights has 2 weights for 1"):
        TRLAgentEnvironment(Dataset.from_list([{"prompt": "hi"}]), [lambda **kw: [1.0]], reward_weights=[1, 2])
    with pytest.raises(ValueError, match="rows name environment 'b', not among environment_factory's"):
        TRLAgentEnvironment(rows, environment_factory={"a": Counter})
    with pytest.raises(ValueError, match="needs a 'prompt' column"):
        TRLAgentEnvironment(Dataset.from_list([{"question": "hi"}]), [lambda **kw: [1.0]])
    env = TRLAgentEnvironment(Dataset.from_list([{"prompt": "hi"}]), [lambda **kw: [1.0]], tools=[double])
    with pytest.raises(EnvironmentSetupError, match="set tokenizer.response_template"):
        env.set_tokenizer(build_word_tokenizer(["hi"]))


def test_a_trl_environment_is_refused_a_collection_process_because_its_rewards_read_the_trainer_state(qwen_tokenizer):
    from loop_trainer.chat import ChatFormatter
    from loop_trainer.rollout import EpisodeLimits
    from loop_trainer.rollout.collection_process import CollectionProcess
    from loop_trainer.rollout.collection_protocol import CollectionProcessError
    from loop_trainer.rollout.engine import EngineSetup

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "Count."}], "start": 0, "target": 1}])
    env = TRLAgentEnvironment(dataset, environment_factory=Counter)
    setup = EngineSetup(env, ChatFormatter(qwen_tokenizer), EpisodeLimits(), 60.0, None, 8)
    with pytest.raises(
        CollectionProcessError, match="TRLAgentEnvironment runs in the trainer's process only .*trainer_state"
    ):
        CollectionProcess(setup)
