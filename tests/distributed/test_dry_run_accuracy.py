"""The dry run's predicted peak is within 15% of the peak measured for the same step on CPU.

``benchmarks/dry_run_accuracy.py`` runs one steady-state step of the real trainer (a
colocated sharded teacher, the fused full-vocabulary loss, two micro-batches) in a process
group of one, and measures its peak resident memory above the process's baseline, with no
help from the memory tracker; the dry run predicts it from fake tensors. The benchmark's
full table (also the 2-rank FSDP2 run) is in the guide's cluster section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from opd_test_helpers import REPO_ROOT

MAX_ERROR = 0.15


@pytest.mark.slow
def test_the_dry_run_predicts_the_measured_peak_within_15_percent():
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "dry_run_accuracy.py"), "--worlds", "1", "--rows", "1",
         "--prompt", "64", "--response", "192", "--json"],
        capture_output=True, text=True, timeout=600, env=environment, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert row["measured"] > 500 * 1024**2  # tensors dominate: weights, Adam moments, the loss's chunks
    assert abs(row["error"]) <= MAX_ERROR, row
