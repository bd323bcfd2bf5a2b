"""Tool calls in Qwen's <tool_call> format: well-formed calls parse, every malformed one is reported."""

from __future__ import annotations

import pytest

from opd.rollout.environments.tool_calls import MalformedCall, ToolCall, parse_tool_calls


def test_parses_calls_in_order():
    text = (
        "<think>\nneed two\n</think>\n\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}\n</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "1+1"}),
        ToolCall("lookup", {"key": "a"}),  # arguments written as a JSON string
    ]


def test_no_call_is_an_answer():
    assert parse_tool_calls("The answer is \\boxed{3}. </tool_call>") == []


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', "not valid JSON"),
        ('["calculator"]', "must be a JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "calculator"}', 'no "arguments"'),
        ('{"name": "calculator", "arguments": [1]}', "must be a JSON object"),
        ('{"name": "calculator", "arguments": "not json"}', "string that is not"),
    ],
)
def test_malformed_calls_say_why(body, reason):
    (call,) = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>")
    assert isinstance(call, MalformedCall)
    assert reason in call.reason


def test_unclosed_call_is_malformed():
    calls = parse_tool_calls('<tool_call>\n{"name": "calculator", "arguments": {}}')
    assert len(calls) == 1 and isinstance(calls[0], MalformedCall) and "not closed" in calls[0].reason
