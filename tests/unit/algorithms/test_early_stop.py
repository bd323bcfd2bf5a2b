"""``training.early_stop``: the rule against a plain reference, and short runs that stop by it.

The rule (:func:`opd.run.early_stop.observe`) is fed sequences of validation
values, hand-made and random (NaN included), and must stop exactly where
:func:`reference_stop` does: a plain re-statement of Hugging Face's
``EarlyStoppingCallback`` (an improvement beats the best by more than ``min_delta``;
``patience`` validations in a row without one stop the run) plus a target.

The runs use the tiny config (seconds each): one stops when validation reaches the
teacher's own accuracy, with the log line, the metrics record, the checkpoint and the
final model of a normal end; one stops for lack of improvement, and the same run resumed
from a checkpoint between two validations stops at the same step.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
from pathlib import Path

import pytest
from opd_test_helpers import REPO_ROOT

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.run.early_stop import EarlyStopConfig, fresh_early_stop_state, observe
from opd.sft import SFTMasterConfig, sft_train
from opd.sft import setup as sft_setup
from opd.utils.config import load_config

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
SFT_CONFIG = REPO_ROOT / "examples" / "configs" / "sft.yaml"
NAN = math.nan


def reference_stop(
    values: list[float],
    mode: str,
    patience: int | None,
    min_delta: float,
    target: float | None,
    start: float | None = None,
    tolerance: float = 0.0,
) -> int | None:
    """The index of the validation that stops the run, or None: a plain statement of the rule.

    ``start`` is the validation before the first step: it may set the first best, nothing else.
    """
    sign = 1.0 if mode == "max" else -1.0
    best = start if start is not None and math.isfinite(start) else None
    since_best = 0
    for index, value in enumerate(values):
        finite = not (math.isnan(value) or math.isinf(value))
        if finite and (best is None or sign * (value - best) > min_delta):
            best = value
            since_best = 0
        else:
            since_best = since_best + 1
        if (
            target is not None
            and finite
            and (value >= target - tolerance if mode == "max" else value <= target + tolerance)
        ):
            return index
        if patience is not None and since_best >= patience:
            return index
    return None


def rule_stop(rule: EarlyStopConfig, values: list[float], start: float | None = None) -> int | None:
    """Where :func:`observe` stops on ``values`` (validations at steps 10, 20, ...)."""
    state = fresh_early_stop_state()
    if start is not None:
        assert observe(rule, state, start, 0, judge=False) is None
    for index, value in enumerate(values):
        if observe(rule, state, value, 10 * (index + 1)) is not None:
            assert state["stopped"]
            return index
        assert not state["stopped"]
    return None


def make_rule(
    mode: str = "max", patience: int | None = None, min_delta: float = 0.0, target=None, tolerance: float = 0.0
) -> EarlyStopConfig:
    metric = "val/accuracy" if mode == "max" else "val/kl_reverse"
    return EarlyStopConfig(
        metric=metric, mode=mode, patience=patience, min_delta=min_delta, target=target, target_tolerance=tolerance
    )


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    ("values", "mode", "patience", "min_delta", "target", "expected"),
    [
        # patience: validations in a row without a new best
        ([0.1, 0.2, 0.2, 0.15, 0.2], "max", 3, 0.0, None, 4),
        ([0.1, 0.2, 0.2, 0.15, 0.3, 0.3], "max", 3, 0.0, None, None),
        ([0.5, 0.4, 0.3], "max", 1, 0.0, None, 1),
        # min_delta: a gain of at most min_delta is no improvement, and the best stays
        ([0.10, 0.12, 0.14, 0.16], "max", 2, 0.05, None, 2),
        ([0.10, 0.16, 0.20, 0.22], "max", 2, 0.05, None, None),
        ([0.10, 0.16, 0.20, 0.20], "max", 2, 0.05, None, 3),
        # mode min
        ([1.0, 0.8, 0.9, 0.85], "min", 2, 0.0, None, 3),
        ([1.0, 0.8, 0.7, 0.6], "min", 2, 0.0, None, None),
        # target: reached when at least (max) / at most (min) the target
        ([0.1, 0.5, 0.99, 1.0, 1.0], "max", None, 0.0, 1.0, 3),
        ([0.5, 0.3, 0.1, 0.05], "min", None, 0.0, 0.1, 2),
        ([0.1, 0.2, 0.3], "max", None, 0.0, 0.9, None),
        # the target can come before the patience runs out
        ([0.9, 0.9, 1.0], "max", 5, 0.0, 1.0, 2),
        # NaN never improves and never reaches the target; the first finite value is the first best
        ([NAN, NAN], "max", 2, 0.0, None, 1),
        ([NAN, 0.5, 0.4, NAN], "max", 2, 0.0, 0.0, 1),
        ([NAN, 0.5, 0.6], "min", 3, 0.0, None, None),
        ([math.inf, 0.2], "max", None, 0.0, 1.0, None),
    ],
)
def test_rule_stops_where_the_plain_statement_does(values, mode, patience, min_delta, target, expected):
    assert reference_stop(values, mode, patience, min_delta, target) == expected
    assert rule_stop(make_rule(mode, patience, min_delta, target), values) == expected


def test_rule_matches_the_reference_on_random_sequences():
    generator = random.Random(0)
    for case in range(3000):
        mode = generator.choice(["max", "min"])
        patience = generator.choice([None, 1, 2, 3, 5])
        target = None if patience is not None and generator.random() < 0.5 else round(generator.uniform(0, 1), 1)
        min_delta = generator.choice([0.0, 0.0, 0.01, 0.1])
        length = generator.randint(1, 12)
        # Coarse values so that ties, exact targets and gains equal to min_delta occur.
        values = [NAN if generator.random() < 0.1 else round(generator.uniform(0, 1), 1) for _ in range(length)]
        start = generator.choice([None, NAN, round(generator.uniform(0, 1), 1)])
        # Tolerances off the values' 0.1 grid: no value sits exactly at target ± tolerance.
        tolerance = generator.choice([0.0, 0.0, 0.05, 0.15]) if target is not None else 0.0
        expected = reference_stop(values, mode, patience, min_delta, target, start, tolerance)
        rule = make_rule(mode, patience, min_delta, target, tolerance)
        assert rule_stop(rule, values, start) == expected, (case, values, start, rule)


def test_the_validation_before_training_sets_the_best_but_never_stops():
    rule = make_rule("max", patience=1, target=0.5)
    state = fresh_early_stop_state()
    assert observe(rule, state, 0.9, 0, judge=False) is None  # already past the target: still no stop
    assert state == {**fresh_early_stop_state(), "best": 0.9, "best_step": 0}
    assert observe(rule, state, 0.6, 10) is not None  # reaches the target (and does not beat 0.9)
    assert state["bad_validations"] == 1 and state["stopped"]


def test_the_teacher_target_is_the_value_kept_in_the_state():
    rule = make_rule("max", target="teacher")
    state = {**fresh_early_stop_state(), "teacher_value": 0.75}
    assert observe(rule, state, 0.7, 10) is None
    reason = observe(rule, state, 0.75, 20)
    assert reason == "val/accuracy = 0.75 reached the target 0.75 (the teacher's) at step 20"


def test_a_tolerance_lets_the_student_stop_one_validation_example_short_of_the_teacher():
    """127 of 128 validation answers right against the teacher's 128: within one example's share, not two."""
    rule = make_rule("max", target="teacher", tolerance=1 / 128)
    state = {**fresh_early_stop_state(), "teacher_value": 1.0}
    assert observe(rule, state, 126 / 128, 10) is None
    reason = observe(rule, state, 127 / 128, 20)
    assert reason == "val/accuracy = 0.9922 reached the target 1 (the teacher's) within 0.007812 at step 20"
    lower = make_rule("min", target=0.5, tolerance=0.05)
    assert rule_stop(lower, [0.7, 0.56, 0.54]) == 2


def test_the_patience_reason_names_metric_value_step_and_best():
    rule = make_rule("min", patience=2, min_delta=0.01)
    state = fresh_early_stop_state()
    for step, value in [(10, 0.5), (20, 0.495)]:
        assert observe(rule, state, value, step) is None
    reason = observe(rule, state, 0.6, 30)
    assert reason == (
        "val/kl_reverse = 0.6 at step 30: 2 validations without improving on the best 0.5 (step 10) "
        "by more than min_delta = 0.01"
    )


def test_mode_follows_the_metric_unless_given():
    assert EarlyStopConfig(metric="val/accuracy", patience=1).resolved_mode() == "max"
    assert EarlyStopConfig(metric="val/kl_forward", patience=1).resolved_mode() == "min"
    assert EarlyStopConfig(metric="val/truncation_rate", patience=1).resolved_mode() == "min"
    assert EarlyStopConfig(metric="val/mean_response_length", patience=1).resolved_mode() is None
    assert EarlyStopConfig(metric="val/mean_response_length", mode="max", patience=1).resolved_mode() == "max"


# --------------------------------------------------------------------------- runs


def run_config(tmp_path: Path, name: str, *overrides: str) -> MasterConfig:
    """The tiny run, cut to 2 prompts per step, 8-token answers, 8 validation prompts, a checkpoint every step."""
    base = [
        f"output_dir={tmp_path / name}",
        "logger.console=false",
        "training.batch_size=2",
        "training.micro_batch_size=null",
        "training.warmup_steps=0",
        "training.max_num_steps=20",
        "training.val_freq=2",
        "training.save_freq=1",
        "checkpointing.keep_top_k=null",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.max_length=8",
        "validation.generate_strategy.max_length=8",
        "data.max_val_examples=8",
    ]
    return load_config(MasterConfig, TINY_CONFIG, base + list(overrides))


def records(config: MasterConfig) -> list[dict]:
    text = (Path(config.logger.log_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def checkpoint_steps(config: MasterConfig) -> list[int]:
    return sorted(
        int(path.name.removeprefix("step_")) for path in Path(config.checkpointing.checkpoint_dir).glob("step_*")
    )


def test_a_run_stops_when_validation_reaches_the_teacher(tmp_path, caplog):
    # The random tiny teacher solves none of the sums, so the student "reaches" it at the first periodic
    # validation; the one before training must not stop the run.
    config = run_config(
        tmp_path,
        "teacher",
        "validation.teacher_baseline=true",
        "training.early_stop.metric=val/accuracy",
        "training.early_stop.target=teacher",
    )
    with caplog.at_level(logging.INFO, logger="opd"):
        distillation_train(setup(config))
    lines = [record.getMessage() for record in caplog.records if "training.early_stop" in record.getMessage()]
    assert lines == [
        "training.early_stop: the target is the teacher's val/teacher_accuracy = 0",
        "training.early_stop: val/accuracy = 0 reached the target 0 (the teacher's) at step 2; "
        "stopping after step 2 of 20",
    ]
    log = records(config)
    assert max(record["step"] for record in log) == 2
    assert [record["step"] for record in log if "train/loss" in record] == [1, 2]
    stop = [record for record in log if "early_stop/stopped" in record]
    assert len(stop) == 1 and stop[0]["step"] == 2 and stop[0]["early_stop/value"] == 0.0
    # The stopping validation is the run's last: no second validation of the same weights.
    assert [record["step"] for record in log if "val/accuracy" in record] == [0, 2]
    assert checkpoint_steps(config) == [1, 2]
    saved = json.loads((Path(config.checkpointing.checkpoint_dir) / "step_2" / "save_state.json").read_text())
    assert saved["early_stop"] == {
        "best": 0.0,
        "best_step": 0,
        "bad_validations": 1,
        "teacher_value": 0.0,
        "stopped": True,
    }
    assert (Path(config.output_dir) / "final_model" / "model.safetensors").is_file()

    # Rerunning the same command finds the run complete.
    before = (Path(config.logger.log_dir) / "metrics.jsonl").read_text()
    distillation_train(setup(config))
    assert (Path(config.logger.log_dir) / "metrics.jsonl").read_text() == before
    assert checkpoint_steps(config) == [1, 2]


def test_a_resumed_run_stops_at_the_step_of_the_uninterrupted_run(tmp_path):
    # min_delta larger than any KL change: the validation before training sets the best and none beats it,
    # so the third periodic validation (step 6) stops the run.
    rule = [
        "training.early_stop.metric=val/kl_reverse",
        "training.early_stop.patience=3",
        "training.early_stop.min_delta=100.0",
    ]
    config = run_config(tmp_path, "uninterrupted", *rule)
    distillation_train(setup(config))
    uninterrupted = records(config)
    assert max(record["step"] for record in uninterrupted) == 6
    assert checkpoint_steps(config) == [1, 2, 3, 4, 5, 6]

    # The same run as if killed after step 5's checkpoint (two validations counted), then rerun.
    resumed = run_config(tmp_path, "resumed", *rule)
    shutil.copytree(Path(config.output_dir), Path(resumed.output_dir))
    checkpoints = Path(resumed.checkpointing.checkpoint_dir)
    saved = json.loads((checkpoints / "step_5" / "save_state.json").read_text())
    assert saved["early_stop"]["bad_validations"] == 2 and not saved["early_stop"]["stopped"]
    shutil.rmtree(checkpoints / "step_6")
    shutil.rmtree(Path(resumed.output_dir) / "final_model")
    distillation_train(setup(resumed))
    assert checkpoint_steps(resumed) == [1, 2, 3, 4, 5, 6]
    again = records(resumed)

    def comparable(log: list[dict]) -> list[dict]:
        return [
            {key: value for key, value in record.items() if key != "time" and not key.startswith(("timing/", "perf/"))}
            for record in log
        ]

    assert comparable(again) == comparable(uninterrupted)
    assert (Path(resumed.output_dir) / "final_model" / "model.safetensors").is_file()


def test_sft_stops_by_the_same_rule(tmp_path):
    # A target every accuracy reaches: the first periodic validation (step 2) ends the run.
    config = load_config(
        SFTMasterConfig,
        SFT_CONFIG,
        [
            f"output_dir={tmp_path / 'sft'}",
            "logger.console=false",
            "training.batch_size=4",
            "training.max_num_steps=20",
            "training.val_freq=2",
            "training.save_freq=0",
            "data.max_val_examples=4",
            "validation.generate_strategy.max_length=8",
            "training.early_stop.metric=val/accuracy",
            "training.early_stop.target=0.0",
        ],
    )
    sft_train(sft_setup(config))
    log = records(config)
    assert [record["step"] for record in log if "train/loss" in record] == [1, 2]
    assert [record["step"] for record in log if "early_stop/stopped" in record] == [2]
    saved = json.loads((Path(config.checkpointing.checkpoint_dir) / "step_2" / "save_state.json").read_text())
    assert saved["early_stop"]["stopped"] and saved["step"] == 2
    assert (Path(config.output_dir) / "final_model" / "model.safetensors").is_file()
