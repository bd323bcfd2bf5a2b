"""What every script in ``benchmarks/`` shares: the data it prepares for itself, and ``--smoke``.

A fresh clone has the demo's models (committed under ``examples/demo/models/``) but not
the arithmetic task they are trained on (``examples/data/arithmetic/``, generated, not
committed). A benchmark that reads a task calls :func:`arithmetic_task` first, which runs
the repository's generator (``examples/data/make_arithmetic_task.py``) when a split is
missing. The generator is deterministic and writes each file atomically, so two processes
that prepare the same task at once write the same files.

``--smoke`` runs a benchmark at its smallest sizes for a few steps, to show in seconds that
it still runs (``scripts/smoke_benchmarks.sh`` runs every one so); its figures mean
nothing. :func:`parse_arguments` gives each script the flag and its smoke settings, which
flags given on the command line still override.

The scripts import this module by name: ``python benchmarks/<script>.py`` puts
``benchmarks/`` first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TASK_GENERATOR = REPO / "examples" / "data" / "make_arithmetic_task.py"
DEMO_TASK = REPO / "examples" / "data" / "arithmetic"
"""The demo's task (3-digit addition, the teacher's trace format): what ``demo.yaml`` reads."""
SPLITS = ("train", "val", "test")
SMOKE_HELP = "smallest sizes and a few steps, to check in seconds that the script runs (its figures mean nothing)"


def arithmetic_task(out_dir: Path = DEMO_TASK, digits: int = 3, trace: str = "teacher") -> Path:
    """The directory of an arithmetic task, its train/val/test splits written first if one is missing.

    Args:
        out_dir: where the task lives.
        digits: digits of each operand.
        trace: the answers' format (``make_arithmetic_task.py --trace``).

    Returns:
        ``out_dir``.

    Raises:
        SystemExit: with the generator's last error line, if it failed.
    """
    if all((out_dir / f"{split}.jsonl").is_file() for split in SPLITS):
        return out_dir
    command = [sys.executable, str(TASK_GENERATOR), "--out-dir", str(out_dir), "--digits", str(digits)]
    completed = subprocess.run([*command, "--trace", trace], capture_output=True, text=True)
    if completed.returncode != 0:
        last_line = (completed.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"could not write the arithmetic task to {out_dir}: {last_line}")
    return out_dir


SMOKE_TRAIN_EXAMPLES = 64
"""Training rows a ``--smoke`` run reads (``data.max_train_examples``): a few steps draw fewer, and
tokenizing the demo's 20,000 costs each ``opd`` process seconds of CPU."""


def add_train_examples_argument(parser: argparse.ArgumentParser) -> None:
    """``--train-examples N``: the rows of the training data each run reads (default: all of them)."""
    parser.add_argument(
        "--train-examples",
        type=int,
        default=None,
        help="rows of the training data each run reads (data.max_train_examples; default: all)",
    )


def train_examples_overrides(count: int | None) -> list[str]:
    """The config override of ``--train-examples`` (none for all rows)."""
    return [] if count is None else [f"data.max_train_examples={count}"]


def parse_arguments(
    parser: argparse.ArgumentParser, smoke: dict[str, Any], argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Adds ``--smoke`` to ``parser`` and parses ``argv``.

    Args:
        parser: the script's parser, every other argument already added.
        smoke: the defaults ``--smoke`` replaces, by destination name (``{"steps": 2}``);
            an argument given on the command line keeps its value.
        argv: the arguments (None: ``sys.argv[1:]``).

    Returns:
        The arguments, with ``smoke`` True or False.
    """
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    arguments = parser.parse_args(argv)
    if not arguments.smoke:
        return arguments
    parser.set_defaults(**smoke)
    return parser.parse_args(argv)
