"""The trainer's real step at real shapes with no weights and no GPU: fake tensors over a fake process group.

:func:`dry_run_rank` runs one rank of the FSDP2 trainer the way a GPU cluster would:
:meth:`TrainerWorker.build <opd.distributed.trainer_worker.TrainerWorker.build>` shards
the student (and a colocated teacher) and builds the optimizer, and
:meth:`TrainerWorker.train <opd.distributed.trainer_worker.TrainerWorker.train>` runs
the configured loss over a micro-batch of the configured shape, forward, backward,
gradient reduction and optimizer step. Nothing is computed and nothing is allocated:

* every tensor is a ``FakeTensor`` (shape, dtype and device, no data), so a 32B teacher
  costs nothing; the models are built from their ``config.json`` on the meta device,
  sharded, and given fake storage on the compute device, as the trainer's sharded loading
  does before it reads the weights (:func:`opd.models.model_shapes.model_config`);
* the process group is ``torch.distributed``'s fake one (every collective returns at
  once), so rank ``r`` of ``N`` runs alone in this process;
* the compute device is a stand-in accelerator, ``fakegpu``: PyTorch's ``privateuseone``
  device type with a Python device guard and streams that do nothing. A CPU-only build
  cannot run even fake CUDA tensors through every operator (``copy_`` asks for a CUDA
  device guard, which only a CUDA build has), but any accelerator other than ``cpu``
  keeps host tensors apart from device tensors, which is what the audit needs. It is
  registered for the rest of the process (``torch.accelerator`` then reports it), so a
  dry run belongs in a process of its own, as ``opd plan`` runs it;
* ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` attributes every
  storage to parameters, gradients, optimizer state, activations and collective buffers
  and records the peak, as torchtitan's memory estimator does.

Two more things stand in for what fake tensors cannot do:

* **values.** A step reads a few values back to Python (a metric's ``float()``, a
  mask's selected positions). A read gives 1 (``True`` for a flag); a boolean selection
  over ``[..., L]`` positions picks each row's loss positions, that is the
  ``response_tokens`` a dry run plans for (the response is the part of a row that
  carries loss). Attention uses the flash kernel (its memory is linear in the length),
  as it does on a GPU.
* **the device audit.** Every tensor handed to a collective must live on the compute
  device: an NCCL process group has no CPU backend, so a host tensor there fails the
  first step on a GPU. :class:`~opd.plan.fake_device.DeviceMismatchError` names the
  collective, the device and the line of opd that called it.

The parts: :mod:`opd.plan.fake_device` (the stand-in accelerator, the values, the audit,
the fake process group), :mod:`opd.plan.fake_step` (the models from their configs, the
step's fake modes, the trace at the models' real depths), :mod:`opd.plan.rank_trace` (one
trainer rank's step) and :mod:`opd.plan.replica_trace` (one teacher-pool replica's forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opd.distributed.trainer_worker import TrainerSpec
from opd.models.interfaces import LossFunction, TeacherRequest
from opd.plan.fake_device import compute_device
from opd.plan.fake_step import StepShape, layer_depths, peak_on, traced_or_extrapolated
from opd.plan.layer_extrapolation import Trace, largest_phase_peak
from opd.plan.rank_trace import trace_rank
from opd.plan.replica_trace import trace_teacher_replica


@dataclass
class RankMemory:
    """What one rank holds: the tracker's peak and the step's standing memory, in bytes.

    Attributes:
        rank: the rank.
        peak: the tracker's peak over the step on the compute device.
        peak_breakdown: that peak by the tracker's categories (``Sharded Param``,
            ``Activation``, ``All Gather``, ...), non-zero ones only.
        student_parameters: this rank's shard of the student's fp32 master weights.
        student_gradients: this rank's shard of the student's gradients.
        optimizer_state: this rank's Adam moments (and step counters).
        teacher_parameters: this rank's copy of a colocated teacher (a shard, or whole), or
            of the output layer of a teacher apart that answers a full-vocabulary loss.
        collectives: collectives the audit checked.
        host_peak: bytes of tensors the step made on the host (0 when every tensor is on the device).
        extrapolated_layers: the models traced at a few layers and extrapolated, by path, to
            their depth (:mod:`opd.plan.layer_extrapolation`); empty when every layer was traced.
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

    Attributes:
        peak: the tracker's peak over the forward on the compute device.
        weights: this device's share of the teacher (its FSDP2 shard, or the whole model).
        answer: the answer it sends (hidden states, top-k or token log-probs), on the device before it is sent.
        extrapolated_layers: as :attr:`RankMemory.extrapolated_layers`.
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

    The replica is built as a pool worker builds it (:class:`opd.distributed.teacher_pool.TeacherWorker`):
    the whole teacher on one device, or with ``shards_per_replica`` > 1 sharded with FSDP2
    over the replica's devices, forward only. A full-vocabulary request is answered with
    the final hidden states (the trainer binds them to its copy of the head); the others
    with the answer itself. A deep teacher with alike layers is traced at a few layers and
    extrapolated, unless ``every_layer`` (:func:`~opd.plan.fake_step.traced_or_extrapolated`).
    """
    device = compute_device()

    def trace_at(depths: dict[str, int]) -> Trace:
        with layer_depths(depths):
            return trace_teacher_replica(path, dtype, shards_per_replica, shape, request, device)

    trace = traced_or_extrapolated(trace_at, [path], every_layer)
    _, snapshot = peak_on(largest_phase_peak(trace.peaks), device)
    return ReplicaMemory(
        peak=snapshot.get("Total", 0),
        weights=trace.scalars["weights"],
        answer=trace.scalars["answer"],
        extrapolated_layers=trace.extrapolated,
    )


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
    """Builds and trains rank ``rank`` of ``world_size`` on fake tensors; returns its memory.

    The tracked step is a steady-state one: Adam's moments exist before it starts
    (:func:`~opd.plan.rank_trace.adam_state_in_place`), as they do from a run's second
    step on. A teacher that runs apart (``spec.teacher_path`` None: a pool, a served
    teacher) sends its answer to every micro-batch as it would arrive from another
    process, on the host: the final hidden states for a full-vocabulary loss (bound to
    the output layer the rank loads, ``spec.teacher_head_path``), else the top-k or token
    log-probs.

    A deep student or colocated teacher with alike layers is traced at a few layers and
    extrapolated to its depth, unless ``every_layer``
    (:func:`~opd.plan.fake_step.traced_or_extrapolated`); the device audit sees every kind
    of collective either way.

    Args:
        spec: the trainer as the run configures it (``backend`` is ignored: the group is fake).
        world_size: trainer ranks.
        rank: the rank to run.
        shape: its micro-batches.
        loss_fn: the run's loss.
        vocab_size: token ids are drawn below this.
        teacher_hidden_size: the width of a teacher's hidden states that runs apart and
            answers a full-vocabulary loss; unused otherwise.
        every_layer: trace every layer of every model, extrapolating nothing.

    Raises:
        DeviceMismatchError: a collective got a tensor off the compute device.
    """
    device = compute_device()

    def trace_at(depths: dict[str, int]) -> Trace:
        with layer_depths(depths):
            return trace_rank(spec, world_size, rank, shape, loss_fn, vocab_size, teacher_hidden_size, device)

    trace = traced_or_extrapolated(trace_at, [spec.student_path, *spec.colocated_teachers()], every_layer)
    host_peak, snapshot = peak_on(largest_phase_peak(trace.peaks), device)
    return RankMemory(
        rank=rank,
        peak=snapshot.get("Total", 0),
        peak_breakdown={kind: value for kind, value in snapshot.items() if value and kind != "Total"},
        student_parameters=trace.scalars["student_parameters"],
        student_gradients=trace.scalars["student_gradients"],
        optimizer_state=trace.scalars["optimizer_state"],
        teacher_parameters=trace.scalars["teacher_parameters"],
        collectives=trace.scalars["collectives"],
        host_peak=host_peak,
        extrapolated_layers=trace.extrapolated,
    )
