"""What the driver does with a teacher's whole-batch answer: one micro-batch's rows of it, and its checkpoint form.

A batch scored ahead (:mod:`opd.distillation.step`) is checkpointed as plain tensors while in flight; hidden states
are never saved (``[B, L, D]`` per batch would outweigh the checkpoint), so the teacher scores it again on resume.
"""

from __future__ import annotations

from typing import Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import pack_rows
from opd.models.interfaces import (
    HIDDEN_STATE_SIGNALS,
    AnsweredWhereTrained,
    SeveralTeachersSignal,
    SingleTeacherSignal,
    TeacherSignal,
    TopKLogprobs,
)
from opd.models.lm_head import LMHeadInput
from opd.teachers.several_teachers import MixedSignal, RoutedPart, RoutedSignal, map_single, single_rows


def holds_hidden_states(signal: TeacherSignal | None) -> bool:
    """Whether ``signal``, or any teacher's part of it (routing, a mixture), is hidden states."""
    if isinstance(signal, RoutedSignal):
        return any(holds_hidden_states(part.signal) for part in signal.parts)
    if isinstance(signal, MixedSignal):
        return any(holds_hidden_states(member) for member in (signal.mixed, *signal.members))
    return isinstance(signal, (LMHeadInput, *HIDDEN_STATE_SIGNALS))


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
    assert not isinstance(signal, AnsweredWhereTrained)  # answered per micro-batch where it trains: nothing to cut
    if "sequence_lengths" in micro_batch:
        rows = micro_batch["sample_index"][0].cpu()
        lengths = [int(length) for length in micro_batch["sequence_lengths"][0]]
        if isinstance(signal, SeveralTeachersSignal):
            return signal.select_rows(rows, max(lengths)).pack(lengths)
        return map_single(signal, lambda part: pack_rows(part, lengths, rows.tolist()))
    rows = micro_batch["sample_index"].cpu()
    width = micro_batch["input_ids"].shape[1]
    if isinstance(signal, SeveralTeachersSignal):
        return signal.select_rows(rows, width)
    return single_rows(signal, rows, width)
