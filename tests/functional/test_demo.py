"""A shortened run of the README's main job: the demo student must measurably learn.

``examples/demo/run_demo.py`` with the committed demo models, cut to SHORT_STEPS
on-policy steps (cosine decay over those steps; about two minutes on 2 CPU cores). The
student's greedy test accuracy after distillation must exceed its accuracy before
(0.000: greedy decoding of fixed weights, so it does not vary) by at least MIN_GAIN.

Why 0.15: with the committed student (2 layers, hidden 128, 300 SFT steps; it starts at
0.008) this exact command gave gains of 0.254 (training.seed = 42, the seed below) and
0.234 (seed 1) on 2026-11-21. The previous student (hidden 64) gave 0.312, 0.352, 0.242
and 0.285 for seeds 1-4, a standard deviation of 0.047: 0.15 sits about two such
deviations under the new gains, while a run whose loss, mask or update is broken leaves
the student at or near its starting accuracy.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHORT_STEPS = 150
MIN_GAIN = 0.15
LAST_LINE = re.compile(
    r"^demo accuracy teacher=(?P<teacher>[0-9.]+) student_before=(?P<before>[0-9.]+) "
    r"student_after=(?P<after>[0-9.]+) minutes=(?P<minutes>[0-9.]+)$"
)


def short_demo_overrides(output_dir: Path, seed: int = 42) -> list[str]:
    """The shortened demo: fewer steps, validation and checkpoints only at the end.

    Without periodic validation the demo's early stop (``run_demo.STOP_AT_TEACHER``) has
    nothing to act on, so it is off; every one of the SHORT_STEPS steps is trained.
    """
    return [
        f"output_dir={output_dir}", f"training.max_num_steps={SHORT_STEPS}", f"training.seed={seed}",
        "training.val_freq=0", "training.early_stop=null", "training.save_freq=0", "validation.val_at_start=false",
    ]


def test_short_demo_student_learns_from_the_teacher(tmp_path):
    output_dir = tmp_path / "demo"
    # The timeout only guards against a hang: the run takes 2.5 minutes on 2 idle cores,
    # and past 15 on cores shared with other training jobs (seen 2026-11-21).
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo" / "run_demo.py"), *short_demo_overrides(output_dir)],
        capture_output=True, text=True, cwd=REPO, timeout=1800,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    match = LAST_LINE.match(last)
    assert match, last
    teacher, before, after = (float(match[key]) for key in ("teacher", "before", "after"))
    assert teacher >= 0.9, f"the committed teacher should solve the task: {last}"
    assert before <= 0.2, f"the committed student should start weak: {last}"
    assert after - before >= MIN_GAIN, last

    saved = json.loads((output_dir / "demo_results.json").read_text())
    assert [saved["teacher"], saved["student_before"], saved["student_after"]] == pytest.approx(
        [teacher, before, after], abs=5e-4)  # the last line rounds to 3 decimals
    assert (output_dir / "final_model" / "model.safetensors").is_file()
    assert (output_dir / "logs" / "curves.png").is_file()
    records = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == SHORT_STEPS
    assert all(r["train/on_policy"] == 1 for r in records if "train/on_policy" in r)  # lambda = 1
