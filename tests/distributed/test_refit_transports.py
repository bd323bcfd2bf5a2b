"""Refit transports on a real local Ray cluster: 2 FSDP2 trainer workers, 2 HF rollout workers, in bf16.

``model.dtype: bfloat16`` on CPU: the trainer keeps fp32 master weights and the rollout
engines hold bf16, so every refit must cast before it gathers. After a training step has
moved the trainer's weights away from what the engines hold:

* the object store (the CPU default) leaves in every rollout worker the trainer's weights
  cast to bf16, bitwise, and reports ``refit/bytes`` = the student's parameters at 2 bytes
  each (counted from a freshly built student, a tied head once) and
  ``refit/bytes_delivered`` = that × 2 workers;
* a broadcast over a gloo group of trainer rank 0 and the rollout workers (small buckets,
  so several go out) leaves bitwise what an object-store refit of the same weights leaves,
  with the same byte counts; it is double-buffered at both ends, and a second broadcast
  refit, after another step, travels in the same buffers (nothing allocated per refit) and
  again leaves the trainer's weights bitwise.

One Ray cluster serves the module; every worker runs one thread.
"""

from __future__ import annotations

import pytest
import torch
from opd_test_helpers import REPO_ROOT, short_run_overrides

from opd.data.batches import build_fixed_data_batch
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distributed.refit.transport import BroadcastTransport, ObjectStoreTransport
from opd.losses.nll import NLLLossFn
from opd.models.tiny import build_tiny_model
from opd.utils.config import load_config

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
WORKERS = 2
SMALL_BUCKET_BYTES = 16 * 1024  # several buckets for the tiny student (about 180 kB in bf16)


@pytest.fixture(scope="module")
def components(ray_cluster, tmp_path_factory):
    config = load_config(
        MasterConfig,
        TINY,
        [
            *short_run_overrides(tmp_path_factory.mktemp("refit"), "refit"),
            "model.dtype=bfloat16",
            f"cluster.trainer.workers={WORKERS}",
            f"cluster.rollout.workers={WORKERS}",
            "training.warmup_steps=0",
            "training.batch_size=4",
        ],
    )
    parts = setup(config)
    yield parts
    parts.close()


def train_one_step(parts) -> None:
    examples = next(iter(parts.dataloader))
    parts.student_policy.train(build_fixed_data_batch(examples, parts.tokenizer.pad_token_id, True), NLLLossFn())


def trainer_weights_in_bf16(parts) -> dict[str, torch.Tensor]:
    """The trainer's whole fp32 master weights (gathered on their own), cast to the engines' bf16."""
    return {name: tensor.to(torch.bfloat16) for name, tensor in parts.student_policy.weights_for_refit()}


def rollout_weights(parts) -> list[dict[str, torch.Tensor]]:
    return parts.student_generation.workers.run_all("weights")


def assert_holds(held: list[dict[str, torch.Tensor]], expected: dict[str, torch.Tensor]) -> None:
    for rank, weights in enumerate(held):
        for name, tensor in expected.items():
            assert weights[name].dtype == torch.bfloat16, (rank, name)
            assert torch.equal(weights[name], tensor), f"rollout worker {rank}: {name}"


def student_bytes_in_bf16() -> int:
    return sum(parameter.numel() for parameter in build_tiny_model("student").parameters()) * 2


def test_object_store_refit_sends_bf16_weights_and_counts_their_bytes(components):
    generation = components.student_generation
    assert isinstance(generation.transport, ObjectStoreTransport)  # auto on CPU workers
    train_one_step(components)
    expected = trainer_weights_in_bf16(components)
    stale = rollout_weights(components)
    assert any(not torch.equal(stale[0][name], tensor) for name, tensor in expected.items())  # a refit is due
    metrics = generation.refit(components.student_policy)
    assert_holds(rollout_weights(components), expected)
    assert metrics == {
        "refit/bytes": float(student_bytes_in_bf16()),
        "refit/bytes_delivered": float(WORKERS * student_bytes_in_bf16()),
    }


def test_a_gloo_broadcast_refit_leaves_what_the_object_store_leaves(components):
    generation = components.student_generation
    trainer = components.student_policy.workers
    train_one_step(components)
    expected = trainer_weights_in_bf16(components)
    stale = rollout_weights(components)
    assert any(not torch.equal(stale[0][name], tensor) for name, tensor in expected.items())  # a refit is due
    broadcast = BroadcastTransport(generation.workers, SMALL_BUCKET_BYTES, torch.bfloat16, timeout_s=120)
    report = broadcast.send(trainer)
    assert broadcast.layouts is not None and len(broadcast.layouts) > 1  # several buckets went out
    after_broadcast = rollout_weights(components)
    assert_holds(after_broadcast, expected)
    assert report.metrics() == {
        "refit/bytes": float(student_bytes_in_bf16()),
        "refit/bytes_delivered": float(WORKERS * student_bytes_in_bf16()),
    }
    # The object store, over the same weights, leaves exactly the same in every worker.
    generation.refit(components.student_policy)
    for by_broadcast, by_object_store in zip(after_broadcast, rollout_weights(components), strict=True):
        assert by_broadcast.keys() == by_object_store.keys()
        for name, tensor in by_object_store.items():
            assert torch.equal(by_broadcast[name], tensor), name
    # A second broadcast refit after another step: the same buffers at both ends, the new weights bitwise.
    addresses = trainer.run_rank(0, "refit_buffer_addresses"), generation.workers.run_all("refit_buffer_addresses")
    assert addresses[0] is not None and all(address is not None for address in addresses[1])
    train_one_step(components)
    expected = trainer_weights_in_bf16(components)
    broadcast.send(trainer)
    assert_holds(rollout_weights(components), expected)
    assert (trainer.run_rank(0, "refit_buffer_addresses"), generation.workers.run_all("refit_buffer_addresses")) == (
        addresses
    )
