"""Wall-clock timing of a step's phases, in NeMo-RL's ``with timer.time("name"):`` style.

A phase timed several times in one step accumulates.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timer:
    """Accumulates seconds per named phase until :meth:`pop`."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Adds the wall time of the ``with`` block to phase ``name`` (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Adds ``seconds`` timed elsewhere (a worker's own clock) to phase ``name``."""
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def seconds(self, name: str) -> float:
        """The time accumulated in phase ``name`` (0 if it never ran)."""
        return self._seconds.get(name, 0.0)

    def pop(self) -> dict[str, float]:
        """All phases' times, and a fresh start for the next step."""
        seconds, self._seconds = self._seconds, {}
        return seconds
