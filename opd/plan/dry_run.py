"""The trainer's real step at real shapes with no weights and no GPU: fake tensors over a fake process group.

:func:`dry_run_rank` runs one FSDP2 trainer rank as a cluster would (``TrainerWorker.build`` and ``.train``: forward,
backward, gradient reduction, optimizer step), but every tensor is a ``FakeTensor`` (so a 32B teacher costs
nothing), the process group is ``torch.distributed``'s fake one (rank ``r`` of ``N`` runs alone), the device is a
stand-in accelerator, and ``FSDPMemTracker`` records the peak by category, as torchtitan's estimator does. A device
audit fails any collective handed a host tensor: NCCL has no CPU backend, so that would fail the first GPU step.

Parts: :mod:`opd.plan.fake_device` (accelerator, values, audit, process group), :mod:`opd.plan.fake_step` (models
from configs, fake modes, depth extrapolation), :mod:`opd.plan.rank_trace` (a trainer rank's step) and
:mod:`opd.plan.replica_trace` (a teacher-pool replica's forward).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from opd.distributed.trainer_worker import TrainerSpec
from opd.models.interfaces import LossFunction, TeacherRequest
from opd.plan.fake_device import compute_device
from opd.plan.fake_step import StepShape, peak_on, traced_or_extrapolated
from opd.plan.rank_trace import trace_rank
from opd.plan.replica_trace import trace_teacher_replica


@dataclass
class RankMemory:
    """What one rank holds, in bytes: the tracker's peak on the compute device and the step's standing memory.

    Attributes:
        peak_breakdown: the peak by the tracker's non-zero categories (``Sharded Param``, ``Activation``, ...).
        student_parameters: this rank's shard of the fp32 master weights (gradients and Adam state likewise).
        teacher_parameters: a colocated teacher (shard or whole), or the head of a teacher apart (full-vocab loss).
        collectives: collectives the audit checked.
        host_peak: bytes of tensors the step made on the host.
        extrapolated_layers: depth by path of each model traced at a few layers and extrapolated
            (:mod:`opd.plan.layer_extrapolation`).
    """

    rank: int
    peak: int
    peak_breakdown: dict[str, int]
    student_parameters: int
    student_gradients: int
    optimizer_state: int
    teacher_parameters: int
    collectives: int
    host_peak: int = 0
    extrapolated_layers: dict[str, int] = field(default_factory=dict)

    @property
    def standing(self) -> int:
        """Memory held between steps: weights, gradients, optimizer state, the teacher."""
        return self.student_parameters + self.student_gradients + self.optimizer_state + self.teacher_parameters

    @property
    def transient(self) -> int:
        """The rest of the peak: activations, gathered layers, collective buffers, the loss's chunks."""
        return max(self.peak - self.standing, 0)


@dataclass
class ReplicaMemory:
    """What one device of a teacher-pool replica holds while it scores a micro-batch, in bytes.

    ``weights`` is its FSDP2 shard or the whole teacher; ``answer`` what it sends, on the device before sending.
    """

    peak: int
    weights: int
    answer: int
    extrapolated_layers: dict[str, int] = field(default_factory=dict)


def dry_run_teacher_replica(
    path: str,
    dtype: torch.dtype,
    shards_per_replica: int,
    shape: StepShape,
    request: TeacherRequest,
    *,
    every_layer: bool = False,
) -> ReplicaMemory:
    """Scores one micro-batch on the first device of a teacher-pool replica, on fake tensors; returns its memory.

    Built as :class:`opd.distributed.teacher_pool.TeacherWorker` builds it (FSDP2 when ``shards_per_replica`` > 1);
    deep teachers are extrapolated unless ``every_layer`` (:func:`~opd.plan.fake_step.traced_or_extrapolated`).
    """
    device = compute_device()
    trace_at = functools.partial(trace_teacher_replica, path, dtype, shards_per_replica, shape, request, device)
    trace = traced_or_extrapolated(trace_at, [path], every_layer)
    _, snapshot = peak_on(trace.peaks, device)
    return ReplicaMemory(peak=snapshot.get("Total", 0), extrapolated_layers=trace.extrapolated, **trace.scalars)


def dry_run_rank(
    spec: TrainerSpec,
    world_size: int,
    rank: int,
    shape: StepShape,
    loss_fn: LossFunction,
    vocab_size: int,
    teacher_hidden_size: int | None = None,
    *,
    every_layer: bool = False,
) -> RankMemory:
    """Builds and trains rank ``rank`` of ``world_size`` on fake tensors (a steady-state step); returns its memory.

    ``spec.backend`` is ignored; ``teacher_hidden_size`` is the width of a teacher apart that answers a
    full-vocabulary loss. Deep models are extrapolated unless ``every_layer``; the audit sees every kind of
    collective either way.

    Raises:
        DeviceMismatchError: a collective got a tensor off the compute device.
    """
    device = compute_device()
    trace_at = functools.partial(
        trace_rank, spec, world_size, rank, shape, loss_fn, vocab_size, teacher_hidden_size, device
    )
    trace = traced_or_extrapolated(trace_at, [spec.student_path, *spec.colocated_teachers()], every_layer)
    host_peak, snapshot = peak_on(trace.peaks, device)
    return RankMemory(
        rank=rank,
        peak=snapshot.get("Total", 0),
        peak_breakdown={kind: value for kind, value in snapshot.items() if value and kind != "Total"},
        host_peak=host_peak,
        extrapolated_layers=trace.extrapolated,
        **trace.scalars,  # the parameters, gradients, optimizer state, teacher and collectives rank_trace counts
    )
