"""Multi-turn rollouts on a cluster: 2 FSDP2 trainer workers and a rollout worker equal one process.

The calculator environment drives the episodes from the controller; each turn is one
``generate`` call, which on a cluster is answered by the rollout worker (an HF engine,
refit from the trainer after each step). The tiny student never calls a tool on its own,
so its first turn of every episode is a calculator call (the controller's engine object
is wrapped, in both runs alike); the environment's answer is appended and the engine
writes the second turn. 2 steps of the exact loss, greedy: the per-step loss, KL and
gradient norm, the episode metrics and the final weights equal the in-process run's
(within the float32 rounding derived in ``opd_float_tolerance``: the two ranks sum the
micro-batches' gradients in another order), in sync and under one_step_off, where the cluster runs each
step's episodes on a background thread while the student trains (the engine is refit
only once they end) and one process runs them in turn.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
from opd_float_tolerance import METRIC_ZERO, adam_weight_tolerance, assert_weights_within, entries, metric_tolerance
from opd_test_helpers import REPO_ROOT, first_turn_calls_the_tool, short_run_overrides
from safetensors.torch import load_file

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.run.plotting import read_metrics
from opd.utils.config import load_config

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
STEPS = 2
LEARNING_RATE = 3e-3
MICRO_BATCHES = 2
"""Per step: 2 episodes in micro-batches of 1 (1 per rank on the cluster)."""
COMPARED = ("train/loss", "train/kl_forward", "train/grad_norm", "env/turns", "env/tool_calls", "env/success_share")


def run(tmp_path: Path, *cluster: str) -> tuple[list[dict], dict, set[str]]:
    config = load_config(MasterConfig, TINY, [
        *short_run_overrides(tmp_path),
        "checkpointing.enabled=false",
        "training.batch_size=2",
        "training.micro_batch_size=1",
        "training.warmup_steps=0",
        f"training.learning_rate={LEARNING_RATE}",
        f"training.max_num_steps={STEPS}",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.decoding_method=greedy",
        "distillation.generate_strategy.max_length=6",
        "environment.max_turns=2",
        "data.max_train_examples=4",
        "data.max_prompt_length=1024",  # the tools section is about 700 bytes of the byte-level tokenizer
        "loss_fn.compile_kernels=false",
        *cluster,
    ])
    parts = setup(config)
    threads: set[str] = set()
    try:
        generation = parts.student_generation
        first_turn_calls_the_tool(generation, parts.tokenizer, CALL)
        forced = generation.generate

        def recording(*args, **kwargs):
            threads.add(threading.current_thread().name)
            return forced(*args, **kwargs)

        generation.generate = recording
        distillation_train(parts)
    finally:
        parts.close()
    records = [record for record in read_metrics(Path(config.output_dir) / "logs") if "train/loss" in record]
    final = load_file(str(Path(config.output_dir) / "final_model" / "model.safetensors"))
    return records, final, threads


@pytest.fixture(scope="module", params=["sync", "one_step_off"])
def runs(request, ray_cluster, tmp_path_factory):
    scheduler = f"training.scheduler={request.param}"
    in_process = run(tmp_path_factory.mktemp("in_process"), scheduler)
    on_cluster = run(
        tmp_path_factory.mktemp("cluster"),
        scheduler,
        "cluster.trainer.workers=2",
        "cluster.rollout.workers=1",
        *(["cluster.placement=split"] if request.param != "sync" else []),
    )
    return request.param, in_process, on_cluster


def test_a_cluster_trains_on_multi_turn_rollouts_as_one_process_does(runs):
    scheduler, (expected, expected_weights, _), (actual, actual_weights, threads) = runs
    # one_step_off on the rollout workers: the episodes run beside the update, on a thread of their own.
    assert threads == ({"opd-episodes_0"} if scheduler == "one_step_off" else {"MainThread"})
    assert [record["step"] for record in actual] == [record["step"] for record in expected] == [1, 2]
    for mine, reference in zip(actual, expected, strict=True):
        assert reference["env/turns"] == 2.0 and reference["env/tool_calls"] == 1.0  # a call, an answer, a turn
        tolerance = metric_tolerance(mine["step"], entries(expected_weights))
        for key in COMPARED:
            assert math.isclose(mine[key], reference[key], rel_tol=tolerance, abs_tol=METRIC_ZERO), (
                key, mine, reference)
    tolerance = adam_weight_tolerance(LEARNING_RATE, STEPS, MICRO_BATCHES, entries(expected_weights))
    assert_weights_within(actual_weights, expected_weights, tolerance)
