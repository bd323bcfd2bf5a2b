"""A config's refusals as data: when each applies, and what it says.

A cross-setting check is a sequence of checks tried in order; the first problem found is reported, naming the
conflicting keys and the fix. Each check is a :class:`Refusal`, a :class:`Finding`, or a function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

SubjectT = TypeVar("SubjectT")
SubjectT_contra = TypeVar("SubjectT_contra", contravariant=True)


@dataclass(frozen=True)
class Refusal(Generic[SubjectT]):
    """A combination that cannot run: ``applies`` says when, ``message`` what to tell (a text, or made from it)."""

    applies: Callable[[SubjectT], bool]
    message: str | Callable[[SubjectT], str]

    def __call__(self, subject: SubjectT) -> str | None:
        if not self.applies(subject):
            return None
        return self.message if isinstance(self.message, str) else self.message(subject)


@dataclass(frozen=True)
class Finding(Generic[SubjectT]):
    """A refusal that tells what ``find`` found (None: nothing to refuse), in a message made from both."""

    find: Callable[[SubjectT], str | None]
    message: Callable[[SubjectT, str], str]

    def __call__(self, subject: SubjectT) -> str | None:
        found = self.find(subject)
        return None if found is None else self.message(subject, found)


class Check(Protocol[SubjectT_contra]):
    """One check of a subject: its problem, or None (a :class:`Refusal`, a :class:`Finding` or a function)."""

    def __call__(self, subject: SubjectT_contra, /) -> str | None: ...


def first_problem(checks: Iterable[Check[SubjectT]], subject: SubjectT) -> str | None:
    """The first problem that ``checks``, in order, find in ``subject``, or None."""
    return next((problem for check in checks if (problem := check(subject)) is not None), None)


def all_problems(checks: Iterable[Check[SubjectT]], subject: SubjectT) -> list[str]:
    """Every problem that ``checks``, in order, find in ``subject``."""
    return [problem for check in checks if (problem := check(subject)) is not None]
