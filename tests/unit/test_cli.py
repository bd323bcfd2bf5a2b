"""Tests for the ``opd`` command line (``python -m opd train --config FILE [overrides]``).

User mistakes must end the run with exit status 2 and one ``opd: error:`` line on stderr
that names the offending key (or file and line), never a Python traceback.

Each ``opd train`` process pays for importing torch and transformers (a few seconds), so
the failing runs are started together once per module and then checked one by one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = "examples/configs/distillation_tiny.yaml"
ERROR_PREFIX = "opd: error:"


def opd_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "opd", *args]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Starts every failing ``opd train`` at once; returns {case: CompletedProcess-like}."""
    tmp_path = tmp_path_factory.mktemp("cli")
    output_dir = f"output_dir={tmp_path / 'out'}"

    broken_data = tmp_path / "broken.jsonl"
    good_row = {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}
    broken_line = '{"messages": [{"role": "user", "content": '  # line 2: cut off mid-object
    broken_data.write_text(json.dumps(good_row) + "\n" + broken_line + "\n" + json.dumps(good_row) + "\n")

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("defaults: " + str(REPO_ROOT / TINY) + "\ntraining:\n  batch_size: [1, 2\n  seed: 3\n")

    cases = {
        "unknown_key": ["train", "--config", TINY, output_dir, "training.bogus_knob=1"],
        "out_of_range": ["train", "--config", TINY, output_dir, "distillation.lambda=1.5"],
        "broken_data": ["train", "--config", TINY, output_dir, f"data.train_path={broken_data}"],
        "invalid_yaml": ["train", "--config", str(bad_yaml), output_dir],
        "missing_config": ["train", "training.batch_size=4"],
        "unparsable_override": ["train", "--config", TINY, output_dir, "training.batch_size=[1"],
    }
    processes = {
        name: subprocess.Popen(
            opd_command(*args), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, args in cases.items()
    }
    results = {}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(cases[name], process.returncode, stdout, stderr)
    results["broken_data_path"] = broken_data
    return results


def error_line(result: subprocess.CompletedProcess) -> str:
    """Checks the user-error contract and returns the single error line."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "Traceback" not in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith(ERROR_PREFIX)]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_unknown_key(runs):
    line = error_line(runs["unknown_key"])
    assert "training.bogus_knob" in line
    assert "unknown key" in line


def test_out_of_range_value(runs):
    line = error_line(runs["out_of_range"])
    assert "distillation.lambda" in line
    assert "1.5" in line


def test_malformed_data_line(runs):
    line = error_line(runs["broken_data"])
    assert str(runs["broken_data_path"]) in line
    assert "line 2" in line
    assert "invalid JSON" in line


def test_invalid_yaml_is_one_error_line(runs):
    result = runs["invalid_yaml"]
    line = error_line(result)
    assert "not valid YAML" in line
    assert result.stderr.strip() == line


def test_invalid_yaml_exits_2_without_traceback(runs):
    result = runs["invalid_yaml"]
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(ERROR_PREFIX)
    assert "not valid YAML" in result.stderr


def test_unparsable_override_value(runs):
    line = error_line(runs["unparsable_override"])
    assert "training.batch_size=[1" in line


def test_missing_config_prints_usage(runs):
    result = runs["missing_config"]
    assert result.returncode == 2
    assert "usage: opd train" in result.stderr
    assert "--config" in result.stderr
    assert "required" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_exits_zero():
    result = subprocess.run(opd_command("--help"), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "train" in result.stdout
