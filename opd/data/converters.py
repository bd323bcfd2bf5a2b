"""Converters from task-specific dataset layouts to the chat format.

opd trains on chat-format examples (``{"messages": [...], ...}``). Math datasets
such as DeepScaleR are usually published as flat rows instead::

    {"problem": "What is 1+1?", "ground_truth_answer": "2"}

This module turns such "math-cl" rows into a single user turn built from a prompt
template, keeping the answer under ``ground_truth`` for the reward environment.
:mod:`opd.data.convert_math_cl` converts a whole dataset once, ahead of training.
"""

import string
from pathlib import Path
from typing import Any

from opd.utils.errors import DataError

PROMPT_PLACEHOLDER = "prompt"


def load_prompt_template(path: str | Path) -> str:
    """Reads a prompt template and checks that it is a usable ``str.format`` template.

    The text is returned exactly as stored (no stripping): a trailing newline, or
    the lack of one, changes what the model sees, e.g. a template that ends in
    ``Assistant: <think>`` makes the student continue right after the tag.

    Args:
        path: UTF-8 text file containing exactly one kind of placeholder,
            ``{prompt}``. Literal braces must be written as ``{{`` and ``}}``.

    Returns:
        The template text.

    Raises:
        DataError: If the file is missing or unreadable, has no ``{prompt}``
            placeholder, or has other placeholders or unbalanced braces.
    """
    path = Path(path)
    try:
        template = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"prompt file {path} not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"prompt file {path} could not be read as UTF-8 text: {err}") from None

    # Parse the template up front so a stray brace is reported once, naming the
    # file, rather than as a KeyError on the first example.
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
    """Converts one math-cl row into a chat-format example.

    Args:
        example: A row with ``problem`` (str) and ``ground_truth_answer``
            (str or number), and optionally ``solution`` (str), a worked answer that
            becomes the assistant message. Other fields are kept as they are.
        prompt_template: Template from :func:`load_prompt_template`; the problem
            is substituted for ``{prompt}``.

    Returns:
        ``{"messages": [{"role": "user", "content": ...}, (assistant solution)],
        "ground_truth": str, "problem": str, **other_fields}``.

    Raises:
        DataError: If a field is missing or has the wrong type. The message does
            not name the row; callers that know it (see ``load_chat_dataset``)
            prefix it.
    """
    if not isinstance(example, dict):
        raise DataError(f'expected an object with "problem" and "ground_truth_answer", got {_type_name(example)}')

    problem = example.get("problem")
    if problem is None:
        raise DataError(
            f'missing "problem" (math_cl rows need "problem" and "ground_truth_answer"); {_keys_hint(example)}'
        )
    if not isinstance(problem, str) or not problem.strip():
        raise DataError(f'"problem" must be a non-empty string, got {_describe(problem)}')

    answer = example.get("ground_truth_answer")
    if answer is None:
        raise DataError(
            f'missing "ground_truth_answer" (math_cl rows need "problem" and "ground_truth_answer"); '
            f"{_keys_hint(example)}"
        )
    # bool is a subclass of int, but True as a math answer is almost surely a bad column.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f'"ground_truth_answer" must be a string or a number, got {_type_name(answer)}')

    messages = [{"role": "user", "content": prompt_template.format(prompt=problem)}]
    # An optional worked solution becomes the assistant turn: the fixed data of λ < 1 steps
    # and the target of SFT.
    solution = example.get("solution")
    if solution is not None:
        if not isinstance(solution, str) or not solution.strip():
            raise DataError(f'"solution" must be a non-empty string when present, got {_describe(solution)}')
        messages.append({"role": "assistant", "content": solution})
    # Other columns ride along (a per-example teacher context, say: distillation.teacher_context_key).
    extra = {key: value for key, value in example.items() if key not in ("problem", "ground_truth_answer", "solution")}
    return {**extra, "messages": messages, "ground_truth": str(answer), "problem": problem}


def _type_name(value: Any) -> str:
    """Names a value's type the way a user who wrote JSON would recognise it."""
    return "null" if value is None else type(value).__name__


def _describe(value: Any) -> str:
    """Describes a bad value: an empty string is shown as such, anything else by type."""
    return "an empty string" if isinstance(value, str) else _type_name(value)


def _keys_hint(example: dict[str, Any]) -> str:
    """Lists the keys a row does have, which usually reveals a renamed column."""
    keys = ", ".join(sorted(map(str, example))) or "none"
    return f"found keys: {keys}"
