"""``scripts/gpu_check.py``: a check that cannot run is ``missing``, and fails the run.

A check whose script was never committed, or whose packages are not installed, checks
nothing; reported as ``skipped`` it let the vLLM refit check pass on every GPU run while
its script did not exist. Here the table must say ``missing`` with what is missing, and
the exit status must be 1, which CI sees. The rehearsal (``--rehearse``) keeps the runs on
the CPU; neither check starts anything heavy, since each stops at what is missing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU_CHECK = REPO / "scripts" / "gpu_check.py"


def run_gpu_check(script: Path, *checks: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment.pop("OPD_GPU_CHECK_REHEARSAL", None)  # --rehearse must set it for the children itself
    return subprocess.run(
        [sys.executable, str(script), "--rehearse", "--only", *checks],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=script.parents[1],
        env=environment,
    )


def table_row(output: str, check: str) -> list[str]:
    """The cells of ``check``'s row in the printed table."""
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == check:
            return cells
    raise AssertionError(f"no row for {check} in:\n{output}")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here: the check can run")
def test_the_vllm_check_without_vllm_is_missing_and_fails_the_run():
    result = run_gpu_check(GPU_CHECK, "vllm")
    _, status, _, figure = table_row(result.stdout, "vllm")
    assert status == "missing", result.stdout + result.stderr
    assert "not installed: vllm" in figure
    assert result.returncode == 1


def test_a_check_whose_script_is_absent_is_missing(tmp_path):
    # A checkout without scripts/gpu_checks/: gpu_check.py alone, in a copy of the repository's layout.
    copy = tmp_path / "scripts" / "gpu_check.py"
    copy.parent.mkdir()
    shutil.copy(GPU_CHECK, copy)
    result = run_gpu_check(copy, "vllm", "refit_ipc")
    for check, script in (("vllm", "vllm_refit.py"), ("refit_ipc", "refit_ipc.py")):
        _, status, _, figure = table_row(result.stdout, check)
        assert status == "missing", result.stdout + result.stderr
        assert f"scripts/gpu_checks/{script} is not in this checkout" in figure
    assert result.returncode == 1


def test_missing_and_skipped_are_told_apart():
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check._status({"missing": "not installed: vllm"}) == "missing"
    assert gpu_check._status({"skipped": "needs 2 GPUs"}) == "skipped"
    assert gpu_check._status({"ok": True, "figure": ""}) == "ok"
    assert gpu_check._status({"ok": False, "figure": ""}) == "FAILED"
    assert gpu_check._missing(GPU_CHECK, ("a_package_that_is_not_installed",)) == (
        "not installed: a_package_that_is_not_installed"
    )
