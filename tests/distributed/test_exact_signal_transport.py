"""The exact full-vocabulary loss from a teacher running apart from the trainer equals one process, on Ray.

Such a teacher sends its final hidden states alone
(:class:`~opd.models.interfaces.TeacherHiddenStates`); each FSDP2 trainer worker loaded
the teacher's output layer once and binds them to it, so the fused loss makes the
teacher's logits chunk by chunk, as in one process. Two steps of the default loss
(``full_vocab``, fused), against the same run in one process:

* two trainer workers over gloo and a teacher pool whose replica is one teacher sharded
  over two workers (``cluster.teacher.shards_per_replica: 2``), with validation's exact
  KL at the end (computed on the ranks from the pool's hidden states);
* a teacher served by ``opd serve-teacher`` on 127.0.0.1 (fp32 hidden states on the
  wire) under ``two_step_off``: the batch scored ahead carries the hidden states to the
  trainer worker, against ``two_step_off`` in one process.

Equal means: per-step loss, KL and gradient norm, and the final weights, within the
float32 rounding derived in ``opd_float_tolerance`` (the two ranks sum the micro-batches'
gradients in another order). One Ray cluster serves the module; every worker runs one thread.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from pathlib import Path

from opd_float_tolerance import METRIC_ZERO, assert_weights_within, entries, metric_tolerance, run_weight_tolerance
from opd_test_helpers import REPO_ROOT, BackgroundProcess, short_run_overrides
from safetensors.torch import load_file

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.run.plotting import read_metrics
from opd.utils.config import load_config

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
VAL_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "val.jsonl"
STEPS = 2
TWO_TRAINERS = ["cluster.trainer.workers=2", "cluster.rollout.workers=1"]


def config(tmp_path: Path, name: str, *overrides: str) -> MasterConfig:
    return load_config(MasterConfig, TINY, [
        *short_run_overrides(tmp_path, name), f"training.max_num_steps={STEPS}", "training.batch_size=4",
        "training.micro_batch_size=1", "training.save_freq=0", "training.warmup_steps=0",
        "distillation.num_samples_per_prompt=1", "distillation.generate_strategy.decoding_method=greedy",
        "distillation.generate_strategy.max_length=10", "loss_fn.type=full_vocab", "loss_fn.compile_kernels=false",
        *overrides,
    ])


def run(config_: MasterConfig) -> tuple[list[dict], dict, float]:
    """The run's step records, its final weights and how far they may be from another order's (float32 rounding)."""
    components = setup(config_)
    try:
        distillation_train(components)
    finally:
        components.close()
    output = Path(config_.output_dir)
    records = [record for record in read_metrics(output / "logs") if "train/loss" in record]
    weights = load_file(str(output / "final_model" / "model.safetensors"))
    return records, weights, run_weight_tolerance(config_, weights)


def assert_same_run(actual: tuple[list[dict], dict, float], expected: tuple[list[dict], dict, float]) -> None:
    (steps, weights, _), (reference_steps, reference_weights, tolerance) = actual, expected
    assert len(steps) == len(reference_steps) == STEPS
    for mine, reference in zip(steps, reference_steps, strict=True):
        for key in ("train/loss", "train/kl_forward", "train/grad_norm"):
            assert math.isclose(mine[key], reference[key], rel_tol=metric_tolerance(mine["step"], entries(weights)),
                                abs_tol=METRIC_ZERO), (
                f"step {mine['step']} {key}: cluster {mine[key]!r}, one process {reference[key]!r}"
            )
    assert reference_steps[0]["train/loss"] > 0
    assert_weights_within(weights, reference_weights, tolerance)


def validation_records(config_: MasterConfig) -> list[dict]:
    return [record for record in read_metrics(Path(config_.output_dir) / "logs") if "val/kl_forward" in record]


def test_a_sharded_teacher_pool_gives_the_exact_loss_of_one_process(ray_cluster, tmp_path):
    # Validation at the end too: its exact KL compares the student with the pool's hidden states on the ranks.
    validation = [f"data.val_path={VAL_DATA}", "validation.val_at_end=true", "validation.batch_size=8",
                  "validation.generate_strategy.max_length=6", "data.max_val_examples=8"]
    in_process = config(tmp_path, "process", *validation)
    expected = run(in_process)
    pool = ["cluster.teacher.placement=pool", "cluster.teacher.workers=2", "cluster.teacher.shards_per_replica=2"]
    on_cluster = config(tmp_path, "pool", *validation, *TWO_TRAINERS, *pool)
    assert_same_run(run(on_cluster), expected)
    (validated,), (reference,) = validation_records(on_cluster), validation_records(in_process)
    for key in ("val/kl_forward", "val/kl_reverse"):
        assert reference[key] > 0
        # After the last step: the weights are STEPS steps' rounding apart.
        tolerance = metric_tolerance(STEPS + 1, entries(expected[1]))
        assert math.isclose(validated[key], reference[key], rel_tol=tolerance), (key, validated[key], reference[key])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_served_teacher_scoring_ahead_on_a_cluster_gives_the_exact_loss_of_one_process(ray_cluster, tmp_path):
    # two_step_off: the batch of step 2 is scored during step 1, and its hidden states wait in the controller.
    schedule = ["training.scheduler=two_step_off", "training.micro_batch_size=2"]
    expected = run(config(tmp_path, "process", *schedule))
    port = free_port()
    server = BackgroundProcess(
        "server", [sys.executable, "-m", "opd", "serve-teacher", "--model", "tiny:teacher", "--port", str(port)],
        tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120,
    )
    try:
        server.wait_until(lambda: "serving" in server.stdout, "the server to start")
        served = ["teacher.backend=remote", f"teacher.remote.url=http://127.0.0.1:{port}",
                  "teacher.remote.protocol=opd", "teacher.remote.hidden_dtype=float32"]
        cluster = ["cluster.placement=split", "cluster.trainer.workers=1", "cluster.rollout.workers=1"]
        actual = run(config(tmp_path, "cluster", *schedule, *served, *cluster))
    finally:
        server.stop_if_running()
    assert [record["train/staleness_mean"] for record in actual[0]] == [0.0, 1.0]  # batch 2 was scored ahead
    assert_same_run(actual, expected)
