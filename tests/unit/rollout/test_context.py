"""Context policies: what the model is shown of an episode's history, and the token-exact segments an
episode becomes when that stops being append-only."""

from __future__ import annotations

import torch

from loop_trainer.chat import ChatFormatter
from loop_trainer.config import EpisodeSettings
from loop_trainer.rollout import EpisodeLimits, RolloutEngine, TransformersBackend
from loop_trainer.rollout.context import ELIDED, ContextPolicy, compacted, extends
from loop_trainer.training.batching import collate, training_samples
from support.helpers import EchoEnv, EchoEpisode, ScriptedBackend

OPENING = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]


def history(observations: list[str], replies: list[str] | None = None) -> list[dict[str, str]]:
    replies = replies or [f"reply {i}" for i in range(len(observations))]
    messages = list(OPENING)
    for reply, observation in zip(replies, observations, strict=True):
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
    return messages


def words(text: str) -> int:
    return len(text.split())


def test_nothing_set_shows_the_history_as_it_is():
    policy = ContextPolicy()
    assert not policy.active
    messages = history(["a b", "c"])
    assert policy.shown(messages, 2, words) == messages


def test_keep_observations_elides_all_but_the_last_n_and_never_the_opening():
    shown = ContextPolicy(keep_observations=2).shown(history(["o1", "o2", "o3"]), 2, words)
    assert shown[:2] == OPENING
    assert [m["content"] for m in shown if m["role"] == "user"][1:] == [ELIDED, "o2", "o3"]
    assert [m["content"] for m in shown if m["role"] == "assistant"] == ["reply 0", "reply 1", "reply 2"]


def test_a_budget_compacts_to_half_and_the_elided_part_only_grows():
    observations = ["w " * 3] * 7  # 3 tokens each, budget 10
    policy = ContextPolicy(observation_budget=10)
    elided_before: set[int] = set()
    compactions = 0
    for n in range(1, len(observations) + 1):
        shown = policy.shown(history(observations[:n]), 2, words)
        elided = {i for i, m in enumerate(shown) if m["content"] == ELIDED}
        kept = sum(words(m["content"]) for m in shown[2:] if m["role"] == "user" and m["content"] != ELIDED)
        assert elided >= elided_before  # monotone: a segment starts only at a compaction
        assert kept <= 10 and shown[-1]["content"] != ELIDED
        compactions += elided != elided_before
        elided_before = elided
    assert compactions == 2  # at the 4th observation (12 > 10: down to the newest, 3) and at the 7th
    assert compacted([5, 7], [100, 1], budget=10) == [5]  # one huge observation is elided once a newer one comes


def test_strip_thinking_removes_think_blocks_from_every_earlier_reply():
    messages = history(["o1", "o2"], ["<think>plan a</think>\nfind ann", "<think>\nplan b\n</think> open k1"])
    shown = ContextPolicy(strip_thinking=True).shown(messages, 2, words)
    assert [m["content"] for m in shown if m["role"] == "assistant"] == ["find ann", "open k1"]
    assert messages[2]["content"].startswith("<think>")  # the history itself is untouched


def test_extends_is_message_prefix_equality():
    before = history(["o1"])
    assert extends(before, history(["o1", "o2"]))
    assert not extends(before, ContextPolicy(keep_observations=1).shown(history(["o1", "o2"]), 2, words))


def test_the_keys_build_the_policy_for_training_and_loop_eval():
    settings = EpisodeSettings(context_keep_observations=3, context_strip_thinking=True)
    assert settings.context_policy() == ContextPolicy(keep_observations=3, strip_thinking=True)
    assert not EpisodeSettings().context_policy().active


def collect(engine: RolloutEngine, env: EchoEnv):
    with engine:
        return engine.collect(env.rows, 1).trajectories


def test_an_inactive_policy_gives_the_append_only_trajectory(qwen_tokenizer):
    def build(policy):
        env = EchoEnv([{"task_id": "t0", "turns": 4}])
        backend = ScriptedBackend(qwen_tokenizer, lambda prompt: f"reply {len(prompt)}")
        limits = EpisodeLimits(max_turns=10)
        return env, RolloutEngine(
            env, backend, ChatFormatter(qwen_tokenizer), limits, show_progress=False, context_policy=policy
        )

    (plain,) = collect(*reversed(build(None)))
    (inactive,) = collect(*reversed(build(ContextPolicy())))
    assert plain.segment_starts == [] and plain.segments == [(0, len(plain.token_ids))]
    assert inactive.to_dict() == {**plain.to_dict(), "seconds": inactive.seconds}


def test_each_segment_is_exactly_the_rewritten_history_as_the_model_saw_it(qwen_tokenizer):
    """keep_observations=1 over four turns: every reply after the first observation sees a history whose
    older observation was elided, so turns 2, 3 and 4 each open a segment rendered afresh; each
    segment's context is what the backend was sent, and its sampled tokens are exactly the reply's."""
    formatter = ChatFormatter(qwen_tokenizer)
    env = EchoEnv([{"task_id": "t0", "turns": 4}])
    prompts: list[list[int]] = []

    def reply(prompt):
        prompts.append(prompt)
        return f"reply {len(prompts)}"

    engine = RolloutEngine(
        env,
        ScriptedBackend(qwen_tokenizer, reply),
        formatter,
        EpisodeLimits(max_turns=10),
        show_progress=False,
        context_policy=ContextPolicy(keep_observations=1),
    )
    (trajectory,) = collect(engine, env)
    assert trajectory.num_turns == 4 and len(trajectory.segments) == 3
    policy = ContextPolicy(keep_observations=1)
    for k, (start, end) in enumerate(trajectory.segments):
        segment = trajectory.token_ids[start:end]
        turns = sorted({t for t in trajectory.turn_ids[start:end] if t >= 0})
        first = turns[0]
        # the context the model was sent for its first reply in this segment
        assert prompts[first] == segment[: len(prompts[first])]
        if k > 0:  # opened afresh: the rewritten history of that moment, rendered as a whole conversation
            seen = trajectory.messages[: 2 + 2 * first]
            shown = policy.shown(seen, 2, formatter.count_tokens)
            assert segment[: len(prompts[first])] == formatter.opening_ids(shown)
            assert ELIDED in qwen_tokenizer.decode(segment)
        for t in turns:  # every reply of the segment continued from the segment's own tokens
            assert prompts[t] == segment[: len(prompts[t])]
        sampled = [tok for tok, m in zip(segment, trajectory.loss_mask[start:end], strict=True) if m]
        expected = [
            tok
            for t in turns
            for tok in qwen_tokenizer.encode(f"reply {t + 1}")
            + [formatter.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        ]
        assert sampled == expected
    assert trajectory.segments[0] == (0, trajectory.segment_starts[0])
    assert sum(trajectory.loss_mask) == sum(len(qwen_tokenizer.encode(f"reply {t}")) + 1 for t in range(1, 5))


class ForgetfulEpisode(EchoEpisode):
    """Shows the model only the opening and the last observation: its own context hook."""

    def context(self, history):
        return [*history[:2], history[-1]]


class ForgetfulEnv(EchoEnv):
    def episode(self, task):
        return ForgetfulEpisode(self, task)


def test_an_episode_hook_comes_before_the_keys(qwen_tokenizer):
    env = ForgetfulEnv([{"task_id": "t0", "turns": 3}])
    prompts: list[list[int]] = []
    backend = ScriptedBackend(qwen_tokenizer, lambda prompt: prompts.append(prompt) or "go")
    engine = RolloutEngine(
        env,
        backend,
        ChatFormatter(qwen_tokenizer),
        EpisodeLimits(max_turns=10),
        show_progress=False,
        context_policy=ContextPolicy(keep_observations=5),
    )
    (trajectory,) = collect(engine, env)
    assert len(trajectory.segments) == 3
    assert "obs 1" not in qwen_tokenizer.decode(prompts[2]) and "obs 2" in qwen_tokenizer.decode(prompts[2])
    assert [m["content"] for m in trajectory.messages if m["role"] == "user"][1:] == ["obs 1", "obs 2"]


def test_the_trainers_log_probs_of_each_segment_equal_the_samplers(vault_tiny):
    """A real sampler (the tiny vault model, T=1) on vault episodes with only the last observation
    shown: each segment, trained as a row of its own, gives the sampler's log-prob for every token it
    sampled."""
    env, model, tokenizer = vault_tiny
    model.eval()
    backend = TransformersBackend(model, stop_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    engine = RolloutEngine(
        env,
        backend,
        ChatFormatter(tokenizer),
        EpisodeLimits(max_turns=6, max_new_tokens_per_turn=4, max_trajectory_tokens=512),
        show_progress=False,
        context_policy=ContextPolicy(keep_observations=1),
    )
    with engine:
        trajectories = engine.collect(list(env.tasks())[:4], 2, seed=3).trajectories
    split = [t for t in trajectories if t.segment_starts]
    assert split, "no episode was long enough to be split"
    for index, trajectory in enumerate(split):
        samples = training_samples(trajectory, 1.0, 512, index)
        assert len(samples) == sum(any(trajectory.loss_mask[s:e]) for s, e in trajectory.segments) and all(
            s.trajectory == index for s in samples
        )
        assert sum(sum(s.loss_mask) for s in samples) == trajectory.num_sampled_tokens
        batch = collate(samples, tokenizer.pad_token_id)
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        sampled = batch.loss_mask[:, 1:].bool()
        torch.testing.assert_close(logprobs[sampled], batch.sampler_logprobs[:, 1:][sampled], rtol=0, atol=2e-5)
