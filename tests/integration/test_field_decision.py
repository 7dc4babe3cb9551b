"""``benchmarks/field_decision.py``, the teacher-forced probe of which field a policy answers on
``contacts``: it conditions on exactly the ids the rollout engine would have built, its log-probs
are the model's own, and on the starting SmolLM2 it shows the rule docs/real-model.md reports."""

from __future__ import annotations

import pytest
import torch

from benchmarks.field_decision import continuation_logprob, field_decisions, final_turn_prefix, load_policy
from benchmarks.real_model_capability import demonstration
from loop_trainer.chat import ChatFormatter
from loop_trainer.envs.contacts import ContactsEnv, solve
from support.packaged import needs_packaged_model


@pytest.fixture(scope="module")
def starting_policy():
    return load_policy(None)


@needs_packaged_model
def test_the_final_turn_is_conditioned_on_what_the_rollout_engine_renders(starting_policy):
    model, tokenizer = starting_policy
    formatter, stop_id = ChatFormatter(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>")
    task = ContactsEnv(num_tasks=2, examples=2).tasks("test")[0]
    prefix = final_turn_prefix(task, formatter, stop_id)
    ids, mask = demonstration(task, formatter, stop_id)
    final_reply = formatter._encode(solve(task)[-1]) + [stop_id]
    assert ids == prefix + final_reply and mask[len(prefix) :] == [1] * len(final_reply)

    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    by_token = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert continuation_logprob(model, prefix, final_reply) == pytest.approx(
        float(by_token[len(prefix) - 1 :].sum()), abs=1e-4
    )


@needs_packaged_model
def test_the_starting_model_answers_the_field_of_the_last_example(starting_policy):
    model, tokenizer = starting_policy
    tasks = list(ContactsEnv(num_tasks=64, examples=2).tasks("test"))[:6]
    rows = field_decisions(model, tokenizer, tasks)
    assert {row["asked"] == row["last_example"] for row in rows} == {True, False}  # both kinds are probed
    for row in rows:
        assert 0 < row["p_either"] <= 1
        assert (row["p_right"] > 0.9) if row["asked"] == row["last_example"] else (row["p_right"] < 0.1)
