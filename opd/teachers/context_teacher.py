"""Context distillation: the teacher scores the student's completion under its own, longer prompt.

The student sees ``[prompt | completion]``, the teacher ``[teacher prompt | completion]``: the same conversation with
a teacher-only context inserted (:mod:`opd.data.teacher_context`). The completion ids are appended as they are,
never re-tokenized, so completion token ``j`` sits at ``p + j`` in the student's row and ``q + j`` in the teacher's.
:class:`ContextTeacher` wraps any teacher and moves its answers back to the student's positions (zeros outside the
completion, which the loss masks), for right-padded rows and packed rows (``sequence_lengths``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.models.interfaces import (
    AnsweredWhereTrained,
    Pending,
    PolicyInterface,
    SeveralTeachersSignal,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TokenLogprobsRequest,
    TopKLogprobs,
)
from opd.teachers.several_teachers import map_single
from opd.utils.timer import Timer


@dataclass(frozen=True)
class _Segment:
    """One sequence of a micro-batch: where it lives in the student's tensor and its prompts."""

    row: int  # row of the student tensor (always 0 in a packed batch)
    offset: int  # where the sequence starts in that row (0 unless packed)
    prompt_length: int  # p
    length: int  # prompt + completion
    teacher_prompt: list[int]

    @property
    def completion_length(self) -> int:
        return self.length - self.prompt_length


def _segments(data: BatchedDataDict) -> list[_Segment]:
    """The sequences of a right-padded or packed micro-batch with their teacher prompts."""
    if "teacher_prompt_ids" not in data:
        raise ValueError("context distillation needs data['teacher_prompt_ids'] (one teacher prompt per sequence)")
    if "sequence_lengths" in data:  # one packed row of several sequences
        lengths = [int(length) for length in data["sequence_lengths"][0]]
        prompt_lengths = [int(length) for length in data["prompt_lengths"][0]]
        teacher_prompts = data["teacher_prompt_ids"][0]
        offsets = [sum(lengths[:index]) for index in range(len(lengths))]
        return [
            _Segment(0, offset, prompt, length, list(teacher))
            for offset, prompt, length, teacher in zip(offsets, prompt_lengths, lengths, teacher_prompts)
        ]
    return [
        _Segment(row, 0, int(prompt), int(length), list(teacher))
        for row, (prompt, length, teacher) in enumerate(
            zip(data["prompt_lengths"], data["input_lengths"], data["teacher_prompt_ids"])
        )
    ]


class ContextTeacher(TeacherInterface):
    """Wraps ``teacher`` so each sequence is scored under its teacher-only prompt (rows padded by ``pad_token_id``)."""

    def __init__(self, teacher: TeacherInterface, pad_token_id: int) -> None:
        self.teacher = teacher
        self.pad_token_id = pad_token_id

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """None: a context changes the rows, not the signals (the wrapped teacher's class decides)."""
        return None

    def refusal(self, request: TeacherRequest) -> str | None:
        """The wrapped teacher's refusal: the context changes the rows, not the signals."""
        return self.teacher.refusal(request)

    # ------------------------------------------------------------------ rows

    def teacher_batch(self, data: BatchedDataDict) -> tuple[BatchedDataDict, list[_Segment]]:
        """The teacher's right-padded rows ``[teacher prompt | completion]``, one per sequence."""
        segments = _segments(data)
        rows = []
        masks = []
        for segment in segments:
            span = slice(segment.offset + segment.prompt_length, segment.offset + segment.length)
            completion = data["input_ids"][segment.row, span].tolist()
            rows.append(segment.teacher_prompt + completion)
            in_loss = [1.0] * len(completion)
            if "token_mask" in data:
                in_loss = data["token_mask"][segment.row, span].tolist()
            masks.append([0.0] * len(segment.teacher_prompt) + in_loss)
        width = max((len(row) for row in rows), default=0)
        device = data["input_ids"].device
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        token_mask = torch.zeros((len(rows), width), dtype=torch.float32)
        for index, (row, mask) in enumerate(zip(rows, masks)):
            input_ids[index, : len(row)] = torch.tensor(row, dtype=torch.long)
            token_mask[index, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
        batch = BatchedDataDict(
            input_ids=input_ids,
            input_lengths=torch.tensor([len(row) for row in rows], dtype=torch.long),
            prompt_lengths=torch.tensor([len(segment.teacher_prompt) for segment in segments], dtype=torch.long),
            token_mask=token_mask,
        )
        return batch.to(device), segments

    def _to_student_positions(
        self, data: BatchedDataDict, segments: list[_Segment], teacher_output: torch.Tensor, predicts_next: bool
    ) -> torch.Tensor:
        """The teacher's per-position answers at the student's positions.

        ``predicts_next``: position ``t`` describes token ``t + 1`` (all but token log-probs).
        """
        shape = (*data["input_ids"].shape, *teacher_output.shape[2:])
        out = torch.zeros(shape, dtype=teacher_output.dtype, device=teacher_output.device)
        shift = 1 if predicts_next else 0
        for index, segment in enumerate(segments):
            count = segment.completion_length
            if count == 0:
                continue
            student_start = segment.offset + segment.prompt_length - shift
            teacher_start = len(segment.teacher_prompt) - shift
            out[segment.row, student_start : student_start + count] = teacher_output[
                index, teacher_start : teacher_start + count
            ]
        return out

    # ------------------------------------------------------------------ TeacherInterface

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The wrapped teacher's answer for ``[teacher prompt | completion]`` at the student's positions, else zeros."""
        return self.score_async(data, request).result()

    def score_async(self, data: BatchedDataDict, request: TeacherRequest) -> Pending[TeacherSignal]:
        """Starts the wrapped teacher's scoring (in the background where it can) and maps its answer on collection."""
        batch, segments = self.teacher_batch(data)
        answer = self.teacher.score_async(batch, request)
        return _Mapped(answer, lambda signal: self._to_student_signal(data, segments, signal, request))

    def _to_student_signal(
        self, data: BatchedDataDict, segments: list[_Segment], answer: TeacherSignal, request: TeacherRequest
    ) -> TeacherSignal:
        """The wrapped teacher's answer moved to the student's positions (see :meth:`score`)."""
        if isinstance(answer, (SeveralTeachersSignal, AnsweredWhereTrained)):
            raise TypeError("a teacher-only context wraps each of several teachers, not the group")
        if isinstance(answer, tuple) and not isinstance(answer, TopKLogprobs):
            answer = TopKLogprobs(answer[0], answer[1], None)  # a top-k answer leaves as TopKLogprobs
        predicts_next = not isinstance(request, TokenLogprobsRequest)
        # Every tensor of the answer moves: hidden states (bound or bare), top k with its rest mass, or log-probs.
        return map_single(answer, lambda values: self._to_student_positions(data, segments, values, predicts_next))

    def follow_student(self, student: PolicyInterface, version: int, timer: Timer | None = None) -> None:
        """The wrapped teacher follows the student (a context changes the rows, not the weights)."""
        self.teacher.follow_student(student, version, timer)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped teacher's state."""
        return self.teacher.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restores the wrapped teacher's state."""
        self.teacher.load_state_dict(state)

    def close(self) -> None:
        """Closes the wrapped teacher."""
        self.teacher.close()


class _Mapped(Pending[TeacherSignal]):
    """A pending answer, transformed when it is collected."""

    def __init__(self, pending: Pending[TeacherSignal], transform: Callable[[TeacherSignal], TeacherSignal]) -> None:
        self.pending, self.transform = pending, transform

    def result(self) -> TeacherSignal:
        """The transformed answer."""
        return self.transform(self.pending.result())
