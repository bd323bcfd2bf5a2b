"""Running one tool call within limits: every failure becomes a message, never an exception.

:func:`run_tool` checks the call's arguments against the tool's schema, runs the tool in
a separate daemon thread and waits at most ``timeout_s`` for it, then turns what it
returned into text no longer than ``max_output_chars`` (longer output is cut, and the cut
is said in the message). An unknown tool, arguments that do not fit the schema, an
exception inside the tool, a timeout, or a value that cannot be written as text each come
back as a failed :class:`ToolOutcome` whose ``content`` tells the student what went
wrong, so a misbehaving tool or a confused model never takes the run down.

The time limit bounds how long the rollout waits, not what the tool computes: Python
cannot stop a thread, so a tool that ignores the limit keeps running in the background
(as a daemon, it does not keep the process alive). Tools must therefore bound their own
work; the built-in calculator bounds its numbers before computing
(:mod:`opd.environments.calculator`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from opd.environments.tools import Tool, argument_problem


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of every tool call.

    Attributes:
        timeout_s: longest wait for a tool's result, in seconds.
        max_output_chars: longest tool output passed to the student; longer output is cut.
    """

    timeout_s: float = 5.0
    max_output_chars: int = 2000

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_output_chars < 1:
            raise ValueError(f"max_output_chars must be >= 1, got {self.max_output_chars}")


@dataclass(frozen=True)
class ToolOutcome:
    """What one call gave the student.

    Attributes:
        content: the tool's output, or the error, as the ``tool`` message's text.
        ok: the tool ran and returned within its limits (a cut output is still ok).
    """

    content: str
    ok: bool


def error_message(reason: str) -> str:
    """How a failed call reads to the student."""
    return f"Error: {reason}"


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[output cut: {len(text)} characters, the limit is {limit}]"


def run_tool(tool: Tool | None, name: str, arguments: dict[str, Any], limits: SandboxLimits) -> ToolOutcome:
    """Runs ``tool`` with ``arguments`` within ``limits``; a failure is a failed outcome.

    Args:
        tool: the registered tool, or None when no tool is called ``name``.
        name: the name the call asked for.
        arguments: the call's arguments.
        limits: time and output-size limits.
    """
    if tool is None:
        return ToolOutcome(error_message(f"there is no tool named {name!r}"), False)
    problem = argument_problem(tool.parameters, arguments)
    if problem is not None:
        return ToolOutcome(error_message(f"{name}: {problem}"), False)
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["value"] = _as_text(tool.function(**arguments))
        except BaseException as error:  # whatever the tool raises (even SystemExit) is an observation
            result["error"] = error

    worker = threading.Thread(target=call, name=f"tool-{name}", daemon=True)
    worker.start()
    worker.join(limits.timeout_s)
    if worker.is_alive():
        return ToolOutcome(error_message(f"{name} did not finish within {limits.timeout_s:g} s"), False)
    if "error" in result:
        error = result["error"]
        detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        return ToolOutcome(_cut(error_message(f"{name} failed: {detail}"), limits.max_output_chars), False)
    return ToolOutcome(_cut(result["value"], limits.max_output_chars), True)
