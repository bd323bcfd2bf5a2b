"""Asynchronous schedules on a real local Ray cluster equal the same schedules run in one process.

Split pools (the rollout worker has its own slot), one thread per worker:

* ``one_step_off``: a trainer worker with the colocated teacher and the exact fused
  full-vocabulary loss, one HF rollout worker sampling the next batch while the trainer
  trains (λ = 0.5, greedy), against the in-process ``one_step_off`` run;
* ``two_step_off``: the same with the top-k loss and a teacher pool scoring the next batch
  while the trainer trains;
* a ``one_step_off`` cluster run killed with SIGKILL after a checkpoint and rerun ends
  with the same per-step losses and bitwise the same weights as the uninterrupted run.

Equal means: the same sampled versions and staleness per step, per-step losses and
final weights within the float32 rounding derived in ``opd_float_tolerance`` (one trainer
worker here: the gradients are summed in the same order, and the runs agree bit for bit
on one machine; other CPU kernels round differently).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opd_float_tolerance import (
    METRIC_ZERO,
    adam_weight_tolerance,
    assert_weights_within,
    entries,
    metric_tolerance,
    tiny_student_entries,
)
from opd_test_helpers import REPO_ROOT, TINY_TRAIN_DATA, short_run_overrides
from safetensors.torch import load_file

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.utils.config import load_config

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
STEPS = 6
LEARNING_RATE = 0.01
MICRO_BATCHES = 2
"""Per step: 4 sequences in micro-batches of 2."""


def async_overrides(scheduler: str, steps: int = STEPS) -> list[str]:
    return [
        f"training.scheduler={scheduler}",
        f"training.max_num_steps={steps}",
        "training.batch_size=4",
        "training.micro_batch_size=2",
        f"training.learning_rate={LEARNING_RATE}",
        "distillation.lambda=0.5",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.decoding_method=greedy",
        "distillation.generate_strategy.max_length=12",
    ]


CLUSTER = ["cluster.placement=split", "cluster.trainer.workers=1", "cluster.rollout.workers=1"]


def train(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    config = load_config(MasterConfig, TINY, [*short_run_overrides(tmp_path, name), "training.save_freq=0", *overrides])
    components = setup(config)
    try:
        distillation_train(components)
    finally:
        components.close()
    return steps_of(Path(config.output_dir))


def steps_of(output_dir: Path) -> list[dict]:
    lines = (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "train/loss" in record]


def assert_same_run(actual: list[dict], expected: list[dict], actual_dir: Path, expected_dir: Path) -> None:
    assert len(actual) == len(expected) == STEPS
    assert 0 < sum(record["train/on_policy"] for record in actual) < STEPS  # both branches ran
    for mine, reference in zip(actual, expected, strict=True):
        for key in ("train/on_policy", "train/sampled_version", "train/staleness_mean"):
            assert mine.get(key) == reference.get(key), f"step {mine['step']} {key}"
        tolerance = metric_tolerance(mine["step"], tiny_student_entries())
        for key in ("train/loss", "train/grad_norm"):
            assert math.isclose(mine[key], reference[key], rel_tol=tolerance, abs_tol=METRIC_ZERO), (
                f"step {mine['step']} {key}: cluster {mine[key]!r}, one process {reference[key]!r}"
            )
    cluster_weights = load_file(str(actual_dir / "final_model" / "model.safetensors"))
    process_weights = load_file(str(expected_dir / "final_model" / "model.safetensors"))
    tolerance = adam_weight_tolerance(LEARNING_RATE, STEPS, MICRO_BATCHES, entries(process_weights))
    assert_weights_within(cluster_weights, process_weights, tolerance)


@pytest.mark.parametrize(
    ("scheduler", "extra"),
    [
        ("one_step_off", []),
        ("two_step_off", ["loss_fn.type=topk", "loss_fn.k=8", "cluster.teacher.placement=pool"]),
    ],
)
def test_cluster_schedule_equals_the_in_process_schedule(ray_cluster, tmp_path, scheduler, extra):
    loss = [item for item in extra if item.startswith("loss_fn")]
    expected = train(tmp_path, "process", *async_overrides(scheduler), *loss)
    actual = train(tmp_path, "cluster", *async_overrides(scheduler), *extra, *CLUSTER)
    stale = [record["train/staleness_mean"] for record in actual if record["train/on_policy"]]
    assert max(stale) == (1 if scheduler == "one_step_off" else 2)
    assert all("timing/wait_prev_gen" in record for record in actual)
    assert_same_run(actual, expected, tmp_path / "cluster", tmp_path / "process")


def cli(output_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "opd",
        "train",
        "--config",
        str(TINY),
        f"output_dir={output_dir}",
        f"data.train_path={TINY_TRAIN_DATA}",
        "data.val_path=null",
        "validation.val_at_start=false",
        "validation.val_at_end=false",
        "training.save_freq=2",
        "checkpointing.keep_top_k=null",
        *async_overrides("one_step_off"),
        "distillation.generate_strategy.decoding_method=top_p",  # sampled: the RNG streams are resumed too
        *CLUSTER,
    ]


def start_cli(output_dir: Path) -> subprocess.Popen:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir.parent / f"{output_dir.name}.out", "a") as log:
        return subprocess.Popen(
            cli(output_dir),
            cwd=REPO_ROOT,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run_cli(output_dir: Path, kill_after: Path | None = None) -> int:
    process = start_cli(output_dir)
    if kill_after is not None:
        deadline = time.monotonic() + 240
        while not kill_after.exists():
            assert process.poll() is None, f"the run ended ({process.returncode}) before {kill_after} appeared"
            assert time.monotonic() < deadline, f"{kill_after} did not appear"
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGKILL)  # the controller and every Ray process it started
    return process.wait(timeout=300)


@pytest.mark.slow  # three `opd train` processes, each with a private Ray cluster
def test_sigkill_and_rerun_equals_the_uninterrupted_asynchronous_run(tmp_path):
    # The reference runs beside the killed run and its rerun (each its own private Ray cluster, one
    # thread a worker): a run leaves much of its cores idle, and nothing it computes depends on timing.
    reference_run = start_cli(tmp_path / "reference")
    try:
        killed = tmp_path / "killed"
        assert run_cli(killed, kill_after=killed / "checkpoints" / "step_2") == -signal.SIGKILL
        assert run_cli(killed) == 0, (tmp_path / "killed.out").read_text()[-3000:]
        assert reference_run.wait(timeout=300) == 0, (tmp_path / "reference.out").read_text()[-3000:]
    finally:
        if reference_run.poll() is None:  # a run above failed: the reference is not left running
            os.killpg(reference_run.pid, signal.SIGKILL)
            reference_run.wait()
    reference, resumed = steps_of(tmp_path / "reference"), steps_of(killed)
    assert [record["step"] for record in resumed] == list(range(1, STEPS + 1))
    for mine, expected in zip(resumed, reference, strict=True):
        assert mine["train/loss"] == expected["train/loss"], f"step {mine['step']}"
        assert mine.get("train/sampled_version") == expected.get("train/sampled_version")
    weights = load_file(str(killed / "final_model" / "model.safetensors"))
    for name, tensor in load_file(str(tmp_path / "reference" / "final_model" / "model.safetensors")).items():
        assert (weights[name] == tensor).all(), name
