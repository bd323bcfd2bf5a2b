"""The loss with several teachers: one objective, applied to each teacher's rows or to their mixture.

The wrappers only decide which teacher answer (:mod:`opd.teachers.several_teachers`) the objective sees. Per-teacher
metrics, logged as ``train/teacher/<name>/...``: the :data:`PER_TEACHER_MEANS` (over the tokens it scored) and
``token_share``; its scoring time as ``timing/teacher/<name>``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import select_segments, shift_token_mask
from opd.models.interfaces import LossFunction, PerTeacherRequest, TeacherRequest
from opd.models.lm_head import LMHeadInput
from opd.models.step_metrics import MetricValue, accumulate_metrics, metric_share
from opd.teachers.several_teachers import MixedSignal, RoutedSignal

PER_TEACHER_MEANS = ("kl_forward", "kl_reverse", "kl_reverse_estimate")
"""Metrics of the objective that are token means, reported for each teacher."""


def _teacher_key(name: str, metric: str) -> str:
    return f"teacher/{name}/{metric}"


def _timing_metrics(seconds: dict[str, float]) -> dict[str, float]:
    """Each teacher's scoring time, named as a phase the driver logs as ``timing/teacher/<name>``."""
    return {f"teacher/{name}_seconds": value for name, value in seconds.items()}


def _rows_of(data: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The rows ``rows`` of every per-row field of a micro-batch (tensors and lists)."""
    size = len(data["input_ids"])
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size:
            out[key] = value[rows.to(value.device)]
        elif isinstance(value, list) and len(value) == size:
            out[key] = [value[row] for row in rows.tolist()]
        else:
            out[key] = value
    return out


def _student_at(
    student_output: torch.Tensor | LMHeadInput, index: torch.Tensor, packed: bool
) -> torch.Tensor | LMHeadInput:
    """The student's output at rows ``index``, or (``packed``) at positions ``index`` of its one row ``[1, n, ...]``."""
    values = student_output.hidden_states if isinstance(student_output, LMHeadInput) else student_output
    index = index.to(values.device)
    selected = values[:, index] if packed else values[index]
    return student_output.with_rows(selected) if isinstance(student_output, LMHeadInput) else selected


def _detached(student_output: torch.Tensor | LMHeadInput) -> torch.Tensor | LMHeadInput:
    if isinstance(student_output, LMHeadInput):
        bias = student_output.bias.detach() if student_output.bias is not None else None
        return dataclasses.replace(
            student_output,
            hidden_states=student_output.hidden_states.detach(),
            weight=student_output.weight.detach(),
            bias=bias,
        )
    return student_output.detach()


class _SeveralTeachersLoss(LossFunction):
    """Delegates everything but the call to the objectives it wraps (``objective``: the first)."""

    def __init__(self, objectives: Sequence[LossFunction], names: Sequence[str]) -> None:
        self.objectives = list(objectives)
        self.objective = self.objectives[0]
        self.names = list(names)
        self.fused_lm_head = self.objective.fused_lm_head

    @property
    def teacher_request(self) -> TeacherRequest | None:
        """Every teacher is asked for the objective's signal."""
        return self.objective.teacher_request

    def for_step(self, step: int) -> LossFunction:
        """A copy whose objectives are those of step ``step``, or itself where none changes."""
        objectives = [objective.for_step(step) for objective in self.objectives]
        if all(new is old for new, old in zip(objectives, self.objectives, strict=True)):
            return self
        stepped = copy.copy(self)
        stepped.objectives, stepped.objective = objectives, objectives[0]
        return stepped

    @property
    def needs_task_reward(self) -> bool:
        """Whether any teacher's objective rewards the task."""
        return any(objective.needs_task_reward for objective in self.objectives)

    @property
    def needs_sampler_logprobs(self) -> bool:
        """Whether any teacher's objective needs the sampler's log-probs."""
        return any(objective.needs_sampler_logprobs for objective in self.objectives)


class RoutedLoss(_SeveralTeachersLoss):
    """Each teacher's objective applied to its rows with its answer (a :class:`RoutedSignal`).

    Every loss is a sum over positions over a global normaliser, so the group losses sum to the micro-batch's loss
    and gradient exactly. ``objectives``: one per name, in member order (a member's own ``loss_fn`` or the shared
    one), agreeing on ``fused_lm_head`` (the student's output is computed once); else ``ValueError``.
    """

    def __init__(self, objectives: Sequence[LossFunction], names: Sequence[str]) -> None:
        if len(objectives) != len(names) or not objectives:
            raise ValueError("RoutedLoss needs one objective per teacher")
        if len({objective.fused_lm_head for objective in objectives}) > 1:
            raise ValueError("the teachers' objectives must all take the fused LM head, or all take logits")
        super().__init__(objectives, names)

    @property
    def teacher_request(self) -> TeacherRequest | None:
        """The one signal every teacher is asked for, or a :class:`PerTeacherRequest` when they differ."""
        requests = [objective.teacher_request for objective in self.objectives]
        singles = [
            request for request in requests if request is not None and not isinstance(request, PerTeacherRequest)
        ]
        if len(singles) != len(requests):
            raise ValueError("every routed teacher's objective must ask its teacher for one signal")
        if all(request == singles[0] for request in singles):
            return singles[0]
        return PerTeacherRequest(tuple(singles))

    def loss_and_metrics(
        self,
        student_output: Any,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_output: Any = None,
    ) -> tuple[torch.Tensor, dict[str, MetricValue]]:
        """Σ over teachers of the objective on their rows; metrics summed and per teacher; ``TypeError`` if unrouted."""
        if not isinstance(teacher_output, RoutedSignal):
            raise TypeError(f"RoutedLoss needs the answer of RoutedTeachers, got {type(teacher_output).__name__}")
        total: torch.Tensor | None = None
        metrics: dict[str, MetricValue] = {}
        for part in teacher_output.parts:
            if part.segments is None:
                student, part_data = _student_at(student_output, part.rows, packed=False), _rows_of(data, part.rows)
            else:  # packed: the teacher's sequences, a packed row of their own
                student = _student_at(student_output, part.rows, packed=True)
                part_data = select_segments(BatchedDataDict(data), part.segments)[1]
            loss, part_metrics = self.objectives[part.teacher].loss_and_metrics(
                student, part_data, global_valid_tokens, global_valid_seqs, part.signal
            )
            total = loss if total is None else total + loss
            accumulate_metrics(metrics, part_metrics)
            name = self.names[part.teacher]
            for key in (*PER_TEACHER_MEANS, "num_valid_tokens"):
                if key in part_metrics:
                    metrics[_teacher_key(name, key)] = part_metrics[key]
        if total is None:  # a micro-batch always has rows; kept for an empty one
            raise ValueError("RoutedLoss got a micro-batch without rows")
        metrics.update(_timing_metrics(teacher_output.seconds))
        return total, metrics

    def finish_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Turns each teacher's summed shares into means over its own tokens, and adds its ``token_share``."""
        finished = dict(metrics)
        all_tokens = metrics.get("num_valid_tokens", 0.0)
        for name in self.names:
            tokens = finished.pop(_teacher_key(name, "num_valid_tokens"), 0.0)
            finished[_teacher_key(name, "token_share")] = tokens / all_tokens if all_tokens > 0 else 0.0
            for key in PER_TEACHER_MEANS:
                share = finished.get(_teacher_key(name, key))
                if share is not None and tokens > 0:
                    # The objective's shares are divided by the step's tokens; this teacher had `tokens`.
                    finished[_teacher_key(name, key)] = share * all_tokens / tokens
        return finished


class MixtureLoss(_SeveralTeachersLoss):
    """The objective applied to the teachers' mixture (a :class:`MixedSignal`); each teacher's KL as metrics.

    ``member_metrics``: compare the student with each member too (no gradient; one more evaluation per member).
    """

    def __init__(self, objective: LossFunction, names: Sequence[str], member_metrics: bool = True) -> None:
        super().__init__([objective], names)
        self.member_metrics = member_metrics

    def loss_and_metrics(
        self,
        student_output: Any,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_output: Any = None,
    ) -> tuple[torch.Tensor, dict[str, MetricValue]]:
        """The objective on the mixture, and each member's KL and weight share (``TypeError`` if not mixed)."""
        if not isinstance(teacher_output, MixedSignal):
            raise TypeError(f"MixtureLoss needs the answer of TeacherMixture, got {type(teacher_output).__name__}")
        loss, metrics = self.objective.loss_and_metrics(
            student_output, data, global_valid_tokens, global_valid_seqs, teacher_output.mixed
        )
        loss_tokens = shift_token_mask(data["token_mask"]).to(torch.float64)  # [B, L - 1]
        weights = teacher_output.weights.to(device=loss_tokens.device, dtype=torch.float64)
        normaliser = float(max(global_valid_tokens, 1))
        student = _detached(student_output) if self.member_metrics else None
        for member, name in enumerate(self.names):
            # Per row [B, members], or per token [1, T, members] in a packed row (each loss token's own).
            share = weights[:, 1:, member] if weights.dim() == 3 else weights[:, member].unsqueeze(-1)
            metrics[_teacher_key(name, "token_share")] = metric_share((share * loss_tokens).sum(), normaliser)
            if student is None:
                continue
            with torch.no_grad():
                _, member_metrics = self.objective.loss_and_metrics(
                    student, data, global_valid_tokens, global_valid_seqs, teacher_output.members[member]
                )
            for key in PER_TEACHER_MEANS:
                if key in member_metrics:
                    metrics[_teacher_key(name, key)] = member_metrics[key]
        metrics.update(_timing_metrics(teacher_output.seconds))
        return loss, metrics
