"""What a tool call gave the student: its text and whether the tool returned within its limits.

Shared by the sandbox (:mod:`opd.rollout.tools.sandbox`) and its worker processes
(:mod:`opd.rollout.tools.workers`), which format results and failures the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolOutcome:
    """What one call gave the student: the ``tool`` message's text, and ``ok`` when the tool returned in its limits."""

    content: str
    ok: bool


def failure(reason: str, max_output_chars: int | None = None) -> ToolOutcome:
    """A failed call, as it reads to the student (cut to ``max_output_chars`` where given)."""
    text = f"Error: {reason}"
    return ToolOutcome(text if max_output_chars is None else cut(text, max_output_chars), False)


def as_text(value: Any) -> str:
    """A tool's result as the message's text: a string as is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, the cut said."""
    return text if len(text) <= limit else f"{text[:limit]}\n[output cut: {len(text)} characters, the limit is {limit}]"


def failure_detail(error: BaseException) -> str:
    """``Type: message`` of what a tool raised; its ``str()`` is the tool's code too, and may itself raise."""
    try:
        message = str(error)
    except Exception:
        message = "(its message could not be read)"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
