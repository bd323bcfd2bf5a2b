"""The README's main job: on-policy distillation that measurably teaches, on CPU.

A tiny teacher that solves 3-digit addition (``examples/demo/models/teacher``) and a
smaller student that knows the answer format but rarely gets the sum right
(``examples/demo/models/student``) are scored on the task's held-out test split; the
student is distilled from the teacher with ``examples/configs/demo.yaml`` and
:data:`STOP_AT_TEACHER`: validation every 25 steps, and the run stops as soon as the
student's validation accuracy comes within one of the 128 validation examples of the
teacher's own (``training.max_num_steps`` stays the cap); the distilled student is scored again. The script prints a table and, as its last line,

    demo accuracy teacher=<a> student_before=<b> student_after=<c> minutes=<m>

It also writes ``<output_dir>/demo_results.json``, the run's logs and curves
(``<output_dir>/logs/curves.png``) and the distilled model (``<output_dir>/final_model``).

Usage: ``python examples/demo/run_demo.py [--config FILE] [key.sub=value ...]``
(the overrides go to the distillation config after :data:`STOP_AT_TEACHER`, e.g.
``training.max_num_steps=60``, or ``training.early_stop=null`` to train every step, which
``training.val_freq=0`` also needs; relative paths, as in ``demo.yaml``, are relative to the
repository root).
The models are rebuilt from scratch by ``python examples/demo/prepare_models.py``.
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

from opd.cli import main as opd_main  # noqa: E402

TASK_DIR = REPO / "examples" / "data" / "arithmetic"
MODELS_DIR = REPO / "examples" / "demo" / "models"
DEFAULT_CONFIG = REPO / "examples" / "configs" / "demo.yaml"
STOP_AT_TEACHER = [
    "validation.teacher_baseline=true",
    "training.val_freq=25",
    "training.early_stop.metric=val/accuracy",
    "training.early_stop.target=teacher",
    "training.early_stop.target_tolerance=0.0078125",
    "training.early_stop.patience=4",
]
"""The demo's early stop (``training.early_stop``): the teacher answers the validation prompts
once before training, and the run ends at the first validation where the student's accuracy
is within one validation example (1/128 = 0.0078125) of the teacher's, or after 4
validations (100 steps) in a row without a new best. Not in
demo.yaml: the λ study, the benchmarks and the demos that inherit demo.yaml train for a
fixed number of steps."""


def ensure_task_data() -> None:
    """Writes the arithmetic task (deterministic, about a second) if it is not there yet."""
    if all((TASK_DIR / f"{split}.jsonl").is_file() for split in ("train", "val", "test")):
        return
    subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_arithmetic_task.py")], check=True)


def test_accuracy(config_path: Path, overrides: list[str], model_path: Path, log_dir: Path) -> float:
    """Greedy accuracy of ``model_path`` on the test split, through ``opd eval``."""
    arguments = [
        "eval", "--config", str(config_path), *overrides,
        f"validation.model_path={model_path}", f"data.val_path={TASK_DIR / 'test.jsonl'}",
        "data.max_val_examples=null", f"logger.log_dir={log_dir}",
    ]
    status = opd_main(arguments)
    if status != 0:
        raise SystemExit(status)
    return json.loads((log_dir / "eval_metrics.json").read_text(encoding="utf-8"))["val/accuracy"]


def describe(model_dir: Path) -> str:
    """``4 layers, hidden 128`` from a model directory's config.json."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="distillation config")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="distillation config overrides")
    args = parser.parse_args()
    start = time.perf_counter()
    # demo.yaml's paths (models, data, output_dir) are relative to the repository root.
    os.chdir(REPO)

    ensure_task_data()
    from opd.distillation.config import MasterConfig
    from opd.utils.config import load_config
    from opd.utils.errors import OpdError

    overrides = [*STOP_AT_TEACHER, *args.overrides]
    try:  # a bad key or value stops here, before any model is loaded, with one line
        config = load_config(MasterConfig, str(args.config), overrides)
    except OpdError as error:
        raise SystemExit(f"run_demo: error: {error}") from None
    output_dir = Path(config.output_dir)
    teacher, student = Path(config.model.teacher_model_path), Path(config.model.student_model_path)
    for path in (teacher, student):
        if not (path / "config.json").is_file():
            raise SystemExit(f"run_demo: error: no model at {path}; build the demo models with "
                             "`python examples/demo/prepare_models.py`")

    print("== test accuracy before distillation", flush=True)
    teacher_accuracy = test_accuracy(args.config, overrides, teacher, output_dir / "eval" / "teacher")
    before = test_accuracy(args.config, overrides, student, output_dir / "eval" / "student_before")

    print("== on-policy distillation", flush=True)
    status = opd_main(["train", "--config", str(args.config), *overrides])
    if status != 0:
        raise SystemExit(status)

    print("== test accuracy after distillation", flush=True)
    after = test_accuracy(args.config, overrides, output_dir / "final_model", output_dir / "eval" / "student_after")
    minutes = (time.perf_counter() - start) / 60

    gap = teacher_accuracy - before
    closed = (after - before) / gap if gap > 0 else float("nan")
    test_examples = len((TASK_DIR / "test.jsonl").read_text(encoding="utf-8").splitlines())
    import torch  # loaded by the runs above

    results = {
        "teacher": teacher_accuracy, "student_before": before, "student_after": after,
        "gap_closed": closed, "minutes": minutes, "test_examples": test_examples, "output_dir": str(output_dir),
        # The CPU kernels torch ran (AVX512, AVX2, ...): their float32 sums round differently,
        # so a run is reproducible, to the last bit, on kernels of the same kind.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    (output_dir / "demo_results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print()
    rows = [(f"teacher ({describe(teacher)})", teacher_accuracy), (f"student before ({describe(student)})", before),
            ("student after distillation", after)]
    print(f"{'model':<40} {'test accuracy':>13}")
    for name, accuracy in rows:
        print(f"{name:<40} {accuracy:>13.3f}")
    print(f"gap closed: {closed:.0%} of the teacher-student gap, in {minutes:.1f} minutes; "
          f"curves: {output_dir / 'logs' / 'curves.png'}")
    print(f"demo accuracy teacher={teacher_accuracy:.3f} student_before={before:.3f} "
          f"student_after={after:.3f} minutes={minutes:.1f}")


if __name__ == "__main__":
    main()
