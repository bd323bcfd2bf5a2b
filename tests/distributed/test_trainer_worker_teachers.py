"""Several teachers and a cross-tokenizer teacher inside the trainer workers, and several heads bound there, on Ray.

Each run is 2 steps with 2 FSDP2 trainer workers over gloo on the tiny models (float32),
against the same run in one process. Equal means: per-step loss, KL and gradient norm,
and the final weights, within the float32 rounding derived in ``opd_float_tolerance``.

* Two routed teachers colocated in the trainer workers (``cluster.teacher.placement:
  colocated``): each worker loads both members sharded and builds the run's teacher
  around them with the in-process builder, so the exact full-vocabulary loss is taken in
  the workers. A mixture of a colocated member (whole, ``cluster.teacher.sharded: false``,
  split placement) and a served one: each worker mixes its own member with what its
  client of the server gets.
* A teacher with another tokenizer colocated in the trainer workers: each worker wraps it
  in the cross-tokenizer mapping, with the teacher's own tokenizer.
* The full-vocabulary loss with several teachers running apart: two routed teachers each
  in a pool of their own, and a mixture of a pooled and a served member. Each sends hidden
  states alone; every trainer worker holds both members' output layers and binds each
  member's hidden states to its own (the mixture is mixed there).

One Ray cluster serves the module; every worker runs one thread (two shared cores).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
from pathlib import Path

import pytest
from opd_float_tolerance import METRIC_ZERO, assert_weights_within, entries, metric_tolerance, run_weight_tolerance
from opd_test_helpers import REPO_ROOT, BackgroundProcess, short_run_overrides
from safetensors.torch import load_file
from transformers import AutoTokenizer

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.models.tiny import build_model_for_tokenizer, train_bpe_tokenizer
from opd.run.plotting import read_metrics
from opd.utils.config import load_config

pytestmark = pytest.mark.slow

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
DEMO = REPO_ROOT / "examples" / "configs" / "demo.yaml"
DEMO_TEACHER = REPO_ROOT / "examples" / "demo" / "models" / "teacher"
STEPS = 2
TWO_TRAINERS = ["cluster.trainer.workers=2", "cluster.rollout.workers=1"]
COLOCATED = [*TWO_TRAINERS, "cluster.teacher.placement=colocated"]
POOLS = [*TWO_TRAINERS, "cluster.teacher.placement=pool"]
MEMBERS = (
    "[{name: add, model_path: 'tiny:teacher', weight: 0.7}, {name: sub, model_path: 'tiny:student-b', weight: 0.3}]"
)


def run(config: MasterConfig) -> tuple[list[dict], dict, float]:
    """The run's step records, its final weights and how far they may be from another order's (float32 rounding)."""
    components = setup(config)
    try:
        distillation_train(components)
    finally:
        components.close()
    output = Path(config.output_dir)
    records = [record for record in read_metrics(output / "logs") if "train/loss" in record]
    weights = load_file(str(output / "final_model" / "model.safetensors"))
    return records, weights, run_weight_tolerance(config, weights)


def assert_same_run(actual: tuple[list[dict], dict, float], expected: tuple[list[dict], dict, float],
                    keys: list[str]) -> None:
    (steps, weights, _), (reference_steps, reference_weights, tolerance) = actual, expected
    assert len(steps) == len(reference_steps) == STEPS
    for mine, reference in zip(steps, reference_steps, strict=True):
        for key in ("train/loss", "train/grad_norm", *keys):
            assert math.isclose(mine[key], reference[key], rel_tol=metric_tolerance(mine["step"], entries(weights)),
                                abs_tol=METRIC_ZERO), (
                f"step {mine['step']} {key}: cluster {mine[key]!r}, one process {reference[key]!r}"
            )
    assert reference_steps[0]["train/loss"] > 0
    assert_weights_within(weights, reference_weights, tolerance)


def write_task_data(path: Path, count: int) -> None:
    """Arithmetic chats whose ``task`` (add, sub) routes each to a teacher."""
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(count):
            x, y = 10 + (7 * i) % 80, 3 + (5 * i) % 9
            sign, answer, task = ("+", x + y, "add") if i % 3 else ("-", x - y, "sub")
            handle.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"What is {x} {sign} {y}?"},
                            {"role": "assistant", "content": f"{x} {sign} {y} = {answer}."},
                        ],
                        "ground_truth": str(answer),
                        "task": task,
                    }
                )
                + "\n"
            )


def teachers(tmp_path: Path, name: str, mode: str, *overrides: str) -> MasterConfig:
    """Two teachers (routed by the example's task, or mixed 0.7 / 0.3) with the exact full-vocabulary loss."""
    data = tmp_path / "train.jsonl"
    if not data.exists():
        write_task_data(data, 16)
    route = ["teachers.route_key=task"] if mode == "route" else []
    return load_config(
        MasterConfig,
        TINY,
        [
            *short_run_overrides(tmp_path, name),
            f"data.train_path={data}",
            f"training.max_num_steps={STEPS}",
            "training.batch_size=4",
            "training.micro_batch_size=1",
            "training.save_freq=0",
            "training.warmup_steps=0",
            "distillation.num_samples_per_prompt=1",
            "distillation.generate_strategy.decoding_method=greedy",
            "distillation.generate_strategy.max_length=10",
            "loss_fn.type=full_vocab",
            "loss_fn.compile_kernels=false",
            "model.teacher_model_path=null",
            f"teachers.mode={mode}",
            *route,
            f"teachers.members={MEMBERS}",
            *overrides,
        ],
    )


ROUTED_KEYS = ["train/teacher/add/kl_forward", "train/teacher/sub/kl_forward"]


def test_routed_teachers_in_the_trainer_workers_and_in_pools_give_the_loss_of_one_process(ray_cluster, tmp_path):
    # Validation at the end too: its exact KL compares each row with its own teacher, on the ranks.
    write_task_data(tmp_path / "val.jsonl", 4)
    validation = [
        f"data.val_path={tmp_path / 'val.jsonl'}",
        "validation.val_at_end=true",
        "validation.batch_size=4",
        "validation.generate_strategy.max_length=6",
    ]
    in_process = teachers(tmp_path, "process", "route", *validation)
    expected = run(in_process)
    assert {record["train/teacher/add/token_share"] > 0 for record in expected[0]} == {True}  # both have rows
    # Both sharded over the two trainer ranks (each rank runs every member's forward, in order).
    colocated = teachers(tmp_path, "colocated", "route", *validation, *COLOCATED)
    assert_same_run(run(colocated), expected, ROUTED_KEYS)
    # Each in a pool of its own: every trainer rank binds each member's hidden states to that member's head.
    pools = teachers(tmp_path, "pools", "route", *validation, *POOLS)
    assert_same_run(run(pools), expected, ROUTED_KEYS)
    (reference,) = validation_records(in_process)
    assert reference["val/kl_forward"] > 0
    for config in (colocated, pools):
        (validated,) = validation_records(config)
        for key in ("val/kl_forward", "val/kl_reverse"):
            # After the last step: the weights are STEPS steps' rounding apart.
            tolerance = metric_tolerance(STEPS + 1, entries(expected[1]))
            assert math.isclose(validated[key], reference[key], rel_tol=tolerance), (key, validated, reference)


def validation_records(config: MasterConfig) -> list[dict]:
    return [record for record in read_metrics(Path(config.output_dir) / "logs") if "val/kl_forward" in record]


def test_a_mixture_with_a_served_member_in_the_trainer_workers_and_beside_a_pool_gives_the_loss_of_one_process(
    ray_cluster, tmp_path
):
    port = free_port()
    server = BackgroundProcess(
        "server",
        [sys.executable, "-m", "opd", "serve-teacher", "--model", "tiny:student-b", "--port", str(port)],
        tmp_path,
        {**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    try:
        server.wait_until(lambda: "serving" in server.stdout, "the server to start")
        # The member "sub" is served (opd serve-teacher, fp32 hidden states on the wire) in every run.
        served = (
            "teachers.members=[{name: add, model_path: 'tiny:teacher', weight: 0.7}, {name: sub, backend: remote, "
            f"model_path: 'tiny:student-b', weight: 0.3, remote: {{url: 'http://127.0.0.1:{port}', protocol: opd, "
            "hidden_dtype: float32}}]"
        )
        expected = run(teachers(tmp_path, "process", "mixture", served))
        # "add" whole in each trainer worker (split placement), mixed there with its client's answer from "sub".
        whole = ["cluster.placement=split", "cluster.teacher.sharded=false"]
        colocated = run(teachers(tmp_path, "colocated", "mixture", *COLOCATED, *whole, served))
        # "add" in a pool: both members send hidden states, bound to their heads and mixed in the trainer workers.
        apart = run(teachers(tmp_path, "apart", "mixture", *POOLS, served))
    finally:
        server.stop_if_running()
    assert_same_run(colocated, expected, ["train/kl_forward"])
    assert_same_run(apart, expected, ["train/kl_forward"])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def other_tokenizer_teacher(tmp_path_factory) -> Path:
    """The demo teacher's architecture with a tokenizer of its own (300 tokens, other merges)."""
    student = AutoTokenizer.from_pretrained(DEMO_TEACHER)
    texts = [
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a}+{b} carry 1, answer "
        f"{a + b}<|im_end|>\n"
        for a in range(100, 400, 3)
        for b in (7, 58)
    ]
    other = train_bpe_tokenizer(texts, vocab_size=300)
    assert other.get_vocab() != student.get_vocab()
    directory = tmp_path_factory.mktemp("other_tokenizer") / "teacher"
    build_model_for_tokenizer("teacher", other).save_pretrained(directory)
    other.save_pretrained(directory)
    return directory


def cross_tokenizer(tmp_path: Path, teacher: Path, name: str, *overrides: str) -> MasterConfig:
    """Two steps of the demo's student with a teacher of another tokenizer (top-k over the shared strings)."""
    return load_config(
        MasterConfig,
        DEMO,
        [
            f"output_dir={tmp_path / name}",
            "data.val_path=null",
            "validation.val_at_start=false",
            "validation.val_at_end=false",
            "logger.console=false",
            f"model.teacher_model_path={teacher}",
            "teacher.cross_tokenizer=true",
            "loss_fn.type=topk",
            "loss_fn.k=8",
            f"training.max_num_steps={STEPS}",
            "training.batch_size=4",
            "training.micro_batch_size=2",
            "training.save_freq=0",
            "training.warmup_steps=0",
            "distillation.generate_strategy.max_length=24",
            "data.max_train_examples=8",
            *overrides,
        ],
    )


def test_a_teacher_with_another_tokenizer_in_the_trainer_workers_matches_one_process(
    ray_cluster, tmp_path, other_tokenizer_teacher
):
    expected = run(cross_tokenizer(tmp_path, other_tokenizer_teacher, "process"))
    actual = run(cross_tokenizer(tmp_path, other_tokenizer_teacher, "colocated", *COLOCATED))
    assert_same_run(actual, expected, ["train/kl_forward"])
