"""What the engine hands an episode that parses tool calls: the tools it declares are shown in the
opening the way the chat template shows tools, and each reply arrives as a ``Reply`` carrying the
sampled ids and the trajectory they continue."""

from __future__ import annotations

from datasets import Dataset

from loop_trainer.chat import ChatFormatter
from loop_trainer.envs.base import Environment, Episode, Reply, Score, Step
from loop_trainer.rollout import EpisodeLimits, RolloutEngine
from support.helpers import ScriptedBackend


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


class ToolEpisode(Episode):
    def __init__(self, log: list[Reply], tools):
        self.log, self.tools = log, tools

    def start(self):
        return [{"role": "user", "content": "What is 3 times 4?"}]

    def step(self, reply: Reply) -> Step:
        self.log.append(reply)
        if len(self.log) == 1:
            return Step(messages=[{"role": "tool", "name": "multiply", "content": "12"}])
        return Step(done=True)

    def score(self):
        return Score(reward=1.0)


class ToolEnv(Environment):
    def __init__(self, tools):
        self.tools, self.log = tools, []

    def tasks(self, split="train"):
        return Dataset.from_list([{"task_id": "t0"}])

    def episode(self, task):
        return ToolEpisode(self.log, self.tools)


def collect(tokenizer, env, replies):
    backend = ScriptedBackend(tokenizer, lambda prompt: replies[min(backend.calls, len(replies)) - 1])
    engine = RolloutEngine(env, backend, ChatFormatter(tokenizer), EpisodeLimits(max_turns=4))
    with engine:
        return engine.collect(env.tasks(), rollouts_per_task=1).trajectories[0]


def test_declared_tools_are_rendered_in_the_opening_and_replies_carry_their_tokens(qwen_tokenizer):
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    env = ToolEnv([multiply])
    trajectory = collect(qwen_tokenizer, env, [call, "It is 12."])
    expected_opening = qwen_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 times 4?"}],
        tools=[multiply],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<tools>" in expected_opening and '"name": "multiply"' in expected_opening
    assert qwen_tokenizer.decode(trajectory.token_ids[: trajectory.prompt_length]) == expected_opening
    first, second = env.log
    assert isinstance(first, Reply) and first == call and trajectory.messages[-3]["content"] == call
    assert type(trajectory.messages[-3]["content"]) is str  # stored as plain text
    # the sampled ids (stop token included) and the whole trajectory they continue, exactly
    assert list(first.prompt_ids) == trajectory.token_ids[: trajectory.prompt_length]
    start = len(first.prompt_ids)
    assert list(first.token_ids) == trajectory.token_ids[start : start + len(first.token_ids)]
    assert qwen_tokenizer.decode(first.token_ids, skip_special_tokens=True) == call
    assert list(second.prompt_ids) == trajectory.token_ids[: len(second.prompt_ids)]
    assert "<tool_response>\n12\n</tool_response>" in qwen_tokenizer.decode(second.prompt_ids[start:])


def test_an_episode_without_tools_renders_as_before(qwen_tokenizer):
    env = ToolEnv(None)
    trajectory = collect(qwen_tokenizer, env, ["x", "y"])
    plain = qwen_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 times 4?"}], add_generation_prompt=True, tokenize=False
    )
    assert qwen_tokenizer.decode(trajectory.token_ids[: trajectory.prompt_length]) == plain
    assert "<tools>" not in plain
