"""Checks that a finished demo run (``bash scripts/demo.sh``) did what the README says it does.

    python scripts/check_demo_result.py OUTPUT_DIR [--min-gap-closed 0.8]

Reads ``OUTPUT_DIR/demo_results.json`` (written by ``examples/demo/run_demo.py``) and
exits with status 1 and one line per failed check unless the committed teacher solves the
task (test accuracy >= 0.9), the committed student starts weak (<= 0.2) and distillation
closed at least ``--min-gap-closed`` of the gap between them. CI (``.ci/run``) runs it
after the demo; the final model and the curves must be on disk too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def problems(output_dir: Path, min_gap_closed: float) -> list[str]:
    """What the run at ``output_dir`` failed to show; empty when it shows all of it."""
    results_file = output_dir / "demo_results.json"
    if not results_file.is_file():
        return [f"{results_file} does not exist: the demo did not finish"]
    results = json.loads(results_file.read_text(encoding="utf-8"))
    teacher, before, after = results["teacher"], results["student_before"], results["student_after"]
    found = []
    if teacher < 0.9:
        found.append(f"the committed teacher should solve the task: test accuracy {teacher:.3f} < 0.9")
    if before > 0.2:
        found.append(f"the committed student should start weak: test accuracy {before:.3f} > 0.2")
    closed = (after - before) / (teacher - before) if teacher > before else float("nan")
    if not closed >= min_gap_closed:
        found.append(
            f"distillation closed {closed:.0%} of the teacher-student gap ({before:.3f} -> {after:.3f}, "
            f"teacher {teacher:.3f}); expected at least {min_gap_closed:.0%}"
        )
    for required in ("final_model/model.safetensors", "logs/curves.png", "logs/metrics.jsonl"):
        if not (output_dir / required).is_file():
            found.append(f"{output_dir / required} is missing")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path, help="the demo's output_dir")
    parser.add_argument("--min-gap-closed", type=float, default=0.8, help="fraction of the gap (default 0.8)")
    args = parser.parse_args()
    found = problems(args.output_dir, args.min_gap_closed)
    for problem in found:
        print(f"check_demo_result: {problem}", file=sys.stderr)
    if not found:
        print(f"check_demo_result: {args.output_dir}: the student learned from the teacher as the README says")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
