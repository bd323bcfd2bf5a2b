"""Parsing tool calls in the chat template's format (Qwen2.5's, after Hermes): one JSON object per call::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "1234 * 567"}}
    </tool_call>

A call that cannot be read is a :class:`MalformedCall` with the reason, answered with an error the student sees:
whatever the model wrote (bad JSON, nesting past Python's recursion limit, an integer of more digits than Python
converts) is a reason, never an exception.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    """A call that could not be read, with what was written and why it failed."""

    text: str
    reason: str


def _unreadable(error: Exception) -> str:
    """Why JSON the model wrote could not be read: bad syntax, or what Python refuses (nesting past its recursion
    limit, an integer literal of more than 4,300 digits)."""
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at character {error.pos}"
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return f"{type(error).__name__}: {str(error)[:200]}"


def _read_call(body: str) -> ToolCall | MalformedCall:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as error:
        return MalformedCall(body, f"the call is not valid JSON ({_unreadable(error)})")
    if not isinstance(value, dict):
        return MalformedCall(body, f"the call must be a JSON object, got {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(body, 'the call has no "name" string')
    if "arguments" not in value:
        return MalformedCall(body, 'the call has no "arguments" object')
    arguments = value["arguments"]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as error:
            return MalformedCall(body, f'"arguments" is a string that is not a JSON object ({_unreadable(error)})')
    if not isinstance(arguments, dict):
        return MalformedCall(body, f'"arguments" must be a JSON object, got {type(arguments).__name__}')
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every call opened in ``text``, in order; an unclosed one is a :class:`MalformedCall`, a stray close ignored."""
    calls: list[ToolCall | MalformedCall] = []
    position = 0
    while (start := text.find(CALL_OPEN, position)) >= 0:
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        if end < 0:
            calls.append(MalformedCall(text[body_start:], f"the call is not closed with {CALL_CLOSE}"))
            break
        calls.append(_read_call(text[body_start:end].strip()))
        position = end + len(CALL_CLOSE)
    return calls
