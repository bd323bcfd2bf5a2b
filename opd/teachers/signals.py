"""What the driver does with a teacher's whole-batch answer: one micro-batch's rows of it, and its checkpoint form.

A batch scored ahead (:mod:`opd.distillation.step`) is checkpointed as plain tensors while in flight; hidden states
are never saved (``[B, L, D]`` per batch would outweigh the checkpoint), so the teacher scores it again on resume.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import pack_rows
from opd.models.interfaces import (
    SeveralTeachersSignal,
    SingleTeacherSignal,
    TeacherHiddenStates,
    TeacherSignal,
    TopKLogprobs,
)
from opd.models.lm_head import LMHeadInput
from opd.teachers.several_teachers import MixedSignal, RoutedPart, RoutedSignal


def holds_hidden_states(signal: TeacherSignal | None) -> bool:
    """Whether ``signal``, or any teacher's part of it (routing, a mixture), is hidden states."""
    if isinstance(signal, RoutedSignal):
        return any(holds_hidden_states(part.signal) for part in signal.parts)
    if isinstance(signal, MixedSignal):
        return any(holds_hidden_states(member) for member in (signal.mixed, *signal.members))
    return isinstance(signal, (LMHeadInput, TeacherHiddenStates))


def signal_to_state(signal: TeacherSignal | None) -> dict[str, Any] | None:
    """A signal as plain tensors (checkpoints load with ``weights_only``); several teachers' answers keep parts."""
    if signal is None:
        return None
    if isinstance(signal, RoutedSignal):
        parts = [
            {"teacher": part.teacher, "rows": part.rows, "signal": signal_to_state(part.signal)}
            for part in signal.parts
        ]
        return {"kind": "routed", "parts": parts, "batch_size": signal.batch_size}
    if isinstance(signal, MixedSignal):
        return {
            "kind": "mixed",
            "mixed": signal_to_state(signal.mixed),
            "members": [signal_to_state(member) for member in signal.members],
            "weights": signal.weights,
        }
    if isinstance(signal, TopKLogprobs):
        return {"kind": "topk", "logprobs": signal.logprobs, "ids": signal.ids, "rest": signal.rest_logprobs}
    if isinstance(signal, tuple):
        return {"kind": "tuple", "parts": list(signal)}
    assert isinstance(signal, torch.Tensor)  # token log-probs (hidden states are never saved)
    return {"kind": "tensor", "value": signal}


def signal_from_state(state: dict[str, Any] | None) -> TeacherSignal | None:
    if state is None:
        return None
    if state["kind"] == "routed":
        parts = [RoutedPart(part["teacher"], part["rows"], _single(part["signal"])) for part in state["parts"]]
        return RoutedSignal(parts, state["batch_size"])
    if state["kind"] == "mixed":
        members = [_single(member) for member in state["members"]]
        return MixedSignal(_single(state["mixed"]), members, state["weights"])
    if state["kind"] == "topk":
        return TopKLogprobs(state["logprobs"], state["ids"], state["rest"])
    if state["kind"] == "tuple":
        return tuple(state["parts"])
    return state["value"]


def _single(state: dict[str, Any]) -> SingleTeacherSignal:
    """One member's answer from its state."""
    signal = signal_from_state(state)
    assert signal is not None and not isinstance(signal, SeveralTeachersSignal)
    return signal


def signal_rows(signal: TeacherSignal, micro_batch: BatchedDataDict) -> TeacherSignal:
    """The rows of a whole batch's teacher signal that a micro-batch holds (``sample_index``), cut to its width.

    A packed micro-batch (one row with ``sequence_lengths``) gets its rows packed as its tokens are, so each
    position keeps the teacher's answer for it (what the teacher answers when it scores the packed row itself).
    """
    if "sequence_lengths" in micro_batch:
        rows = micro_batch["sample_index"][0].cpu()
        lengths = [int(length) for length in micro_batch["sequence_lengths"][0]]
        if isinstance(signal, SeveralTeachersSignal):
            return signal.select_rows(rows, max(lengths)).pack(lengths)
        if isinstance(signal, TeacherHiddenStates):
            return TeacherHiddenStates(pack_rows(signal.hidden_states, lengths, rows.tolist()))
        if isinstance(signal, LMHeadInput):
            return signal.with_rows(pack_rows(signal.hidden_states, lengths, rows.tolist()))
        return _map_tensors(signal, lambda part: pack_rows(part, lengths, rows.tolist()))
    rows = micro_batch["sample_index"].cpu()
    width = micro_batch["input_ids"].shape[1]
    if isinstance(signal, TeacherHiddenStates):
        return signal.rows(rows, width)
    if isinstance(signal, LMHeadInput):
        return signal.with_rows(signal.hidden_states[rows.to(signal.hidden_states.device), :width])
    if isinstance(signal, SeveralTeachersSignal):
        return signal.select_rows(rows, width)
    return _map_tensors(signal, lambda part: part[rows.to(part.device), :width])


def _map_tensors(signal: TeacherSignal, per_row: Callable[[torch.Tensor], torch.Tensor]) -> TeacherSignal:
    """One teacher's top-k or token signal with ``per_row`` applied to each of its ``[B, L, ...]`` tensors."""
    if isinstance(signal, TopKLogprobs):
        rest = per_row(signal.rest_logprobs) if signal.rest_logprobs is not None else None
        return TopKLogprobs(per_row(signal.logprobs), per_row(signal.ids), rest)
    if isinstance(signal, tuple):
        return tuple(per_row(part) for part in signal)  # type: ignore[return-value]
    assert isinstance(signal, torch.Tensor)  # full-vocabulary signals are scored by the trainer
    return per_row(signal)
