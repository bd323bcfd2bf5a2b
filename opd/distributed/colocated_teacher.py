"""The teacher that lives in the trainer workers, as the driver holds it.

With a colocated teacher (``cluster.teacher.placement: colocated``) every trainer worker
loads the frozen teacher (sharded or whole, or each of several) and builds the run's
teacher around it with the same assembly as one process
(:func:`opd.distillation.teacher_plan.assemble_teacher`). Scoring there keeps the exact
full-vocabulary loss as cheap as in one process: the teacher's logits are made chunk by
chunk beside the student's, and never leave the device.

The driver still holds the teacher and asks it for every micro-batch, as in every other
placement: :class:`TeacherInTrainerWorkers` answers each question with
:class:`~opd.models.interfaces.AnsweredWhereTrained`, which tells the worker that receives
the micro-batch to score it with the teacher it holds. So the object in
``distillation_step`` is the one that answers, and a test can count its answers.
"""

from __future__ import annotations

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.distributed.workers.worker_group import WorkerGroup
from opd.models.interfaces import AnsweredWhereTrained, TeacherInterface, TeacherRequest, TeacherSignal


class TeacherInTrainerWorkers(TeacherInterface):
    """The run's teacher, assembled in each trainer worker around its colocated models.

    Args:
        workers: the trainer workers, started with their teachers.
        student_classes: what the teacher's top-k ids name when it has another tokenizer
            (rank 0's assembled teacher reports it); None: student tokens.
    """

    def __init__(self, workers: WorkerGroup, student_classes: torch.Tensor | None = None) -> None:
        self.workers = workers
        self._student_classes = student_classes
        self.micro_batches_answered = 0
        """How many micro-batches the driver asked this teacher about (each scored in a worker)."""

    @property
    def student_classes(self) -> torch.Tensor | None:
        """The assembled teacher's classes of student tokens (a teacher with another tokenizer), else None."""
        return self._student_classes

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """None: the workers hold the models, so every signal can be computed there."""
        return None

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The answer for ``data``: to be made by the trainer worker that receives these rows.

        The answer is only of use where the student trains (``train`` and
        ``compare_with_teacher`` of :class:`~opd.distributed.fsdp_policy.FSDPPolicy`);
        nothing else asks a colocated teacher (the asynchronous schedules that score ahead
        are refused with it, and the baselines sample from the rollout workers).
        """
        self.micro_batches_answered += 1
        return AnsweredWhereTrained(request)
