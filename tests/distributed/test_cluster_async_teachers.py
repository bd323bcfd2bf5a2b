"""Several teachers in pools with two_step_off and packing on a real local Ray cluster equal one process (issue 35).

Two routed teachers, each in a teacher pool of its own, score each batch ahead while the
student trains (``two_step_off``: the group starts every pool on its rows with
``score_async`` and combines their answers when collected); the FSDP2 trainer worker
trains packed micro-batches, each packed like its rows of the answer. Split placement (a
trainer worker, a rollout worker and two teacher pools fill the module's 4 CPUs), 2
steps: the per-step losses, per-teacher KLs and staleness are those of
the same schedule in one process (within 1e-5).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from opd_float_tolerance import METRIC_ZERO, metric_tolerance, tiny_student_entries
from opd_test_helpers import REPO_ROOT

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.run.plotting import read_metrics
from opd.utils.config import load_config

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
ON_CLUSTER = [
    "cluster.placement=split",
    "cluster.trainer.workers=1",
    "cluster.rollout.workers=1",
    "cluster.start_timeout_s=60",
    "cluster.teacher.placement=pool",
]


def write_task_data(path: Path, count: int) -> None:
    rows = []
    for i in range(count):
        x, y = 10 + (7 * i) % 80, 3 + (5 * i) % 9
        sign, answer, task = ("+", x + y, "add") if i % 3 else ("-", x - y, "sub")
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {x} {sign} {y}?"},
                    {"role": "assistant", "content": f"{x} {sign} {y} = {answer}."},
                ],
                "ground_truth": str(answer),
                "task": task,
            }
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    write_task_data(tmp_path / "train.jsonl", 8)
    config = load_config(
        MasterConfig,
        TINY,
        [
            f"output_dir={tmp_path / name}",
            f"data.train_path={tmp_path / 'train.jsonl'}",
            "data.val_path=null",
            "validation.val_at_start=false",
            "validation.val_at_end=false",
            "logger.console=false",
            "training.max_num_steps=2",
            "training.batch_size=4",
            "training.micro_batch_size=2",
            "training.save_freq=0",
            "training.scheduler=two_step_off",
            "training.sequence_packing=true",
            "distillation.num_samples_per_prompt=1",
            "distillation.generate_strategy.decoding_method=greedy",
            "distillation.generate_strategy.max_length=8",
            "model.teacher_model_path=null",
            "loss_fn.type=topk",
            "loss_fn.k=4",
            "teachers.mode=route",
            "teachers.route_key=task",
            "teachers.members=[{name: add, model_path: 'tiny:teacher'}, {name: sub, model_path: 'tiny:student-b'}]",
            *overrides,
        ],
    )
    components = setup(config)
    try:
        distillation_train(components)
    finally:
        components.close()
    return [record for record in read_metrics(Path(config.output_dir) / "logs") if "train/loss" in record]


def test_routed_pools_scored_ahead_with_packing_equal_one_process(ray_cluster, tmp_path):
    in_process = run(tmp_path, "process")
    on_cluster = run(tmp_path, "cluster", *ON_CLUSTER)
    assert len(on_cluster) == len(in_process) == 2
    assert any(0 < record["train/teacher/add/token_share"] < 1 for record in in_process)  # both teachers score
    for mine, reference in zip(on_cluster, in_process, strict=True):
        assert mine["train/staleness_max"] == reference["train/staleness_max"]
        per_teacher = sorted(key for key in reference if key.startswith("train/teacher/"))
        assert per_teacher == sorted(key for key in mine if key.startswith("train/teacher/"))
        for key in ("train/loss", "train/kl_forward", *per_teacher):
            tolerance = metric_tolerance(mine["step"], tiny_student_entries())
            assert math.isclose(mine[key], reference[key], rel_tol=tolerance, abs_tol=METRIC_ZERO), (mine["step"], key)
