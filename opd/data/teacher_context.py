"""Teacher-only context: the text the teacher sees in its prompt and the student does not (context distillation).

The student, trained on the teacher's scores of its completions, learns to behave as if it had the context. The
context is inserted into the messages before the chat template is applied, so the teacher's prompt is exactly what
a chat model would see with it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opd.utils.errors import DataError


@dataclass(frozen=True)
class TeacherContext:
    """How to build each example's teacher-only context: fixed ``text``, the per-example field ``key``, or both.

    ``placement`` (a :data:`PLACEMENTS` key); ``separator`` joins the context to the text it precedes, and ``text``
    to the per-example context.
    """

    text: str | None
    key: str | None
    placement: str = "user_prefix"
    separator: str = "\n\n"

    def context_for(self, example: dict[str, Any]) -> str:
        """This example's context; ``DataError`` (caller adds the row) if ``key``'s value is not a non-empty string."""
        parts = [self.text] if self.text else []
        if self.key is not None:
            value = example.get(self.key)
            if not isinstance(value, str) or not value.strip():
                kind = "an empty string" if isinstance(value, str) else f"a {type(value).__name__}"
                found = "missing" if value is None else kind
                raise DataError(
                    f'field "{self.key}" (distillation.teacher_context_key) must be a non-empty string, found {found}'
                )
            parts.append(value)
        return self.separator.join(parts)

    def apply(self, messages: list[dict[str, Any]], context: str) -> list[dict[str, Any]]:
        """A copy of ``messages`` with ``context`` inserted; ``DataError`` if ``user_prefix`` finds no user message."""
        return PLACEMENTS[self.placement](copy.deepcopy(messages), context, self.separator)


def _before_first_user(messages: list[dict[str, Any]], context: str, separator: str) -> list[dict[str, Any]]:
    for message in messages:
        if message.get("role") == "user":
            message["content"] = context + separator + message["content"]
            return messages
    raise DataError("teacher_context_placement = user_prefix needs a user message in the prompt")


def _in_system_message(messages: list[dict[str, Any]], context: str, separator: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = context + separator + messages[0]["content"]
    else:
        messages.insert(0, {"role": "system", "content": context})
    return messages


PLACEMENTS: dict[str, Callable[[list[dict[str, Any]], str, str], list[dict[str, Any]]]] = {
    "user_prefix": _before_first_user,
    "system": _in_system_message,
}
"""How each ``distillation.teacher_context_placement`` inserts the context into (a copy of) the messages."""
