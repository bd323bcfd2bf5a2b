"""A config's refusals as data: when each applies, and what it says.

A check that spans a config's settings is a sequence of checks tried in order, the first
problem found being the one reported (its message names the keys that conflict and how to
fix them). A combination that is refused outright is a :class:`Refusal`; a check that
needs a loop or asks another component is a function returning its problem or None,
listed beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

SubjectT = TypeVar("SubjectT")


@dataclass(frozen=True)
class Refusal(Generic[SubjectT]):
    """A combination that cannot run: ``applies`` says when, ``message`` what to tell (a text, or made from it)."""

    applies: Callable[[SubjectT], bool]
    message: str | Callable[[SubjectT], str]

    def __call__(self, subject: SubjectT) -> str | None:
        if not self.applies(subject):
            return None
        return self.message if isinstance(self.message, str) else self.message(subject)


def first_problem(checks: Iterable[Callable[[SubjectT], str | None]], subject: SubjectT) -> str | None:
    """The first problem that ``checks``, in order, find in ``subject``, or None."""
    return next((problem for check in checks if (problem := check(subject)) is not None), None)
