"""Context distillation with the teacher colocated in the trainer workers equals one process (issue 35).

The teacher sees each completion after its own prompt (``distillation.teacher_context``):
the rows' ``teacher_prompt_ids`` travel with the student's rows to the 2 FSDP2 workers
(over gloo, on a real local Ray cluster), and each worker's colocated teacher scores them
under that context, as the in-process teacher does. 2 steps, the exact fused
full-vocabulary loss, packed micro-batches, and validation's KL at the end: per-step
losses, gradient norms and the validation KL equal the in-process run's within float32
rounding (``opd_float_tolerance.metric_tolerance``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from opd_float_tolerance import METRIC_ZERO, metric_tolerance, tiny_student_entries
from opd_test_helpers import REPO_ROOT, TINY_TRAIN_DATA, short_run_overrides

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.run.plotting import read_metrics
from opd.utils.config import load_config

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
CONTEXT = [
    "distillation.teacher_context=Add the two numbers carefully.",
    "training.max_num_steps=2",
    "training.batch_size=4",
    "training.micro_batch_size=1",
    "training.save_freq=0",
    "training.sequence_packing=true",
    "distillation.num_samples_per_prompt=1",
    "distillation.generate_strategy.decoding_method=greedy",
    "distillation.generate_strategy.max_length=8",
    f"data.val_path={TINY_TRAIN_DATA}",
    "data.max_val_examples=4",
    "validation.val_at_end=true",
    "validation.generate_strategy.max_length=8",
]


def run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    config = load_config(MasterConfig, TINY, [*short_run_overrides(tmp_path, name), *CONTEXT, *overrides])
    components = setup(config)
    try:
        distillation_train(components)
    finally:
        components.close()
    return read_metrics(Path(config.output_dir) / "logs")


def test_a_colocated_teacher_scores_under_the_teacher_context_as_in_one_process(ray_cluster, tmp_path):
    expected = run(tmp_path, "process")
    actual = run(tmp_path, "cluster", "cluster.trainer.workers=2", "cluster.rollout.workers=1")
    steps = [[record for record in records if "train/loss" in record] for records in (actual, expected)]
    assert len(steps[0]) == len(steps[1]) == 2
    for mine, reference in zip(*steps, strict=True):
        for key in ("train/loss", "train/kl_forward", "train/grad_norm"):
            tolerance = metric_tolerance(mine["step"], tiny_student_entries())
            assert math.isclose(mine[key], reference[key], rel_tol=tolerance, abs_tol=METRIC_ZERO), (mine["step"], key)
    validation = [[record for record in records if "val/kl_forward" in record][-1] for records in (actual, expected)]
    # After the 2 steps: a third step's rounding.
    tolerance = metric_tolerance(len(steps[0]) + 1, tiny_student_entries())
    assert validation[0]["val/kl_forward"] == pytest.approx(validation[1]["val/kl_forward"], rel=tolerance)
