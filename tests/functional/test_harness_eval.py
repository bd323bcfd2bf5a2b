"""lm-evaluation-harness from opd, offline: ``opd eval --harness lm-eval`` and ``validation.harness_tasks``.

The task is the repo's own (``examples/eval_tasks/opd_arithmetic.yaml``) over a local JSONL
file, so nothing is downloaded. The file's ground truth is wrong on every other row, so the
committed demo teacher, which answers every row right, scores 0.5 by both checks; the check
that matters is that lm-eval's score of each model equals opd's own validation accuracy on
the same rows (the same prompts, greedy decoding, the answer in ``\\boxed{}``: math-verify
on opd's side, lm-eval's regex and exact match on the other).
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
from opd_test_helpers import REPO_ROOT, short_run_overrides

from opd.algorithms.distillation_config import MasterConfig
from opd.algorithms.harness import METRIC_PREFIX, HarnessConfig, HarnessResults
from opd.cli import main
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
TEACHER = str(REPO_ROOT / "examples" / "demo" / "models" / "teacher")
STUDENT = str(REPO_ROOT / "examples" / "demo" / "models" / "student")
METRIC = "exact_match,boxed"


def _rows(path: Path, count: int = 16) -> Path:
    """3-digit additions whose ground truth is off by one on every odd row."""
    rng = random.Random(7)
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(count):
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            truth = a + b + (index % 2)
            handle.write(json.dumps({"problem": f"What is {a} + {b}?", "ground_truth_answer": str(truth)}) + "\n")
    return path


def _tasks(directory: Path, data: Path) -> Path:
    """The shipped task files, with the data path pointed at ``data``."""
    directory.mkdir()
    for source in (REPO_ROOT / "examples" / "eval_tasks").iterdir():
        if source.suffix in {".yaml", ".py"}:
            shutil.copy(source, directory / source.name)
    task = directory / "opd_arithmetic.yaml"
    text = task.read_text()
    assert "test: examples/data/arithmetic/test.jsonl" in text
    task.write_text(text.replace("test: examples/data/arithmetic/test.jsonl", f"test: {data}"))
    return directory


def test_lm_eval_scores_equal_opd_validation(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the task module reads the prompt template beside it; configs are repo-relative
    data = _rows(tmp_path / "rows.jsonl")
    tasks = _tasks(tmp_path / "tasks", data)
    harness_logs = tmp_path / "harness"
    status = main(
        ["eval", "--config", str(DEMO_CONFIG), "--harness", "lm-eval", "--tasks", "opd_arithmetic",
         "--include-path", str(tasks), "--compare", "teacher",
         f"validation.model_path={STUDENT}", f"logger.log_dir={harness_logs}"]
    )  # fmt: skip
    assert status == 0
    written = json.loads((harness_logs / "harness_results.json").read_text())
    assert written["models"] == {"model": STUDENT, "teacher": "examples/demo/models/teacher"}  # as the config says
    table = (harness_logs / "harness_table.md").read_text()
    assert table.splitlines()[0] == "| task | metric | model | teacher |"

    for label, model in (("model", STUDENT), ("teacher", TEACHER)):
        opd_logs = tmp_path / f"opd_{label}"
        status = main(
            ["eval", "--config", str(DEMO_CONFIG), f"validation.model_path={model}", f"data.val_path={data}",
             f"logger.log_dir={opd_logs}", "validation.teacher_baseline=false"]
        )  # fmt: skip
        assert status == 0
        accuracy = json.loads((opd_logs / "eval_metrics.json").read_text())["val/accuracy"]
        assert written["scores"][label]["opd_arithmetic"][METRIC] == pytest.approx(accuracy, abs=1e-9), label
    assert written["scores"]["teacher"]["opd_arithmetic"][METRIC] == 0.5  # right on every row the data is


def test_a_run_ends_with_the_harness(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    tasks = _tasks(tmp_path / "tasks", _rows(tmp_path / "rows.jsonl", count=4))
    overrides = [
        *short_run_overrides(tmp_path),
        "training.max_num_steps=1",
        "checkpointing.enabled=false",
        "validation.harness_tasks=[opd_arithmetic]",
        f"validation.harness.include_path={tasks}",
        "validation.harness.compare=[student_before]",
        "validation.harness.batch_size=4",
    ]
    config = load_config(MasterConfig, TINY_CONFIG, overrides)
    from opd.algorithms.distillation import distillation_train
    from opd.algorithms.distillation_setup import setup

    distillation_train(**setup(config).as_arguments())
    log_dir = Path(config.logger.log_dir)
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    harness = [record for record in records if f"{METRIC_PREFIX}opd_arithmetic/{METRIC}" in record]
    assert len(harness) == 1 and harness[0]["step"] == 1
    written = json.loads((log_dir / "harness_results.json").read_text())
    assert set(written["scores"]) == {"model", "student_before"}
    assert written["models"]["model"] == str(Path(config.output_dir) / "final_model")
    card = (Path(config.output_dir) / "final_model" / "README.md").read_text()
    assert "## Evaluation" in card and "| opd_arithmetic | exact_match,boxed |" in card


def test_results_table_and_metric_names():
    results = HarnessResults(
        tasks=["a", "b"],
        scores={"model": {"a": {"acc": 0.25}, "b": {"em": 1.0}}, "teacher": {"a": {"acc": 0.75}}},
    )
    assert results.metrics() == {"harness/a/acc": 0.25, "harness/b/em": 1.0}
    assert results.metrics("teacher") == {"harness/a/acc": 0.75}
    assert results.table().splitlines() == [
        "| task | metric | model | teacher |",
        "|---|---|---|---|",
        "| a | acc | 0.2500 | 0.7500 |",
        "| b | em | 1.0000 | — |",
    ]


def test_harness_errors_name_what_is_wrong(tmp_path, monkeypatch):
    from opd.algorithms.harness import evaluate_with_harness, load_for_harness, require_harness
    from opd.models.config import ModelLoadingConfig
    from opd.algorithms.sft import SFTMasterConfig

    with pytest.raises(ConfigError, match=r"validation.harness.compare names \['teacher'\].*student_before"):
        load_config(
            SFTMasterConfig,
            REPO_ROOT / "examples" / "configs" / "sft.yaml",
            ["validation.harness_tasks=[x]", "validation.harness.compare=[teacher]"],
        )
    with pytest.raises(ValueError, match="named twice"):
        HarnessConfig(compare=["teacher", "teacher"])
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'opd\[eval\]'"):
        require_harness(HarnessConfig())
    monkeypatch.undo()
    loading = ModelLoadingConfig(device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match=r"no task \['no_such_task'\]"):
        evaluate_with_harness(
            {"model": "tiny:student"}, ["no_such_task"], HarnessConfig(), lambda path: load_for_harness(path, loading)
        )


def test_local_tasks_are_indexed_without_lm_evals_own_and_once_per_process(tmp_path):
    """Every task asked for is under include_path: lm-eval's built-in tasks (seconds to index) stay out."""
    from opd.algorithms.harness import _task_manager

    tasks = str(_tasks(tmp_path / "tasks", _rows(tmp_path / "rows.jsonl", count=4)))
    manager = _task_manager(tasks, ("opd_arithmetic",))
    assert "opd_arithmetic" in manager.all_tasks
    assert "gsm8k" not in manager.all_tasks and len(manager.all_tasks) < 10  # no built-in task indexed
    assert _task_manager(tasks, ("opd_arithmetic",)) is manager  # built once, reused for the next model
