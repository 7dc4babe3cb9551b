"""verifiers.v1 tasksets (verifiers 0.4's API; 0.3.1 ships the same stack) through LOOP: ``from_verifiers``,
run by the rollout engine and by LOOPTrainer with a scripted model. No network, no model hub, no ``uv``.

The test venv holds verifiers 0.3.1 (0.4.0 pins mcp 2.0, which OpenEnv's fastmcp 3 cannot share a venv
with); this file imports only ``verifiers.v1``, so it runs unchanged on 0.4.0 (docs/environments.md)."""

from __future__ import annotations

import asyncio
import random

import pytest
import verifiers.v1 as vf

from loop_trainer import LOOPTrainer
from loop_trainer.chat import ChatFormatter
from loop_trainer.compat.verifiers import from_verifiers
from loop_trainer.envs import EnvironmentSetupError, UnknownSplitError
from loop_trainer.rollout import EpisodeLimits, RolloutEngine
from support.helpers import ScriptedBackend, two_iterations_on_a_qwen_vocabulary


class SumData(vf.TaskData):
    a: int
    b: int


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    """Add two numbers: 2 for the sum (a weighted reward), 0.5 for a number, and the reply's length as a metric."""

    @vf.reward(weight=2.0)
    async def correct(self, trace) -> float:
        return float(trace.last_reply == str(self.data.a + self.data.b))

    @vf.reward(weight=0.5)
    async def a_number(self, trace) -> float:
        return float(trace.last_reply.isdigit())

    @vf.metric
    async def reply_length(self, trace) -> float:
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def __init__(self, pairs, **data):
        super().__init__(vf.TasksetConfig())
        self.pairs, self.data = pairs, data

    def load(self):
        for a, b in self.pairs:
            data = SumData(prompt=f"What is {a}+{b}?", system_prompt="Reply with a number.", a=a, b=b, **self.data)
            yield SumTask(data)


def first(taskset, n):
    """A view of ``taskset``'s first ``n`` tasks: ``take`` in 0.4, ``head`` in 0.3.1's v1."""
    return taskset.take(n) if hasattr(taskset, "take") else taskset.head(n)


def collect(tokenizer, env, backend, *, k=1, split="train", max_turns=4, max_new_tokens_per_turn=16):
    env.set_tokenizer(tokenizer)
    with RolloutEngine(
        env,
        backend,
        ChatFormatter(tokenizer),
        EpisodeLimits(max_turns=max_turns, max_new_tokens_per_turn=max_new_tokens_per_turn),
        show_progress=False,
    ) as engine:
        return engine.collect(env.tasks(split), rollouts_per_task=k)


def test_a_taskset_runs_token_exact_with_the_tasks_rewards(qwen_tokenizer):
    tok = qwen_tokenizer
    env = from_verifiers(SumTaskset([(2, 3), (1, 1)]))
    replies = {"What is 2+3?": "5", "What is 1+1?": "two"}
    backend = ScriptedBackend(tok, lambda prompt: next(r for q, r in replies.items() if q in tok.decode(prompt)))
    batch = collect(tok, env, backend)
    assert not batch.failed, batch.failed[0].error
    right, wrong = batch.trajectories
    # the reward is the trace's, the weighted sum of the task's @vf.reward functions; the metric comes along
    assert (right.task_id, right.reward, wrong.reward) == ("0", 2.5, 0.0)
    assert right.info["rewards"] == {"correct": 1.0, "a_number": 1.0}
    assert wrong.info["rewards"] == {"correct": 0.0, "a_number": 0.0}
    assert right.info["metrics"] == {"reply_length": 1.0} and wrong.info["metrics"] == {"reply_length": 3.0}
    assert right.info["stop_condition"] == "no_tools_called" and right.ending == "done" and right.num_turns == 1
    # token-exact: the task's system prompt and prompt as the opening, then the one sampled reply
    opening = [{"role": "system", "content": "Reply with a number."}, {"role": "user", "content": "What is 2+3?"}]
    assert right.messages[: right.num_opening_messages] == opening
    fmt = ChatFormatter(tok)
    sampled = tok.encode("5", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert right.token_ids == fmt.opening_ids(opening) + sampled
    assert [i for i, m in zip(right.token_ids, right.loss_mask, strict=True) if m] == sampled


def test_two_loop_iterations_on_a_taskset(qwen_tokenizer, tmp_path):
    tok, rng = qwen_tokenizer, random.Random(0)
    scored: list[float] = []

    class Recorded(SumTask):
        @vf.reward(weight=2.0)
        async def correct(self, trace) -> float:
            scored.append(float(trace.last_reply == str(self.data.a + self.data.b)))
            return scored[-1]

    class RecordedTaskset(SumTaskset):
        def load(self):
            for task in super().load():
                yield Recorded(task.data)

    env = from_verifiers(RecordedTaskset([(1, 1), (1, 2), (2, 2), (0, 1)]))
    model, args = two_iterations_on_a_qwen_vocabulary(
        tok, tmp_path, max_turns=2, max_new_tokens_per_turn=4, max_trajectory_tokens=200
    )
    before = [p.detach().clone() for p in model.parameters()]
    backend = ScriptedBackend(tok, lambda prompt: str(rng.randint(1, 4)))
    trainer = LOOPTrainer(model, env, args, processing_class=tok, generation_backend=backend)
    trainer.train()
    assert len(trainer.history) == 2
    assert all(h["num_failed"] == 0 and h["num_rollouts"] == 6 for h in trainer.history)
    # the rewards LOOP trained on are the task's: 2 x correct + 0.5 (every scripted reply is a number)
    assert len(scored) == 12 and len(set(scored)) > 1
    for i, h in enumerate(trainer.history):
        assert h["reward_mean"] == pytest.approx(sum(2 * s + 0.5 for s in scored[6 * i : 6 * i + 6]) / 6)
    assert sum(h["optimizer_steps"] for h in trainer.history) > 0
    assert any(not p.equal(b) for p, b in zip(model.parameters(), before, strict=True))


def test_splits_and_task_ids():
    env = from_verifiers(SumTaskset([(1, 2), (3, 4)]), eval_taskset=SumTaskset([(5, 6)]))
    assert env.tasks()["task_id"] == ["0", "1"] and env.tasks()["prompt"] == ["What is 1+2?", "What is 3+4?"]
    assert env.tasks("eval")["prompt"] == ["What is 5+6?"]
    assert env.name == "verifiers:SumTaskset" and env.default_eval_split == "eval"
    with pytest.raises(UnknownSplitError, match="splits are 'train' \\(the taskset"):
        from_verifiers(SumTaskset([(1, 2)])).tasks("eval")
    # a durable id (0.4) or a name that names every task once is the task id
    assert from_verifiers(SumTaskset([(1, 2)], name="sum-1")).tasks()["task_id"] == ["sum-1"]
    assert from_verifiers(SumTaskset([(1, 2), (2, 3)], name="same")).tasks()["task_id"] == ["0", "1"]
    # a view of a taskset is a taskset
    assert from_verifiers(first(SumTaskset([(1, 2), (3, 4), (5, 6)]), 2)).tasks()["prompt"][-1] == "What is 3+4?"


def test_a_raising_reward_fails_only_its_rollout(qwen_tokenizer):
    class Fragile(SumTask):
        @vf.reward
        async def fragile(self, trace) -> float:
            if self.data.a == 0:
                raise ZeroDivisionError("oops")
            return 1.0

    class FragileTaskset(SumTaskset):
        def load(self):
            for task in super().load():
                yield Fragile(task.data)

    tok = qwen_tokenizer
    batch = collect(tok, from_verifiers(FragileTaskset([(1, 1), (0, 1)])), ScriptedBackend(tok, lambda prompt: "2"))
    [ok] = batch.trajectories
    assert ok.task_id == "0" and ok.reward == 2.0 + 0.5 + 1.0
    [failed] = batch.failed
    assert failed.task_id == "1" and "ZeroDivisionError: oops" in failed.error and "\n" not in failed.error


def test_what_cannot_run_in_process_is_refused_in_one_line():
    from verifiers.v1.runtimes import DockerConfig

    class Search(vf.Toolset):
        @vf.tool
        async def search(self, query: str) -> str:
            """Search."""
            return query

    class OwnHandlers(Search):
        def register(self, mcp):
            return None

    def with_tools(server):
        class WithTools(SumTask):
            @classmethod
            def toolsets(cls, config):
                return [server]

        return WithTools

    class Intercepting(SumTask):
        @vf.intercept
        async def rewrite(self, request: vf.Request) -> vf.Request:
            return request

    class RequestStop(SumTask):
        @vf.stop
        async def long_prompt(self, request: vf.Request) -> bool:
            return False

    class Boxed(SumTask):
        NEEDS_CONTAINER = True

    class WithSetup(SumTask):
        async def setup(self, trace, runtime):
            return None

    class NoReward(vf.Task[SumData, vf.State, vf.TaskConfig]):
        pass

    class RuntimeReward(SumTask):
        @vf.reward
        async def tests_pass(self, trace, runtime) -> float:
            return 1.0

    def taskset_of(task_cls, **data):
        class One(SumTaskset):
            def load(self):
                for task in super().load():
                    yield task_cls(task.data)

        return One([(1, 2)], **data)

    cases = {
        with_tools(Search(vf.ToolsetConfig(url="http://tools:8000/mcp"))): "WithTools's tool server Search is remote",
        with_tools(Search(vf.ToolsetConfig(runtime=DockerConfig()))): "WithTools's tool server Search runs in a Docker",
        with_tools(OwnHandlers(vf.ToolsetConfig())): "WithTools's tool server OwnHandlers registers MCP handlers",
        Intercepting: "Intercepting intercepts model requests",
        RequestStop: "RequestStop's stop long_prompt reads a Request",
        Boxed: "Boxed needs a container",
        WithSetup: "WithSetup defines setup, which run in a runtime",
        NoReward: "NoReward has no reward",
        RuntimeReward: "RuntimeReward's tests_pass need a runtime",
    }
    for task_cls, message in cases.items():
        with pytest.raises(EnvironmentSetupError, match=f"^{message}"):
            from_verifiers(taskset_of(task_cls)).tasks()

    class Silent(SumTaskset):  # the user opens the conversation: a user simulator's task
        def load(self):
            yield SumTask(SumData(a=1, b=2))

    with pytest.raises(EnvironmentSetupError, match="^SumTask has no prompt"):
        from_verifiers(Silent([])).tasks()

    class Endless(SumTaskset):
        INFINITE = True

    bound = r"pass taskset.take\(n\) \(verifiers 0.3.1: taskset.head\(n\)\)"
    with pytest.raises(EnvironmentSetupError, match=f"^Endless is infinite; .* {bound}"):
        from_verifiers(Endless([(1, 2)]))
    assert from_verifiers(first(Endless([(1, 2)]), 1)).tasks()["task_id"] == ["0"]

    class Shared(SumTaskset):
        @classmethod
        def toolsets(cls, config):
            return [Search(vf.SharedToolsetConfig(url="http://tools:8000/mcp"))]

    with pytest.raises(EnvironmentSetupError, match="^Shared's shared tool server Search is remote"):
        from_verifiers(Shared([(1, 2)]))

    class Solo(vf.Env):  # an Env: a taskset and the agents that play it (not constructed: that loads by id)
        async def run(self, task, agents):
            return None

    with pytest.raises(ValueError, match=r"pass its taskset, from_verifiers\(env.taskset\)"):
        from_verifiers(object.__new__(Solo))
    with pytest.raises(ValueError, match="^fail_on_reward_error apply to verifiers 0.3 environments"):
        from_verifiers(SumTaskset([(1, 2)]), fail_on_reward_error=True)
    with pytest.raises(ValueError, match="^eval_taskset is for a verifiers.v1 taskset"):
        from_verifiers(object(), eval_taskset=SumTaskset([(1, 2)]))


def test_an_episode_is_the_tasks_opening_and_one_reply():
    env = from_verifiers(SumTaskset([(2, 2)]))

    async def run():
        episode = env.episode(env.tasks()[0])
        opening = await episode.start()
        step = await episode.step("4")
        return opening, step, await episode.score()

    opening, step, score = asyncio.run(run())
    assert opening[-1] == {"role": "user", "content": "What is 2+2?"} and step.done and not step.messages
    assert score.reward == 2.5 and score.info["task_key"] == env.loaded["train"][0].key


class Cart(vf.State):
    items: list[str] = []


class Shop(vf.Toolset[vf.ToolsetConfig, Cart]):
    """A shop whose tools fill the rollout's cart (the state a tool server shares with its rollout)."""

    opened: list[str] = []  # which tasks a shop was set up for, and when shops closed

    async def setup_task(self, task) -> None:
        Shop.opened.append(task.data.want)

    @vf.tool
    async def add(self, item: str, count: int = 1) -> str:
        """Put ``count`` of ``item`` in the cart."""
        self.state.items = [*self.state.items, *[item] * count]
        return f"{len(self.state.items)} in the cart"

    @vf.tool(name="cart")
    def contents(self) -> dict:
        """What the cart holds."""
        return {"items": self.state.items}

    @vf.tool
    async def pay(self) -> str:
        """Pay."""
        raise RuntimeError("the till is closed")


class ShopData(vf.TaskData):
    want: str


class ShopTask(vf.Task[ShopData, Cart, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Shop(vf.ToolsetConfig())]

    @vf.reward
    async def bought(self, trace) -> float:
        return float(sorted(trace.state.items) == sorted(self.data.want.split()))

    @vf.stop
    async def cart_full(self, trace: vf.Trace) -> bool:
        return len(trace.state.items) >= 3


class ShopTaskset(vf.Taskset[ShopTask, vf.TasksetConfig]):
    def __init__(self, wants):
        super().__init__(vf.TasksetConfig())
        self.wants = wants

    def load(self):
        for want in self.wants:
            yield ShopTask(ShopData(prompt=f"Buy {want}.", want=want))


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_a_task_with_tools_runs_them_in_process_on_the_rollouts_state(qwen_tokenizer):
    tok = qwen_tokenizer
    script = {
        "Buy egg milk.": [
            call("shop_add", '{"item": "egg"}'),
            call("shop_cart", "{}") + "\n" + call("shop_pay", "{}"),
            call("shop_add", '{"item": "milk", "count": "many"}') + "\n" + call("shop_steal", "{}"),
            "<tool_call>\n{not json\n</tool_call>",
            call("shop_add", '{"item": "milk"}'),
            "Done.",
        ],
        "Buy tea tea tea.": [call("shop_add", '{"item": "tea", "count": 3}'), "never asked"],
    }
    Shop.opened.clear()
    backend = ScriptedBackend(tok, lambda prompt: next(r for q, r in script.items() if q in tok.decode(prompt)).pop(0))
    batch = collect(
        tok, from_verifiers(ShopTaskset(["egg milk", "tea tea tea"])), backend, max_turns=8, max_new_tokens_per_turn=64
    )
    assert not batch.failed, batch.failed[0].error
    shopped, full = batch.trajectories
    assert sorted(Shop.opened) == ["egg milk", "tea tea tea"]  # a shop per episode, set up for its task
    # the tools reach the model through the chat template, named <server>_<tool> as verifiers' harness names them
    text = tok.decode(shopped.token_ids)
    head = text[: text.index("Buy egg milk.")]
    assert all(f'"name": "shop_{name}"' in head for name in ("add", "cart", "pay"))
    assert "Put ``count`` of ``item`` in the cart." in head
    results = [m["content"] for m in shopped.messages if m["role"] == "tool"]
    assert results == [
        "1 in the cart",
        '{\n  "items": [\n    "egg"\n  ]\n}',
        "Error executing tool pay: the till is closed",
        results[3],  # a count that is not an integer: the arguments do not validate
        "error: unknown tool 'shop_steal'",
        results[5],  # a call whose JSON does not parse: answered, and the episode goes on
        "2 in the cart",
    ]
    assert results[3].startswith("Error executing tool add: ") and "count" in results[3]
    assert "malformed tool call" in results[5]
    # the tools' state is what the task scores: egg and milk bought, no stray milk from the failed call
    assert shopped.reward == 1.0 and shopped.info["stop_condition"] == "no_tools_called"
    assert shopped.num_turns == 6 and shopped.info["tool_calls"] == 6
    # a stop on the trace ends the episode before the next reply: three teas fill the cart
    assert full.reward == 1.0 and full.num_turns == 1 and full.info["stop_condition"] == "cart_full"
    assert full.ending == "done"
    # token-exact: only the sampled replies are trained on
    sampled = [i for i, m in zip(shopped.token_ids, shopped.loss_mask, strict=True) if m]
    assert tok.decode(sampled).count("<tool_call>") == 7 and "1 in the cart" not in tok.decode(sampled)


def test_the_verifiers_under_test_is_the_one_asked_for():
    """`make test` runs this file twice: on .venv's verifiers 0.3.1 and on 0.4.0 (LOOP_EXPECT_VERIFIERS)."""
    import os

    import verifiers

    assert verifiers.__version__ == os.environ.get("LOOP_EXPECT_VERIFIERS", "0.3.1")


def test_tools_with_a_chat_template_that_cannot_be_parsed_are_refused_in_one_line():
    from loop_trainer.models.tiny import build_word_tokenizer

    env = from_verifiers(ShopTaskset(["egg"]))
    env.set_tokenizer(build_word_tokenizer(["buy", "egg"]))  # a template with no tool-call format TRL knows
    with pytest.raises(EnvironmentSetupError) as refused:
        asyncio.run(env.episode(env.tasks()[0]).start())
    assert str(refused.value).startswith("ShopTask has tools, but ") and "\n" not in str(refused.value)
    plain = from_verifiers(SumTaskset([(1, 2)]))  # without tools the same tokenizer is fine
    plain.set_tokenizer(build_word_tokenizer(["buy", "egg"]))
    assert asyncio.run(plain.episode(plain.tasks()[0]).start())[-1]["content"] == "What is 1+2?"
