"""The timing rule every benchmark table here uses: the median of timed calls after one untimed call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``call``, after one untimed call (warm-up)."""
    return median_and_range(call, repeats)[0]


def median_and_range(call: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """``(median, min, max)`` wall time of ``repeats`` calls of ``call``, after one untimed call (warm-up)."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)
