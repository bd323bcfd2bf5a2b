"""Teacher-only context: the text the teacher sees in its prompt and the student does not.

Context distillation (prime-rl's form): the teacher is given instructions, a system
prompt or a worked demonstration; the student, trained on the teacher's scores of its own
completions, learns to behave as if it had them. The context is inserted into the
conversation's messages and the chat template is applied afterwards, so the teacher's
prompt is exactly what a chat model would see with that context (its special tokens and
markup included), tokenized as a whole.

Where it goes (``distillation.teacher_context_placement``):

* ``user_prefix``: before the first user message's text, followed by the separator;
* ``system``: as a system message at the start, or, if the conversation already has one,
  before that message's text.

What it is: ``distillation.teacher_context`` (the same text for every example),
``distillation.teacher_context_key`` (a per-example field of the dataset, e.g. a
demonstration), or both (the fixed text first).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opd.utils.errors import DataError


@dataclass(frozen=True)
class TeacherContext:
    """How to build each example's teacher-only context.

    Attributes:
        text: the fixed context, or None.
        key: the dataset field with a per-example context, or None.
        placement: ``user_prefix`` or ``system``.
        separator: between the context and the text it precedes (and between ``text``
            and the per-example context when both are set).
    """

    text: str | None
    key: str | None
    placement: str = "user_prefix"
    separator: str = "\n\n"

    def context_for(self, example: dict[str, Any]) -> str:
        """This example's context.

        Raises:
            DataError: if the example lacks ``key`` or its value is not a non-empty string
                (the caller prefixes the source and row).
        """
        parts = [self.text] if self.text else []
        if self.key is not None:
            value = example.get(self.key)
            if not isinstance(value, str) or not value.strip():
                found = (
                    "missing"
                    if value is None
                    else f"a {type(value).__name__}"
                    if not isinstance(value, str)
                    else "an empty string"
                )
                raise DataError(
                    f'field "{self.key}" (distillation.teacher_context_key) must be a non-empty string, found {found}'
                )
            parts.append(value)
        return self.separator.join(parts)

    def apply(self, messages: list[dict[str, Any]], context: str) -> list[dict[str, Any]]:
        """A copy of ``messages`` with ``context`` inserted (the input is not modified).

        Raises:
            DataError: for ``user_prefix`` when the conversation has no user message.
        """
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
