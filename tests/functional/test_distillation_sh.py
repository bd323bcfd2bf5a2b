"""Runs ``tests/functional/distillation.sh`` (the tiny end-to-end CPU run) under pytest."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_functional_distillation_script(tmp_path):
    result = subprocess.run(
        ["bash", str(REPO / "tests" / "functional" / "distillation.sh"), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHON": sys.executable},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "functional distillation OK" in result.stdout
