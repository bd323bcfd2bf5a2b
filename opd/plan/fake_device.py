"""The fakes a dry run (:mod:`opd.plan.dry_run`) runs the trainer on, beside fake tensors.

The stand-in accelerator ``fakegpu`` exists because a CPU-only build cannot run fake CUDA tensors through every
operator (``copy_`` asks for a CUDA device guard), while any non-``cpu`` device keeps host and device tensors apart,
as the audit needs. It stays registered for the rest of the process, so a dry run needs a process of its own.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from opd.distributed.fsdp import device_mesh

ACCELERATOR = "fakegpu"
"""The stand-in compute device type: PyTorch's ``privateuseone`` under this name (see :mod:`opd.plan.dry_run`)."""
_OPD_ROOT = Path(__file__).resolve().parents[1]
_DRY_RUN_FILES = frozenset(
    _OPD_ROOT / "plan" / f"{name}.py" for name in ("dry_run", "fake_device", "fake_step", "rank_trace", "replica_trace")
)
"""The dry run's own modules: the caller the audit names is looked for outside them."""
_aten = torch.ops.aten
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


class DeviceMismatchError(RuntimeError):
    """A collective received a tensor that is not on the compute device (a bug in opd, found by the dry run)."""


@contextlib.contextmanager
def attributes_replaced(owner: Any, **stand_ins: Any) -> Iterator[None]:
    """``owner``'s attributes named in ``stand_ins`` replaced by them for the block; the originals put back after."""
    originals = {name: getattr(owner, name) for name in stand_ins}
    for name, stand_in in stand_ins.items():
        setattr(owner, name, stand_in)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(owner, name, original)


# ---------------------------------------------------------------------------- the stand-in accelerator


def _nothing(*args: Any, **kwargs: Any) -> None:
    """A call of the stand-in accelerator that has nothing to do: any arguments, no effect."""


class _NoStream:
    """A stream and event of the stand-in accelerator: there is nothing to order, every call is a no-op."""

    __init__ = wait_stream = wait_event = record = wait = synchronize = __exit__ = _nothing

    def record_event(self, event: Any = None) -> _NoStream:
        return _NoStream()

    def query(self) -> bool:
        return True

    def __enter__(self) -> _NoStream:
        return self


class _AcceleratorModule:
    """``torch.privateuseone``: the device-module API FSDP2 calls (one device, streams that do nothing)."""

    Stream = _NoStream
    Event = _NoStream

    def __init__(self) -> None:
        self._stream = _NoStream()

    def is_initialized(self) -> bool:
        return True

    is_available = is_initialized

    def _is_in_bad_fork(self) -> bool:
        return False

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    set_device = manual_seed_all = synchronize = _nothing

    def current_stream(self, device: Any = None) -> _NoStream:
        return self._stream

    # Activation checkpointing saves and restores the RNG state around recomputation: there is none.
    set_rng_state = manual_seed = _nothing

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def device(self, device: Any) -> contextlib.AbstractContextManager[Any]:
        """No device to select (and, as ``stream``, no stream to enter)."""
        return contextlib.nullcontext()

    stream = device

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        """What ``torch.autocast`` asks of a device (checkpointing's recomputation enters it)."""
        return [torch.float16, torch.bfloat16]


@functools.cache
def compute_device() -> torch.device:
    """The dry run's compute device (the stand-in accelerator's device 0), registered once (PyTorch allows one)."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=ACCELERATOR, backend_module=_AcceleratorModule())
    return torch.device(ACCELERATOR, 0)


# ---------------------------------------------------------------------------- fake values and the audit


class DataDependentStandIns(TorchDispatchMode):
    """Answers what a fake tensor cannot: values read back and data-dependent selections.

    A read gives 1 (``True`` for a flag); a boolean selection over ``[..., L]`` picks ``response_tokens`` positions
    per row (the loss positions planned for), or all of a shorter row.
    """

    def __init__(self, response_tokens: int) -> None:
        super().__init__()
        self.response_tokens = response_tokens

    def _selected(self, mask: torch.Tensor) -> int:
        if mask.dim() == 0:
            return 1
        rows = mask.numel() // max(mask.shape[-1], 1)
        return rows * min(mask.shape[-1], self.response_tokens)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:
            tensor = args[0]
            return True if tensor.dtype == torch.bool else 1.0 if tensor.is_floating_point() else 1
        if func is _aten.nonzero.default:
            mask = args[0]
            return torch.zeros(self._selected(mask), mask.dim(), dtype=torch.long, device=mask.device)
        if func is _aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            source, indices = args
            positions: list[torch.Tensor | None] = []
            for index in indices:
                if index is not None and index.dtype == torch.bool:
                    count = self._selected(index)
                    positions.extend(torch.zeros(count, dtype=torch.long, device=index.device) for _ in index.shape)
                else:
                    positions.append(index)
            return func(source, positions)
        return func(*args, **kwargs)


def gpu_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with the kernel a GPU picks: flash, or memory-efficient with a mask or in fp32.

    On an unknown device PyTorch would use the math kernel, which holds ``[B, H, L, L]`` weights; the GPU kernels keep
    the output and one log-sum-exp per position. Grouped key/value heads are repeated first.
    """
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    if attn_mask is None and query.dtype in (torch.bfloat16, torch.float16):
        return _aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    return _aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
    )[0]


def _caller() -> str:
    """Where a collective was called from: the innermost frame outside torch, and the innermost of opd's own."""
    torch_root = Path(torch.__file__).resolve().parent
    outside_torch = opd_frame = None
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path in _DRY_RUN_FILES or path.is_relative_to(torch_root):
            continue
        shown = path.relative_to(_OPD_ROOT.parent) if path.is_relative_to(_OPD_ROOT) else path
        where = f"{shown}:{frame.lineno} in {frame.name}"
        outside_torch = outside_torch or where
        if path.is_relative_to(_OPD_ROOT):
            opd_frame = where
            break
    if outside_torch == opd_frame:
        return outside_torch or "an unknown place"
    return f"{outside_torch} (within {opd_frame})" if opd_frame else str(outside_torch)


class DeviceAudit(TorchDispatchMode):
    """Fails any collective that is handed a tensor off the compute device (see :mod:`opd.plan.dry_run`)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.collectives = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self.collectives += 1
            tensors, _ = tree_flatten((args, kwargs))
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor) and tensor.device.type != self.device.type:
                    raise DeviceMismatchError(
                        f"device audit: the collective {func} received a {tensor.dtype} tensor of shape "
                        f"{tuple(tensor.shape)} on '{tensor.device}', but the trainer computes on the accelerator "
                        f"('{self.device}' in this dry run, a GPU on a cluster); an NCCL process group has no CPU "
                        f"backend, so this fails the first step on GPUs. Called from {_caller()}"
                    )
        return func(*args, **kwargs)


def _symmetric_all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """``all_gather_object`` over a fake group (which moves no bytes): every rank holds what this rank holds."""
    object_list[:] = [obj] * len(object_list)


def tensors_from_data_via_host() -> contextlib.AbstractContextManager[None]:
    """``torch.tensor(data, device=...)`` made on the host, then moved to the device under the fake mode.

    PyTorch builds tensors from data below the dispatcher's modes, allocating really on a device fakegpu lacks.
    """

    def via_host(original: Any) -> Any:
        @functools.wraps(original)
        def make(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            tensor = original(data, *args, **kwargs)
            return tensor if device is None else tensor.to(device)

        return make

    return attributes_replaced(torch, tensor=via_host(torch.tensor), as_tensor=via_host(torch.as_tensor))


def sharding_metadata_apart() -> contextlib.AbstractContextManager[None]:
    """DTensor works out an operator's output metadata in a fake mode of its own, as it does on a GPU.

    Otherwise it would use the tracked mode, which would count a whole unsharded tensor for every sharded operation.
    """
    from torch.distributed.tensor import _sharding_prop

    return attributes_replaced(_sharding_prop, detect_fake_mode=lambda *args: None)


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int, shard_group_size: int | None = None) -> Iterator[Any]:
    """The fake process group as rank ``rank`` of ``world_size``; yields the trainer's mesh (``device_mesh``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = compute_device()
    if dist.is_initialized():
        raise RuntimeError("the dry run needs a process of its own: a process group is already initialised")
    dist.init_process_group(f"cpu:fake,{device.type}:fake", store=FakeStore(), rank=rank, world_size=world_size)
    # Silences torch's warning, on destroy, about a group without a default backend.
    dist.distributed_c10d._get_default_group()._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    slicing = DeviceMesh.__getitem__

    def sliced_with_real_tensors(mesh: DeviceMesh, names: Any) -> DeviceMesh:
        # A sub-mesh finds this rank's coordinates from real data, which the fake modes would stand in for.
        with _disable_current_modes():
            return slicing(mesh, names)

    try:
        with (
            attributes_replaced(dist, all_gather_object=_symmetric_all_gather_object),
            attributes_replaced(DeviceMesh, __getitem__=sliced_with_real_tensors),
        ):
            yield device_mesh(device.type, world_size, shard_group_size)
    finally:
        dist.destroy_process_group()
