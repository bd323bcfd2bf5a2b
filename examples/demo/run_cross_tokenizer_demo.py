"""A teacher with another tokenizer teaches the CPU demo's student, against the same-tokenizer demo.

The demo student (``examples/demo/models/student``, the demo tokenizer) is distilled twice
with ``examples/configs/demo.yaml`` and the top-k loss (``loss_fn.type: topk``, k = 16, the
only loss a cross-tokenizer teacher sends):

* ``same_tokenizer``: from the demo teacher (same tokenizer);
* ``cross_tokenizer``: from ``examples/demo/models/teacher_other_tokenizer``, the same task
  learnt by a model with another tokenizer (``prepare_cross_tokenizer_teacher.py``), with
  ``teacher.cross_tokenizer: true``.

Every model is scored on the addition test split with ``opd eval`` (the other-tokenizer
teacher with a 128-token limit instead of 96: its tokenizer needs more tokens per trace). The script prints
the test accuracies and the mean time per step, and as its last line

    cross_tokenizer accuracy teacher=<t> student_before=<b> same=<s> cross=<c> step_ratio=<r>

Usage: ``python examples/demo/run_cross_tokenizer_demo.py [key.sub=value ...]`` (overrides
for both runs, e.g. ``training.max_num_steps=200``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from opd.cli import main as opd_main  # noqa: E402

MODELS = REPO / "examples" / "demo" / "models"
CONFIG = REPO / "examples" / "configs" / "demo.yaml"
TEST = REPO / "examples" / "data" / "arithmetic" / "test.jsonl"
TOPK = ["loss_fn.type=topk", "loss_fn.k=16"]
RUNS = {
    "same_tokenizer": [f"model.teacher_model_path={MODELS / 'teacher'}"],
    "cross_tokenizer": [f"model.teacher_model_path={MODELS / 'teacher_other_tokenizer'}", "teacher.cross_tokenizer=true"],
}


def test_accuracy(model: Path, log_dir: Path, *overrides: str) -> float:
    """Greedy test accuracy of ``model`` with its own tokenizer (it is also the teacher of the KL: 0)."""
    status = opd_main([
        "eval", "--config", str(CONFIG), f"model.student_model_path={model}", f"model.teacher_model_path={model}",
        f"validation.model_path={model}", f"data.val_path={TEST}", "data.max_val_examples=null",
        f"logger.log_dir={log_dir}", *overrides,
    ])
    if status != 0:
        raise SystemExit(status)
    return json.loads((log_dir / "eval_metrics.json").read_text(encoding="utf-8"))["val/accuracy"]


def mean_step_seconds(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    return statistics.mean(record["timing/step"] for record in records if "timing/step" in record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=str(REPO / "results" / "cross_tokenizer_demo"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    output = Path(args.output_dir)
    teacher = MODELS / "teacher_other_tokenizer"
    if not (teacher / "config.json").is_file():
        raise SystemExit(f"missing {teacher}: run python examples/demo/prepare_cross_tokenizer_teacher.py first")
    results = {
        # Its tokenizer spends more tokens on the same trace: a longer limit, so it is not cut short.
        "teacher_other_tokenizer": test_accuracy(
            teacher, output / "eval" / "teacher_other_tokenizer", "validation.generate_strategy.max_length=128"
        ),
        "teacher": test_accuracy(MODELS / "teacher", output / "eval" / "teacher"),
        "student_before": test_accuracy(MODELS / "student", output / "eval" / "student_before"),
    }
    for run, overrides in RUNS.items():
        run_dir = output / run
        status = opd_main(["train", "--config", str(CONFIG), *TOPK, *overrides, f"output_dir={run_dir}", *args.overrides])
        if status != 0:
            raise SystemExit(status)
        results[run] = test_accuracy(run_dir / "final_model", output / "eval" / run)
        results[f"{run}_step_seconds"] = mean_step_seconds(run_dir)
    (output / "cross_tokenizer_results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(f"\n{'model':<34}{'test accuracy':>14}{'s/step':>9}")
    print(f"{'teacher, demo tokenizer':<34}{results['teacher']:>14.3f}")
    print(f"{'teacher, other tokenizer':<34}{results['teacher_other_tokenizer']:>14.3f}")
    print(f"{'student before':<34}{results['student_before']:>14.3f}")
    for run in RUNS:
        print(f"{'student after, ' + run:<34}{results[run]:>14.3f}{results[run + '_step_seconds']:>9.3f}")
    ratio = results["cross_tokenizer_step_seconds"] / results["same_tokenizer_step_seconds"]
    print(f"cross_tokenizer accuracy teacher={results['teacher_other_tokenizer']:.3f} "
          f"student_before={results['student_before']:.3f} same={results['same_tokenizer']:.3f} "
          f"cross={results['cross_tokenizer']:.3f} step_ratio={ratio:.2f}")


if __name__ == "__main__":
    main()
