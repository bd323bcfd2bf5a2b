"""The refit's wire format and transport choice, without Ray (the broadcast group itself runs
in ``tests/distributed/test_refit_transports.py``).

* a bucket packed into one flat buffer comes back bitwise, by its layout, for mixed
  dtypes and shapes (a scalar, an empty tensor); a buffer of the wrong size is refused;
* double buffering: bucket i+1 is gathered while bucket i is still being sent, a send is
  waited for only before its buffer is packed again, every bucket travels in one of the
  same two buffers (none allocated per bucket), and each arrives bitwise;
* ``cluster.rollout.refit_transport``: ``auto`` picks the object store on CPU workers,
  CUDA IPC colocated and the broadcast split on GPUs; CUDA IPC on CPU workers or split
  pools is a config error that names the key.
"""

from __future__ import annotations

import pytest
import torch

from opd.distributed.config import ClusterConfig
from opd.distributed.refit.wire import RefitBuffers, layout_bytes, layout_of, pack, send_double_buffered, unpack


def bucket() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=generator)),
        ("b", torch.randn(7, generator=generator).to(torch.bfloat16)),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("empty", torch.empty(0, 4)),
        ("ids", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
    ]


def test_a_packed_bucket_unpacks_bitwise_by_its_layout():
    entries = bucket()
    buffer = pack(entries)
    assert buffer.dtype == torch.uint8
    # 60 bytes, 14 from 64, 8 from 80, none at 96, 48 from 96: each start aligned to 16 bytes
    assert buffer.numel() == layout_bytes(layout_of(entries)) == 96 + 48
    unpacked = unpack(buffer, layout_of(entries))
    assert [name for name, _ in unpacked] == [name for name, _ in entries]
    for (_, actual), (_, expected) in zip(unpacked, entries, strict=True):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        assert torch.equal(actual, expected)


def test_a_buffer_of_another_size_is_refused():
    entries = bucket()
    with pytest.raises(ValueError, match="layout says"):
        unpack(pack(entries)[:-1], layout_of(entries))


def test_double_buffering_gathers_the_next_bucket_while_the_last_is_sent():
    buckets = [[(f"w{index}", torch.full((index + 1, 3), float(index)))] for index in range(5)]
    capacity = max(layout_bytes(layout_of(bucket)) for bucket in buckets)
    buffers = RefitBuffers(capacity, torch.device("cpu"))
    events: list[str] = []
    arrived: list[list[tuple[str, torch.Tensor]]] = []
    used: list[int] = []

    def gathered():
        for index, bucket in enumerate(buckets):
            events.append(f"gather {index}")
            yield bucket

    class Sending:
        def __init__(self, index: int, packed: torch.Tensor) -> None:
            self.index, self.packed = index, packed

        def wait(self) -> None:
            # What the receiver gets is read only now: a buffer packed again before this would corrupt it.
            arrived.append(
                [(name, tensor.clone()) for name, tensor in unpack(self.packed, layout_of(buckets[self.index]))]
            )
            events.append(f"wait {self.index}")

    def start_send(packed: torch.Tensor) -> Sending:
        index = len(used)
        used.append(packed.data_ptr())
        events.append(f"send {index}")
        return Sending(index, packed)

    sent = send_double_buffered(gathered(), buffers, start_send)
    assert events == [
        "gather 0", "send 0",
        "gather 1", "send 1",
        "gather 2", "wait 0", "send 2",  # bucket 2 reuses bucket 0's buffer: bucket 0 must be gone first
        "gather 3", "wait 1", "send 3",
        "gather 4", "wait 2", "send 4",
        "wait 3", "wait 4",
    ]  # fmt: skip
    assert used == [buffers.pointers()[index % 2] for index in range(5)]
    assert sent == sum(layout_bytes(layout_of(bucket)) for bucket in buckets)
    received = sorted(arrived, key=lambda bucket: bucket[0][0])
    for got, expected in zip(received, buckets, strict=True):
        assert got[0][0] == expected[0][0] and torch.equal(got[0][1], expected[0][1])


def test_a_bucket_larger_than_the_buffers_is_refused():
    buffers = RefitBuffers(64, torch.device("cpu"))
    with pytest.raises(ValueError, match="a bucket of 65 bytes, the buffers hold 64"):
        buffers.view(3, 65)


@pytest.mark.parametrize(
    ("gpus", "placement", "expected"),
    [
        (0, "colocated", "object_store"),
        (0, "split", "object_store"),
        (1, "colocated", "cuda_ipc"),
        (1, "split", "broadcast"),
    ],
)
def test_auto_picks_the_transport_the_devices_have(gpus, placement, expected):
    cluster = ClusterConfig(gpus_per_worker=gpus, placement=placement)
    assert cluster.resolved_refit_transport() == expected


def test_an_explicit_transport_is_kept():
    cluster = ClusterConfig.model_validate({"rollout": {"refit_transport": "broadcast"}})
    assert cluster.resolved_refit_transport() == "broadcast"


@pytest.mark.parametrize(
    ("settings", "match"),
    [({}, "needs GPUs"), ({"gpus_per_worker": 1, "placement": "split"}, "needs cluster.placement = colocated")],
)
def test_cuda_ipc_where_it_cannot_work_is_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        ClusterConfig.model_validate({**settings, "rollout": {"refit_transport": "cuda_ipc"}})


def test_buckets_close_only_between_decoder_layers_and_modules():
    """A vLLM engine reloads each call's layers whole: a bucket holding only q_proj of a fused q/k/v layer would
    leave k and v uninitialised (scripts/gpu_checks/vllm_refit.py found it on the broadcast refit)."""
    from opd.distributed.refit.buckets import in_buckets, module_group
    from opd.models.tiny import build_tiny_model

    named = list(build_tiny_model("student").state_dict().items())
    layer_bytes = sum(t.numel() * t.element_size() for name, t in named if name.startswith("model.layers.0."))
    for bucket_bytes in (1, 4096, layer_bytes // 3, layer_bytes, 2 * layer_bytes + 1):
        buckets = list(in_buckets(named, bucket_bytes))
        assert [entry for bucket in buckets for entry in bucket] == named  # every weight once, in order
        groups = [{module_group(name) for name, _ in bucket} for bucket in buckets]
        for earlier, later in zip(groups, groups[1:]):
            assert not earlier & later, f"bucket size {bucket_bytes}: a module split across buckets"
        for bucket in buckets[:-1]:  # each closed bucket reached the size (a last one may be smaller)
            assert sum(t.numel() * t.element_size() for _, t in bucket) >= bucket_bytes
    assert module_group("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert module_group("model.norm.weight") == "model.norm" and module_group("lm_head.weight") == "lm_head"
