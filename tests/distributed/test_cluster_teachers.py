"""Several teachers and a teacher with another tokenizer on a real local Ray cluster equal the in-process run.

* Two routed teachers, each in a teacher pool of its own, with objectives of their own
  (top-k with k = 4 and k = 2, so each pool is asked its own signal): 2 FSDP2 trainer
  workers give the per-step losses and per-teacher KLs of one process.
* A teacher with another tokenizer in a pool: the driver re-tokenizes and maps its
  answers as in process, and the per-step losses are those of one process.
* Several teachers and a cross-tokenizer teacher colocated in the trainer workers, and the
  full-vocabulary loss with several teachers running apart, are in
  ``test_trainer_worker_teachers.py``.

One Ray cluster serves the module; every worker runs one thread (two shared cores).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from opd_float_tolerance import METRIC_ZERO, metric_tolerance, model_entries, tiny_student_entries
from opd_test_helpers import REPO_ROOT
from transformers import AutoTokenizer

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.models.tiny import build_model_for_tokenizer, train_bpe_tokenizer
from opd.run.plotting import read_metrics
from opd.utils.config import load_config

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
DEMO = REPO_ROOT / "examples" / "configs" / "demo.yaml"
DEMO_TEACHER = REPO_ROOT / "examples" / "demo" / "models" / "teacher"
ON_CLUSTER = ["cluster.trainer.workers=2", "cluster.rollout.workers=1", "cluster.teacher.placement=pool"]


def run(config: MasterConfig) -> list[dict]:
    components = setup(config)
    try:
        distillation_train(components)
    finally:
        components.close()
    return [record for record in read_metrics(Path(config.output_dir) / "logs") if "train/loss" in record]


def assert_same_steps(on_cluster: list[dict], in_process: list[dict], keys: list[str], student_entries: int) -> None:
    """Every step's ``keys`` within float32 rounding (``opd_float_tolerance.metric_tolerance``)."""
    assert len(on_cluster) == len(in_process) > 0
    for mine, reference in zip(on_cluster, in_process, strict=True):
        tolerance = metric_tolerance(mine["step"], student_entries)
        for key in keys:
            assert math.isclose(mine[key], reference[key], rel_tol=tolerance, abs_tol=METRIC_ZERO), (
                f"step {mine['step']} {key}: cluster {mine[key]!r}, one process {reference[key]!r}"
            )


def write_task_data(path: Path, count: int) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(count):
            x, y = 10 + (7 * i) % 80, 3 + (5 * i) % 9
            sign, answer, task = ("+", x + y, "add") if i % 3 else ("-", x - y, "sub")
            handle.write(json.dumps({
                "messages": [{"role": "user", "content": f"What is {x} {sign} {y}?"},
                             {"role": "assistant", "content": f"{x} {sign} {y} = {answer}."}],
                "ground_truth": str(answer), "task": task}) + "\n")


def two_teachers(tmp_path: Path, name: str, *overrides: str) -> MasterConfig:
    write_task_data(tmp_path / "train.jsonl", 24)
    return load_config(MasterConfig, TINY, [
        f"output_dir={tmp_path / name}", f"data.train_path={tmp_path / 'train.jsonl'}", "data.val_path=null",
        "validation.val_at_start=false", "validation.val_at_end=false", "logger.console=false",
        "training.max_num_steps=3", "training.batch_size=8", "training.micro_batch_size=2", "training.save_freq=0",
        "distillation.lambda=0.5", "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.decoding_method=greedy",
        "distillation.generate_strategy.max_length=10",
        "model.teacher_model_path=null", "loss_fn.type=topk", "loss_fn.k=4",
        "teachers.mode=route", "teachers.route_key=task",
        "teachers.members=[{name: add, model_path: 'tiny:teacher'}, "
        "{name: sub, model_path: 'tiny:student-b', loss_fn: {type: topk, k: 2}}]",
        *overrides,
    ])


def test_routed_teachers_in_pools_of_their_own_match_one_process(ray_cluster, tmp_path):
    in_process = run(two_teachers(tmp_path, "in_process"))
    on_cluster = run(two_teachers(tmp_path, "cluster", *ON_CLUSTER))
    assert 0 < sum(record["train/on_policy"] for record in in_process) < len(in_process)  # both branches ran
    keys = ["train/loss", "train/grad_norm", "train/teacher/add/kl_forward", "train/teacher/sub/kl_forward",
            "train/teacher/add/token_share"]
    assert_same_steps(on_cluster, in_process, keys, tiny_student_entries())
    assert all(record["timing/teacher/add"] > 0 and record["timing/teacher/sub"] > 0 for record in on_cluster)


@pytest.fixture(scope="module")
def other_tokenizer_teacher(tmp_path_factory) -> Path:
    """The demo teacher's architecture with a tokenizer of its own (300 tokens, other merges)."""
    student = AutoTokenizer.from_pretrained(DEMO_TEACHER)
    texts = [f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a}+{b} carry 1, answer "
             f"{a + b}<|im_end|>\n" for a in range(100, 400, 3) for b in (7, 58)]
    other = train_bpe_tokenizer(texts, vocab_size=300)
    assert other.get_vocab() != student.get_vocab()
    directory = tmp_path_factory.mktemp("other_tokenizer") / "teacher"
    build_model_for_tokenizer("teacher", other).save_pretrained(directory)
    other.save_pretrained(directory)
    return directory


def cross_tokenizer(tmp_path: Path, teacher: Path, name: str, *overrides: str) -> MasterConfig:
    return load_config(MasterConfig, DEMO, [
        f"output_dir={tmp_path / name}", f"model.teacher_model_path={teacher}", "teacher.cross_tokenizer=true",
        "loss_fn.type=topk", "loss_fn.k=8", "training.max_num_steps=2", "training.batch_size=4",
        "training.micro_batch_size=2", "training.save_freq=0", "distillation.generate_strategy.max_length=24",
        "data.val_path=null", "validation.val_at_start=false", "validation.val_at_end=false", "logger.console=false",
        "data.max_train_examples=32",  # two steps of 4; each run tokenised the file's 20,000 rows twice (two tokenizers)
        *overrides,
    ])


def test_a_teacher_with_another_tokenizer_in_a_pool_matches_one_process(ray_cluster, tmp_path, other_tokenizer_teacher):
    in_process = run(cross_tokenizer(tmp_path, other_tokenizer_teacher, "in_process"))
    on_cluster = run(cross_tokenizer(tmp_path, other_tokenizer_teacher, "cluster", *ON_CLUSTER))
    student = REPO_ROOT / "examples" / "demo" / "models" / "student"
    assert_same_steps(on_cluster, in_process, ["train/loss", "train/kl_forward", "train/grad_norm"], model_entries(student))
    assert all(record["train/loss"] > 0 for record in on_cluster)
