"""Converters from task-specific dataset layouts to the chat format (``{"messages": [...], ...}``).

A "math-cl" row (``{"problem": ..., "ground_truth_answer": ...}``) becomes one user turn built from a prompt
template, with the answer kept under ``ground_truth`` for the reward environment.
:mod:`opd.data.convert_math_cl` converts a whole dataset ahead of training.
"""

import string
from pathlib import Path
from typing import Any

from opd.utils.errors import DataError

PROMPT_PLACEHOLDER = "prompt"


def load_prompt_template(path: str | Path) -> str:
    """Reads a UTF-8 ``str.format`` template whose only placeholder is ``{prompt}`` (literal braces: ``{{ }}``).

    The text is returned unstripped: a trailing newline or its absence changes what the model sees.

    Raises:
        DataError: if the file is missing or unreadable, lacks ``{prompt}``, or has other placeholders or
            unbalanced braces.
    """
    path = Path(path)
    try:
        template = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"prompt file {path} not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"prompt file {path} could not be read as UTF-8 text: {err}") from None

    # Parse up front: a stray brace is reported once, naming the file, not as a KeyError on the first example.
    try:
        field_names = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as err:
        raise DataError(
            f"prompt file {path} is not a valid str.format template ({err}); write literal braces as {{{{ and }}}}"
        ) from None

    if PROMPT_PLACEHOLDER not in field_names:
        raise DataError(f"prompt file {path} must contain the {{prompt}} placeholder where the problem goes")
    unexpected = sorted(field_names - {PROMPT_PLACEHOLDER})
    if unexpected:
        shown = ", ".join("{" + name + "}" for name in unexpected)
        raise DataError(
            f"prompt file {path} has unknown placeholder(s) {shown}; only {{prompt}} is filled in, "
            "so write literal braces as {{ and }}"
        )
    return template


def math_cl_to_chat(example: dict[str, Any], prompt_template: str) -> dict[str, Any]:
    """Converts one math-cl row into ``{"messages": [user, (assistant)], "ground_truth", "problem", **others}``.

    ``problem`` (str) fills ``{prompt}``; ``ground_truth_answer`` (str or number) becomes the ``ground_truth`` string;
    an optional ``solution`` (str) becomes the assistant turn. Other fields are kept.

    Raises:
        DataError: if a field is missing or has the wrong type; the message does not name the row (callers prefix it).
    """
    if not isinstance(example, dict):
        raise DataError(f'expected an object with "problem" and "ground_truth_answer", got {type_name(example)}')

    problem = example.get("problem")
    if problem is None:
        raise DataError(
            f'missing "problem" (math_cl rows need "problem" and "ground_truth_answer"); {keys_hint(example)}'
        )
    if not isinstance(problem, str) or not problem.strip():
        raise DataError(f'"problem" must be a non-empty string, got {_describe(problem)}')

    answer = example.get("ground_truth_answer")
    if answer is None:
        raise DataError(
            f'missing "ground_truth_answer" (math_cl rows need "problem" and "ground_truth_answer"); '
            f"{keys_hint(example)}"
        )
    # bool is a subclass of int, but True as a math answer is almost surely a bad column.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f'"ground_truth_answer" must be a string or a number, got {type_name(answer)}')

    messages = [{"role": "user", "content": prompt_template.format(prompt=problem)}]
    # The worked solution is the fixed data of λ < 1 steps and the target of SFT.
    solution = example.get("solution")
    if solution is not None:
        if not isinstance(solution, str) or not solution.strip():
            raise DataError(f'"solution" must be a non-empty string when present, got {_describe(solution)}')
        messages.append({"role": "assistant", "content": solution})
    # Other columns ride along (a per-example teacher context, say: distillation.teacher_context_key).
    extra = {key: value for key, value in example.items() if key not in ("problem", "ground_truth_answer", "solution")}
    return {**extra, "messages": messages, "ground_truth": str(answer), "problem": problem}


def type_name(value: Any) -> str:
    """Names a value's type the way a user who wrote JSON would recognise it."""
    return "null" if value is None else type(value).__name__


def _describe(value: Any) -> str:
    """Describes a bad value: an empty string is shown as such, anything else by type."""
    return "an empty string" if isinstance(value, str) else type_name(value)


def keys_hint(example: dict[str, Any]) -> str:
    """Lists the keys a row does have, which usually reveals a renamed column."""
    keys = ", ".join(sorted(map(str, example))) or "none"
    return f"found keys: {keys}"
