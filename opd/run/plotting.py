"""``opd plot LOG_DIR|metrics.jsonl``: ``curves.png`` and ``summary.txt`` beside a run's ``metrics.jsonl``.

Training records carry ``train/loss``; validation records ``val/*``. Where a step appears twice (a resume whose file
was not truncated), its latest record wins.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from opd.run.early_stop import SIGN_OF_BETTER
from opd.utils.errors import DataError, OpdError

METRICS_FILENAME = "metrics.jsonl"
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "Infinity": math.inf, "-Infinity": -math.inf}
TRAIN_MARKER = "train/loss"

# (panel title, y label, metric keys) in display order; a panel is drawn when any key is present.
_PANELS: list[tuple[str, str, tuple[str, ...]]] = [
    ("training loss", "loss", ("train/loss",)),
    ("train KL", "KL (nats/token)", ("train/kl_forward", "train/kl_reverse")),
    ("validation KL", "KL (nats/token)", ("val/kl_forward", "val/kl_reverse")),
    ("validation accuracy", "accuracy", ("val/accuracy",)),
]
# Validation metrics in the summary, with which direction is better.
_VAL_BEST: list[tuple[str, Literal["max", "min"]]] = [
    ("val/accuracy", "max"),
    ("val/kl_forward", "min"),
    ("val/kl_reverse", "min"),
]


# --------------------------------------------------------------------------- reading


def metrics_file(path: str | Path) -> Path:
    """The metrics file for ``path``: the path itself, or ``<path>/metrics.jsonl`` for a directory."""
    path = Path(path)
    return path / METRICS_FILENAME if path.is_dir() else path


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (or of a log directory's) in file order, ``"nan"``/``"inf"`` back as floats.

    Raises:
        DataError: the file is missing, or a line (named) is not a JSON object with an integer ``step``.
    """
    file = metrics_file(path)
    if not file.is_file():
        raise DataError(f"metrics file not found: {file}")
    records: list[dict[str, Any]] = []
    with open(file, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            text = line.strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise DataError(f"{file}: line {number} is not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise DataError(f"{file}: line {number} is not a JSON object")
            step = record.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                raise DataError(f"{file}: line {number} has no integer 'step'")
            for key, value in record.items():
                if isinstance(value, str) and value in _NON_FINITE:
                    record[key] = _NON_FINITE[value]
            records.append(record)
    return records


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _series(records: list[dict[str, Any]], key: str, finite_only: bool = True) -> tuple[list[int], list[float]]:
    """Steps and values of ``key``, sorted by step, the last record of a repeated step winning."""
    by_step: dict[int, float] = {}
    for record in records:
        value = _number(record.get(key))
        if value is None or (finite_only and not math.isfinite(value)):
            continue
        by_step[record["step"]] = value
    steps = sorted(by_step)
    return steps, [by_step[step] for step in steps]


def _train_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Training records, one per step (the latest of a repeated step), in step order."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        if TRAIN_MARKER in record:
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def _run_label(file: Path) -> str:
    """The run's name: the log directory's name, or its parent's when it is the default ``logs``."""
    log_dir = file.resolve().parent
    if log_dir.name == "logs" and log_dir.parent.name:
        return log_dir.parent.name
    return log_dir.name


# --------------------------------------------------------------------------- curves


def plot_curves(path: str | Path, output_png: str | Path | None = None) -> Path:
    """Draws the :data:`_PANELS` present in the file into one PNG (default ``<log dir>/curves.png``); returns its path.

    Matplotlib's Agg canvas is used directly: no display needed, the global backend untouched.

    Raises:
        DataError: unreadable file, or none of the plotted metrics is present.
        OpdError: Matplotlib is not installed.
    """
    file = metrics_file(path)
    records = read_metrics(file)
    panels = []
    for title, ylabel, keys in _PANELS:
        lines = [(key, *_series(records, key)) for key in keys]
        lines = [line for line in lines if line[1]]
        if lines:
            panels.append((title, ylabel, lines))
    if not panels:
        wanted = ", ".join(key for _, _, keys in _PANELS for key in keys)
        raise DataError(f"{file}: nothing to plot (none of {wanted} has a finite value)")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise OpdError("plotting needs matplotlib: pip install 'opd[logging]'") from None

    columns = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6.0 * columns, 3.6 * rows + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False)
    for index, (title, ylabel, lines) in enumerate(panels):
        ax = axes[index // columns][index % columns]
        for key, steps, values in lines:
            # Validation has few points: show them as markers on the line.
            marker = "o" if key.startswith("val/") or len(steps) <= 20 else None
            ax.plot(steps, values, marker=marker, markersize=4, linewidth=1.4, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if len(lines) > 1 or lines[0][0].endswith(("_forward", "_reverse")):
            ax.legend(fontsize="small")  # a lone KL line still says which direction it is
    for index in range(len(panels), rows * columns):
        axes[index // columns][index % columns].set_visible(False)
    figure.suptitle(_run_label(file))
    output = Path(output_png) if output_png is not None else file.parent / "curves.png"
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(str(output), format="png")
    return output


# --------------------------------------------------------------------------- summary


def _fmt(value: float) -> str:
    return f"{value:.6g}"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _first_last(steps: list[int], values: list[float]) -> str:
    return f"first {_fmt(values[0])} at step {steps[0]}, last {_fmt(values[-1])} at step {steps[-1]}"


def summarize(records: list[dict[str, Any]], label: str = "run") -> str:
    """The text of :func:`write_summary` for already-read records."""
    lines = [f"run: {label}"]
    train = _train_records(records)
    if train:
        lines.append(f"train steps: {len(train)} (steps {train[0]['step']}..{train[-1]['step']})")
    else:
        lines.append("train steps: 0")

    steps, values = _series(train, "train/loss")
    if values:
        low = min(range(len(values)), key=values.__getitem__)
        lines.append(f"train/loss: {_first_last(steps, values)}, min {_fmt(values[low])} at step {steps[low]}")
    for key in ("train/kl_forward", "train/kl_reverse"):
        steps, values = _series(train, key)
        if values:
            lines.append(
                f"{key}: {_first_last(steps, values)}; "
                f"mean of first 5 {_fmt(_mean(values[:5]))}, mean of last 5 {_fmt(_mean(values[-5:]))}"
            )

    validation = [record for record in records if TRAIN_MARKER not in record]
    for key, direction in _VAL_BEST:
        steps, values = _series(validation, key)
        if not values:
            continue
        sign = SIGN_OF_BETTER[direction]
        best = max(range(len(values)), key=lambda index: sign * values[index])
        lines.append(
            f"{key}: {_first_last(steps, values)}, best ({direction}) {_fmt(values[best])} at step {steps[best]}"
        )

    times = [value for record in records if (value := _number(record.get("time"))) is not None]
    if times:
        lines.append(f"total time: {_fmt(max(times))} s")

    timing_keys = sorted({key for record in records for key in record if key.startswith("timing/")})
    for key in timing_keys:
        # Step phases are averaged per step; others (timing/validation, ...) per occurrence.
        in_train = any(key in record for record in train)
        _, values = _series(train if in_train else validation, key)
        if values:
            per = "step" if in_train else key.split("/", 1)[1]
            lines.append(f"{key}: mean {_fmt(_mean(values))} s per {per}")
    _, values = _series(train, "perf/tokens_per_s")
    if values:
        lines.append(f"perf/tokens_per_s: mean {_fmt(_mean(values))}")
    _, values = _series(records, "perf/peak_memory_mb")
    if values:
        lines.append(f"perf/peak_memory_mb: max {_fmt(max(values))}")
    return "\n".join(lines) + "\n"


def write_summary(path: str | Path, output_txt: str | Path | None = None) -> str:
    """Writes :func:`summarize`'s text (default ``<log dir>/summary.txt``) and returns it; DataError for a bad file."""
    file = metrics_file(path)
    text = summarize(read_metrics(file), _run_label(file))
    output = Path(output_txt) if output_txt is not None else file.parent / "summary.txt"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    return text


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """``opd plot LOG_DIR_OR_JSONL [--output PNG]`` (``argv`` after ``plot``); returns 0, or 2 for a user error."""
    parser = argparse.ArgumentParser(
        prog="opd plot",
        description="Plot learning curves and summarise a run from its metrics.jsonl.",
    )
    parser.add_argument("path", help="a run's log directory, or its metrics.jsonl")
    parser.add_argument("--output", "-o", default=None, help="PNG to write (default: <log dir>/curves.png)")
    try:
        args = parser.parse_args(list(argv) if argv is not None else sys.argv[2:])
    except SystemExit as exit_:  # --help, or a usage error argparse already printed
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        file = metrics_file(args.path)
        summary_path = file.parent / "summary.txt"
        text = write_summary(file, summary_path)
        png = plot_curves(file, args.output)
    except (OpdError, OSError) as error:
        print(f"opd: error: {error}", file=sys.stderr)
        return 2
    print(f"curves: {png}")
    print(f"summary: {summary_path}")
    print()
    print(text, end="")
    return 0
