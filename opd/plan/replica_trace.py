"""One trace of a teacher-pool replica's forward on fake tensors (:func:`opd.plan.dry_run.dry_run_teacher_replica`)."""

from __future__ import annotations

from typing import Any

import torch

from opd.distributed.fsdp import shard_model
from opd.distributed.trainer_worker import ShardedTeacher
from opd.models.interfaces import FullVocabRequest, TeacherRequest
from opd.plan.fake_device import DeviceAudit
from opd.plan.fake_step import (
    StepShape,
    check_phase_peaks,
    fake_step,
    local_bytes,
    phase_peaks,
    planned_micro_batch,
    skeleton,
)
from opd.plan.layer_extrapolation import Trace
from opd.teachers.local_teacher import LocalTeacher


def trace_teacher_replica(
    path: str,
    dtype: torch.dtype,
    shards_per_replica: int,
    shape: StepShape,
    request: TeacherRequest,
    device: torch.device,
) -> Trace:
    """One dry run of :func:`~opd.plan.dry_run.dry_run_teacher_replica`, at the depths the context sets."""
    from torch.distributed._tools.mem_tracker import MemTracker

    with fake_step(0, shards_per_replica, None, shape, DeviceAudit(device)) as mesh:
        model = skeleton(path, dtype)
        if shards_per_replica > 1:
            model = shard_model(model, mesh)
        model.to_empty(device=device)
        if shards_per_replica == 1 and getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()  # to_empty gave the tied head a tensor of its own
        # One pass per row: the shared-prompt forward groups rows by token values, which fake tensors lack.
        teacher = ShardedTeacher(model) if shards_per_replica > 1 else LocalTeacher(model, share_prompt_forward=False)
        # The tracker hooks every parameter's gradient, which a frozen weight refuses; scoring stays no-grad.
        model.requires_grad_(True)
        weights = local_bytes(model.parameters())
        batch = planned_micro_batch(shape, model.config.vocab_size)
        tracker = MemTracker()
        tracker.track_external(model)
        phases = phase_peaks(tracker, {"teacher": (path, model)}, None)
        with tracker, torch.no_grad():
            phases.record()
            if isinstance(request, FullVocabRequest):
                answer: Any = teacher.get_hidden_states(batch).hidden_states
            else:
                answer = teacher.score(batch, request)
        # Top-k: the pair of tensors and the rest mass; the other answers are one tensor.
        answer_bytes = local_bytes([answer] if torch.is_tensor(answer) else [*answer, answer.rest_logprobs])
    check_phase_peaks(phases, tracker)
    return Trace({"weights": weights, "answer": answer_bytes}, phases.peaks)
