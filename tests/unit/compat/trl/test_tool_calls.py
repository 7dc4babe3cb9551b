"""Tool calling with TRL 1.16's semantics: which functions are tools, parsing the model's
``<tool_call>`` blocks with TRL's parser, and the tool messages (TRL's exact error texts)."""

from __future__ import annotations

import asyncio

import pytest

from loop_trainer.compat.trl.tool_calls import (
    ToolCallingSetupError,
    call_tools,
    malformed_call_message,
    parse_reply,
    prepare_tokenizer,
    tool_functions,
)
from loop_trainer.envs.base import Reply


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


async def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: What to shout.
    """
    await asyncio.sleep(0)
    return text.upper()


def explode() -> str:
    """Always fails."""
    raise RuntimeError("kaput")


class Counter:
    def reset(self, **row):
        self.count = 0

    def get_reward(self) -> float:
        return float(self.count)

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.count += by
        return self.count

    def multiply(self, a: int, b: int) -> str:
        """The environment's own multiply.

        Args:
            a: First.
            b: Second.
        """
        return "env"

    def _helper(self):
        return None


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer):
    return prepare_tokenizer(qwen_tokenizer)


def reply(tokenizer, text: str, tools=(multiply,)) -> Reply:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=list(tools), add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    return Reply(
        tokenizer.decode(ids, skip_special_tokens=True), ids, tokenizer.encode(prompt, add_special_tokens=False)
    )


def test_tools_are_the_list_plus_the_environments_public_methods():
    env = Counter()
    functions = tool_functions([multiply, shout], env)
    assert sorted(functions) == ["increment", "multiply", "shout"]  # not reset, get_reward, _helper
    assert functions["multiply"](1, 2) == "env"  # the environment's method wins over the plain tool
    assert tool_functions([multiply]) == {"multiply": multiply}


def test_calls_are_parsed_with_trls_parser_and_typed_by_the_schema(tokenizer):
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": "4"}}\n</tool_call><|im_end|>'
    parsed = parse_reply(tokenizer, reply(tokenizer, call), tools=[multiply])
    assert parsed["tool_calls"] == [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    ]
    two = (
        call.replace("<|im_end|>", "\n")
        + '<tool_call>\n{"name": "shout", "arguments": {"text": "x"}}\n</tool_call><|im_end|>'
    )
    assert [c["function"]["name"] for c in parse_reply(tokenizer, reply(tokenizer, two))["tool_calls"]] == [
        "multiply",
        "shout",
    ]
    plain = parse_reply(tokenizer, reply(tokenizer, "It is 12.<|im_end|>"))
    assert plain == {"role": "assistant", "content": "It is 12."}
    assert malformed_call_message(tokenizer, plain) is None


def test_results_and_errors_come_back_as_tool_messages_with_trls_texts():
    env = Counter()
    env.reset()
    functions = tool_functions([multiply, shout, explode], env)

    def call(name, arguments):
        return {"type": "function", "function": {"name": name, "arguments": arguments}}

    messages, failures = asyncio.run(
        call_tools(
            [
                call("increment", {"by": 2}),
                call("shout", {"text": "hey"}),
                call("nope", {}),
                call("increment", {"by": 1, "c": 3}),
                call("increment", {}),
                call("explode", {}),
                {"type": "retrieval", "name": "search"},
                call("increment", "1"),
                call("increment", None),
            ],
            functions,
        )
    )
    assert [m["role"] for m in messages] == ["tool"] * 9
    assert [m["name"] for m in messages] == [
        "increment",
        "shout",
        "nope",
        "increment",
        "increment",
        "explode",
        "search",
        "increment",
        "increment",
    ]
    assert [m["content"] for m in messages[:7]] == [
        "2",
        "HEY",
        "{'error': 'Tool nope not found.'}",
        "{'error': \"Counter.increment() got an unexpected keyword argument 'c'\"}",
        "{'error': \"Counter.increment() missing 1 required positional argument: 'by'\"}",
        "{'error': 'kaput'}",
        "{'error': 'Unsupported tool call type: retrieval'}",
    ]
    assert "must be a mapping, not str" in messages[7]["content"]
    assert "missing 1 required positional argument" in messages[8]["content"]  # None arguments become {}
    assert failures == 7 and env.count == 2


def test_a_call_that_does_not_parse_gets_a_tool_message_saying_why(tokenizer):
    for text, reason in (
        (
            '<tool_call>\n{"name": "multiply", "arguments": {"a": 3,, }}\n</tool_call><|im_end|>',
            "its JSON does not parse",
        ),
        ('<tool_call>\n{"name": "multiply", "argu', "its JSON does not parse"),
        ('<tool_call>\n{"function": "multiply"}\n</tool_call><|im_end|>', 'it needs a "name"'),
    ):
        parsed = parse_reply(tokenizer, reply(tokenizer, text))
        assert "tool_calls" not in parsed
        message = malformed_call_message(tokenizer, parsed)
        assert message["role"] == "tool" and message["content"].startswith("{'error': 'malformed tool call: " + reason)
        assert '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}' in message["content"]


def test_a_template_trl_cannot_parse_is_one_actionable_line():
    from loop_trainer.models.tiny import build_word_tokenizer

    tokenizer = build_word_tokenizer(["hello"])
    with pytest.raises(ToolCallingSetupError, match="set tokenizer.response_template") as error:
        prepare_tokenizer(tokenizer)
    assert "\n" not in str(error.value)
