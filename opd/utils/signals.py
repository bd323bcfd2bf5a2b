"""Graceful stop on SIGINT / SIGTERM.

The first signal sets a flag: the training loop finishes its step, checkpoints and exits. A second signal
interrupts at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeAlias

SignalHandler: TypeAlias = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
"""What ``signal.getsignal`` returns and ``signal.signal`` takes back."""


class GracefulStop:
    """Context manager that turns the first SIGINT/SIGTERM into a stop request (``signal_name``)."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, SignalHandler] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop was requested."""
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name
        # The next signal gets the previous behaviour (KeyboardInterrupt / termination).
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __enter__(self) -> GracefulStop:
        # Handlers can only be installed from the main thread (e.g. not under some test runners).
        if threading.current_thread() is threading.main_thread():
            for sig in self._SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
