"""One trace of a trainer rank's step on fake tensors (:func:`opd.plan.dry_run.dry_run_rank`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from opd.distributed.trainer_worker import TrainerSpec, TrainerWorker
from opd.kernels.fused_lm_head import alike_chunks_traced_once
from opd.models.interfaces import (
    AnsweredWhereTrained,
    FullVocabRequest,
    LossFunction,
    TeacherHiddenStates,
    TeacherRequest,
    TeacherSignal,
    TokenLogprobsRequest,
    TopKLogprobs,
    TopKRequest,
)
from opd.plan.fake_device import DeviceAudit
from opd.plan.fake_step import (
    StepShape,
    check_phase_peaks,
    fake_step,
    hidden_states_as_module_call,
    local_bytes,
    local_tensor,
    phase_peaks,
    planned_micro_batch,
)
from opd.plan.layer_extrapolation import Trace


def _tracked_kinds() -> Any:
    """FSDPMemTracker's categories plus the colocated teacher's weights (which it does not know of)."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.distributed._tools.mem_tracker import _RefType

    kinds = {kind.name: kind.value for kind in _FSDPRefType}
    kinds["TEACHER"] = "Teacher Param"
    return _RefType("_TrackedKinds", kinds)  # type: ignore[call-overload]


def _teacher_answer(
    request: TeacherRequest, shape: StepShape, vocab_size: int, hidden_size: int | None
) -> TeacherSignal:
    """A teacher's answer to ``request`` for one micro-batch, as it arrives from another process (host tensors)."""
    rows, length = shape.micro_batch_size, shape.row_tokens
    if isinstance(request, FullVocabRequest):
        if hidden_size is None:
            raise ValueError("a full-vocabulary answer from a teacher apart needs the teacher's hidden size")
        return TeacherHiddenStates(torch.zeros(rows, length, hidden_size, dtype=torch.bfloat16))
    if isinstance(request, TopKRequest):
        k = min(request.k, vocab_size)
        return TopKLogprobs(
            torch.zeros(rows, length, k), torch.zeros(rows, length, k, dtype=torch.long), torch.zeros(rows, length)
        )
    if isinstance(request, TokenLogprobsRequest):
        return torch.zeros(rows, length)
    raise ValueError(f"the dry run does not plan a teacher apart answering {type(request).__name__}")


def adam_state_in_place(trainer: TrainerWorker) -> None:
    """Gives every parameter Adam's moments, as every step after the first finds them.

    One optimizer step over zero gradients; the learning-rate schedule is not stepped.
    """
    for parameter in trainer.model.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def trace_rank(
    spec: TrainerSpec,
    world_size: int,
    rank: int,
    shape: StepShape,
    loss_fn: LossFunction,
    vocab_size: int,
    teacher_hidden_size: int | None,
    device: torch.device,
) -> Trace:
    """One dry run of :func:`~opd.plan.dry_run.dry_run_rank`, at the depths the context sets."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    # One pass per row: the shared-prompt forward groups rows by token values, which fake tensors lack
    # (its prompt cache is not counted).
    spec = replace(spec, teacher_share_prompt_forward=(False,) * len(spec.colocated_teachers()))
    global_tokens = shape.micro_batch_size * shape.response_tokens * shape.micro_batches * world_size
    global_rows = shape.micro_batch_size * shape.micro_batches * world_size
    audit = DeviceAudit(device)
    with fake_step(rank, world_size, spec.shard_group_size, shape, audit) as mesh:
        micro_batch = planned_micro_batch(shape, vocab_size)  # fake host tensors, as the controller sends them
        request = loss_fn.teacher_request
        # A teacher apart sends its answer; a colocated one answers in the worker.
        signals: list[TeacherSignal] | None = (
            None
            if request is None
            else [_teacher_answer(request, shape, vocab_size, teacher_hidden_size)] * shape.micro_batches
            if spec.teacher_path is None
            else [AnsweredWhereTrained(request)] * shape.micro_batches
        )
        trainer = TrainerWorker(rank, world_size, spec)
        trainer.build(mesh, device)
        adam_state_in_place(trainer)
        # A colocated copy, or the output layer that binds a teacher apart's hidden states.
        teacher_tensors: list[torch.Tensor] = []
        if trainer.teacher_members:
            teacher_tensors = list(trainer.teacher_members[0].model.parameters())
        elif trainer.teacher_heads and trainer.teacher_heads[0] is not None:
            head = trainer.teacher_heads[0]
            teacher_tensors = [head.weight] + ([head.bias] if head.bias is not None else [])
        teacher_bytes = local_bytes(teacher_tensors)
        tracker = FSDPMemTracker(trainer.model, trainer.optimizer)
        kinds = _tracked_kinds()
        tracker._ref_class = kinds
        for tensor in teacher_tensors:  # the tracker counts only the student's own weights unless told
            tracker._update_and_maybe_create_winfos(local_tensor(tensor), kinds.TEACHER)
        hidden_states_as_module_call(trainer.model)
        models = {"student": (spec.student_path, trainer.model)}
        for index, (path, member) in enumerate(zip(spec.colocated_teachers(), trainer.teacher_members, strict=True)):
            models[f"teacher{index}"] = (path, member.model)
        phases = phase_peaks(tracker, models, trainer.model)
        with tracker, alike_chunks_traced_once():
            phases.record()
            # Else the tracker refuses the root's next forward; the peak is unaffected.
            trainer.model.register_forward_pre_hook(lambda *_: tracker.reset_mod_stats(), prepend=True)
            trainer.train(loss_fn, global_tokens, global_rows, [micro_batch] * shape.micro_batches, signals)
        parameters = list(trainer.model.parameters())
        optimizer_state = local_bytes(
            value for state in trainer.optimizer.state.values() for value in state.values() if torch.is_tensor(value)
        )
    figures = {
        "student_parameters": local_bytes(parameters),
        # Live from backward to optimizer step: one sharded copy of the trained weights (LoRA: adapters alone).
        "student_gradients": local_bytes(parameter for parameter in parameters if parameter.requires_grad),
        "optimizer_state": optimizer_state,
        "teacher_parameters": teacher_bytes,
        "collectives": audit.collectives,
    }
    check_phase_peaks(phases, tracker)
    return Trace(figures, phases.peaks)
