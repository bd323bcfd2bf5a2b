"""Run logging: console progress, per-step JSONL and TensorBoard.

Metric names are namespaced: ``train/*`` (loss, KL, grad norm, ...), ``val/*``,
``timing/*`` (seconds per phase) and ``perf/*`` (throughput, memory). Every backend
receives the same flat dictionary for a step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from opd.utils.config import StrictConfig

log = logging.getLogger("opd")


class LoggerConfig(StrictConfig):
    """Where and how metrics are written."""

    log_dir: str = Field("logs", description="directory for metrics.jsonl and TensorBoard files")
    jsonl: bool = True
    tensorboard: bool = False
    console: bool = True


def setup_console_logging(level: int = logging.INFO) -> None:
    """Routes opd's ``logging`` messages to stderr with a short prefix."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[opd] %(message)s"))
        log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:.0f}"
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.2e}"
        return f"{value:.4f}"
    return str(value)


class Logger:
    """Fans metrics out to the enabled backends.

    Args:
        config: the ``logger`` config section.
        total_steps: planned optimizer steps (for the console's progress and ETA).
    """

    def __init__(self, config: LoggerConfig, total_steps: int) -> None:
        self.config = config
        self.total_steps = total_steps
        self.log_dir = Path(config.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_time = time.perf_counter()
        self._jsonl = open(self.log_dir / "metrics.jsonl", "a", encoding="utf-8") if config.jsonl else None
        self._tensorboard = None
        if config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional extra
                log.warning("logger.tensorboard is on but tensorboard is not installed; pip install 'opd[logging]'")
            else:
                self._tensorboard = SummaryWriter(log_dir=str(self.log_dir / "tensorboard"))

    def log_metrics(self, metrics: dict[str, Any], step: int, console_keys: list[str] | None = None) -> None:
        """Writes one record of metrics for ``step`` to every backend.

        Args:
            metrics: flat ``{"train/loss": 0.5, ...}``; non-finite floats are kept as
                strings in JSONL so the file stays valid JSON.
            step: optimizer step the metrics belong to.
            console_keys: subset printed on the console (all when None).
        """
        if self._jsonl is not None:
            record = {"step": step, "time": round(time.perf_counter() - self.start_time, 3)}
            for key, value in metrics.items():
                record[key] = str(value) if isinstance(value, float) and not math.isfinite(value) else value
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        if self.config.console:
            keys = console_keys if console_keys is not None else list(metrics)
            # train/ is the default namespace on the console; val/, timing/, perf/ stay visible.
            shown = "  ".join(
                f"{key.removeprefix('train/')}={_format_value(metrics[key])}" for key in keys if key in metrics
            )
            print(f"{self._progress(step)} {shown}", flush=True)

    def _progress(self, step: int) -> str:
        """``step 12/50 [###-------] 01:02<04:05`` : position, bar, elapsed and ETA."""
        elapsed = time.perf_counter() - self.start_time
        fraction = min(step / self.total_steps, 1.0) if self.total_steps else 0.0
        width = 20
        bar = "#" * int(fraction * width) + "-" * (width - int(fraction * width))
        eta = elapsed / step * (self.total_steps - step) if step > 0 else 0.0
        return f"step {step:>{len(str(self.total_steps))}}/{self.total_steps} [{bar}] {_clock(elapsed)}<{_clock(eta)}"

    def close(self) -> None:
        """Flushes and closes every backend."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def is_main_process() -> bool:
    """True on the process that owns logging (rank 0 when launched distributed)."""
    return os.environ.get("RANK", "0") == "0"
