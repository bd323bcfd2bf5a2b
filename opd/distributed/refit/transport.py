"""How the student's new weights travel from the trainer to the rollout workers (``cluster.rollout.refit_transport``).

A :class:`RefitTransport` runs one refit from the controller. Every transport gathers in buckets cast to the
engines' dtype before the gather (a bf16 engine gets half the fp32 masters' bytes):

* ``object_store`` (CPU default): trainer rank 0 puts each bucket in Ray's object store; every worker fetches all.
* ``broadcast`` (split pools on GPUs): rank 0 and the rollout workers form their own process group at the first
  refit (NCCL, or gloo on CPUs, so it is testable without a GPU); rank 0 broadcasts each bucket as one buffer.
* ``cuda_ipc`` (colocated on GPUs): each rollout worker maps the bucket held by the trainer rank on its GPU
  through a CUDA IPC handle: no host copy, no network.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from opd.distributed.refit.wire import BucketLayout, layout_bytes
from opd.distributed.workers.worker_group import WorkerGroup
from opd.utils.errors import WorkerError


@dataclass(frozen=True)
class RefitReport:
    """What one refit moved.

    Attributes:
        gathered_bytes: one whole copy of the weights, in the engines' dtype.
        delivered_bytes: what the engines received, summed over the rollout workers.
    """

    gathered_bytes: int
    delivered_bytes: int

    def metrics(self) -> dict[str, float]:
        """The step metrics of this refit."""
        return {"refit/bytes": float(self.gathered_bytes), "refit/bytes_delivered": float(self.delivered_bytes)}


class RefitTransport(ABC):
    """Moves the trainer's weights into the rollout workers' engines (see the module docstring).

    ``bucket_bytes`` counts in ``dtype``, the engines' dtype; ``timeout_s`` bounds setting up a process group.
    """

    name = ""

    def __init__(self, rollout: WorkerGroup, bucket_bytes: int, dtype: torch.dtype, timeout_s: float) -> None:
        self.rollout, self.bucket_bytes, self.dtype, self.timeout_s = rollout, bucket_bytes, dtype, timeout_s

    @abstractmethod
    def send(self, trainer: WorkerGroup) -> RefitReport:
        """Loads the trainer's current weights into every rollout worker."""


class ObjectStoreTransport(RefitTransport):
    """Trainer rank 0 puts each bucket in Ray's object store; every worker loads them all."""

    name = "object_store"

    def send(self, trainer: WorkerGroup) -> RefitReport:
        refs, gathered = trainer.run_all("weight_buckets", self.bucket_bytes, self.dtype)[0]
        self.rollout.run_all("load_buckets", refs)
        return RefitReport(gathered, gathered * self.rollout.size)


class BroadcastTransport(RefitTransport):
    """Trainer rank 0 broadcasts each bucket to the rollout workers over a group of their own."""

    name = "broadcast"
    layouts: list[BucketLayout] | None = None
    """The buckets' layouts, agreed at the first refit (:meth:`_open`)."""

    def _open(self, trainer: WorkerGroup) -> list[BucketLayout]:
        """The first refit: the buckets' layouts, and the group of trainer rank 0 (its rank 0) and the workers."""
        layouts: list[BucketLayout] = trainer.run_rank(0, "refit_layouts", self.bucket_bytes, self.dtype)
        address, port = trainer.run_rank(0, "rendezvous_address")
        world_size = 1 + self.rollout.size
        # Every member must be inside the meeting at once: start all, then wait (each bounded by timeout_s).
        host = trainer.actors[0].join_refit_group.remote(address, port, world_size, self.timeout_s)
        members = [
            actor.join_refit_group.remote(address, port, 1 + rank, world_size, self.timeout_s)
            for rank, actor in enumerate(self.rollout.actors)
        ]
        self._gather_both(trainer, [host], members, trainer_ranks=[0])
        return layouts

    def send(self, trainer: WorkerGroup) -> RefitReport:
        if self.layouts is None:
            self.layouts = self._open(trainer)
        senders = [actor.broadcast_weights.remote(self.bucket_bytes, self.dtype) for actor in trainer.actors]
        receivers = [actor.receive_broadcast.remote(self.layouts) for actor in self.rollout.actors]
        gathered = self._gather_both(trainer, senders, receivers)[0]
        return RefitReport(gathered, gathered * self.rollout.size)

    def _gather_both(
        self, trainer: WorkerGroup, senders: list[Any], receivers: list[Any], trainer_ranks: list[int] | None = None
    ) -> list[Any]:
        """The trainer ranks' results, once the rollout workers' are in too; names a receiver that died.

        A rollout worker that dies inside the group's collective reaches trainer rank 0 first, as an error on the
        collective's socket ("Connection reset by peer"): that error only echoes the death. The run used to stop
        blaming trainer worker 0; the dead rollout worker is named now, and the echo follows it.
        """
        try:
            results = trainer.gather(senders, ranks=trainer_ranks)
        except WorkerError as failure:
            death = self.rollout.death_among(receivers)
            if death is None:
                raise
            self.rollout.kill()  # the other receivers wait in the collective for a sender that is gone
            raise WorkerError(f"{death}; then {failure}", death.role, death.rank) from None
        self.rollout.gather(receivers)
        return results


class CudaIpcTransport(RefitTransport):
    """Each engine copies every bucket from the trainer rank on its own GPU, through a CUDA IPC handle.

    Colocated, rollout worker ``r`` shares trainer rank ``r mod N``'s GPU; every rank holds each bucket whole.
    """

    name = "cuda_ipc"

    def send(self, trainer: WorkerGroup) -> RefitReport:
        trainer.run_all("start_ipc_refit", self.bucket_bytes, self.dtype)
        self.rollout.run_all("begin_refit")
        handles: list[Any] = trainer.run_all("next_ipc_bucket")
        gathered = 0
        while handles[0] is not None:
            layout = handles[0][1]
            gathered += layout_bytes(layout)
            # The trainer gathers and packs bucket i+1 into its other buffer while the engines copy bucket i.
            following = [actor.next_ipc_bucket.remote() for actor in trainer.actors]
            self.rollout.run_all(
                "load_ipc_bucket",
                per_rank=[(handles[rank % trainer.size][0], layout) for rank in range(self.rollout.size)],
            )
            handles = trainer.gather(following)
        # The engines' post-load processing and prefix-cache reset, once per refit.
        self.rollout.run_all("finish_refit")
        return RefitReport(gathered, gathered * self.rollout.size)


TRANSPORTS: dict[str, type[RefitTransport]] = {
    transport.name: transport for transport in (ObjectStoreTransport, BroadcastTransport, CudaIpcTransport)
}
"""Each ``cluster.rollout.refit_transport`` (resolved) and its class."""
