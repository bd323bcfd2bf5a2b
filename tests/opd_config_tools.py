"""Tools that the tests declare in a config (``environment.tools: [{function: opd_config_tools:...}]``).

A module of its own on the tests' ``sys.path``, light to import: worker processes import a tool's function by name.
"""

from __future__ import annotations

_calls = 0


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor
        b: the second factor,
            an integer too
    """
    return a * b


def describe(title: str, tags: list[str] | None = None, loud: bool = False) -> str:
    """Writes a title with its tags."""
    text = f"{title} [{', '.join(tags or [])}]"
    return text.upper() if loud else text


def count_calls() -> int:
    """How many times this tool was called in this process (a stateful tool: in this episode)."""
    global _calls
    _calls += 1
    return _calls


def grade_length(answer: str, row: dict) -> float:
    """A grader: 1.0 for an answer of at most 20 characters, else 0.0."""
    return 1.0 if len(answer) <= 20 else 0.0


NOT_CALLABLE = 3
