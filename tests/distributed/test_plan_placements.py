"""``opd plan`` plans a pooled or served teacher and a LoRA student, not only a colocated teacher.

Each figure is checked against the arithmetic of the tiny models' own parameters, counted here
from the real models (float32, as ``distillation_tiny.yaml`` loads them):

* a teacher apart (a pool, a served teacher) that answers the full-vocabulary loss leaves its
  output layer, and only that, on every trainer rank; with top-k it leaves nothing there;
* a pool replica's device holds the whole teacher, or its share when the replica is sharded,
  and sends the answer the loss asked for (hidden states, or top-k with the rest mass);
* a LoRA student's gradients and Adam moments are those of its adapters alone;
* an HSDP mesh (4 ranks, groups of 2) shards within a group: each rank holds what one of 2 ranks holds.

The plans run in one process of their own (a dry run registers a stand-in accelerator for
its process, :mod:`opd.plan.dry_run`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from opd_test_helpers import REPO_ROOT, json_from_a_process_of_its_own

from opd.models.tiny import build_tiny_model

SCRIPT = Path(__file__).with_name("plan_placements_script.py")
TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
FLOAT32 = 4
WORLD = 2
ROWS, PROMPT, RESPONSE = 8, 8, 8  # the micro-batch the script plans (tiny config, max lengths 8 + 8)


@pytest.fixture(scope="module")
def plans() -> dict:
    return json_from_a_process_of_its_own([str(SCRIPT), str(TINY)])


def _rank(plan: dict) -> dict:
    return plan["ranks"]["off"][0]


def _teacher() -> torch.nn.Module:
    return build_tiny_model("teacher")


def _head_bytes() -> int:
    head = _teacher().get_output_embeddings().weight
    return head.numel() * FLOAT32


def _teacher_bytes() -> int:
    return sum(parameter.numel() for parameter in _teacher().parameters()) * FLOAT32


def test_a_teacher_apart_leaves_its_output_layer_alone_on_the_trainer_for_the_full_vocabulary_loss(plans):
    for case in ("pool_full_vocab", "served_full_vocab"):
        plan = plans[case]
        assert plan["teacher_in_trainer"] == "its output layer", case
        assert _rank(plan)["teacher_parameters"] == _head_bytes(), case
    colocated = _rank(plans["colocated"])["teacher_parameters"]
    assert _head_bytes() < colocated  # the head alone is far less than a shard of the whole teacher here


def test_a_teacher_apart_answering_top_k_leaves_nothing_on_the_trainer(plans):
    for case in ("pool_topk", "served_topk"):
        assert plans[case]["teacher_in_trainer"] == "none", case
        assert _rank(plans[case])["teacher_parameters"] == 0, case
    # The trainer's peak falls by at least what the head took.
    assert _rank(plans["pool_full_vocab"])["peak"] - _rank(plans["pool_topk"])["peak"] >= _head_bytes()


def test_a_pool_replica_holds_its_share_of_the_teacher_and_sends_the_requested_answer(plans):
    whole, sharded = plans["pool_topk"]["teacher_replica"], plans["pool_full_vocab"]["teacher_replica"]
    assert whole["weights"] == _teacher_bytes()
    # Sharded over 2 devices: half, and at most one padded row per parameter more.
    assert _teacher_bytes() / 2 <= sharded["weights"] <= _teacher_bytes() / 2 + 64 * 1024
    hidden = _teacher().config.hidden_size
    assert sharded["answer"] == ROWS * (PROMPT + RESPONSE) * hidden * FLOAT32  # final hidden states
    k = 64  # the top-k loss's default loss_fn.k
    positions = ROWS * (PROMPT + RESPONSE)
    assert whole["answer"] == positions * k * (FLOAT32 + 8) + positions * FLOAT32  # log-probs, ids, rest
    for replica in (whole, sharded):
        assert replica["peak"] >= replica["weights"] + replica["answer"]
    assert plans["served_topk"]["teacher_replica"] is None and plans["colocated"]["teacher_replica"] is None


def test_a_lora_students_gradients_and_moments_are_its_adapters_alone(plans):
    full, lora = _rank(plans["colocated"]), _rank(plans["lora"])
    assert plans["lora"]["lora"] and not plans["colocated"]["lora"]
    adapters = lora["student_parameters"] - full["student_parameters"]  # the adapters join the base weights
    assert 0 < lora["student_gradients"] <= adapters + 64 * 1024
    assert lora["student_gradients"] < full["student_gradients"] / 4
    # Adam: two moments per trained weight (and a step counter per tensor).
    assert 2 * lora["student_gradients"] <= lora["optimizer_state"] < 2 * lora["student_gradients"] + 4096
    assert lora["peak"] < full["peak"]


def test_an_hsdp_rank_holds_the_shard_of_its_group_not_of_the_world(plans):
    hsdp, two = plans["hsdp"], plans["colocated"]
    assert hsdp["world_size"] == 4 and hsdp["shard_ranks"] == 2
    for key in ("student_parameters", "optimizer_state", "teacher_parameters"):
        assert _rank(hsdp)[key] == _rank(two)[key], key
