"""Context distillation on CPU: the student learns to do without the hint its teacher sees.

``examples/demo/models/hinted_student`` (built by ``prepare_context_demo.py``) adds
3-digit numbers better when the prompt starts with the column sums. This script
self-distils it with ``examples/configs/context_demo.yaml``: the teacher is the model's
initial weights reading each problem's hint, the student the same model without it.
Before training, ``validation.eval_baseline`` measures both on the validation problems;
after training the student (still without the hint) is measured on the held-out test
problems. The last line is

    context demo accuracy student_without_hint=<a> teacher_with_hint=<b> student_after=<c> minutes=<m>

Usage: ``python examples/demo/run_context_demo.py [key.sub=value ...]`` (overrides go to
the distillation config, e.g. ``training.max_num_steps=100``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prepare_context_demo import HINTS, TASK, write_hint_data  # noqa: E402

from opd.cli import main as opd_main  # noqa: E402

CONFIG = REPO / "examples" / "configs" / "context_demo.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of context_demo.yaml")
    args = parser.parse_args()
    start = time.perf_counter()
    os.chdir(REPO)  # the config's paths are relative to the repository root
    if not (TASK / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_arithmetic_task.py")], check=True)
    if not (HINTS / "test.jsonl").is_file():
        write_hint_data()
    from opd.distillation.config import MasterConfig
    from opd.utils.config import load_config
    from opd.utils.errors import OpdError

    try:  # a bad key or value stops here, before any model is loaded, with one line
        config = load_config(MasterConfig, str(CONFIG), args.overrides)
    except OpdError as error:
        raise SystemExit(f"run_context_demo: error: {error}") from None
    output_dir = Path(config.output_dir)
    if not (Path(config.model.student_model_path) / "config.json").is_file():
        raise SystemExit(f"run_context_demo: error: no model at {config.model.student_model_path}; build it with "
                         "`python examples/demo/prepare_context_demo.py`")
    status = opd_main(["train", "--config", str(CONFIG), *args.overrides])
    if status:
        raise SystemExit(status)
    records = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    baseline = next(record for record in records if "val/baseline_accuracy_gap" in record)
    validations = [(record["step"], record["val/accuracy"]) for record in records if "val/accuracy" in record]
    eval_dir = output_dir / "eval_test"
    status = opd_main(["eval", "--config", str(CONFIG), *args.overrides,
                       f"validation.model_path={output_dir / 'final_model'}",
                       f"data.val_path={HINTS / 'test.jsonl'}", "data.max_val_examples=null",
                       "validation.eval_baseline=false", f"logger.log_dir={eval_dir}"])
    if status:
        raise SystemExit(status)
    after = json.loads((eval_dir / "eval_metrics.json").read_text())["val/accuracy"]
    minutes = (time.perf_counter() - start) / 60
    print("\nvalidation accuracy of the student (no hint) during distillation:")
    print("  " + "  ".join(f"step {step}: {accuracy:.3f}" for step, accuracy in validations))
    print(f"\n{'before training (validation problems)':<46} {'accuracy':>8}")
    print(f"{'  student, question alone':<46} {baseline['val/baseline_student_accuracy']:>8.3f}")
    print(f"{'  teacher = same weights, hint + question':<46} {baseline['val/baseline_teacher_accuracy']:>8.3f}")
    print(f"{'after training (test problems)':<46}")
    print(f"{'  student, question alone':<46} {after:>8.3f}")
    print(f"context demo accuracy student_without_hint={baseline['val/baseline_student_accuracy']:.3f} "
          f"teacher_with_hint={baseline['val/baseline_teacher_accuracy']:.3f} student_after={after:.3f} "
          f"minutes={minutes:.1f}")


if __name__ == "__main__":
    main()
