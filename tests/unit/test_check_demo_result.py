"""``scripts/check_demo_result.py``: CI's check that the demo's student learned from its teacher.

A check that passes vacuously would let a broken demo land, so each failure it must name
is built here from a demo output directory written by hand.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("check_demo_result", REPO / "scripts" / "check_demo_result.py")
assert SPEC is not None and SPEC.loader is not None
check = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(check)


def demo_output(directory: Path, teacher: float, before: float, after: float, files: bool = True) -> Path:
    directory.mkdir(parents=True)
    (directory / "demo_results.json").write_text(
        json.dumps({"teacher": teacher, "student_before": before, "student_after": after}))
    if files:
        for name in ("final_model/model.safetensors", "logs/curves.png", "logs/metrics.jsonl"):
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_text("")
    return directory


def test_a_demo_that_closed_the_gap_passes(tmp_path):
    assert check.problems(demo_output(tmp_path / "run", 1.0, 0.008, 1.0), 0.8) == []
    # 80% of the gap exactly: (0.8064 - 0.008) / (1 - 0.008) = 0.8049
    assert check.problems(demo_output(tmp_path / "edge", 1.0, 0.008, 0.8064), 0.8) == []


@pytest.mark.parametrize(("teacher", "before", "after", "expected"), [
    (1.0, 0.008, 0.5, "closed 50% of the teacher-student gap"),
    (0.5, 0.008, 0.5, "the committed teacher should solve the task"),
    (1.0, 0.4, 1.0, "the committed student should start weak"),
    (0.95, 0.95, 0.95, "closed nan% of the teacher-student gap"),  # no gap to close is no evidence
])
def test_each_failure_is_named(tmp_path, teacher, before, after, expected):
    found = check.problems(demo_output(tmp_path / "run", teacher, before, after), 0.8)
    assert any(expected in problem for problem in found), found


def test_an_unfinished_demo_and_missing_files_are_named(tmp_path):
    assert "does not exist: the demo did not finish" in check.problems(tmp_path / "nothing", 0.8)[0]
    found = check.problems(demo_output(tmp_path / "run", 1.0, 0.0, 1.0, files=False), 0.8)
    assert len(found) == 3 and all(problem.endswith("is missing") for problem in found)
