"""The teacher that lives in the trainer workers, as the driver holds it.

Every trainer worker assembles the run's teacher as one process does
(:func:`opd.distillation.teacher_plan.assemble_teacher`), so full-vocabulary logits never leave the device. The
driver still asks this object for every micro-batch, as in any placement; the answer,
:class:`~opd.models.interfaces.AnsweredWhereTrained`, tells the receiving worker to score it there.
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

    ``student_classes``: what the teacher's top-k ids name with another tokenizer (from rank 0); None: tokens.
    """

    def __init__(self, workers: WorkerGroup, student_classes: torch.Tensor | None = None) -> None:
        self.workers = workers
        self._student_classes = student_classes

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

        Schedules that score ahead are refused with a colocated teacher: its workers are busy training.
        """
        return Done(AnsweredWhereTrained(request))

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """Top-k or token log-probs for ``data``, sent here: every rank scores a block of the rows.

        Raises ValueError for a full-vocabulary request: ``[B, L, V]`` stays in the workers (:meth:`score_async`).
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
