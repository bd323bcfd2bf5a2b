"""The validation baselines on a real local Ray cluster equal the in-process ones (greedy, 2 trainer ranks).

* A teacher colocated in the trainer workers, with a teacher-only context: the rollout
  workers load the teacher's weights once and answer with them (``val/teacher_*``), the
  student answers from the rollout workers as it does for validation; ``val/teacher_*``
  and ``val/baseline_*`` equal one process's, and the workers hold no teacher afterwards.
* Two routed teachers, one in a teacher pool and one served (``opd serve-teacher`` on
  127.0.0.1): each answers its own prompts as in one process (``val/teacher_<name>_*``;
  ``slow``).

The baselines are computed straight from the built components (no training step). One Ray
cluster serves the module; every worker runs one thread.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opd_test_helpers import RunningServer

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import validation_baselines
from opd.distributed.rollout import RayGeneration, TeacherOnRolloutWorkers
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.teachers.scoring import PromptScorer
from opd.teachers.served.server import TeacherService
from opd.utils.config import load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
ON_CLUSTER = ["cluster.trainer.workers=2", "cluster.rollout.workers=2"]
ROUTE = ["model.teacher_model_path=null", "teachers.mode=route", "teachers.route_key=task", "loss_fn.type=topk",
         "loss_fn.k=4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cluster_baselines")
    rows = []
    for i in range(6):
        x, y = 10 + (7 * i) % 80, 3 + (5 * i) % 9
        sign, answer, task = ("+", x + y, "add") if i % 3 else ("-", x - y, "sub")
        rows.append({"messages": [{"role": "user", "content": f"What is {x} {sign} {y}?"},
                                  {"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."}],
                     "ground_truth": str(answer), "task": task})
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder / "rows.jsonl"


def baselines(tmp_path: Path, data: Path, *overrides: str, check=None) -> dict[str, float]:
    config = load_config(MasterConfig, TINY, [
        f"output_dir={tmp_path}", f"data.train_path={data}", f"data.val_path={data}", "logger.console=false",
        "checkpointing.enabled=false", "training.batch_size=4", "training.micro_batch_size=2",
        "validation.batch_size=4", "validation.teacher_baseline=true", "validation.generate_strategy.max_length=8",
        "model.teacher_model_path=tiny:teacher", *overrides,
    ])
    parts = setup(config)
    try:
        metrics = validation_baselines(parts.student_generation, parts.teacher_generation, parts.val_dataloader,
                                       parts.tokenizer, config)
        if check is not None:
            check(parts)
        return metrics
    finally:
        parts.close()


def test_a_colocated_teachers_baselines_from_the_rollout_workers_equal_one_process(ray_cluster, tmp_path, data):
    context = ["distillation.teacher_context=Add or subtract carefully.", "validation.eval_baseline=true"]

    def no_teacher_left(parts) -> None:
        assert isinstance(parts.student_generation, RayGeneration)
        engine = parts.teacher_generation[0].generation
        assert isinstance(engine, TeacherOnRolloutWorkers) and not engine.loaded
        workers = parts.student_generation.workers
        assert workers.gather([actor.__ray_call__.remote(lambda self: len(self.teacher_engines))
                               for actor in workers.actors]) == [0, 0]

    on_cluster = baselines(tmp_path / "cluster", data, *context, *ON_CLUSTER, check=no_teacher_left)
    in_process = baselines(tmp_path / "local", data, *context)
    assert "val/teacher_accuracy" in in_process and "val/baseline_accuracy_gap" in in_process
    assert on_cluster == in_process


@pytest.fixture(scope="module")
def served_sub():
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model("student-b").eval()
    running = RunningServer(TeacherService(PromptScorer(model, len(tokenizer)), tokenizer, "sub", 16, 512))
    yield running
    running.stop()


@pytest.mark.slow  # a second cluster start, with a teacher pool; the served path is tested in process too
def test_a_pooled_and_a_served_routed_teacher_answer_as_in_one_process(ray_cluster, tmp_path, data, served_sub):
    members = ("teachers.members=[{name: add, model_path: 'tiny:teacher'}, {name: sub, backend: remote, "
               f"remote: {{url: '{served_sub.url}', backoff_s: 0.01}}}}]")
    on_cluster = baselines(tmp_path / "cluster", data, *ROUTE, members, *ON_CLUSTER,
                           "cluster.teacher.placement=pool", "cluster.teacher.workers=1")
    in_process = baselines(tmp_path / "local", data, *ROUTE, "teachers.members=[{name: add, model_path: "
                           "'tiny:teacher'}, {name: sub, model_path: 'tiny:student-b'}]")
    assert "val/teacher_add_accuracy" in on_cluster and "val/teacher_sub_accuracy" in on_cluster
    assert on_cluster == in_process
