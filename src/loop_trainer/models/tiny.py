"""Tiny models built from a config, with a word-level ChatML tokenizer: no download needed.

Two model specs, for environments that declare their ``vocabulary()``:

* ``tiny:<env>`` -- a small Qwen2 decoder, randomly initialised (the tests use it);
* ``tiny-instruct:<env>`` -- the same model after a supervised warm-up on the environment's
  ``demonstrations()`` (an agent that knows the protocol but gets arguments wrong): a fixed number of
  steps (``tiny_instruct_steps``; ``make demo`` pins 400) or, by default, until held-out
  demonstrations are fitted (:class:`FitRule`), so its cost follows what the environment's
  demonstrations take to learn. LOOP starts from it as the paper starts from an instruct model:
  knowing the format, not yet reliable.

The tokenizer knows the environment's words plus ChatML's special tokens, so a model of a few
hundred thousand parameters trains in seconds on a CPU.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from .warm_up_cache import cached_warm_up, module_source_digest

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant", "tool")
RANDOM_PREFIX = "tiny:"
INSTRUCT_PREFIX = "tiny-instruct:"
DEFAULT_TINY_LAYERS = 2
"""The tiny model's decoder layers unless its environment names ``tiny_layers``."""
WARM_UP_CONVERSATIONS = 512
"""The demonstrations a warm-up of a fixed number of steps (``tiny_instruct_steps``) replays (the demo's 400)."""
WARM_UP_BATCH_SIZE = 32
"""Demonstrations a warm-up step trains on."""

logger = logging.getLogger(__name__)


def replay_demonstrations(env: Any, num_conversations: int, seed: int, timeout: float) -> list[list[dict[str, str]]]:
    """``env.demonstrations(...)``, which replays the environment's own episodes, on a daemon thread: an
    environment whose ``step`` hangs stops the warm-up after ``timeout`` seconds with one line, instead
    of hanging the process before the first iteration (a Python thread cannot be killed; the daemon one
    is left behind and never holds up the exit)."""
    result: dict[str, Any] = {}

    def replay() -> None:
        try:
            result["conversations"] = env.demonstrations(num_conversations, seed=seed)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = error

    worker = threading.Thread(target=replay, name=f"{env.name}-warm-up", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise ValueError(
            f"the warm-up of '{INSTRUCT_PREFIX}{env.name}' replays {num_conversations} of the environment's "
            f"episodes and got no answer within env_timeout={timeout:g}s: its step() may hang (raise "
            "env_timeout if the environment is just slow)"
        )
    if "error" in result:
        raise result["error"]
    return result["conversations"]


def build_word_tokenizer(words: Iterable[str]) -> PreTrainedTokenizerFast:
    """A word-level ChatML tokenizer over ``words`` (split on spaces; newlines are tokens)."""
    vocabulary: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, "<unk>", "\n", *ROLES, *words):
        vocabulary.setdefault(token, len(vocabulary))
    backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r" +"), behavior="removed"),
        ]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = DEFAULT_TINY_LAYERS,
    num_heads: int = 4,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def build_tiny_model(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = DEFAULT_TINY_LAYERS,
    num_heads: int = 4,
    seed: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Qwen2ForCausalLM:
    """A small Qwen2 decoder (head_dim 32, as vLLM's CPU attention needs), randomly initialised."""
    config = tiny_config(
        vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    return model


def build_tiny_for_environment(
    words: Iterable[str], seed: int = 0, num_layers: int = DEFAULT_TINY_LAYERS
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    tokenizer = build_word_tokenizer(words)
    model = build_tiny_model(
        len(tokenizer),
        seed=seed,
        num_layers=num_layers,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model, tokenizer


def tiny_layers_of(env: Any) -> int:
    """The depth ``env`` declares for its tiny model (``Environment.tiny_layers``; None: 2 layers)."""
    layers = getattr(env, "tiny_layers", None)
    if layers is None:
        return DEFAULT_TINY_LAYERS
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(
            f"the '{getattr(env, 'name', type(env).__name__)}' environment's tiny_layers is {layers!r}: "
            "set it to a whole number of decoder layers, 1 or more (or None for the default 2)"
        )
    return layers


@dataclass(frozen=True)
class FitRule:
    """How a warm-up without a fixed number of steps trains, and when it stops: every ``check_every`` steps it measures
    how often the model's most likely next token is the demonstrations' own on held-out replies
    (teacher-forced); once it has seen every demonstration ``min_passes`` times on average, it stops
    when that accuracy has gained less than ``min_gain`` over the last ``window`` steps, or after
    ``max_steps``.

    Accuracy, not loss, and a long window: copying a value out of an earlier message (what the
    task needs) arrives in a jump after a plateau. The vault model's held-out loss stalls from step
    150 to 225 and drops once copying forms (steps 225-300); on ``errands``, whose demonstrations
    are six times longer, copying forms between steps 300 and 500 (32 conversations a step) on 512
    demonstrations, and at 750-800 on fresh ones, after a plateau of 400 steps that gains 0.006 in
    200 (hence 300).

    ``min_passes``: when the plateau ends differs by seed, and no window tells a plateau from the end:
    on 8,192 fresh ``errands`` demonstrations copying formed at steps 400-450 (seed 2), 750-800 (seed
    1) and 850-1,000 (seed 0, after 350 steps that gained 0.004, which the 300-step window took for
    fitted at step 750: greedy held-out success 0.00, nothing for LOOP to learn from). Four passes
    (1,024 steps of 32) cover all three.

    ``conversations``: how many demonstrations it draws, so that a model sees each only a few times
    (about 5 by step 1,400). Repeating a few hundred teaches memorising them: on ``errands``, 512
    conversations seen 30-50 times each left a 2-layer model at greedy held-out success 0.15 (0.00
    for another seed) and a 3-layer one memorising (loss 0.28); 8,192 fresh ones gave the 2-layer
    model 0.97, the errand to do next read off the task line instead of recalled."""

    check_every: int = 50
    window: int = 300
    min_gain: float = 0.005
    min_passes: float = 4.0
    max_steps: int = 3000
    held_out_conversations: int = 64
    conversations: int = 8192
    probe_tasks: int = 64
    """With a :class:`SuccessProbe`: the training tasks it rolls out greedily at each check (``errands``: 3 s
    on one core, against 55 s for the 50 steps between checks)."""
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    adam_beta2: float = 0.95
    """AdamW's rate (reached linearly over ``warmup_steps``) and second-moment decay. On ``errands`` 2e-3, 100 and
    0.95 (with ``length_pool``) reach the copying jumps hundreds of steps sooner than a constant 1e-3 with
    beta2 0.999, the fixed-steps warm-up's: held-out reply accuracy 0.884 at step 2,100 against 0.872 (seed 3),
    0.864 at step 1,200 against 0.813 (seed 0). A fixed ``tiny_instruct_steps`` keeps 1e-3 (the demo's record).
    Cooling the rate (linearly to 0 over 300 steps) from steps 900 or 1,200 of seed 3, before the task line
    was learned, gained nothing; from the slow seeds' last plateau it lifted greedy success from 0.65-0.70 to
    0.89-0.93. A warm-up until fitted cannot tell when that plateau comes, so it averages
    (``average_decay``), and cools once its probe says the plateau is behind it (``cool_steps``)."""
    average_decay: float | None = 0.99
    """The warm-up until fitted measures, probes and keeps an exponential moving average of the weights
    (each step: ``average += (1 - average_decay) * (weights - average)``), not the last step's weights;
    ``None``: the last step's. Why: at the fit rule's constant rate the weights wander around what they have
    learned, and on ``errands`` the average of the last hundred steps reads the task line far better than any
    of them. From the slow seeds' kept warm starts (greedy held-out success 0.65-0.66, level 3 0.25-0.33), 200
    more steps left the weights at 0.67-0.70 and their average (0.99) at 0.84-0.87 (level 3 0.59-0.64). A
    fixed ``tiny_instruct_steps`` keeps the last step's weights (the demo's record)."""
    cool_steps: int = 300
    """Once fitted (or at ``max_steps``), the warm-up until fitted goes on this many steps with its rate cooled
    linearly to 0, and keeps the average where the cooling ends; 0: it stops where it is fitted. Why: the average
    stands in for cooling while the warm-up cannot tell its last plateau, but once the probe says the task line is
    read, cooling is what settles the weights there. From the slow seeds' kept warm starts, 600 steps at the
    constant rate left the average at 0.86 and 0.85 greedy held-out success (level 3: 0.61), and 300 cooled steps
    after them 0.91 and 0.90 (level 3: 0.73 and 0.72). About 4 minutes on one core for ``errands``."""
    length_pool: int = 8
    """Batches drawn at once and regrouped by length (each conversation still drawn uniformly at random):
    a random batch of ``errands`` demonstrations (170-440 tokens) is 31 % padding, a pool of 8 regrouped
    5.5 %, and a step takes 0.8 s instead of 1.1 on one core. 1: every batch drawn on its own."""

    def least_steps(self, conversations: int, batch_size: int) -> int:
        """The steps before the warm-up may stop: ``min_passes`` over ``conversations``."""
        return math.ceil(self.min_passes * conversations / batch_size)


@dataclass(frozen=True)
class SuccessProbe:
    """What a warm-up until fitted stops on where reply accuracy is not enough: ``measure(model)`` is the
    greedy success rate of ``model`` on a few of the environment's training tasks, and the warm-up stops
    once it reaches ``level`` (the environment's ``warm_up_success``).

    Why: on ``errands`` greedy success is a cliff in reply accuracy (0.00 at 0.853, 0.17 at 0.890, 0.97
    at 0.912), and the accuracy learns in several jumps after plateaus of 200-400 steps, so no window
    tells the last plateau from an earlier one (two seeds of three stopped on their next-to-last, with
    starts LOOP could not learn from)."""

    measure: Callable[[Qwen2ForCausalLM], Mapping[str, float]]
    """The greedy rollouts' success rates: ``success_rate`` and any ``success_rate_<part>`` (``errands``: by
    level), all shown in the progress lines."""
    level: float | Mapping[str, float]
    """The environment's ``warm_up_success``: the rate ``success_rate`` must reach, or the readings that must
    each reach their own rate (``{"success_rate": 0.8, "success_rate_level_3": 0.8}``)."""
    tasks: int

    @property
    def targets(self) -> dict[str, float]:
        """Each reading the warm-up stops on, and the rate it must reach."""
        if isinstance(self.level, Mapping):
            return {name: float(rate) for name, rate in self.level.items()}
        return {"success_rate": float(self.level)}

    def describe(self) -> str:
        """The level in words: ``0.8``, or ``success_rate 0.8, level 3 0.8`` for several readings."""
        if not isinstance(self.level, Mapping):
            return f"{self.level:g}"
        return ", ".join(f"{_reading_name(name)} {rate:g}" for name, rate in self.targets.items())

    @staticmethod
    def parts(readings: Mapping[str, float]) -> str:
        """The readings beside the mean, as a progress line shows them: ``level 1 1.00, level 3 0.57``."""
        return ", ".join(
            f"{_reading_name(name)} {value:.2f}" for name, value in sorted(readings.items()) if name != "success_rate"
        )

    def reached(self, readings: Mapping[str, float]) -> bool:
        """Whether every target reading is at its rate; one line naming the reading if the probe lacks it."""
        missing = [name for name in self.targets if name not in readings]
        if missing:
            raise ValueError(
                f"warm_up_success names {', '.join(missing)}, which the greedy probe does not read "
                f"(it reads {', '.join(sorted(readings))}): name only those in the environment's warm_up_success"
            )
        return all(readings[name] >= rate for name, rate in self.targets.items())


def _is_rate(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1


def _reading_name(name: str) -> str:
    """``success_rate_level_3`` -> ``level 3``; ``success_rate`` stays as it is."""
    return name.removeprefix("success_rate_").replace("_", " ") if name != "success_rate" else name


def checked_warm_up_success(env: Any) -> float | Mapping[str, float] | None:
    """``env``'s ``warm_up_success`` (None, a rate, or a mapping of readings to rates), each rate in (0, 1];
    anything else is refused with one line."""
    level = getattr(env, "warm_up_success", None)
    if level is None:
        return None
    rates = level if isinstance(level, Mapping) else {"success_rate": level}
    if not rates or not all(isinstance(name, str) and _is_rate(rate) for name, rate in rates.items()):
        raise ValueError(
            f"the '{getattr(env, 'name', type(env).__name__)}' environment's warm_up_success is {level!r}: set it to "
            "a success rate in (0, 1], a mapping of the probe's readings to such rates "
            "(e.g. {'success_rate': 0.8, 'success_rate_level_3': 0.8}), or None"
        )
    return level


def warm_start(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    conversations: list[list[dict[str, str]]],
    *,
    steps: int | None = 400,
    held_out: list[list[dict[str, str]]] | None = None,
    fit: FitRule = FitRule(),
    batch_size: int = WARM_UP_BATCH_SIZE,
    learning_rate: float | None = None,
    seed: int = 0,
    label: str = "warm-up",
    report: Callable[[str], None] | None = None,
    probe: SuccessProbe | None = None,
) -> Qwen2ForCausalLM:
    """Supervised warm-up on chat conversations (loss on assistant replies only), so a tiny model
    starts RL the way the paper's model does: knowing the format, not yet reliable.

    ``steps``: that many steps; ``None``: until the ``held_out`` conversations are fitted
    (:class:`FitRule`), keeping the weights of the check with the best held-out accuracy (a warm-up
    can peak and then fit the demonstrations' noise: 0.893 at step 600, 0.874 at 750). With a
    ``probe`` (``None`` steps only), fitted means greedy success at the probe's level instead, probed at
    every check (no minimum of passes: the probe cannot mistake a plateau for the end), and the weights
    it stops with are kept. Until fitted, "the weights" are their moving average (``fit.average_decay``):
    what every check measures and probes, and what the model is left with. Once fitted, or at
    ``fit.max_steps``, it trains ``fit.cool_steps`` more steps with the rate cooled linearly to 0 and keeps
    the average where they end.
    Progress goes to ``report`` (default: the log) every ``fit.check_every`` steps.

    ``learning_rate``: AdamW's rate (default 1e-3 for a fixed number of steps, the fit rule's for a warm-up
    until fitted, which also ramps it up and uses the rule's beta2). The learning rate matters more than the
    steps: at a constant 1e-3 the 2-layer model learns within 250 steps to copy the person out of the task
    and the code out of the last observation of ``vault`` (teacher-forced accuracy 1.0 on both, on worlds it
    never saw); at a constant 3e-3 it learns the code but never the person (chance, 0.1, after 3,000 steps),
    and LOOP then has to discover copying from scratch."""
    if steps is None and not held_out:
        raise ValueError("a warm-up until fitted needs held-out conversations")
    rows = [assistant_masked_ids(tokenizer, messages) for messages in conversations]
    checked = [assistant_masked_ids(tokenizer, messages) for messages in held_out or []]
    generator = torch.Generator().manual_seed(seed)
    if steps is None:  # until fitted: the fit rule's rate, warm-up and beta2
        rate = fit.learning_rate if learning_rate is None else learning_rate
        ramp, betas = fit.warmup_steps, (0.9, fit.adam_beta2)
    else:  # a fixed number of steps: AdamW's defaults at 1e-3, as the demo's record was made
        rate, ramp, betas = 1e-3 if learning_rate is None else learning_rate, 0, (0.9, 0.999)
    optimizer = torch.optim.AdamW(model.parameters(), lr=rate, betas=betas, weight_decay=0.0)
    decay = fit.average_decay if steps is None else None
    # what the checks measure and the warm-up keeps: the weights' moving average, or the weights themselves
    kept = copy.deepcopy(model) if decay is not None else model
    most = steps if steps is not None else fit.max_steps
    last = most  # the last step: once fitted (or at the limit), the cooling's end
    cooling_from: int | None = None  # until fitted: the step its rate starts cooling from
    least = fit.least_steps(len(rows), batch_size)
    say = report or logger.info
    history: list[float] = []
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None  # held-out accuracy, step, weights
    started, loss_sum, losses = time.monotonic(), 0.0, 0
    model.train()
    pooled = fit.length_pool if steps is None else 1  # a fixed number of steps draws as it always has
    batches: list[list[int]] = []
    step = 0
    while step < last:
        step += 1
        if not batches:
            batches = _length_grouped_batches(rows, batch_size, pooled, generator)
        picked = batches.pop()
        if cooling_from is not None:
            for group in optimizer.param_groups:
                group["lr"] = rate * (last - step + 1) / (last - cooling_from + 1)  # down to 0 after the last
        elif ramp:
            for group in optimizer.param_groups:
                group["lr"] = rate * min(1.0, step / ramp)
        width = max(len(rows[i][0]) for i in picked)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for row, i in enumerate(picked):
            ids, mask = rows[i]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
            attention[row, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if decay is not None:
            with torch.no_grad():
                torch._foreach_lerp_(list(kept.parameters()), list(model.parameters()), 1 - decay)
        loss_sum, losses = loss_sum + float(loss.detach()), losses + 1
        if step % fit.check_every and step != last:
            continue
        limit = str(most) if steps is not None else f"at most {most}" if cooling_from is None else f"cooling to {last}"
        progress = f"{label}: step {step}/{limit}, loss {loss_sum / losses:.3f}"
        loss_sum, losses = 0.0, 0
        if checked:
            history.append(reply_accuracy(kept, checked))
            model.train()
            progress += f", held-out reply accuracy {history[-1]:.3f}"
            if steps is None and (best is None or history[-1] > best[0]):
                best = (history[-1], step, {name: value.clone() for name, value in kept.state_dict().items()})
        say(f"{progress}, {time.monotonic() - started:.0f} s")
        ended = False  # the stable phase ends at this check: fitted, or at the limit
        if steps is None and probe is not None:
            readings = probe.measure(kept)
            model.train()
            success = readings["success_rate"]
            parts = probe.parts(readings)
            say(
                f"{label}: step {step}, greedy success on {probe.tasks} training tasks {success:.2f}"
                f"{f' ({parts})' if parts else ''} (fitted at {probe.describe()}), {time.monotonic() - started:.0f} s"
            )
            if cooling_from is None and probe.reached(readings):
                say(f"{label}: fitted at step {step} (greedy success {success:.2f} >= {probe.describe()})")
                best = None  # the probed weights are the ones that reached the level (and cool from there)
                ended = True
            elif cooling_from is None and step == most:
                say(
                    f"{label}: reached its limit of {most} steps without greedy success {probe.describe()}: LOOP "
                    "may get too few successes to learn from (set tiny_instruct_steps to train longer, or try "
                    "another seed)"
                )
                ended = True
        elif steps is None and cooling_from is None:
            window = fit.window // fit.check_every
            gain = history[-1] - history[-1 - window] if len(history) > window else None
            if gain is not None and gain < fit.min_gain and step >= least:
                say(
                    f"{label}: fitted at step {step} (held-out reply accuracy gained {gain:.3f} "
                    f"over the last {fit.window} steps)"
                )
                ended = True
            elif step == most:
                say(
                    f"{label}: reached its limit of {most} steps, still improving; "
                    "set tiny_instruct_steps to train longer"
                )
                ended = True
        if ended:
            cooling_from, last = step, step + fit.cool_steps
            if fit.cool_steps:
                say(f"{label}: cooling the rate from {rate:g} to 0 over {fit.cool_steps} more steps (fit.cool_steps)")
    if kept is not model:
        model.load_state_dict(kept.state_dict())
    if best is not None and best[0] > history[-1]:  # past its best: the later steps fitted noise
        model.load_state_dict(best[2])
        say(f"{label}: keeping step {best[1]}, its best held-out reply accuracy ({best[0]:.3f})")
    model.eval()
    return model


def _length_grouped_batches(
    rows: list[tuple[list[int], list[int]]], batch_size: int, pool: int, generator: torch.Generator
) -> list[list[int]]:
    """``pool`` batches of row indices drawn uniformly at random, regrouped so that each batch holds rows of
    similar length (less padding), in random order; with ``pool`` 1, one batch exactly as drawn."""
    picked = torch.randint(len(rows), (batch_size * pool,), generator=generator).tolist()
    if pool == 1:
        return [picked]
    picked.sort(key=lambda i: len(rows[i][0]))
    grouped = [picked[start : start + batch_size] for start in range(0, len(picked), batch_size)]
    return [grouped[i] for i in torch.randperm(pool, generator=generator).tolist()]


@torch.no_grad()
def reply_accuracy(model: Qwen2ForCausalLM, rows: list[tuple[list[int], list[int]]]) -> float:
    """How often the model's most likely next token is the reply token there (teacher-forced),
    over every reply token of ``rows`` (token ids and reply masks)."""
    model.eval()
    right = total = 0
    for ids, mask in rows:
        predicted = model(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1)
        wanted = torch.tensor(ids[1:])
        on_reply = torch.tensor(mask[1:], dtype=torch.bool)
        right += int((predicted == wanted)[on_reply].sum())
        total += int(on_reply.sum())
    return right / max(total, 1)


def assistant_masked_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]
) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and a mask of the tokens to train on: each assistant reply and
    the end-of-turn token after it, not the reply's header (``<|im_start|>assistant\n``: 3 tokens in
    the tiny models' vocabulary, 4 in SmolLM2's) nor what the template adds after the end-of-turn.

    The conversation is tokenized once, with character offsets; each reply's tokens are those that
    start between the end of the rendered history with the assistant header and the end of the
    rendered history with the reply (was: every prefix encoded again, quadratic in the turns: 5 of
    the 27 minutes of an ``errands`` warm-up went to it)."""

    def rendered(history: list[dict[str, str]], *, opening: bool = False) -> str:
        return str(tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=opening))

    text = rendered(messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    mask = [0] * len(ids)
    token = 0
    for end, message in enumerate(messages, start=1):
        if message["role"] != "assistant":
            continue
        opened, closed = rendered(messages[: end - 1], opening=True), rendered(messages[:end])
        if not (text.startswith(opened) and text.startswith(closed)):
            raise ValueError("the chat template renders a conversation's history differently once it goes on")
        while token < len(ids) and offsets[token][0] < len(opened):
            token += 1
        first = token
        while token < len(ids) and offsets[token][0] < len(closed):
            token += 1
        mask[first : token - 1] = [1] * max(0, token - 1 - first)  # the reply and its end-of-turn token
    return ids, mask


def is_tiny_spec(name: str) -> bool:
    return name.startswith((RANDOM_PREFIX, INSTRUCT_PREFIX))


def warm_up_is_probed(name: str, env: Any, warm_up_steps: int | None) -> bool:
    """Whether a greedy success probe ends ``name``'s warm-up (its readings then depend on the episode settings it runs
    under): a ``tiny-instruct:`` model warmed up until fitted, for an environment that names a ``warm_up_success``."""
    return name.startswith(INSTRUCT_PREFIX) and warm_up_steps is None and checked_warm_up_success(env) is not None


def build_tiny_from_spec(
    name: str,
    env,
    seed: int = 0,
    env_timeout: float = 300.0,
    warm_up_steps: int | None = None,
    report: Callable[[str], None] | None = None,
    greedy_success: Callable[[Qwen2ForCausalLM, PreTrainedTokenizerFast, int], Mapping[str, float]] | None = None,
    keep_warm_up: bool = True,
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """Build the model a ``tiny:<env>`` / ``tiny-instruct:<env>`` spec names, for ``env``; the warm-up's
    replay of the environment's episodes gets ``env_timeout`` seconds in all. ``warm_up_steps``
    (the ``tiny_instruct_steps`` key): the warm-up's steps; ``None``: until the demonstrations are
    fitted (:class:`FitRule`), which follows what the environment's demonstrations take to learn.
    ``report`` receives the warm-up's progress lines (default: the log). ``greedy_success(model,
    tokenizer, tasks)``: the greedy success rates on the first ``tasks`` training tasks (``success_rate``, and
    by level where the environment reports levels), which a warm-up
    until fitted stops on where the environment names a ``warm_up_success`` (:class:`SuccessProbe`).
    A ``tiny-instruct:`` warm-up is kept on disk and read back by the next build from the same inputs
    (:mod:`.warm_up_cache`); ``keep_warm_up=False`` warms up here, reading and keeping nothing (what a benchmark
    that times the warm-up needs)."""
    label = name.split(":", 1)[1]
    if label != env.name:
        raise ValueError(f"'{name}' is a tiny model for the '{label}' environment, but the environment is '{env.name}'")
    if not hasattr(env, "vocabulary"):
        raise ValueError(f"'{name}' needs an environment with a vocabulary(); '{env.name}' has none")
    layers = tiny_layers_of(env)
    model, tokenizer = build_tiny_for_environment(env.vocabulary(), seed=seed, num_layers=layers)
    if name.startswith(INSTRUCT_PREFIX):
        if not hasattr(env, "demonstrations"):
            raise ValueError(f"'{name}' needs an environment with demonstrations(); '{env.name}' has none")
        fit = FitRule()
        held_out = fit.held_out_conversations if warm_up_steps is None else 0
        drawn = fit.conversations if warm_up_steps is None else WARM_UP_CONVERSATIONS
        level = checked_warm_up_success(env)
        probe = None
        if warm_up_is_probed(name, env, warm_up_steps) and level is not None and greedy_success is not None:
            probe = SuccessProbe(lambda m: greedy_success(m, tokenizer, fit.probe_tasks), level, fit.probe_tasks)
        plan = (
            f"{warm_up_steps} supervised steps"
            if warm_up_steps is not None
            else f"supervised steps until greedy success on {fit.probe_tasks} training tasks reaches "
            f"{probe.describe()} "
            f"(the environment's warm_up_success; checked every {fit.check_every} steps, at most {fit.max_steps})"
            if probe is not None
            else f"supervised steps until {held_out} held-out ones are fitted (at least "
            f"{fit.least_steps(drawn, WARM_UP_BATCH_SIZE)}: {fit.min_passes:g} passes; at most {fit.max_steps})"
        )
        if warm_up_steps is None and fit.cool_steps:
            plan += f", then {fit.cool_steps} steps with the rate cooled to 0"
        (report or logger.info)(
            f"{name} ({layers} layers): replaying {drawn + held_out} of the environment's episodes for the "
            f"warm-up (at most {env_timeout:g} s), then {plan}"
        )
        conversations = replay_demonstrations(env, drawn, seed, env_timeout)
        checked = replay_demonstrations(env, held_out, seed + 1, env_timeout) if held_out else None
        keyed: dict[str, Any] = {
            "spec": name,
            "seed": seed,
            "steps": warm_up_steps,
            "layers": layers,
            "vocabulary": list(env.vocabulary()),
            "conversations": conversations,
            "held_out": checked,
            "environment": [f"{type(env).__module__}.{type(env).__qualname__}", module_source_digest(type(env))],
        }
        parts: dict[str, Any] | None = keyed
        if probe is not None:  # its readings decide when the warm-up ends: keyed by what they depend on
            probe_key = getattr(greedy_success, "cache_key", None)
            parts = None if probe_key is None else {**keyed, "probe": [probe.describe(), probe_key(fit.probe_tasks)]}

        def warm_up() -> None:
            # on a fork of the global random state: a build leaves it as it found it, as reading a kept one does
            with torch.random.fork_rng(devices=[]):
                warm_start(
                    model,
                    tokenizer,
                    conversations,
                    steps=warm_up_steps,
                    held_out=checked,
                    fit=fit,
                    seed=seed,
                    label=name,
                    report=report,
                    probe=probe,
                )

        cached_warm_up(model, parts if keep_warm_up else None, warm_up, label=name, report=report or logger.info)
    return model, tokenizer


def load_tokenizer(name_or_path: str, **kwargs: Any) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained``, except that a saved word-level tokenizer (a tiny model's,
    ``tokenizer_class: TokenizersBackend``) stays one: transformers 5 otherwise rebuilds any qwen2
    directory's tokenizer as a BPE ``Qwen2Tokenizer`` that no longer splits words the same way."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    config_file = Path(name_or_path) / "tokenizer_config.json"
    if config_file.is_file():
        declared = json.loads(config_file.read_text()).get("tokenizer_class")
        if declared == "TokenizersBackend" and type(tokenizer).__name__ != declared:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(name_or_path, **kwargs)
    return tokenizer
