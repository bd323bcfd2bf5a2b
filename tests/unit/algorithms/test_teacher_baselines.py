"""The validation baselines with several teachers and with a cross-tokenizer teacher (issue 35).

* Routing: each teacher answers the validation prompts routed to it, reported as
  ``val/teacher_<name>_*``; each equals the one-teacher baseline of that model on those
  prompts. A mixture's members each answer every prompt.
* The eval baseline with routing compares the student with each teacher on that teacher's
  prompts (``val/baseline_*_<name>``), equal to the one-teacher eval baseline on them.
* A cross-tokenizer teacher samples in its own tokens from its own rendering of the
  prompts; with the student's tokenizer its baseline equals the plain teacher's.
* What stays refused: a served member, and an early-stop target of "the teacher".

The baselines are computed straight from the built components (no training step).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opd_test_helpers import short_run_overrides

from opd.algorithms.distillation import validation_baselines
from opd.algorithms.distillation_config import MasterConfig
from opd.algorithms.distillation_setup import setup
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
TEACHERS = ("teachers.members=[{name: add, model_path: 'tiny:teacher'}, {name: sub, model_path: 'tiny:student-b'}]")
ROUTE = ["model.teacher_model_path=null", "teachers.mode=route", "teachers.route_key=task", TEACHERS]
MIXTURE = ["model.teacher_model_path=null", "teachers.mode=mixture", TEACHERS]
CONTEXT = ["distillation.teacher_context=Add or subtract carefully.", "validation.eval_baseline=true"]


def _rows(count: int, task: str | None = None) -> list[dict]:
    rows = []
    for i in range(count):
        x, y = 10 + (7 * i) % 80, 3 + (5 * i) % 9
        sign, answer, kind = ("+", x + y, "add") if i % 3 else ("-", x - y, "sub")
        if task is None or task == kind:
            rows.append({
                "messages": [{"role": "user", "content": f"What is {x} {sign} {y}?"},
                             {"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."}],
                "ground_truth": str(answer), "task": kind,
            })
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str | None, Path]:
    """Training rows, and validation rows: all of them, and those of each task."""
    folder = tmp_path_factory.mktemp("baselines")
    paths: dict[str | None, Path] = {}
    for name, rows in {"train": _rows(12), None: _rows(6), "add": _rows(6, "add"), "sub": _rows(6, "sub")}.items():
        paths[name] = folder / f"{name or 'val'}.jsonl"
        paths[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def baselines(tmp_path: Path, data: dict, val: str | None, *overrides: str) -> dict[str, float]:
    config = load_config(MasterConfig, TINY_CONFIG, [
        *short_run_overrides(tmp_path), f"data.train_path={data['train']}", f"data.val_path={data[val]}",
        "validation.teacher_baseline=true", "validation.generate_strategy.max_length=8",
        "model.teacher_model_path=tiny:teacher", *overrides,
    ])
    parts = setup(config)
    try:
        return validation_baselines(parts.student_generation, parts.teacher_generation, parts.val_dataloader,
                                    parts.tokenizer, config)
    finally:
        parts.close()


def _renamed(metrics: dict[str, float], old: str, new: str) -> dict[str, float]:
    return {key.replace(old, new): value for key, value in metrics.items()}


def test_each_routed_teacher_answers_its_own_prompts_as_that_teacher_alone(tmp_path, data):
    several = baselines(tmp_path / "route", data, None, *ROUTE)
    alone_add = baselines(tmp_path / "add", data, "add")
    alone_sub = baselines(tmp_path / "sub", data, "sub", "model.teacher_model_path=tiny:student-b")
    expected = {**_renamed(alone_add, "val/teacher_", "val/teacher_add_"),
                **_renamed(alone_sub, "val/teacher_", "val/teacher_sub_")}
    assert "val/teacher_add_accuracy" in expected and "val/teacher_sub_mean_response_length" in expected
    assert several == expected


def test_each_member_of_a_mixture_answers_every_prompt(tmp_path, data):
    several = baselines(tmp_path / "mix", data, None, *MIXTURE)
    alone_sub = baselines(tmp_path / "sub", data, None, "model.teacher_model_path=tiny:student-b")
    assert {key: value for key, value in several.items() if key.startswith("val/teacher_sub_")} == _renamed(
        alone_sub, "val/teacher_", "val/teacher_sub_")
    assert "val/teacher_add_accuracy" in several


def test_the_eval_baseline_compares_the_student_with_each_routed_teacher_on_its_prompts(tmp_path, data):
    several = baselines(tmp_path / "route", data, None, *ROUTE, *CONTEXT)
    alone = baselines(tmp_path / "add", data, "add", *CONTEXT)
    for key in ("val/baseline_student_accuracy", "val/baseline_teacher_accuracy", "val/baseline_accuracy_gap"):
        assert several[f"{key}_add"] == alone[key]
    assert "val/baseline_accuracy_gap_sub" in several


def test_a_cross_tokenizer_teacher_answers_in_its_own_tokens(tmp_path, data):
    plain = baselines(tmp_path / "plain", data, None, "loss_fn.type=topk", "loss_fn.k=4")
    topk = ("loss_fn.type=topk", "loss_fn.k=4")
    cross = baselines(tmp_path / "cross", data, None, *topk, "teacher.cross_tokenizer=true")
    assert "val/teacher_accuracy" in plain and cross == plain


@pytest.mark.parametrize(("overrides", "message"), [
    (["teachers.members=[{name: add, model_path: 'tiny:teacher'}, {name: sub, backend: remote, "
      "remote: {url: 'http://127.0.0.1:1', protocol: opd}, loss_fn: {type: topk}}]"],
     "validation.teacher_baseline generates with each teacher in process, but sub is served"),
    (["training.early_stop={metric: val/accuracy, target: teacher}"], "several teachers have no one teacher value"),
])
def test_what_stays_refused_names_why(tmp_path, data, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(MasterConfig, TINY_CONFIG, [
            *short_run_overrides(tmp_path), f"data.val_path={data[None]}", "validation.teacher_baseline=true",
            *ROUTE, *overrides])
