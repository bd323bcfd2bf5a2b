"""``opd generate`` killed with SIGKILL and rerun, then ``opd train`` with λ = 0.5 on its output.

The two-command workflow of teacher-made fixed data, as a user runs it: the demo teacher
answers a math-cl-shaped file (``problem`` / ``ground_truth_answer`` rows without worked
answers, like pe-nlp/math-cl); the first ``opd generate`` (a subprocess) is killed once it has
recorded a batch, the same command is run again (in process) and finishes. The output must hold every source row
exactly once, in source order, keeping the rows of the batches recorded before the kill
(that the bytes equal an uninterrupted run's is checked in
``tests/unit/algorithms/test_generate_data.py``, on files cut as a crash leaves them).
Then a λ = 0.5 ``opd train`` on that file (data_format chat) must run both kinds of step;
its fixed-data steps can only have trained on the generated answers, which are longer
than the on-policy cap.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from opd_test_helpers import BackgroundProcess

from opd.cli import main
from opd.generate import PROGRESS_SUFFIX

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATE_CONFIG = REPO_ROOT / "examples" / "configs" / "generate_demo.yaml"
DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"
DEMO_MODELS = REPO_ROOT / "examples" / "demo" / "models"
ARITHMETIC = REPO_ROOT / "examples" / "data" / "arithmetic" / "val.jsonl"
NUM_ROWS = 16
BATCH_SIZE = 2
ON_POLICY_MAX_LENGTH = 8
PROCESS_TIMEOUT = 240.0
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def write_math_cl(path: Path) -> Path:
    rows = [json.loads(line) for line in ARITHMETIC.read_text().splitlines()[:NUM_ROWS]]
    path.write_text(
        "".join(json.dumps({key: row[key] for key in ("problem", "ground_truth_answer")}) + "\n" for row in rows)
    )
    return path


def generate_overrides(source: Path, output: Path) -> list[str]:
    return [
        f"model.teacher_model_path={DEMO_MODELS / 'teacher'}",
        f"data.prompt_file={REPO_ROOT / 'examples' / 'prompts' / 'math_think_answer.txt'}",
        f"data.train_path={source}",
        f"data.max_train_examples={NUM_ROWS}",
        f"generate.output_path={output}",
        f"generate.batch_size={BATCH_SIZE}",
        "generate.only_correct=false",
        "generate.max_attempts_per_prompt=null",
        "generate.progress_bar=false",
    ]


def progress_records(output: Path) -> int:
    """Batches recorded so far (complete lines after the header)."""
    progress = output.with_name(output.name + PROGRESS_SUFFIX)
    return max(progress.read_bytes().count(b"\n") - 1, 0) if progress.is_file() else 0


def opd_process(name: str, argv: list[str], workdir: Path) -> BackgroundProcess:
    return BackgroundProcess(name, [sys.executable, "-m", "opd", *argv], workdir, SUBPROCESS_ENV, PROCESS_TIMEOUT)


def test_killed_generate_rerun_then_lambda_half_training(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = write_math_cl(tmp_path / "math_cl.jsonl")
    output = tmp_path / "answers.jsonl"
    argv = ["generate", "--config", str(GENERATE_CONFIG), *generate_overrides(source, output)]

    first = opd_process("generate_killed", argv, tmp_path)
    first.wait_until(lambda: progress_records(output) >= 1, "a recorded batch")
    first.send(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    done = progress_records(output)
    assert 1 <= done < NUM_ROWS // BATCH_SIZE, "the run finished before it was killed: nothing to resume"
    recorded_rows = b"".join(output.read_bytes().splitlines(keepends=True)[: done * BATCH_SIZE])

    # The rerun and the training run go in process (a subprocess would pay the imports again).
    assert main(argv) == 0
    assert f"resumed after {done * BATCH_SIZE} prompts" in capsys.readouterr().out
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    indices = [row["generated"]["source_index"] for row in rows]
    assert indices == list(range(NUM_ROWS))  # every row once, in source order
    assert output.read_bytes().startswith(recorded_rows)  # what was recorded is kept, not redrawn

    run_dir = tmp_path / "run"
    status = main(
        [
            "train",
            "--config",
            str(DEMO_CONFIG),
            f"output_dir={run_dir}",
            f"model.teacher_model_path={DEMO_MODELS / 'teacher'}",
            f"model.student_model_path={DEMO_MODELS / 'student'}",
            f"data.train_path={output}",
            "data.data_format=chat",
            "data.val_path=null",
            "distillation.lambda=0.5",
            f"distillation.generate_strategy.max_length={ON_POLICY_MAX_LENGTH}",
            "training.batch_size=4",
            "training.micro_batch_size=4",
            "training.max_num_steps=4",
            "checkpointing.enabled=false",
            "logger.progress_bar=false",
        ]
    )
    assert status == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "train/loss" in record]
    assert len(steps) == 4
    fixed = [step for step in steps if step["train/on_policy"] == 0]
    on_policy = [step for step in steps if step["train/on_policy"] == 1]
    assert fixed and on_policy
    assert all(step["train/mean_response_length"] <= ON_POLICY_MAX_LENGTH for step in on_policy)
    assert all(step["train/mean_response_length"] > 3 * ON_POLICY_MAX_LENGTH for step in fixed)
