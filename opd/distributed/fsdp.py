"""FSDP2 for a Hugging Face causal LM: the process group, the sharding and whole tensors back.

:func:`shard_model` shards every decoder layer, then the root (embedding, final norm, head), and:

* **sums** gradients over ranks (also on the HSDP mesh): each rank's loss is already normalised by the global
  batch's tokens, so the sum is the one-process gradient;
* with a 16-bit ``model.dtype`` keeps fp32 master weights, moments and reductions, so tiny updates are not
  rounded away;
* adds ``opd_hidden_states(input_ids, attention_mask, position_ids)``, run under FSDP's hooks, so the fused loss
  gets final hidden states without ``[tokens × vocab]`` logits (the root stays gathered for the head).
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Replicate, Shard

from opd.distributed.refit.buckets import in_buckets
from opd.models.lm_head import final_hidden_states
from opd.utils.devices import is_cuda

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

HIDDEN_STATES_METHOD = "opd_hidden_states"
"""The method :func:`shard_model` adds: the decoder's final hidden states, run under FSDP's hooks."""


DEVICE_TYPE_OF_BACKEND = {"nccl": "cuda", "gloo": "cpu"}
"""The devices a process group's ranks compute on, by its torch.distributed backend."""


def rank_device(backend: str) -> torch.device:
    """Where this rank of a ``backend`` process group computes: its current GPU with NCCL, the CPU with gloo."""
    device_type = DEVICE_TYPE_OF_BACKEND[backend]
    return torch.device(device_type, torch.cuda.current_device()) if is_cuda(device_type) else torch.device("cpu")


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str,
    timeout_s: float,
    shard_group_size: int | None = None,
) -> DeviceMesh:
    """Joins a process group of ``world_size`` ranks and returns the device mesh to shard over.

    ``shard_group_size`` None (or the world size) gives a 1-D FSDP2 mesh. A smaller ``k`` gives the 2-D HSDP mesh
    ``("replicate", "shard")`` of groups of ``k`` consecutive ranks: all-gathers stay inside a group (a node) and
    only gradients cross groups. ``timeout_s`` bounds every collective, so a rank whose peer died fails.

    Raises:
        ValueError: ``shard_group_size`` does not divide ``world_size``.
    """
    if shard_group_size is not None and world_size % shard_group_size:
        raise ValueError(f"shard_group_size {shard_group_size} does not divide the world size {world_size}")
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    device_type = DEVICE_TYPE_OF_BACKEND[backend]
    if is_cuda(device_type):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return device_mesh(device_type, world_size, shard_group_size)


def device_mesh(device_type: str, world_size: int, shard_group_size: int | None = None) -> DeviceMesh:
    """The 1-D FSDP mesh, or the 2-D ``("replicate", "shard")`` HSDP mesh (see :func:`init_process_group`)."""
    if shard_group_size is None or shard_group_size == world_size:
        return init_device_mesh(device_type, (world_size,))
    return init_device_mesh(
        device_type, (world_size // shard_group_size, shard_group_size), mesh_dim_names=("replicate", "shard")
    )


def checkpoint_activations(layer: torch.nn.Module) -> None:
    """Makes ``layer`` keep only its inputs for the backward and run its forward again there.

    ``forward`` is wrapped in place (non-reentrant), so the state dict keeps its names. Applied before
    ``fully_shard``, the recomputation runs where the weights are already gathered. Without gradients it runs once.
    """
    forward = layer.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed


def shard_model(
    model: PreTrainedModel,
    mesh: DeviceMesh,
    compute_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
) -> PreTrainedModel:
    """Shards ``model`` in place with FSDP2 (see the module docstring) and returns it.

    Args:
        model: loaded in the dtype its shards keep (fp32 masters for a trained student).
        compute_dtype: gather weights in this dtype and reduce gradients in fp32; None: the weights' dtype.
        reshard_after_forward: False keeps gathered layers until the backward, saving an all-gather per layer.
        activation_checkpointing: see :func:`checkpoint_activations`.
    """
    reduce_dtype = torch.float32 if compute_dtype is not None else None  # None: the weights' own dtype
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    decoder = model.get_decoder()
    for layer in decoder.layers:
        if activation_checkpointing:
            checkpoint_activations(layer)
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root keeps its weights to the backward anyway
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, as plain SUM collectives: gloo has no pre-multiplied sum.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    setattr(model, HIDDEN_STATES_METHOD, types.MethodType(final_hidden_states, model))
    register_fsdp_forward_method(model, HIDDEN_STATES_METHOD)
    return model


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a sharded DTensor (a collective: every rank must call it), else ``tensor``."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if full_tensor is not None else tensor


def whole_state_dict_buckets(
    model: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The model's state dict, whole, in buckets of about ``bucket_bytes``, one all-gather per bucket.

    With ``dtype``, floating-point tensors are cast *before* the gather (halving a bf16 refit's bytes) and
    ``bucket_bytes`` counts bytes in ``dtype``. Entries keep state-dict order; tied tensors come once, under
    their first name, as a Hugging Face directory stores them. At most one bucket is whole in memory; a tensor
    larger than ``bucket_bytes`` is a bucket of its own. Every rank must iterate to the end.
    """
    yield from whole_buckets(_unique_state_dict(model), bucket_bytes, dtype)


def whole_buckets(
    entries: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``(name, tensor)`` entries of a sharded model, whole, as :func:`whole_state_dict_buckets` gathers them.

    Every rank must pass the same names in the same order and iterate to the end.
    """
    if dtype is not None:
        # Lazily: only the shards of the bucket being filled exist in both dtypes at once.
        entries = ((name, tensor.to(dtype) if tensor.is_floating_point() else tensor) for name, tensor in entries)
    for bucket in in_buckets(entries, bucket_bytes):
        yield _gather_bucket(bucket)


def _unique_state_dict(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict's entries, a tensor held under two names (tied weights) only under its first."""
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # tied names share its storage
        if local.numel() and local.data_ptr() in seen:
            continue
        seen.add(local.data_ptr())
        yield name, tensor.detach()


def _row_shard_dim(tensor: DTensor) -> int | None:
    """The mesh dimension over which ``tensor``'s rows are split (``Shard(0)``, other dims replicated), else None."""
    if tensor.dim() == 0:
        return None
    placements = tuple(tensor.placements)
    sharded = [dim for dim, placement in enumerate(placements) if placement != Replicate()]
    if len(sharded) != 1 or placements[sharded[0]] != Shard(0):
        return None
    return sharded[0]


def _gather_bucket(entries: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Whole tensors of ``entries``: the row-sharded ones gathered together in one flat all-gather.

    ``fully_shard`` splits rows as ``torch.chunk`` does (``ceil(n / world)`` per rank, the last fewer), so each rank
    pads to that count and the excess rows are cut after the gather. On HSDP the gather stays within each shard
    group. Other tensors are made whole on their own.
    """
    by_group: dict[tuple[int, int], list[tuple[str, DTensor, int]]] = {}
    for name, tensor in entries:  # one mesh in practice (one model); keyed so that any mix stays right
        if isinstance(tensor, DTensor) and (dim := _row_shard_dim(tensor)) is not None:
            by_group.setdefault((id(tensor.device_mesh), dim), []).append((name, tensor, dim))
    gathered = {name: tensor for members in by_group.values() for name, tensor in _gather_rows(members).items()}
    return [(name, gathered[name] if name in gathered else whole(tensor)) for name, tensor in entries]


def _gather_rows(members: list[tuple[str, DTensor, int]]) -> dict[str, torch.Tensor]:
    """Whole tensors of row-sharded ``members`` that share one mesh dimension: one all-gather over it."""
    mesh, dim = members[0][1].device_mesh, members[0][2]
    world, group = mesh.size(dim), mesh.get_group(dim)
    pieces, layout = [], []
    for name, tensor, _ in members:
        rows = -(-tensor.shape[0] // world)
        local = tensor.to_local()
        padded = local.new_zeros((rows, *tensor.shape[1:]))
        padded[: local.shape[0]] = local
        pieces.append(padded.reshape(-1).view(torch.uint8))
        layout.append((name, tensor, rows, pieces[-1].numel()))
    flat = torch.cat(pieces)
    out = flat.new_empty(world * flat.numel())  # the concatenated form: gloo takes no other
    _all_gather_flat(out, flat, group)
    out = out.view(world, flat.numel())
    gathered: dict[str, torch.Tensor] = {}
    offset = 0
    for name, tensor, rows, width in layout:
        # Copies: a view would carry the whole buffer with it when pickled (into Ray's object store).
        block = out[:, offset : offset + width].clone().view(tensor.dtype)
        block = block.reshape(world * rows, *tensor.shape[1:])
        gathered[name] = block if block.shape[0] == tensor.shape[0] else block[: tensor.shape[0]].clone()
        offset += width
    return gathered


def _all_gather_flat(out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Every rank's ``flat`` concatenated into ``out`` (``all_gather_single`` from torch 2.13, else the old name)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, flat, group=group)
