"""What both ends of a refit share: a bucket's layout, its flat buffer, a broadcast group, CUDA IPC handles.

Both ends agree on each bucket's :data:`BucketLayout` before the first refit; a bucket then travels as one flat
byte buffer (:func:`pack`, :func:`unpack`) with no metadata on the wire. :func:`open_broadcast_group` builds a
stateless group (own TCP store, bare backend) beside the trainer's, whose process group must not change.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from opd.utils.devices import is_cuda

BucketLayout = list[tuple[str, tuple[int, ...], torch.dtype]]
"""A bucket's tensors, in order: name, shape and dtype."""

IpcHandle = tuple[Any, ...]
"""What :func:`ipc_handle` returns: enough for another process on the same GPU to map a tensor."""


def layout_of(bucket: Sequence[tuple[str, torch.Tensor]]) -> BucketLayout:
    """The layout of a bucket of ``(name, tensor)`` pairs."""
    return [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in bucket]


ALIGNMENT = 16
"""Each tensor starts at a multiple of this many bytes in a packed buffer, so it can be viewed in its dtype."""


def _offsets(layout: BucketLayout) -> tuple[list[tuple[int, int]], int]:
    """Each tensor's ``(start, bytes)`` in the packed buffer, and the buffer's size."""
    spans, offset = [], 0
    for _, shape, dtype in layout:
        offset = -(-offset // ALIGNMENT) * ALIGNMENT
        width = math.prod(shape) * dtype.itemsize
        spans.append((offset, width))
        offset += width
    return spans, offset


def layout_bytes(layout: BucketLayout) -> int:
    """The bytes of a bucket's packed buffer (its tensors' bytes, and at most ``ALIGNMENT - 1`` between two)."""
    return _offsets(layout)[1]


def pack(bucket: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's tensors as one flat ``uint8`` buffer on their device, in order, each aligned: written into ``out``
    (a buffer of at least that size, whose first bytes are returned) or a new one."""
    spans, size = _offsets(layout_of(bucket))
    device = bucket[0][1].device if bucket else torch.device("cpu")
    buffer = torch.zeros(size, dtype=torch.uint8, device=device) if out is None else out[:size]
    for (_, tensor), (start, width) in zip(bucket, spans, strict=True):
        buffer[start : start + width] = tensor.contiguous().reshape(-1).view(torch.uint8)
    return buffer


class RefitBuffers:
    """Two flat byte buffers that one end of a refit keeps for its lifetime: bucket i travels in buffer i mod 2, so
    the next bucket fills one while the other is still being sent or loaded (double buffering), and no refit
    allocates. The gaps between aligned tensors are never read."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.buffers = (
            torch.empty(capacity, dtype=torch.uint8, device=device),
            torch.empty(capacity, dtype=torch.uint8, device=device),
        )

    def view(self, bucket: int, size: int) -> torch.Tensor:
        """The first ``size`` bytes of bucket ``bucket``'s buffer."""
        buffer = self.buffers[bucket % 2]
        if size > buffer.numel():
            raise ValueError(f"refit: a bucket of {size} bytes, the buffers hold {buffer.numel()}")
        return buffer[:size]

    def pointers(self) -> tuple[int, int]:
        """The buffers' addresses (tests check that refits reuse them)."""
        return self.buffers[0].data_ptr(), self.buffers[1].data_ptr()


def unpack(buffer: torch.Tensor, layout: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a flat buffer made by :func:`pack`: views into ``buffer``, by the layout.

    Raises:
        ValueError: the buffer does not have the layout's size.
    """
    spans, size = _offsets(layout)
    if buffer.numel() != size:
        raise ValueError(f"refit: a bucket of {buffer.numel()} bytes, its layout says {size}")
    return [
        (name, buffer[start : start + width].view(dtype).reshape(shape))
        for (name, shape, dtype), (start, width) in zip(layout, spans, strict=True)
    ]


class InFlight(Protocol):
    """A send that has started: ``wait()`` returns once its buffer may be written again."""

    def wait(self) -> None: ...


def send_double_buffered(
    buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
    buffers: RefitBuffers,
    start_send: Callable[[torch.Tensor], InFlight],
) -> int:
    """Packs each bucket into buffer i mod 2 and starts sending it; returns the bytes sent, once all have gone.

    The next bucket is drawn from ``buckets`` (a gather) while the last one is still on its way: a send is waited
    for only before its buffer is packed again, two buckets later.
    """
    in_flight: deque[InFlight] = deque()  # oldest first; bucket i - 2 used the buffer bucket i goes in
    sent = 0
    for index, bucket in enumerate(buckets):
        if len(in_flight) == len(buffers.buffers):
            in_flight.popleft().wait()
        packed = pack(bucket, buffers.view(index, layout_bytes(layout_of(bucket))))
        in_flight.append(start_send(packed))
        sent += packed.numel()
    while in_flight:
        in_flight.popleft().wait()
    return sent


# --------------------------------------------------------------------------- broadcast group


def open_broadcast_group(
    address: str, port: int, rank: int, world_size: int, device: torch.device, timeout_s: float
) -> Any:
    """Joins the refit's broadcast group (rank 0: trainer rank 0, which hosts its store at ``address:port``).

    NCCL on a GPU, gloo on CPU. All members must call at about the same time; ``timeout_s`` bounds the meeting
    and every broadcast. Returns the group's backend, for :func:`broadcast`.
    """
    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore("opd_refit", dist.TCPStore(address, port, world_size, rank == 0, timeout=timeout))
    group: Any
    if is_cuda(device):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout=timeout)
    # The first collective builds the connections: done here, where the meeting is bounded.
    probe = torch.zeros(1, device=device)
    broadcast(group, probe)
    return group


class _Broadcast:
    """A broadcast in flight (:func:`start_broadcast`)."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self) -> None:
        """Returns once the tensor holds the root's bytes (or has been sent, on the root)."""
        self.work.wait()
        if self.tensor.is_cuda:  # NCCL's wait orders the streams; the caller reads the tensor next
            torch.cuda.current_stream(self.tensor.device).synchronize()


def start_broadcast(group: Any, tensor: torch.Tensor, root: int = 0) -> _Broadcast:
    """Starts broadcasting ``tensor`` in place from ``root`` to every member of ``group``; ``wait()`` on the result."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.rootTensor = 0
    return _Broadcast(group.broadcast([tensor], options), tensor)


def broadcast(group: Any, tensor: torch.Tensor, root: int = 0) -> None:
    """Broadcasts ``tensor`` in place from ``root`` to every member of ``group`` (waits for it)."""
    start_broadcast(group, tensor, root).wait()


# --------------------------------------------------------------------------- CUDA IPC


def ipc_handle(tensor: torch.Tensor) -> IpcHandle:
    """A handle through which another process on the same GPU maps ``tensor``; keep ``tensor`` alive until copied."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, arguments = reduce_tensor(tensor.detach())
    return tuple(arguments)


_DEVICE_ARGUMENT = 6
"""Where ``reduce_tensor``'s arguments name the CUDA device (the producer's index)."""


def open_ipc_handle(handle: IpcHandle, device: torch.device) -> torch.Tensor:
    """The tensor behind ``handle``, mapped on ``device`` (this process's index of the same GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    arguments = list(handle)
    # Each process numbers the GPUs it sees from 0: the producer's index need not be ours.
    arguments[_DEVICE_ARGUMENT] = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(*arguments)
