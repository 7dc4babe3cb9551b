"""verifiers 0.3.1 environments (ToolEnv, MultiTurnEnv) through LOOP: ``from_verifiers``, run by the rollout
engine and by LOOPTrainer with a scripted model that emits Qwen2.5 tool calls. No network, no model hub."""

from __future__ import annotations

import asyncio
import random
import sys

import pytest
import verifiers as vf
from datasets import Dataset

from loop_trainer import LOOPTrainer
from loop_trainer.chat import ChatFormatter
from loop_trainer.compat import verifiers as verifiers_env
from loop_trainer.compat.verifiers import from_verifiers
from loop_trainer.envs import EnvironmentSetupError, UnknownSplitError
from loop_trainer.models.tiny import build_word_tokenizer
from loop_trainer.rollout import EpisodeLimits, RolloutEngine
from support.helpers import ScriptedBackend, two_iterations_on_a_qwen_vocabulary


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


class Recording(ScriptedBackend):
    """A scripted backend that keeps what it sampled, to check the trajectory against."""

    def __init__(self, tokenizer, reply):
        super().__init__(tokenizer, reply)
        self.sampled: list[list[int]] = []

    async def generate(self, prompt_ids, max_new_tokens, seed=None):
        completion = await super().generate(prompt_ids, max_new_tokens, seed)
        self.sampled.append(list(completion.token_ids))
        return completion


def collect(tokenizer, env, backend, *, max_turns=8, k=1, rows=None):
    env.set_tokenizer(tokenizer)
    with RolloutEngine(
        env,
        backend,
        ChatFormatter(tokenizer),
        EpisodeLimits(max_turns=max_turns, max_new_tokens_per_turn=64),
        show_progress=False,
    ) as engine:
        return engine.collect(env.tasks() if rows is None else rows, rollouts_per_task=k)


def turn_of(tokenizer, prompt_ids) -> int:
    return tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1


def adder_env(calls, **kwargs):
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        calls.append((a, b))
        return a + b

    def correct(completion, answer) -> float:
        return 1.0 if str(answer) in str(completion[-1].content) else 0.0

    dataset = Dataset.from_dict({"question": ["What is 2+3?"], "answer": ["5"]})
    return vf.ToolEnv(
        tools=[add],
        dataset=dataset,
        rubric=vf.Rubric(funcs=[correct], weights=[2.0]),
        system_prompt="Use the tools.",
        **kwargs,
    )


TOOL_SCRIPT = [call("add", '{"a": 2, "b": "3"}'), call("add", '{"a": 2,, }'), call("nope", "{}"), "It is 5."]


def test_a_tool_env_runs_token_exact_with_the_rubrics_reward(qwen_tokenizer):
    tok, calls = qwen_tokenizer, []
    env = from_verifiers(adder_env(calls, max_turns=6))
    backend = Recording(tok, lambda prompt: TOOL_SCRIPT[turn_of(tok, prompt)])
    batch = collect(tok, env, backend)
    assert not batch.failed, batch.failed[0].error
    [t] = batch.trajectories
    # the tool ran with the arguments the model wrote ("3" typed by the schema, as TRL parses);
    # a malformed call and an unknown tool came back as verifiers' tool messages, and the run went on
    assert calls == [(2, 3)]
    tool_messages = [m["content"] for m in t.messages if m["role"] == "tool"]
    assert tool_messages[0] == "5"
    assert tool_messages[1].startswith("Expecting property name enclosed in double quotes")
    assert tool_messages[2] == "'nope'"
    # the rubric's reward (weight 2, outside [0, 1]) is the trajectory's; verifiers' record comes along
    assert t.reward == 2.0 and t.ending == "done" and t.num_turns == 4
    assert t.info["stop_condition"] == "no_tools_called"
    assert t.info["metrics"]["correct"] == 1.0 and t.info["metrics"]["total_tool_calls"] == 3.0
    assert t.info["completion"][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert env.metrics() == {"stop_no_tools_called": 1.0} and env.metrics() == {}
    # token-exact: the opening (verifiers' prompt, its tool shown by the template), then each sampled
    # reply followed by the template's rendering of the messages verifiers appended
    fmt = ChatFormatter(tok)
    opening = t.messages[: t.num_opening_messages]
    assert [m["role"] for m in opening] == ["system", "user"] and opening[0]["content"] == "Use the tools."
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": env.vf_env.tool_defs[0].parameters,
            },
        }
    ]
    expected = fmt.opening_ids(opening, tools=tools)
    appended = [m for m in t.info["completion"] if m["role"] == "tool"]
    for sampled, message in zip(backend.sampled, [*appended, None], strict=True):
        expected += sampled
        if message is not None:
            expected += fmt.after_reply_ids(sampled, True) + fmt.continuation_ids([message])
    assert t.token_ids == expected
    assert '"name": "add"' in tok.decode(t.token_ids[: t.prompt_length])
    # only the sampled tokens are trained on: no tool response, no prompt
    assert [i for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m] == sum(backend.sampled, [])
    assert "<tool_response>" not in tok.decode([i for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m])


class Guess(vf.MultiTurnEnv):
    """Guess the number: feedback each turn, 'correct!' as the final environment response."""

    scored: list[float] = []

    def __init__(self, answers, **kwargs):
        def solved(state) -> float:  # 1 for a solve, less for a slow one, -0.5 for none
            reward = 1.1 - 0.1 * len(state["trajectory"]) if state["final_env_response"] else -0.5
            Guess.scored.append(reward)
            return reward

        dataset = Dataset.from_dict(
            {"question": [f"Guess my number ({i}), 1 to 4." for i in range(len(answers))], "answer": answers}
        )
        super().__init__(dataset=dataset, rubric=vf.Rubric(funcs=[solved]), max_turns=3, **kwargs)

    async def env_response(self, messages, state, **kwargs):
        guess, answer = messages[-1].content.strip(), state["answer"]
        if answer == "boom":
            raise ValueError("the game crashed")
        if answer == "vf-error":
            raise vf.ToolCallError("the referee is gone")
        if guess == answer:
            state["final_env_response"] = [vf.UserMessage(content="correct!")]
            return state["final_env_response"]
        hint = "higher" if guess.isdigit() and int(guess) < int(answer) else "lower"
        return [vf.UserMessage(content=hint)]


def test_two_loop_iterations_on_a_verifiers_game(qwen_tokenizer, tmp_path):
    tok, rng = qwen_tokenizer, random.Random(0)
    Guess.scored = []
    env = from_verifiers(Guess(["1", "2", "3", "4"]))
    model, args = two_iterations_on_a_qwen_vocabulary(
        tok, tmp_path, max_turns=4, max_new_tokens_per_turn=8, max_trajectory_tokens=400
    )
    before = [p.detach().clone() for p in model.parameters()]
    backend = ScriptedBackend(tok, lambda prompt: str(rng.randint(1, 4)))
    trainer = LOOPTrainer(model, env, args, processing_class=tok, generation_backend=backend)
    trainer.train()
    assert len(trainer.history) == 2
    assert all(h["num_failed"] == 0 and h["num_rollouts"] == 6 for h in trainer.history)
    # the rewards LOOP trained on are the ones the rubric computed, iteration by iteration
    assert len(Guess.scored) == 12 and len(set(Guess.scored)) > 1
    for i, h in enumerate(trainer.history):
        assert h["reward_mean"] == pytest.approx(sum(Guess.scored[6 * i : 6 * i + 6]) / 6)
    stops = sum(
        h.get("env_stop_has_final_env_response", 0) + h.get("env_stop_max_turns_reached", 0) for h in trainer.history
    )
    assert stops == 12
    assert sum(h["optimizer_steps"] for h in trainer.history) > 0
    assert any(not p.equal(b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_failing_environment_fails_only_its_rollouts(qwen_tokenizer):
    tok = qwen_tokenizer
    env = from_verifiers(Guess(["2", "boom", "vf-error"]))
    batch = collect(tok, env, ScriptedBackend(tok, lambda prompt: "1"), k=2)
    assert [t.task_id for t in batch.trajectories] == ["0", "0"]
    errors = sorted({t.error for t in batch.failed})
    assert [t.task_id for t in batch.failed] == ["1", "1", "2", "2"]
    assert errors == [
        "RuntimeError: the verifiers rollout stopped on an error: ToolCallError: the referee is gone",
        "ValueError: the game crashed",
    ]


def test_loops_turn_limit_ends_the_rollout_and_it_is_still_scored(qwen_tokenizer):
    tok = qwen_tokenizer
    env = from_verifiers(Guess(["4"]))
    [t] = collect(tok, env, ScriptedBackend(tok, lambda prompt: "1"), max_turns=2).trajectories
    assert t.ending == "turn_limit" and t.num_turns == 2
    assert t.reward == -0.5 and t.info["stop_condition"] == "prompt_too_long" and t.info["is_truncated"]


def test_closing_an_abandoned_episode_cancels_its_rollout_and_runs_verifiers_cleanup(qwen_tokenizer):
    cleaned = []

    class Tracked(Guess):
        @vf.cleanup
        async def note(self, state):
            cleaned.append(state["answer"])

    env = from_verifiers(Tracked(["3"]))

    async def abandon():
        episode = env.episode(env.tasks()[0])
        opening = await episode.start()
        assert opening[-1] == {"role": "user", "content": "Guess my number (0), 1 to 4."}
        assert not episode.rollout.done()  # waiting for the model's reply
        await asyncio.wait_for(episode.close(), 10)  # a rollout left waiting would never end
        return episode

    episode = asyncio.run(abandon())
    assert episode.rollout.cancelled() and cleaned == ["3"]


def test_an_environment_that_rewrites_history_fails_with_one_line(qwen_tokenizer):
    class Forgetful(Guess):
        async def get_prompt_messages(self, state):
            if not state["trajectory"]:
                return state["prompt"]
            return [*state["prompt"], vf.UserMessage(content="try again")]  # drops the model's reply

    tok = qwen_tokenizer
    batch = collect(tok, from_verifiers(Forgetful(["3"])), ScriptedBackend(tok, lambda prompt: "1"))
    [failed] = batch.failed
    assert failed.error.startswith(
        "EpisodeContractError: the verifiers environment rewrote the conversation at turn 1 "
        "(message 1 differs from what the model saw)"
    )


def test_a_raising_reward_function_is_counted_or_fails_the_rollout(qwen_tokenizer):
    def broken(completion) -> float:
        raise ZeroDivisionError("oops")

    def make(**kwargs):
        dataset = Dataset.from_dict({"question": ["Say hi."], "answer": ["hi"]})
        return from_verifiers(vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[broken])), **kwargs)

    tok = qwen_tokenizer
    env = make()
    [t] = collect(tok, env, ScriptedBackend(tok, lambda prompt: "hi")).trajectories
    assert t.reward == 0.0 and t.num_turns == 1 and t.info["stop_condition"] == "max_turns_reached"
    assert t.info["reward_errors"] == ["Error calling reward function broken: oops"]
    assert env.metrics() == {"reward_function_errors": 1.0, "stop_max_turns_reached": 1.0}
    [failed] = collect(tok, make(fail_on_reward_error=True), ScriptedBackend(tok, lambda prompt: "hi")).failed
    assert failed.error == (
        "RuntimeError: Error calling reward function broken: oops (fail_on_reward_error=True; "
        "verifiers would score it 0.0)"
    )


def test_splits_and_setup_errors():
    train = Dataset.from_dict({"question": ["a", "b"], "answer": ["1", "2"]})
    env = from_verifiers(vf.SingleTurnEnv(dataset=train, rubric=vf.Rubric(funcs=[lambda completion: 1.0])))
    assert env.tasks("train")["task_id"] == ["0", "1"] and "prompt" in env.tasks().column_names
    with pytest.raises(UnknownSplitError, match="splits are 'train'"):
        env.tasks("eval")
    both = from_verifiers(
        vf.SingleTurnEnv(
            dataset=train, eval_dataset=train.select([1]), rubric=vf.Rubric(funcs=[lambda completion: 1.0])
        )
    )
    assert both.tasks("eval")["question"] == ["b"]
    with pytest.raises(EnvironmentSetupError, match="rubric has no reward function with a weight"):
        from_verifiers(vf.SingleTurnEnv(dataset=train))
    with pytest.raises(EnvironmentSetupError, match="group reward functions"):
        from_verifiers(vf.SingleTurnEnv(dataset=train, rubric=vf.Rubric(funcs=[lambda completions: [1.0]])))
    with pytest.raises(ValueError, match="takes a verifiers 0.3.x vf.Environment"):
        from_verifiers(object())
    with pytest.raises(ValueError, match="env_args are for loading an environment by id"):
        from_verifiers(vf.SingleTurnEnv(dataset=train, rubric=vf.Rubric(funcs=[lambda completion: 1.0])), env_args={})
    words = build_word_tokenizer(["hi"])  # a template TRL cannot parse tool calls from
    env.set_tokenizer(words)  # fine without tools
    with pytest.raises(EnvironmentSetupError, match="set tokenizer.response_template"):
        from_verifiers(adder_env([])).set_tokenizer(words)


def test_a_packaged_environment_loads_by_id(tmp_path, monkeypatch):
    (tmp_path / "vf_tiny_game.py").write_text(
        "import verifiers as vf\nfrom datasets import Dataset\n\n"
        "def load_environment(answer='1'):\n"
        "    dataset = Dataset.from_dict({'question': ['Say it.'], 'answer': [answer]})\n"
        "    return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[lambda completion: 1.0]))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = verifiers_env.VerifiersEnvironment("vf-tiny-game", {"answer": "7"})  # as loop-train builds it
    assert env.name == "verifiers:vf-tiny-game" and env.tasks()["answer"] == ["7"]
    with pytest.raises(EnvironmentSetupError, match="^Could not import 'vf-no-such-game' environment"):
        from_verifiers("vf-no-such-game")


def test_a_missing_or_wrong_verifiers_is_one_actionable_line(monkeypatch):
    verifiers_env._verifiers.cache_clear()
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(EnvironmentSetupError, match=r"pip install 'loop-trainer\[verifiers\]'"):
        from_verifiers(object())
    monkeypatch.setitem(sys.modules, "verifiers", vf)
    monkeypatch.setattr(vf, "__version__", "0.4.0")
    verifiers_env._verifiers.cache_clear()
    with pytest.raises(EnvironmentSetupError, match=r"verifiers 0.4.0 is installed.*v1 Taskset.*\[verifiers\]"):
        from_verifiers(object())
    monkeypatch.undo()
    verifiers_env._verifiers.cache_clear()
