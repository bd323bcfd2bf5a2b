"""The trainer's end of a refit: its ranks gather the student's weights, in the engine's dtype, and send them.

:class:`RefitSender` is a mixin of :class:`~opd.distributed.trainer_worker.TrainerWorker`. Every method that
gathers is a collective of all trainer ranks; the transports are described in :mod:`opd.distributed.refit.transport`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from opd.distributed.fsdp import _unique_state_dict, whole_buckets
from opd.distributed.refit.buckets import bucket_bytes_of, in_buckets
from opd.distributed.refit.wire import (
    BucketLayout,
    IpcHandle,
    RefitBuffers,
    ipc_handle,
    layout_bytes,
    layout_of,
    open_broadcast_group,
    pack,
    send_double_buffered,
    start_broadcast,
)


class RefitSender:
    """The refit methods of a trainer rank; the host class sets ``model`` (the FSDP2 student), ``rank``, ``device``."""

    model: Any
    rank: int
    device: torch.device

    def refit_entries(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a refit sends, still sharded, in order: the state dict, a tied tensor once (LoRA overrides this)."""
        return _unique_state_dict(self.model)

    def refit_shapes(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The names, shapes and dtypes of :meth:`refit_entries`, made on one rank alone (no collective)."""
        return _unique_state_dict(self.model)

    def weight_buckets(self, bucket_bytes: int, dtype: torch.dtype) -> tuple[list[Any], int]:
        """Rank 0: the weights in ``dtype``, in buckets of about ``bucket_bytes``, each put in Ray's object store.

        Returns the buckets' object refs and their bytes on rank 0; ``([], 0)`` on the others.
        """
        import ray  # only inside an actor

        refs, sent = [], 0
        # One all-gather per bucket; every rank joins each, rank 0 keeps the buckets.
        for bucket in whole_buckets(self.refit_entries(), bucket_bytes, dtype):
            if self.rank == 0:
                refs.append(ray.put({name: tensor.cpu() for name, tensor in bucket}))
                sent += bucket_bytes_of(bucket)
        return refs, sent

    def refit_layouts(self, bucket_bytes: int, dtype: torch.dtype) -> list[BucketLayout]:
        """The layout of every bucket :meth:`broadcast_weights` and :meth:`next_ipc_bucket` send (no collective)."""
        entries = (
            (
                name,
                torch.empty(tensor.shape, dtype=dtype if tensor.is_floating_point() else tensor.dtype, device="meta"),
            )
            for name, tensor in self.refit_shapes()
        )
        return [layout_of(bucket) for bucket in in_buckets(entries, bucket_bytes)]

    def _buffers(self, bucket_bytes: int, dtype: torch.dtype) -> RefitBuffers:
        """This rank's two send buffers, sized to the largest bucket at the first refit and kept (a GPU holds
        twice ``bucket_bytes`` for them from then on)."""
        if getattr(self, "_refit_buffers", None) is None:
            capacity = max(map(layout_bytes, self.refit_layouts(bucket_bytes, dtype)))
            self._refit_buffers = RefitBuffers(capacity, self.device)
        return self._refit_buffers

    def refit_buffer_addresses(self) -> tuple[int, int] | None:
        """Where this rank's send buffers are (None before its first broadcast or IPC refit): refits reuse them."""
        buffers = getattr(self, "_refit_buffers", None)
        return None if buffers is None else buffers.pointers()

    # ------------------------------------------------------------------ broadcast

    def join_refit_group(self, address: str, port: int, world_size: int, timeout_s: float) -> None:
        """Rank 0: joins the broadcast group as its rank 0 and hosts its store at ``address:port``."""
        self._refit_group = open_broadcast_group(address, port, 0, world_size, self.device, timeout_s)

    def broadcast_weights(self, bucket_bytes: int, dtype: torch.dtype) -> int:
        """Gathers each bucket (every rank) and broadcasts it from rank 0; returns the bytes sent (rank 0).

        Double-buffered (:func:`send_double_buffered`): rank 0 gathers bucket i+1 while bucket i is on the wire.
        """
        buckets = whole_buckets(self.refit_entries(), bucket_bytes, dtype)
        if self.rank != 0:
            deque(buckets, maxlen=0)  # drains the generator: every rank joins each bucket's gather
            return 0
        group = self._refit_group
        return send_double_buffered(
            buckets, self._buffers(bucket_bytes, dtype), lambda packed: start_broadcast(group, packed)
        )

    # ------------------------------------------------------------------ CUDA IPC

    def start_ipc_refit(self, bucket_bytes: int, dtype: torch.dtype) -> None:
        """Begins a refit over CUDA IPC: :meth:`next_ipc_bucket` then gathers one bucket per call."""
        buffers = self._buffers(bucket_bytes, dtype)
        if getattr(self, "_ipc_handles", None) is None:  # the buffers live as long as this rank: one handle each
            self._ipc_handles = tuple(ipc_handle(buffer) for buffer in buffers.buffers)
        self._ipc_buckets: Iterator[tuple[int, list[tuple[str, torch.Tensor]]]] | None = enumerate(
            whole_buckets(self.refit_entries(), bucket_bytes, dtype)
        )

    def next_ipc_bucket(self) -> tuple[IpcHandle, BucketLayout] | None:
        """Gathers the next bucket, packs it into this rank's buffer for it, and returns that buffer's IPC handle
        and the bucket's layout; None on every rank once all weights are sent.

        Bucket i goes in buffer i mod 2: the controller asks for bucket i+1 while the engines copy bucket i, and
        for bucket i+2 only once they have.
        """
        assert self._ipc_buckets is not None, "start_ipc_refit first"
        step = next(self._ipc_buckets, None)
        if step is None:
            self._ipc_buckets = None
            return None
        index, bucket = step
        layout = layout_of(bucket)
        pack(bucket, self._refit_buffers.view(index, layout_bytes(layout)))
        del bucket
        # The engine reads this memory from another process: the packing must be done.
        torch.cuda.current_stream(self.device).synchronize()
        return self._ipc_handles[index % 2], layout
