"""The built-in ``python`` tool: runs the student's Python code, keeping its variables across one episode's calls.

It is a stateful tool (:attr:`~opd.rollout.tools.registry.Tool.stateful`): each episode runs it in a worker
process of its own, started at its first call and ended with the episode, within the sandbox's limits (time,
memory, output; whatever the code starts is killed when the call returns). The variables live in that process's
:data:`_NAMESPACE`, so an episode sees its own earlier calls' variables and never another episode's.

The code can do anything the worker process can (read files, open sockets): the sandbox bounds its time, memory
and processes, not its reach. Run it where the student's code may run.
"""

from __future__ import annotations

import ast
import contextlib
import io
import traceback
from typing import Any

from opd.rollout.tools.registry import Tool

MAX_CODE_CHARS = 20_000
"""Longest code accepted in one call."""

_CELL = "<python>"
"""The file name the student's code runs under (its frames in a traceback)."""

_NAMESPACE: dict[str, Any] = {"__name__": "__main__"}
"""The episode's variables: module state of its own worker process (see the module docstring)."""


class PythonError(Exception):
    """The code raised: its output so far and the traceback's last lines, as a REPL shows them."""


def run_python(code: str) -> str:
    """Runs ``code`` as a notebook cell: what it prints, then the value of a final expression (its ``repr``).

    Raises:
        PythonError: the code does not parse or raises (with its output so far and the error).
    """
    if len(code) > MAX_CODE_CHARS:
        raise PythonError(f"the code is {len(code)} characters long; the limit is {MAX_CODE_CHARS}")
    output = io.StringIO()
    try:
        tree = ast.parse(code, _CELL)
        last = tree.body[-1] if tree.body else None
        final = last if isinstance(last, ast.Expr) else None
        if final is not None:
            tree.body.pop()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            exec(compile(tree, _CELL, "exec"), _NAMESPACE)
            if final is not None:
                value = eval(compile(ast.Expression(final.value), _CELL, "eval"), _NAMESPACE)
                if value is not None:
                    print(repr(value))
    except Exception as error:
        # The frames of this module are not the student's: keep only those of its code.
        frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == _CELL]
        where = f" (line {frames[-1].lineno})" if frames else ""
        lines = traceback.format_exception_only(type(error), error)
        raise PythonError(f"{output.getvalue()}{''.join(lines).strip()}{where}") from None
    return output.getvalue() or "(no output)"


def python_tool() -> Tool:
    """The ``python`` tool (stateful: its variables persist across the calls of one episode)."""
    return Tool(
        name="python",
        function=run_python,
        description="Runs Python code and returns what it prints and the value of its last expression. Variables "
        "and imports persist between calls in this conversation.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python code to run"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        stateful=True,
    )
