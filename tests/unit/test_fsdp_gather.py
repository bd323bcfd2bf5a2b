"""Whole weights out of FSDP2 shards, bucket by bucket, against the unsharded model.

:func:`opd.distributed.fsdp.whole_state_dict_buckets` (the refit's and the final
model's gather) sends each bucket's shards as one flat byte buffer per rank and cuts the
padding off afterwards. It must give bitwise what the unsharded model holds, under the
same names and in the same order, on every rank, for tensors
whose rows do not divide by the world size, ranks that hold no rows at all, mixed dtypes
in one bucket, tied weights, and any bucket size. With a dtype (a refit casts to the
engine's bf16 before the gather) it must give the unsharded model cast to it, bucketed
by the bytes in that dtype, in the buckets the refit's layouts announce
(:meth:`opd.distributed.refit.sender.RefitSender.refit_layouts`).

The ranks are real processes in a real gloo process group (three of them, so that
uneven splits and empty shards occur), spawned with ``torch.multiprocessing``; no Ray.
"""

from __future__ import annotations

import itertools

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from opd.distributed import fsdp
from opd.distributed.fsdp import shard_model, whole_state_dict_buckets
from opd.distributed.refit.buckets import module_group
from opd.distributed.refit.sender import RefitSender
from opd.distributed.refit.wire import layout_of
from opd.models.tiny import build_tiny_model

WORLD = 3
BUCKET_SIZES = [1, 700, 40_000, 10**9]  # one tensor per bucket ... everything in one
CAST_DTYPE = torch.bfloat16
CAST_SUFFIX = "_to_bf16"
LABELS = ["odd_shapes", "tiny_tied", f"odd_shapes{CAST_SUFFIX}", f"tiny_tied{CAST_SUFFIX}"]


class OddShapes(torch.nn.Module):
    """Parameters of 1, 2, 7 and 301 rows (none divides by 3; the first two leave ranks empty), two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.scalar_row = torch.nn.Parameter(torch.randn(1, generator=generator))
        self.two_rows = torch.nn.Parameter(torch.randn(2, 5, generator=generator))
        self.seven_rows = torch.nn.Parameter(torch.randn(7, 3, generator=generator).to(torch.bfloat16))
        self.many_rows = torch.nn.Parameter(torch.randn(301, 4, generator=generator))
        self.cube = torch.nn.Parameter(torch.randn(4, 2, 3, generator=generator).to(torch.float64))


def _check_rank(rank: int, init_file: str, result_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    models = {"odd_shapes": fully_shard(OddShapes(), mesh=mesh)}
    tied = build_tiny_model("student")
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    models["tiny_tied"] = shard_model(tied, mesh)
    # What each bucket's gather is handed: a refit's cast must come before it, not after.
    handed: list[torch.dtype] = []
    gather_bucket = fsdp._gather_bucket

    def recording_gather(entries):
        handed.extend(tensor.dtype for _, tensor in entries)
        return gather_bucket(entries)

    fsdp._gather_bucket = recording_gather
    results = {}
    for label, model, dtype in [(label, model, None) for label, model in models.items()] + [
        (f"{label}{CAST_SUFFIX}", model, CAST_DTYPE) for label, model in models.items()
    ]:
        for bucket_bytes in BUCKET_SIZES:
            handed.clear()
            buckets = list(whole_state_dict_buckets(model, bucket_bytes, dtype))
            sender = RefitSender()
            sender.model = model
            announced = sender.refit_layouts(bucket_bytes, dtype) if dtype is not None else None
            results[(label, bucket_bytes)] = {
                "layouts_match": announced == [layout_of(bucket) for bucket in buckets],
                "handed_dtypes": set(handed),
                "buckets": [[name for name, _ in bucket] for bucket in buckets],
                "flat": [(name, tensor.clone()) for bucket in buckets for name, tensor in bucket],
                "owns_storage": [
                    tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
                    for bucket in buckets
                    for _, tensor in bucket
                ],
            }
    torch.save(results, Path(result_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    """Every rank's gathered state dicts, for each model and bucket size."""
    directory = tmp_path_factory.mktemp("fsdp_gather")
    mp.spawn(_check_rank, args=(str(directory / "init"), str(directory)), nprocs=WORLD, join=True)
    return [torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


def reference_state(label: str) -> list[tuple[str, torch.Tensor]]:
    """The unsharded model's entries, a tied tensor under its first name only (cast for a ``_to_bf16`` label)."""
    if label.endswith(CAST_SUFFIX):
        return [(name, tensor.to(CAST_DTYPE)) for name, tensor in reference_state(label.removesuffix(CAST_SUFFIX))]
    if label == "odd_shapes":
        return list(OddShapes().state_dict().items())
    model = build_tiny_model("student")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    return [(name, tensor) for name, tensor in model.state_dict().items() if name != "lm_head.weight"]


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("bucket_bytes", BUCKET_SIZES)
def test_every_rank_gets_the_unsharded_weights_bitwise(gathered, label, bucket_bytes):
    expected = reference_state(label)
    for rank, results in enumerate(gathered):
        actual = results[(label, bucket_bytes)]["flat"]
        assert [name for name, _ in actual] == [name for name, _ in expected], f"rank {rank}"
        for (name, tensor), (_, reference) in zip(actual, expected, strict=True):
            assert tensor.dtype == reference.dtype and tensor.shape == reference.shape, (rank, name)
            assert torch.equal(tensor, reference), (rank, name)


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("bucket_bytes", BUCKET_SIZES)
def test_every_gathered_tensor_owns_its_storage(gathered, label, bucket_bytes):
    """A view into the bucket's buffer would be pickled with the whole buffer (into Ray's object store)."""
    for rank, results in enumerate(gathered):
        assert all(results[(label, bucket_bytes)]["owns_storage"]), f"rank {rank}"


@pytest.mark.parametrize("label", LABELS)
def test_buckets_close_where_the_module_that_fills_them_ends(gathered, label):
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in reference_state(label)}
    for bucket_bytes in BUCKET_SIZES:
        buckets = gathered[0][(label, bucket_bytes)]["buckets"]
        for index, names in enumerate(buckets):
            assert names, "an empty bucket"
            cumulative = list(itertools.accumulate(sizes[name] for name in names))
            full_at = next((at for at, filled in enumerate(cumulative) if filled >= bucket_bytes), len(names) - 1)
            finishing = {module_group(name) for name in names[full_at:]}
            assert finishing == {module_group(names[full_at])}, "a bucket went on past the module that filled it"
            if index < len(buckets) - 1:
                assert cumulative[-1] >= bucket_bytes, "a bucket closed before it was full"
    assert len(gathered[0][(label, 1)]["buckets"]) == len({module_group(name) for name in sizes})
    assert len(gathered[0][(label, 10**9)]["buckets"]) == 1


@pytest.mark.parametrize("label", [label for label in LABELS if label.endswith(CAST_SUFFIX)])
def test_the_refit_layouts_announce_the_buckets_the_gather_sends(gathered, label):
    """Broadcast receivers allocate each bucket from its layout before the gather has run."""
    for bucket_bytes in BUCKET_SIZES:
        assert gathered[0][(label, bucket_bytes)]["layouts_match"], bucket_bytes


@pytest.mark.parametrize("label", [label for label in LABELS if label.endswith(CAST_SUFFIX)])
def test_the_shards_are_cast_before_the_gather(gathered, label):
    """The collective moves bf16 shards: half the bytes of fp32 (casting the whole tensors after would not)."""
    for bucket_bytes in BUCKET_SIZES:
        assert gathered[0][(label, bucket_bytes)]["handed_dtypes"] == {CAST_DTYPE}, bucket_bytes
