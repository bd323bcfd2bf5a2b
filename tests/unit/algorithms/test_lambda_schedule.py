"""``distillation.lambda`` as a schedule: its values, its config, and the coin of each step.

Under an asynchronous schedule a step's batch is started one or two steps before it is
trained; the coin must still be flipped against the λ of the step that trains it. A
``step`` schedule that switches from fixed data to on-policy at step 3 must therefore give
on-policy flags 0, 0, 1, 1 under every scheduler (a coin flipped against the λ of the step
the batch was started at would give 0, 0, 0, 1 under one_step_off).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opd_test_helpers import REPO_ROOT, short_run_overrides

from opd.distillation.config import MasterConfig
from opd.distillation.lambda_schedule import LambdaSchedule
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"


def _reference(schedule: str, start: float, end: float, steps: int, step: int) -> float:
    """λ of ``step`` by the definition, in plain Python."""
    if schedule == "step":
        return end if step >= steps else start
    if step >= steps:
        return end
    return start + (end - start) * (step - 1) / (steps - 1)


@pytest.mark.parametrize(
    ("schedule", "start", "end", "steps"),
    [("linear", 0.0, 1.0, 5), ("linear", 0.9, 0.1, 4), ("linear", 0.3, 0.7, 1), ("step", 0.0, 1.0, 3), ("step", 1.0, 0.2, 1)],
)
def test_schedule_values_follow_the_definition(schedule, start, end, steps):
    rule = LambdaSchedule(schedule=schedule, start=start, end=end, steps=steps)
    for step in range(1, 9):
        assert rule.at(step) == pytest.approx(_reference(schedule, start, end, steps, step), abs=1e-12)
    assert rule.lowest() == min(start, end)
    assert LambdaSchedule(schedule="linear", start=0.0, end=1.0, steps=5).at(3) == 0.5


def _config(tmp_path: Path, *overrides: str) -> MasterConfig:
    base = [
        *short_run_overrides(tmp_path),
        "checkpointing.enabled=false",
        "training.batch_size=2",
        "training.micro_batch_size=null",
        "training.warmup_steps=0",
        "training.max_num_steps=4",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.max_length=8",
    ]
    return load_config(MasterConfig, TINY_CONFIG, base + list(overrides))


def test_config_takes_a_number_or_a_schedule_and_names_a_bad_one(tmp_path):
    assert _config(tmp_path, "distillation.lambda=0.5").distillation.lambda_at(7) == 0.5
    scheduled = _config(tmp_path, "distillation.lambda={schedule: linear, start: 0.0, end: 1.0, steps: 3}")
    assert [scheduled.distillation.lambda_at(step) for step in (1, 2, 3)] == [0.0, 0.5, 1.0]
    assert scheduled.distillation.lowest_lambda() == 0.0 and scheduled.distillation.lambda_is_scheduled()
    with pytest.raises(ConfigError, match=r"distillation\.lambda"):
        _config(tmp_path, "distillation.lambda={schedule: linear, start: 0.0, end: 1.5, steps: 3}")
    with pytest.raises(ConfigError, match=r"distillation\.lambda"):
        _config(tmp_path, "distillation.lambda={schedule: cosine, start: 0.0, end: 1.0, steps: 3}")
    with pytest.raises(ConfigError, match=r"distillation\.lambda"):
        _config(tmp_path, "distillation.lambda=1.5")


@pytest.mark.parametrize("scheduler", ["sync", "one_step_off", "two_step_off"])
def test_each_step_flips_its_coin_against_its_own_lambda(tmp_path, scheduler):
    config = _config(
        tmp_path,
        f"training.scheduler={scheduler}",
        "distillation.lambda={schedule: step, start: 0.0, end: 1.0, steps: 3}",
    )
    distillation_train(setup(config))
    records = [json.loads(line) for line in (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [record for record in records if "train/on_policy" in record]
    assert [record["train/on_policy"] for record in train] == [0, 0, 1, 1]
    assert [record["train/lambda"] for record in train] == [0.0, 0.0, 1.0, 1.0]
