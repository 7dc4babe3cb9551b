"""A Prime Intellect ``verifiers`` environment as a LOOP environment: ``from_verifiers(vf_env)``.

Two APIs, told apart by what is passed:

* verifiers 0.3.x's classic API (this module), ``import verifiers as vf``: ``vf.MultiTurnEnv`` and
  what builds on its rollout loop (``vf.SingleTurnEnv``, ``vf.ToolEnv``, ``vf.StatefulToolEnv``, your
  own ``env_response`` games), with the environment's ``vf.Rubric`` as the reward. 0.3.1 is its last
  release (0.3.x keeps it in ``verifiers.legacy``, aliased at the top level; 0.4.0 removed it).
* the ``verifiers.v1`` stack, the only one in 0.4 (0.3.1 ships it too): a ``vf.Taskset``, run by
  :mod:`.verifiers_v1`: its chat tasks and their tools (``Toolset`` servers), scored by the
  task's ``@vf.reward`` functions. v1 drives the model from a harness subprocess (a ``uv`` script)
  through an OpenAI-compatible endpoint and the tools over MCP; LOOP plays the chat harness
  in-process instead (the tools' ``@vf.tool`` methods called in-process), so that it appends the
  sampled tokens exactly.

How: each episode runs ``vf_env.rollout(row, client, ...)`` as an asyncio task whose ``client`` is a
bridge: when verifiers asks for a completion, the prompt goes to LOOP's rollout engine, the policy
samples, and the reply goes back as a ``vf.Response`` (:mod:`.verifiers_messages`: tool calls parsed
from the sampled ids as TRL parses them). verifiers keeps its own turn loop, stop conditions, tools
and state; LOOP keeps the tokens. When the rollout ends, ``rubric.score_rollout(state)`` gives the
reward (any real number) and ``Score.info`` gets ``metrics``, ``stop_condition`` and the completion.

Differences from running verifiers itself, and why:

* LOOP renders and appends tokens (never re-renders), so every prompt verifiers sends must extend
  the previous one with the reply; an environment that rewrites history fails that rollout.
* A reply whose ``<tool_call>`` does not parse reaches verifiers as a call with the unparsed text as
  its arguments, so ``ToolEnv`` answers with its parse error and the episode goes on (an OpenAI
  server would drop the call and end the rollout).
* LOOP's limits (``max_turns``, ``max_trajectory_tokens``) end a rollout as verifiers ends one whose
  prompt is too long (``stop_condition`` ``prompt_too_long``); it is still scored. The env's
  ``sampling_args`` are ignored (LOOP samples), and ``state["error"]`` fails the rollout instead of
  scoring it.
* verifiers scores a reward function that raises as 0.0; it is kept, but counted
  (``reward_function_errors``, ``Score.info["reward_errors"]``), or fails the rollout with
  ``fail_on_reward_error=True``. Group reward functions see a group of one (LOOP scores each
  rollout as it ends), so they are refused unless ``allow_group_rewards=True``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

from datasets import Dataset

from ..envs.base import (
    Environment,
    EnvironmentSetupError,
    Episode,
    EpisodeContractError,
    Message,
    Reply,
    Score,
    Step,
    UnknownSplitError,
)
from .trl.tool_calls import prepare_tokenizer
from .verifiers_messages import plain_messages, vf_response
from .verifiers_v1 import VerifiersTasksetEnvironment, is_v1_object

__all__ = ["VerifiersEnvironment", "VerifiersEpisode", "VerifiersTasksetEnvironment", "from_verifiers"]

logger = logging.getLogger(__name__)
INSTALL = "pip install 'loop-trainer[verifiers]' (verifiers==0.3.1 with openai<3)"
_reward_errors: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("vf_reward_errors", default=None)


class _RewardErrors(logging.Handler):
    # verifiers' Rubric catches a raising reward function, logs "Error calling ..." and scores 0.0:
    # the log record is the only trace, so catch it for the episode being scored (a context variable).
    def emit(self, record: logging.LogRecord) -> None:
        errors = _reward_errors.get()
        if errors is not None and record.getMessage().startswith("Error calling"):
            errors.append(record.getMessage())


@functools.cache
def _verifiers() -> Any:
    """verifiers 0.3.x, imported on first use (loop_trainer does not need it), or one actionable line."""
    try:
        import verifiers as vf
    except ImportError as error:
        raise EnvironmentSetupError(f"the verifiers adapter needs verifiers 0.3.x ({error}): {INSTALL}") from None
    if not str(vf.__version__).startswith("0.3."):
        raise EnvironmentSetupError(
            f"verifiers {vf.__version__} is installed, which has no MultiTurnEnv/ToolEnv/Rubric (0.4.0 removed "
            f"them): pass a verifiers.v1 Taskset to from_verifiers, or for a 0.3 environment {INSTALL}"
        )
    rubrics = logging.getLogger("verifiers.legacy.rubrics")
    if not any(isinstance(handler, _RewardErrors) for handler in rubrics.handlers):
        rubrics.addHandler(_RewardErrors())
    if not rubrics.isEnabledFor(logging.ERROR):  # VF_LOG_LEVEL=CRITICAL would drop the records
        rubrics.setLevel(logging.ERROR)
    return vf


@functools.cache
def _bridge_client() -> type:
    """A ``vf.Client`` whose model is a LOOP episode: ``get_response`` hands the episode the prompt and
    waits for the policy's reply. Its native-API hooks (an OpenAI or Anthropic client's) are never called."""
    vf = _verifiers()

    def __init__(self: Any, episode: VerifiersEpisode) -> None:
        vf.Client.__init__(self, None)
        self.episode = episode

    async def get_response(
        self: Any, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kwargs: Any
    ) -> Any:
        return await self.episode.ask(prompt, tools)

    async def close(self: Any) -> None:
        return None

    def unused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("LOOP's bridge client answers in get_response")

    methods = {
        **dict.fromkeys(vf.Client.__abstractmethods__, unused),
        "__init__": __init__,
        "get_response": get_response,
        "close": close,
    }
    return type("LOOPBridgeClient", (vf.Client,), methods)


def _chain(error: BaseException | None) -> str:
    parts: list[str] = []
    while error is not None and len(parts) < 4:  # the explicit chain (raise ... from), as verifiers shows it
        parts.append(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
        error = error.__cause__
    return " <- ".join(parts)


class VerifiersEnvironment(Environment):
    """A verifiers 0.3.x environment (an object, or an id for ``vf.load_environment`` with
    ``env_args``): its dataset as the "train" split, its eval dataset as "eval"."""

    name = "verifiers"
    default_eval_split = "eval"  # its eval_dataset
    reward_range = (-math.inf, math.inf)
    in_process_only = "its metrics count since the last call, and a collection process's copy would be counted again"

    def __init__(
        self,
        vf_env: Any,
        env_args: Mapping[str, Any] | None = None,
        *,
        fail_on_reward_error: bool = False,
        allow_group_rewards: bool = False,
    ):
        vf = _verifiers()
        if isinstance(vf_env, str):  # a packaged environment (Environments Hub): a module with load_environment()
            try:
                vf_env = vf.load_environment(vf_env, **dict(env_args or {}))
            except (ValueError, RuntimeError) as error:
                raise EnvironmentSetupError(str(error).splitlines()[0]) from None
        elif env_args is not None:
            raise ValueError(
                "env_args are for loading an environment by id (from_verifiers('my-env', env_args=...)); "
                "this one is already built"
            )
        if not isinstance(vf_env, vf.Environment):
            raise ValueError(
                f"from_verifiers takes a verifiers 0.3.x vf.Environment (MultiTurnEnv, ToolEnv, ...) or a "
                f"verifiers.v1 Taskset, got {type(vf_env).__name__}"
            )
        rubric = vf_env.rubric
        if not any(weight for weight in rubric._get_reward_weights()):
            raise EnvironmentSetupError(
                f"{type(vf_env).__name__}'s rubric has no reward function with a weight (only "
                "metrics): pass rubric=vf.Rubric(funcs=[...]) to the environment"
            )
        if rubric.has_group_rewards and not allow_group_rewards:
            raise EnvironmentSetupError(
                "the rubric has group reward functions (plural parameters such as completions/"
                "states): LOOP scores each rollout as it ends, so they would see a group of one; "
                "pass allow_group_rewards=True if each rollout's score depends on it alone"
            )
        # LOOP's sampler draws every reply (at LOOPConfig's temperature); verifiers' default {n: 1, extra_body: {}}
        # asks for nothing else
        unused = {
            k: v
            for k, v in (getattr(vf_env, "sampling_args", None) or {}).items()
            if (k, v) not in (("n", 1), ("extra_body", {}))
        }
        if unused:
            logger.warning(
                "the verifiers environment's sampling_args %s are not used: LOOP samples at LOOPConfig's temperature",
                unused,
            )
        self.vf_env, self.vf = vf_env, vf
        self.name = f"verifiers:{getattr(vf_env, 'env_id', None) or type(vf_env).__name__}"
        self.fail_on_reward_error = fail_on_reward_error
        self.tokenizer: Any = None
        self.datasets: dict[str, Dataset] = {}
        self.added_task_id = False
        self.counts: Counter[str] = Counter()

    def _splits(self) -> dict[str, Any]:
        env = self.vf_env
        return {
            "train": (env.dataset is not None or env.dataset_source is not None) and env.get_dataset,
            "eval": (env.eval_dataset is not None or env.eval_dataset_source is not None) and env.get_eval_dataset,
        }

    def tasks(self, split: str = "train") -> Dataset:
        loaders = {name: load for name, load in self._splits().items() if load}
        if split not in loaders:
            raise UnknownSplitError(
                f"this verifiers environment's splits are {', '.join(map(repr, loaders)) or 'none'} "
                "(its dataset and eval_dataset); set train_split / eval_split to one of them"
            )
        if split not in self.datasets:
            dataset = loaders[split]()
            if "task_id" not in dataset.column_names:  # verifiers' example_id names a row, if distinct
                ids = [str(e) for e in dataset["example_id"]] if "example_id" in dataset.column_names else []
                ids = ids if len(set(ids)) == len(dataset) else [f"row-{i}" for i in range(len(dataset))]
                dataset, self.added_task_id = dataset.add_column("task_id", ids), True
            self.datasets[split] = dataset
        return self.datasets[split]

    def set_tokenizer(self, tokenizer: Any) -> None:
        try:  # a response template to parse tool calls with (tools may also come per row, in info["tool_defs"])
            tokenizer = prepare_tokenizer(tokenizer)
        except ValueError as error:
            if self.vf_env.tool_defs:  # without tools, replies are plain text and need no parsing
                raise EnvironmentSetupError(str(error)) from None
        self.tokenizer = tokenizer

    def episode(self, task: Mapping[str, Any]) -> VerifiersEpisode:
        row = {k: v for k, v in task.items() if not (k == "task_id" and self.added_task_id)}
        return VerifiersEpisode(self, row)

    def metrics(self) -> dict[str, float]:
        """Since the last call: ``stop_<condition>`` (how rollouts ended) and ``reward_function_errors``."""
        counts, self.counts = self.counts, Counter()
        return {key: float(value) for key, value in counts.items()}


class VerifiersEpisode(Episode):
    """One ``vf_env.rollout`` running beside the rollout engine, exchanging prompts and replies."""

    def __init__(self, env: VerifiersEnvironment, row: dict[str, Any]):
        self.env, self.row = env, row
        self.events: asyncio.Queue = asyncio.Queue()
        self.rollout: asyncio.Task | None = None
        self.pending: asyncio.Future | None = None  # the reply verifiers waits for
        self.known: list[Message] = []  # the conversation so far, as verifiers sees it
        self.tool_defs: list[dict[str, Any]] | None = None
        self.state: Any = None
        self.turn = 0

    async def ask(self, prompt: Any, tools: Any) -> Any:
        """Called by the bridge client inside the rollout: hand the prompt over, await the reply."""
        reply = asyncio.get_running_loop().create_future()
        self.events.put_nowait((prompt, tools, reply))
        return await reply

    async def _next(self) -> tuple[list[Message], Any] | None:
        """The next prompt verifiers sends, or None once the rollout has ended."""
        event = await self.events.get()
        if event is None:
            assert self.rollout is not None  # its end is what put the None
            self.state = self.rollout.result()  # re-raises what the environment raised
            error = self.state.get("error")
            if error is not None:
                raise RuntimeError(f"the verifiers rollout stopped on an error: {_chain(error)}".splitlines()[0])
            self.env.counts[f"stop_{self.state.get('stop_condition')}"] += 1
            return None
        prompt, tools, self.pending = event
        # vf.Tool as the JSON schema chat templates and TRL's parser take
        tool_defs = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in tools or ()
        ] or None
        if self.turn and tool_defs != self.tool_defs:
            raise EpisodeContractError(
                f"the verifiers environment changed its tools at turn {self.turn}; the chat "
                "template shows tools once, in the opening"
            )
        self.tool_defs = tool_defs
        return plain_messages(prompt), tools

    async def start(self) -> list[Message]:
        client = _bridge_client()(self)
        sampling_args = dict(getattr(self.env.vf_env, "sampling_args", None) or {})
        self.rollout = asyncio.create_task(self.env.vf_env.rollout(self.row, client, "loop-policy", sampling_args))
        self.rollout.add_done_callback(lambda _: self.events.put_nowait(None))
        event = await self._next()
        if event is None:
            raise EpisodeContractError(
                f"the verifiers rollout ended before asking the model anything (stop "
                f"condition {self.state.get('stop_condition')!r})"
            )
        self.known = event[0]
        self.tools = self.tool_defs
        return list(self.known)

    async def step(self, reply: Reply) -> Step:
        self.turn += 1
        response = vf_response(self.env.vf.types, reply, self.env.tokenizer, self.tool_defs, self.turn)
        self.known = self.known + plain_messages([response.message])  # what verifiers records of the reply
        assert self.pending is not None  # the prompt this replies to came with it
        if not self.pending.done():  # not when verifiers' own timeout_seconds cancelled the wait
            self.pending.set_result(response)
        event = await self._next()
        if event is None:
            return Step(done=True)
        prompt = event[0]
        if prompt[: len(self.known)] != self.known:
            index = next((i for i, (a, b) in enumerate(zip(prompt, self.known, strict=False)) if a != b), len(prompt))
            raise EpisodeContractError(
                f"the verifiers environment rewrote the conversation at turn {self.turn} (message {index} differs from "
                "what the model saw); LOOP appends tokens and cannot re-render earlier turns"
            )
        new, self.known = prompt[len(self.known) :], prompt
        return Step(messages=new)

    async def score(self) -> Score:
        if self.state is None:
            # LOOP's turn or token limit ended the episode while verifiers waits for a reply: end the
            # rollout the way verifiers ends one whose context is full, so that it cleans up and renders
            assert self.pending is not None  # the rollout runs on: it asked for a reply
            if not self.pending.done():
                self.pending.set_exception(self.env.vf.OverlongPromptError("LOOP's max_turns or max_trajectory_tokens"))
            if await self._next() is not None:
                raise EpisodeContractError("the verifiers environment asked the model again after its context was full")
        state, rubric = self.state, self.env.vf_env.rubric
        errors: list[str] = []
        token = _reward_errors.set(errors)
        try:
            await (rubric.score_group([state]) if rubric.has_group_rewards else rubric.score_rollout(state))
            await rubric.cleanup(state)
        finally:
            _reward_errors.reset(token)
        if errors:
            self.env.counts["reward_function_errors"] += len(errors)
            if self.env.fail_on_reward_error:
                raise RuntimeError(f"{errors[0]} (fail_on_reward_error=True; verifiers would score it 0.0)")
            logger.warning("a verifiers reward function raised and was scored 0.0: %s", errors[0])
        info: dict[str, Any] = {
            "metrics": {k: float(v) for k, v in (state.get("metrics") or {}).items()},
            "stop_condition": state.get("stop_condition"),
            "is_truncated": bool(state.get("is_truncated")),
            "completion": plain_messages(state.get("completion") or []),
        }
        if errors:
            info["reward_errors"] = errors
        return Score(reward=state["reward"], info=info)

    async def close(self) -> None:
        # an episode the engine abandons (a failure, a limit, early stopping) must not leave its
        # rollout task waiting forever: cancel it, so that verifiers' cleanup handlers run
        if self.rollout is not None and not self.rollout.done():
            self.rollout.cancel()
        if self.rollout is not None:
            await asyncio.gather(self.rollout, return_exceptions=True)


def from_verifiers(
    vf_env: Any,
    *,
    env_args: Mapping[str, Any] | None = None,
    fail_on_reward_error: bool = False,
    allow_group_rewards: bool = False,
    eval_taskset: Any = None,
) -> Environment:
    """``vf_env`` as a LOOP environment for ``LOOPTrainer`` or ``loop-eval``: a verifiers 0.3.x
    environment (or an id ``vf.load_environment`` knows), with ``env_args``, ``fail_on_reward_error``
    and ``allow_group_rewards`` as :class:`VerifiersEnvironment` takes them; or a verifiers.v1
    ``Taskset`` (0.4's API), with ``eval_taskset`` as its "eval" split."""
    if is_v1_object(vf_env):
        classic = (
            ("env_args", env_args is not None),
            ("fail_on_reward_error", fail_on_reward_error),
            ("allow_group_rewards", allow_group_rewards),
        )
        if used := [key for key, given in classic if given]:
            raise ValueError(
                f"{', '.join(used)} apply to verifiers 0.3 environments; a verifiers.v1 taskset takes eval_taskset "
                "only (its task's reward functions fail the rollout when they raise)"
            )
        return VerifiersTasksetEnvironment(vf_env, eval_taskset=eval_taskset)
    if eval_taskset is not None:
        raise ValueError(
            "eval_taskset is for a verifiers.v1 taskset; a verifiers 0.3 environment's eval split is its eval_dataset"
        )
    return VerifiersEnvironment(
        vf_env, env_args, fail_on_reward_error=fail_on_reward_error, allow_group_rewards=allow_group_rewards
    )
