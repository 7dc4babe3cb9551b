"""GRPOTrainer's agent-training arguments as a LOOP environment.

A TRL 1.16 multi-turn script hands ``GRPOTrainer`` a ``train_dataset`` with a ``prompt`` column,
``reward_funcs``, and ``tools`` and/or an ``environment_factory``. :class:`TRLAgentEnvironment`
takes the same objects and gives them TRL's semantics, one episode per rollout, so they run
through LOOP's concurrent rollout engine unchanged:

* the prompt is the row's ``prompt`` (a conversation, or a string: one user message);
* ``environment_factory`` (or a dict of them, picked per row by its ``environment`` column) gives
  each rollout its own instance (reused across iterations, as TRL pools them); ``reset(**row)``
  is called with the whole row (``environment`` left out in dict mode), and a string it returns
  is appended to the last prompt message, with no separator;
* tools are ``tools`` plus the instance's public methods (not ``reset``/``get_reward``), shown
  through the chat template and called as TRL calls them (:mod:`.tool_calls`); the episode ends at
  the first reply without a tool call, or after ``max_tool_calling_iterations`` rounds of calls;
* the reward is TRL's: the weighted sum (``reward_weights``, default 1) of the reward functions,
  called as TRL calls them (``prompts``, ``completions`` as messages, ``completion_ids``, every
  other column as a list, ``trainer_state``, ``log_extra``, ``log_metric``, ``environments``),
  plus ``get_reward()`` with weight 1; ``None`` from a function leaves it out.

Differences, and why: reward functions are called once per finished episode (a batch of one, as
soon as it ends) instead of once per generation batch; a reply whose tool call does not parse gets a
tool message instead of ending the episode; every reward must be finite, and a rollout all of whose
reward sources returned ``None`` fails (counted) instead of getting a zero advantage. LOOP needs no
prefix-preserving template swap: it appends the sampled tokens exactly and never re-renders them.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from datasets import Dataset
from transformers import TrainerCallback

from ...envs.base import (
    Environment,
    EnvironmentSetupError,
    Episode,
    EpisodeContractError,
    Message,
    Reply,
    Score,
    Step,
    UnknownSplitError,
    with_task_ids,
)
from .tool_calls import call_tools, malformed_call_message, parse_reply, prepare_tokenizer, tool_functions

__all__ = ["TRLAgentEnvironment"]


def _name(function: Callable) -> str:
    return getattr(function, "__name__", type(function).__name__)


def _is_model(value: Any) -> bool:
    # GRPOTrainer also takes reward models (a model id, or a model): callable, but not as a reward function
    return (
        type(value).__module__.startswith(("torch.", "transformers."))
        or hasattr(value, "config")
        and hasattr(value, "forward")
    )


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class TRLAgentEnvironment(Environment):
    """``train_dataset`` / ``eval_dataset`` rows as tasks (splits "train" and "eval"), each episode
    an agent that calls ``tools`` and the ``environment_factory`` instance's methods."""

    name = "trl"
    default_eval_split = "eval"  # its eval_dataset
    reward_range = (-math.inf, math.inf)
    in_process_only = (
        "its reward functions read the trainer's state (trainer_state), which a collection process does not have, "
        "and its metrics are means since the last call"
    )

    def __init__(
        self,
        train_dataset: Dataset,
        reward_funcs: Callable | Sequence[Callable] = (),
        *,
        tools: Sequence[Callable] = (),
        environment_factory: Callable | Mapping[str, Callable] | None = None,
        reward_weights: Sequence[float] | None = None,
        max_tool_calling_iterations: int | None = None,
        eval_dataset: Dataset | None = None,
        answer_malformed_calls: bool = False,
    ):
        self.reward_funcs = (
            [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs or ())
        )
        for function in self.reward_funcs:
            if not callable(function) or _is_model(function):
                raise ValueError(
                    f"reward_funcs: LOOP takes reward functions (callables); got {function!r}. Wrap a "
                    "reward model in a function that scores the completions"
                )
        if reward_weights is not None and len(reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(reward_weights)} weights for {len(self.reward_funcs)} "
                "reward functions (reward_funcs): give one weight per function"
            )
        self.reward_weights = (
            [1.0] * len(self.reward_funcs) if reward_weights is None else [float(w) for w in reward_weights]
        )
        self.factories = (
            {None: environment_factory} if callable(environment_factory) else dict(environment_factory or {})
        )
        self.multi_environment = isinstance(environment_factory, Mapping)
        self.tools = list(tools or ())
        self.max_tool_calling_iterations = max_tool_calling_iterations
        # False: as GRPOTrainer, a reply opening a call that does not parse is plain text and ends the rollout
        self.answer_malformed_calls = answer_malformed_calls
        # one instance per factory now, as TRL probes them: its class says whether it owns a reward, and
        # it is the first of the pool rollouts draw from
        self.pools: dict[Any, list[Any]] = {}
        self.has_get_reward: dict[Any, bool] = {}
        for key, factory in self.factories.items():
            instance = factory()
            if not callable(getattr(instance, "reset", None)):
                raise ValueError(
                    "Each environment instance returned by `environment_factory` must define a callable "
                    f"`reset` ({type(instance).__name__} does not)"
                )
            self.pools[key] = [instance]
            self.has_get_reward[key] = inspect.isfunction(getattr(type(instance), "get_reward", None))
        if not self.reward_funcs and not any(self.has_get_reward.values()):
            raise ValueError("no reward: pass reward_funcs, or an environment_factory whose class defines get_reward()")
        self.user_columns: set[str] = set()  # what reset() and the reward functions see of a row
        self.datasets = {"train": self._checked(train_dataset, "train_dataset")}
        if eval_dataset is not None:
            self.datasets["eval"] = self._checked(eval_dataset, "eval_dataset")
        self.tokenizer: Any = None
        self.trainer_state: Any = None
        self.logged: dict[str, list[float]] = {}

    def _checked(self, dataset: Dataset, argument: str) -> Dataset:
        if not isinstance(dataset, Dataset):
            raise ValueError(f"{argument} must be a datasets.Dataset, got {type(dataset).__name__}")
        if "prompt" not in dataset.column_names and not self.factories:
            raise ValueError(
                f"{argument} needs a 'prompt' column (a conversation or a string); it has: "
                + ", ".join(dataset.column_names)
            )
        if self.multi_environment:
            names = set(dataset["environment"]) if "environment" in dataset.column_names else {None}
            unknown = sorted(str(n) for n in names - set(self.factories))
            if unknown:
                raise ValueError(
                    f"{argument}: rows name environment {unknown[0]!r}, not among environment_factory's "
                    f"({', '.join(map(str, self.factories))}); every row needs an 'environment' column "
                    "naming one of them"
                )
        self.user_columns.update(dataset.column_names)
        return with_task_ids(dataset, "row")

    def tasks(self, split: str = "train") -> Dataset:
        if split not in self.datasets:
            raise UnknownSplitError(
                f"this environment's splits are {', '.join(map(repr, self.datasets))} "
                "(train_dataset, eval_dataset); set train_split / eval_split to one of them"
            )
        return self.datasets[split]

    def set_tokenizer(self, tokenizer: Any) -> None:
        if self.tools or self.factories:
            try:
                tokenizer = prepare_tokenizer(tokenizer)
            except ValueError as error:
                raise EnvironmentSetupError(str(error)) from None
        self.tokenizer = tokenizer

    def episode(self, task: Mapping[str, Any]) -> TRLAgentEpisode:
        return TRLAgentEpisode(self, task)

    def metrics(self) -> dict[str, float]:
        """What reward functions logged with ``log_metric`` since the last call (means)."""
        logged, self.logged = self.logged, {}
        return {name: sum(values) / len(values) for name, values in logged.items() if values}

    def take_instance(self, key: Any) -> Any:
        pool = self.pools[key]
        return pool.pop() if pool else self.factories[key]()

    def give_back(self, key: Any, instance: Any) -> None:
        self.pools[key].append(instance)


class TRLAgentEpisode(Episode):
    def __init__(self, env: TRLAgentEnvironment, task: Mapping[str, Any]):
        self.env = env
        self.row = {k: v for k, v in task.items() if k in env.user_columns}
        self.key = self.row.get("environment") if env.multi_environment else None
        self.instance: Any = None
        self.prompt: list[Message] = []
        self.completion: list[dict[str, Any]] = []
        self.replies: list[Reply] = []
        self.tool_rounds = self.tool_calls = self.tool_failures = 0

    async def start(self) -> list[Message]:
        prompt = self.row.get("prompt", [{"role": "user", "content": ""}])
        self.prompt = (
            [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        )
        if self.env.factories:
            self.instance = self.env.take_instance(self.key)
            kwargs = (
                {k: v for k, v in self.row.items() if k != "environment"} if self.env.multi_environment else self.row
            )
            observation = await _maybe_await(self.instance.reset(**kwargs))
            if isinstance(observation, str):
                self.prompt[-1] = {**self.prompt[-1], "content": self.prompt[-1]["content"] + observation}
            elif observation is not None:
                raise EpisodeContractError(
                    f"reset() returned a {type(observation).__name__}; LOOP takes a str or None "
                    "(multimodal observations are not supported)"
                )
        self.functions = tool_functions(self.env.tools, self.instance)
        self.tools = list(self.functions.values()) or None
        return self.prompt

    async def step(self, reply: Reply) -> Step:
        self.replies.append(reply)
        parsed: dict[str, Any] = (
            parse_reply(self.env.tokenizer, reply, self.tools)
            if self.tools
            else {"role": "assistant", "content": str(reply)}
        )
        self.completion.append(parsed)
        calls = parsed.get("tool_calls")
        if not calls:
            answer = self.tools and self.env.answer_malformed_calls
            malformed = malformed_call_message(self.env.tokenizer, parsed) if answer else None
            if malformed is None or self._out_of_rounds():
                return Step(done=True)
            self.tool_rounds += 1
            self.tool_failures += 1
            self.completion.append(malformed)
            return Step(messages=[malformed])
        if self._out_of_rounds():
            return Step(done=True)  # as in TRL, the last reply's calls are not executed
        self.tool_rounds += 1
        messages, failures = await call_tools(calls, self.functions)
        self.tool_calls += len(calls)
        self.tool_failures += failures
        self.completion.extend(messages)
        return Step(messages=messages)

    def _out_of_rounds(self) -> bool:
        limit = self.env.max_tool_calling_iterations
        return limit is not None and self.tool_rounds >= limit

    async def score(self) -> Score:
        env = self.env
        extra = {k: [v] for k, v in self.row.items() if k not in ("prompt", "completion", "completion_ids")}
        completion_ids = []
        if self.replies:
            last = self.replies[-1]
            completion_ids = [*last.prompt_ids, *last.token_ids][len(self.replies[0].prompt_ids) :]
        logged: dict[str, Any] = {}
        kwargs = {
            **extra,
            "trainer_state": env.trainer_state,
            "log_extra": lambda column, values: logged.update({column: values}),
            "log_metric": lambda name, value: env.logged.setdefault(name, []).append(float(value)),
        }
        if self.instance is not None:
            kwargs["environments"] = [self.instance]
        rewards: dict[str, float] = {}
        total, counted = 0.0, 0
        sources = [(_name(f), f, w) for f, w in zip(env.reward_funcs, env.reward_weights, strict=True)]
        for name, function, weight in sources:
            values = await _maybe_await(
                function(
                    prompts=[self.prompt], completions=[self.completion], completion_ids=[completion_ids], **kwargs
                )
            )
            if not isinstance(values, (list, tuple)) or len(values) != 1:
                raise EpisodeContractError(
                    f"the reward function '{name}' returned {values!r}; it must return a list "
                    "with one reward per completion (here 1)"
                )
            if values[0] is not None:
                rewards[name] = float(values[0])
                total, counted = total + weight * rewards[name], counted + 1
        if self.instance is not None and env.has_get_reward[self.key]:
            value = await _maybe_await(self.instance.get_reward())
            if value is not None:
                rewards[type(self.instance).__name__] = float(value)
                total, counted = total + float(value), counted + 1
        if not counted:
            raise EpisodeContractError(
                "every reward source returned None for this rollout (reward_funcs and get_reward): it cannot be scored"
            )
        info = {
            "rewards": rewards,
            "tool_calls": self.tool_calls,
            "tool_failures": self.tool_failures,
            "completion": self.completion,
        }
        if logged:
            info["logged"] = logged
        return Score(reward=total, info=info)

    def close(self) -> None:
        if self.instance is not None:
            self.env.give_back(self.key, self.instance)
            self.instance = None


class TrainerStateForRewards(TrainerCallback):
    """Hands the trainer's state to the environment as each iteration begins: TRL's reward functions get it as
    ``trainer_state`` (GRPOTrainer passes it too)."""

    def __init__(self, env: TRLAgentEnvironment):
        self.env = env

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.env.trainer_state = state

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.env.trainer_state = state
