"""The validation baselines with several teachers and with a cross-tokenizer teacher (issue 35).

* Routing: each teacher answers the validation prompts routed to it, reported as
  ``val/teacher_<name>_*``; each equals the one-teacher baseline of that model on those
  prompts. A mixture's members each answer every prompt.
* The eval baseline with routing compares the student with each teacher on that teacher's
  prompts (``val/baseline_*_<name>``), equal to the one-teacher eval baseline on them.
* A cross-tokenizer teacher samples in its own tokens from its own rendering of the
  prompts; with the student's tokenizer its baseline equals the plain teacher's.
* A served teacher answers from its server (``/v1/completions``, greedy): its baselines
  equal the in-process teacher's, alone (with the eval baseline and a teacher-only
  context too) and as a routed member beside an in-process one.
* What stays refused: an early-stop target of "the teacher" with several teachers.

The baselines are computed straight from the built components (no training step).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opd_test_helpers import RunningServer, short_run_overrides

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import validation_baselines
from opd.models.decoding import GenerateStrategyConfig
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.teachers.scoring import PromptScorer
from opd.teachers.served.remote_generation import RemoteGeneration, response_ids, sampling_fields
from opd.teachers.served.remote_teacher import TeacherServiceError
from opd.teachers.served.server import TeacherService
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


@pytest.fixture(scope="module")
def served_sub():
    """``opd serve-teacher``'s app over the tiny ``student-b`` model, on 127.0.0.1."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model("student-b").eval()
    running = RunningServer(TeacherService(PromptScorer(model, len(tokenizer)), tokenizer, "sub", 16, 512))
    yield running
    running.stop()


def served(url: str, protocol: str) -> list[str]:
    return ["teacher.backend=remote", f"teacher.remote.url={url}", f"teacher.remote.protocol={protocol}",
            "teacher.remote.backoff_s=0.01", "loss_fn.type=topk", "loss_fn.k=4"]


@pytest.mark.parametrize("protocol", ["openai", "opd"])
def test_a_served_teacher_answers_as_the_same_teacher_in_process(tmp_path, data, served_sub, protocol):
    asked = served_sub.service.requests["/v1/completions"]
    on_server = baselines(tmp_path / "served", data, None, "model.teacher_model_path=tiny:student-b", *CONTEXT,
                          *served(served_sub.url, protocol))
    in_process = baselines(tmp_path / "local", data, None, "model.teacher_model_path=tiny:student-b", *CONTEXT,
                           "loss_fn.type=topk", "loss_fn.k=4")
    assert served_sub.service.requests["/v1/completions"] > asked  # the server answered
    assert "val/teacher_accuracy" in on_server and "val/baseline_accuracy_gap" in on_server
    assert on_server["val/teacher_mean_response_length"] > 0
    assert on_server == in_process


def test_a_served_member_answers_its_routed_prompts_as_in_process(tmp_path, data, served_sub):
    members = ("teachers.members=[{name: add, model_path: 'tiny:teacher'}, {name: sub, backend: remote, "
               f"remote: {{url: '{served_sub.url}', backoff_s: 0.01}}}}]")
    with_server = baselines(tmp_path / "served", data, None, *ROUTE, members, "loss_fn.type=topk", "loss_fn.k=4")
    in_process = baselines(tmp_path / "local", data, None, *ROUTE, "loss_fn.type=topk", "loss_fn.k=4")
    assert "val/teacher_sub_accuracy" in with_server
    assert with_server == in_process


def test_the_served_engine_reads_the_ids_of_an_older_vllm_and_names_what_it_lacks():
    # vLLM before return_token_ids names the sampled tokens as token_id:<id> in logprobs.tokens.
    assert response_ids({"token_ids": [5, 7]}) == [5, 7]
    assert response_ids({"logprobs": {"tokens": ["token_id:5", "token_id:7"]}}) == [5, 7]
    with pytest.raises(TeacherServiceError, match="no token ids"):
        response_ids({"text": "hi", "logprobs": None})
    assert sampling_fields(GenerateStrategyConfig(decoding_method="greedy")) == {"temperature": 0.0}
    assert sampling_fields(GenerateStrategyConfig(decoding_method="top_k", temperature=0.7, top_k=5)) == {
        "temperature": 0.7, "top_k": 5, "top_p": 1.0}
    assert sampling_fields(GenerateStrategyConfig(decoding_method="top_p", temperature=0.7, top_p=0.9)) == {
        "temperature": 0.7, "top_k": -1, "top_p": 0.9}
    engine = RemoteGeneration("http://127.0.0.1:1", "m", None, [2], 0)
    with pytest.raises(ValueError, match="no sampler log-probs"):
        engine.generate([[1, 2]], GenerateStrategyConfig())
    engine.close()


@pytest.mark.parametrize(("overrides", "message"), [
    (["training.early_stop={metric: val/accuracy, target: teacher}"], "several teachers have no one teacher value"),
])
def test_what_stays_refused_names_why(tmp_path, data, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(MasterConfig, TINY_CONFIG, [
            *short_run_overrides(tmp_path), f"data.val_path={data[None]}", "validation.teacher_baseline=true",
            *ROUTE, *overrides])
