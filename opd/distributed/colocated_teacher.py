"""The teacher that lives in the trainer workers, as the driver holds it.

With a colocated teacher (``cluster.teacher.placement: colocated``) every trainer worker
loads the frozen teacher (sharded or whole, or each of several) and builds the run's
teacher around it with the same assembly as one process
(:func:`opd.distillation.teacher_plan.assemble_teacher`). Scoring there keeps the exact
full-vocabulary loss as cheap as in one process: the teacher's logits are made chunk by
chunk beside the student's, and never leave the device.

The driver still holds the teacher and asks it for every micro-batch, as in every other
placement: :class:`TeacherInTrainerWorkers` answers each question (``score_async``) with
:class:`~opd.models.interfaces.AnsweredWhereTrained`, which tells the worker that receives
the micro-batch to score it with the teacher it holds. Asked with ``score``, it sends top-k
or token log-probs here, each rank scoring a block of the rows. So the object in
``distillation_step`` is the one that answers, and a test can count its answers.
"""

from __future__ import annotations

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.distributed.batch_plan import contiguous_blocks
from opd.distributed.teacher_pool import concat_blocks
from opd.distributed.workers.worker_group import WorkerGroup
from opd.models.interfaces import (
    AnsweredWhereTrained,
    Done,
    FullVocabRequest,
    Pending,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
)


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

    def score_async(self, data: BatchedDataDict, request: TeacherRequest) -> Pending[TeacherSignal]:
        """The driver's question for a micro-batch it trains or validates: answered where the rows go.

        Each trainer worker scores the micro-batch it receives with the teacher it holds,
        beside the student's hidden states (``train`` and ``compare_with_teacher`` of
        :class:`~opd.distributed.fsdp_policy.FSDPPolicy`), so a full-vocabulary answer never
        leaves the device. (The asynchronous schedules that score ahead are refused with a
        colocated teacher: its workers are busy training.)
        """
        self.micro_batches_answered += 1
        return Done(AnsweredWhereTrained(request))

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """Top-k or token log-probs for ``data``, sent here: every rank scores a block of the rows.

        Raises:
            ValueError: for a full-vocabulary request: its ``[B, L, V]`` answer stays in the
                trainer workers (:meth:`score_async` asks them to use it there).
        """
        if isinstance(request, FullVocabRequest):
            raise ValueError(
                "the colocated teacher's full vocabulary stays in the trainer workers: the student's trainer "
                "scores with it there (train, compare_with_teacher); ask for top-k or token log-probs to send"
            )
        blocks, counts = contiguous_blocks(data, self.workers.size)
        return concat_blocks(
            self.workers.run_all("teacher_score", request, per_rank=[(block,) for block in blocks]), counts
        )
