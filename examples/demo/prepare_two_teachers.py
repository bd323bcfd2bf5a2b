"""Builds the two-teacher demo's models (one command, deterministic).

1. writes the two-task data (``examples/data/make_two_task_arithmetic.py``) if missing;
2. the **addition expert** is the CPU demo's teacher (``examples/demo/models/teacher``),
   trained on addition only;
3. the **subtraction expert**: a model of the same shape, initialised afresh for the demo
   tokenizer and fine-tuned with ``opd sft`` on subtraction only (1500 steps, like the
   addition expert);
4. the **student**: the demo student's shape, fine-tuned briefly (300 steps) on both tasks,
   so that it writes both traces and the answer tags but gets most answers wrong;
5. copies them to ``examples/demo/models/{sub_teacher,two_task_student}``.

Usage: ``python examples/demo/prepare_two_teachers.py [--teacher-steps N] [--student-steps N]
[--only teacher|student]`` (about 20 minutes on 2 CPU cores, almost all of it the
subtraction expert).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "arithmetic_two_tasks"
MODELS = REPO / "examples" / "demo" / "models"


def run_sft(init_dir: Path, output_dir: Path, steps: int, train: Path, val: Path, extra: list[str]) -> Path:
    """Fine-tunes ``init_dir`` with ``opd sft`` on ``train`` and returns its final model directory."""
    command = [
        sys.executable, "-m", "opd", "sft", "--config", str(REPO / "examples" / "configs" / "sft_arithmetic.yaml"),
        f"model.model_path={init_dir}", f"output_dir={output_dir}", f"training.max_num_steps={steps}",
        f"data.train_path={train}", f"data.val_path={val}", *extra,
    ]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO)
    return output_dir / "final_model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher-steps", type=int, default=1500)
    parser.add_argument("--student-steps", type=int, default=300)
    parser.add_argument("--work-dir", default=str(REPO / "results" / "two_teachers_prep"))
    parser.add_argument("--only", choices=["teacher", "student"], default=None)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from opd.models.tiny import build_model_for_tokenizer

    if not (DATA / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_two_task_arithmetic.py")], check=True)
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)  # a fresh build every time: nothing here is resumed
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "teacher")  # the demo's: every model shares it
    roles = {"teacher": ("demo-teacher", "sub_teacher"), "student": ("demo-student", "two_task_student")}
    if args.only:
        roles = {args.only: roles[args.only]}
    finals = {}
    for role, (preset, _) in roles.items():
        init_dir = work / f"{role}_init"
        build_model_for_tokenizer(preset, tokenizer).save_pretrained(init_dir)
        tokenizer.save_pretrained(init_dir)
    if "teacher" in roles:
        finals["teacher"] = run_sft(work / "teacher_init", work / "sft_teacher", args.teacher_steps,
                                    DATA / "train_sub.jsonl", DATA / "val_sub.jsonl", [])
    if "student" in roles:
        finals["student"] = run_sft(work / "student_init", work / "sft_student", args.student_steps,
                                    DATA / "train.jsonl", DATA / "val.jsonl",
                                    ["training.val_freq=50", "training.save_freq=0"])
    for role, final in finals.items():
        target = MODELS / roles[role][1]
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(final, target)
        print(f"{role}: {target}")


if __name__ == "__main__":
    main()
