"""Builds the λ study's extra models (``benchmarks/lambda_study.py``): capacity gaps and a harder task.

The study's main setting is the README demo's pair (``examples/demo/models/{teacher,student}``,
3-digit addition). This script adds the two settings issue 23 asks for, with the demo's
tokenizer and the demo's recipe (``opd sft`` with ``examples/configs/sft_arithmetic.yaml``):

* **Capacity gap**: two students smaller than the demo student, both one layer with
  32-dimensional heads: ``study_student_small`` (hidden 64) and ``study_student_tiny``
  (hidden 32). Each is fine-tuned for ``--student-steps`` on the 3-digit worked
  solutions, as the demo student was, so it writes the trace and the answer tags; they are
  distilled from the demo teacher.
* **Harder task**: 5-digit addition (``examples/data/arithmetic_5digit``, written with
  ``make_arithmetic_task.py --digits 5``). ``study_teacher_5digit`` is the demo teacher
  fine-tuned for ``--teacher-steps`` on its worked solutions at the demo recipe's learning
  rate, then ``--teacher-polish-steps`` more at a quarter of it (the constant high rate
  leaves its accuracy swinging between evaluations), and ``study_student_5digit``
  the demo student fine-tuned for ``--hard-student-steps`` on them: it writes five-column
  traces but gets the sums wrong. The teacher's accuracy levels off near 0.83 on the
  validation problems; the study reports its test accuracy.

Each model is written to ``examples/demo/models/<name>`` (committed). The result is
deterministic for a given machine's kernels; rebuilding takes about 45 minutes on 2 CPU
cores, most of it the 5-digit teacher's 2,000 steps.

Usage: ``python examples/demo/prepare_study_models.py [--only NAME ...]``
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from prepare_models import run_sft  # this script's directory is on sys.path

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "examples" / "demo" / "models"
TASK_3DIGIT = REPO / "examples" / "data" / "arithmetic"
TASK_5DIGIT = REPO / "examples" / "data" / "arithmetic_5digit"
NAMES = ("study_student_small", "study_student_tiny", "study_teacher_5digit", "study_student_5digit")


def write_task(directory: Path, digits: int) -> None:
    """Writes the addition task with ``digits``-digit operands into ``directory`` if missing."""
    if not (directory / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_arithmetic_task.py"),
                        "--digits", str(digits), "--out-dir", str(directory)], check=True)


def fine_tune(init_dir: Path, task: Path, output_dir: Path, steps: int, max_length: int, *extra: str) -> Path:
    """``opd sft`` of ``init_dir`` on ``task``'s worked solutions (the demo's recipe); returns the final model."""
    return run_sft(init_dir, output_dir, steps, [
        f"data.train_path={task / 'train.jsonl'}", f"data.val_path={task / 'val.jsonl'}",
        f"validation.generate_strategy.max_length={max_length}", "training.val_freq=100", "training.save_freq=0",
        *extra,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student-steps", type=int, default=300)
    parser.add_argument("--teacher-steps", type=int, default=1200)
    parser.add_argument("--teacher-polish-steps", type=int, default=800)
    parser.add_argument("--hard-student-steps", type=int, default=100)
    parser.add_argument("--only", nargs="+", choices=NAMES, default=list(NAMES))
    parser.add_argument("--work-dir", default=str(REPO / "results" / "study_prep"))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from opd.models.tiny import build_model_for_tokenizer

    write_task(TASK_3DIGIT, 3)
    write_task(TASK_5DIGIT, 5)
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)  # a fresh build every time: nothing here is resumed
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "teacher")  # the demo pair's tokenizer
    finals: dict[str, Path] = {}
    for name, preset in (("study_student_small", "study-student-small"), ("study_student_tiny", "study-student-tiny")):
        if name in args.only:
            init_dir = work / f"{name}_init"
            build_model_for_tokenizer(preset, tokenizer).save_pretrained(init_dir)
            tokenizer.save_pretrained(init_dir)
            finals[name] = fine_tune(init_dir, TASK_3DIGIT, work / name, args.student_steps, 96)
    if "study_teacher_5digit" in args.only:
        first = fine_tune(MODELS / "teacher", TASK_5DIGIT, work / "study_teacher_5digit", args.teacher_steps, 128)
        finals["study_teacher_5digit"] = fine_tune(first, TASK_5DIGIT, work / "study_teacher_5digit_polish",
                                                   args.teacher_polish_steps, 128, "training.learning_rate=5.0e-4")
    if "study_student_5digit" in args.only:
        finals["study_student_5digit"] = fine_tune(MODELS / "student", TASK_5DIGIT, work / "study_student_5digit",
                                                   args.hard_student_steps, 128)
    for name, final in finals.items():
        target = MODELS / name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(final, target)
        print(f"{name}: {target}")


if __name__ == "__main__":
    main()
