"""Several teachers behind one :class:`~opd.models.interfaces.TeacherInterface` (the ``teachers:`` section).

* :class:`RoutedTeachers` (``teachers.mode: route``): every row goes to the one member its example names
  (``teacher_index``, :mod:`opd.data.teacher_choice`), asked for one signal for all or, where members have
  objectives of their own, a :class:`~opd.models.interfaces.PerTeacherRequest`. A member without rows costs
  nothing; a full-vocabulary member still sends hidden states and its head to the fused loss. The answer, a
  :class:`RoutedSignal`, is applied row group by row group by :class:`~opd.losses.several_teachers_loss.RoutedLoss`.
* :class:`TeacherMixture` (``teachers.mode: mixture``): every member scores every row and the student matches
  ``p_mix = Σ_i w_i p_i`` with the example's ``teacher_weights``. The answer is a :class:`MixedSignal`.

The mixture per signal (``w_i`` sum to 1 per row; ``T`` the loss temperature):

* full vocabulary: the logits ``T · log Σ_i w_i softmax(z_i / T)``, whose ``softmax(· / T)`` is ``p_mix``;
* top-k: a candidate (in any member's top k at ``T``) gets ``Σ_i w_i p_i(token)``, a member that did not list it
  counting 0 (its mass stays in that member's rest). The k most likely candidates are sent; the rest is
  ``Σ_i w_i rest_i`` plus the unsent candidates, summed from positive terms. A true distribution, exact when the
  members list the same tokens or k covers the vocabulary; otherwise mass moves from listed tokens into the rest;
* token log-probs: ``log Σ_i w_i p_i(token)``, exact.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import pack_rows, select_segments
from opd.kernels.topk_rest import rest_logprobs_from_topk
from opd.models.interfaces import (
    HIDDEN_STATE_SIGNALS,
    AnsweredWhereTrained,
    FullVocabRequest,
    Pending,
    PerTeacherRequest,
    SeveralTeachersSignal,
    SingleTeacherRequest,
    SingleTeacherSignal,
    StoredHiddenStates,
    TeacherHiddenStates,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TopKLogprobs,
    TopKRequest,
    signal_to_device,
)
from opd.models.lm_head import LMHeadInput

KindT = TypeVar("KindT")


def _refusal_of_members(
    names: Sequence[str], members: Sequence[TeacherInterface], requests: Sequence[TeacherRequest]
) -> str | None:
    """The first member's refusal of its request, naming that member."""
    for name, member, request in zip(names, members, requests, strict=True):
        reason = member.refusal(request)
        if reason is not None:
            return f"teacher {name!r}: {reason}"
    return None


def _single(signal: TeacherSignal) -> SingleTeacherSignal:
    """``signal`` as one member's answer; TypeError for a group's."""
    if isinstance(signal, SeveralTeachersSignal):
        raise TypeError("a member of several teachers is one teacher, not a group")
    return signal


def _as_dense(signal: TeacherSignal) -> SingleTeacherSignal:
    """Logits instead of hidden states and a head (answers that must be combined position by position)."""
    signal = _single(signal)
    return signal.logits() if isinstance(signal, LMHeadInput) else signal


def _all_of(kind: type[KindT], signals: Sequence[SingleTeacherSignal]) -> list[KindT]:
    """``signals``, every one of type ``kind`` (the answers of one request); TypeError otherwise."""
    found: list[KindT] = [signal for signal in signals if isinstance(signal, kind)]
    if len(found) != len(signals):
        raise TypeError("the teachers answered one request with different kinds of signal")
    return found


def single_rows(signal: TeacherSignal, rows: torch.Tensor, width: int) -> SingleTeacherSignal:
    """Rows ``rows`` of one teacher's ``[B, L, ...]`` answer, cut to ``width`` positions."""
    return map_single(signal, lambda tensor: tensor[rows.to(tensor.device), :width])


def map_single(signal: TeacherSignal, per_row: Callable[[torch.Tensor], torch.Tensor]) -> SingleTeacherSignal:
    """One teacher's answer with ``per_row`` applied to each of its ``[B, L, ...]`` tensors."""
    signal = _single(signal)
    if isinstance(signal, LMHeadInput):
        return dataclasses.replace(signal, hidden_states=per_row(signal.hidden_states))
    if isinstance(signal, TeacherHiddenStates):
        return TeacherHiddenStates(per_row(signal.hidden_states))
    if isinstance(signal, StoredHiddenStates):  # applied where they are fetched
        return signal.then(per_row)
    if isinstance(signal, TopKLogprobs):
        rest = per_row(signal.rest_logprobs) if signal.rest_logprobs is not None else None
        return TopKLogprobs(per_row(signal.logprobs), per_row(signal.ids), rest)
    if isinstance(signal, tuple):
        return (per_row(signal[0]), per_row(signal[1]))
    if isinstance(signal, AnsweredWhereTrained):  # made where the rows are: nothing to select
        return signal
    return per_row(signal)


class _Combined(Pending[TeacherSignal]):
    """Members' pending answers, combined when collected; each one's time runs from the start to its collection."""

    def __init__(
        self,
        names: Sequence[str],
        pending: Sequence[Pending[TeacherSignal]],
        combine: Callable[[list[TeacherSignal], dict[str, float]], SeveralTeachersSignal],
    ) -> None:
        self.names, self.pending, self.combine = list(names), list(pending), combine
        self.started = time.perf_counter()

    def result(self) -> TeacherSignal:
        """Waits for every member, then combines their answers."""
        answers: list[TeacherSignal] = []
        seconds: dict[str, float] = {}
        for name, pending in zip(self.names, self.pending, strict=True):
            answers.append(pending.result())
            seconds[name] = time.perf_counter() - self.started
        return self.combine(answers, seconds)


def waits_for_heads(signal: TeacherSignal) -> bool:
    """Whether the answer holds members' bare hidden states, combinable only where their heads are (trainer workers)."""
    if isinstance(signal, RoutedSignal):
        return any(isinstance(part.signal, HIDDEN_STATE_SIGNALS) for part in signal.parts)
    return isinstance(signal, MixedSignal) and signal.mixed is None


# --------------------------------------------------------------------------- routing


@dataclass
class RoutedPart:
    """One member's answer for the rows routed to it; ``teacher`` indexes ``teachers.members``.

    ``rows``: ``[b]`` int64 positions of its rows in the micro-batch (packed: of its sequences' tokens in the row);
    ``signal``: its answer for them, in that order (packed: one row of its sequences); ``segments``: packed only, which
    sequences of the packed row are its.
    """

    teacher: int
    rows: torch.Tensor
    signal: TeacherSignal
    segments: torch.Tensor | None = None


@dataclass
class RoutedSignal(SeveralTeachersSignal):
    """Several teachers' answers, each for its own rows of one micro-batch.

    ``parts``: one per member with rows, in member order; ``batch_size``: 1 when packed; ``seconds``: scoring time by
    member name; ``packed_length``: a packed micro-batch's tokens (the parts hold token positions), else None.
    """

    parts: list[RoutedPart]
    batch_size: int
    seconds: dict[str, float] = field(default_factory=dict)
    packed_length: int | None = None

    def combined(self) -> SingleTeacherSignal:
        """The parts in row order as one answer; logits cut to the narrowest width (wider outputs are padding)."""
        signals = [_as_dense(part.signal) for part in self.parts]
        rows = [part.rows for part in self.parts]
        size = self.batch_size if self.packed_length is None else self.packed_length
        # Packed parts are one row each: their positions are along the second dimension.
        scatter = _scatter_rows if self.packed_length is None else _scatter_positions
        if isinstance(signals[0], tuple):
            pairs = _all_of(tuple, signals)
            logprobs = scatter([pair[0] for pair in pairs], rows, size)
            ids = scatter([pair[1] for pair in pairs], rows, size)
            rests = [pair.rest_logprobs for pair in pairs if isinstance(pair, TopKLogprobs)]
            known = [rest for rest in rests if rest is not None]
            rest = scatter(known, rows, size) if len(known) == len(pairs) else None
            return TopKLogprobs(logprobs, ids, rest)
        tensors = _all_of(torch.Tensor, signals)
        if tensors[0].dim() == 3:
            width = min(tensor.shape[-1] for tensor in tensors)
            tensors = [tensor[..., :width] for tensor in tensors]
        return scatter(tensors, rows, size)

    def to(self, device: torch.device) -> RoutedSignal:
        """Every part's answer on ``device`` (the row positions stay on the CPU)."""
        parts = [
            RoutedPart(part.teacher, part.rows, _single_to(part.signal, device), part.segments) for part in self.parts
        ]
        return RoutedSignal(parts, self.batch_size, dict(self.seconds), self.packed_length)

    def select_rows(self, rows: torch.Tensor, width: int) -> RoutedSignal:
        """Each member's answer for its rows among ``rows``, renumbered in their order; carries no scoring times."""
        rows = rows.cpu()
        place = torch.full((self.batch_size,), -1, dtype=torch.long)
        place[rows] = torch.arange(rows.numel())
        parts: list[RoutedPart] = []
        for part in self.parts:
            local = place[part.rows.cpu()]
            kept = (local >= 0).nonzero().squeeze(-1)
            if kept.numel():
                parts.append(RoutedPart(part.teacher, local[kept], single_rows(part.signal, kept, width)))
        return RoutedSignal(parts, rows.numel())

    def pack(self, lengths: list[int]) -> RoutedSignal:
        """Each member's rows become its sequences of the packed row (their tokens' positions)."""
        starts = [sum(lengths[:index]) for index in range(len(lengths))]
        parts = []
        for part in self.parts:
            segments = [int(row) for row in part.rows]
            positions = torch.cat([torch.arange(starts[row], starts[row] + lengths[row]) for row in segments])
            own_lengths = [lengths[row] for row in segments]
            signal = map_single(part.signal, functools.partial(pack_rows, lengths=own_lengths))
            parts.append(RoutedPart(part.teacher, positions, signal, torch.tensor(segments)))
        return RoutedSignal(parts, 1, dict(self.seconds), sum(lengths))


def _single_to(signal: TeacherSignal, device: torch.device) -> SingleTeacherSignal:
    return _single(signal_to_device(signal, device))


def _scatter_positions(pieces: Sequence[torch.Tensor], positions: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """One packed row ``[1, length, ...]`` from each part's ``[1, n_i, ...]`` answer at its positions."""
    first = pieces[0]
    out = first.new_zeros((1, length, *first.shape[2:]))
    for piece, index in zip(pieces, positions, strict=True):
        out[:, index.to(out.device)] = piece.to(out.device)
    return out


def _scatter_rows(pieces: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], batch_size: int) -> torch.Tensor:
    first = pieces[0]
    out = first.new_zeros((batch_size, *first.shape[1:]))
    for piece, index in zip(pieces, rows, strict=True):
        out[index.to(out.device)] = piece.to(out.device)
    return out


class _SeveralTeachers(TeacherInterface):
    """Members behind one teacher; ``names`` name the metrics."""

    def __init__(self, names: Sequence[str], members: Sequence[TeacherInterface]) -> None:
        if len(names) != len(members) or not members:
            raise ValueError(f"{type(self).__name__} needs one name per member, and at least one member")
        self.names = list(names)
        self.members = list(members)

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """Depends on the members (see :meth:`refusal`)."""
        return None

    def close(self) -> None:
        """Closes every member."""
        for member in self.members:
            member.close()


class RoutedTeachers(_SeveralTeachers):
    """Each row is scored by the member its example was routed to (``teacher_index``)."""

    def refusal(self, request: TeacherRequest) -> str | None:
        """The first member's refusal of its request, naming that member."""
        return _refusal_of_members(self.names, self.members, self._requests(request))

    def _requests(self, request: TeacherRequest) -> list[SingleTeacherRequest]:
        """Each member's request: its own from a :class:`PerTeacherRequest`, else ``request`` for all."""
        if not isinstance(request, PerTeacherRequest):
            return [request] * len(self.members)
        if len(request.requests) != len(self.members):
            raise ValueError(
                f"a request per teacher has {len(request.requests)} requests for {len(self.members)} teachers"
            )
        return list(request.requests)

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> RoutedSignal:
        """Each member scores its own rows with its own request; members without rows are not called.

        Raises:
            ValueError: no or an out-of-range ``teacher_index``, or a PerTeacherRequest without one request per member.
        """
        parts: list[RoutedPart] = []
        seconds: dict[str, float] = {}
        requests = self._requests(request)
        for position, rows in self._routes(data):
            started = time.perf_counter()
            selected, part_rows, segments = _routed_rows(data, rows)
            signal = self.members[position].score(selected, requests[position])
            seconds[self.names[position]] = time.perf_counter() - started
            parts.append(RoutedPart(position, part_rows, signal, segments))
        return RoutedSignal(parts, data.size, seconds, _packed_length(data))

    def score_async(self, data: BatchedDataDict, request: TeacherRequest) -> Pending[TeacherSignal]:
        """Starts each member with rows on them (in the background where it can); combined as :meth:`score` does."""
        requests = self._requests(request)
        routes = self._routes(data)
        selections = [_routed_rows(data, rows) for _, rows in routes]
        pending = [
            self.members[position].score_async(selected, requests[position])
            for (position, _), (selected, _, _) in zip(routes, selections, strict=True)
        ]

        def combine(answers: list[TeacherSignal], seconds: dict[str, float]) -> RoutedSignal:
            parts = [
                RoutedPart(position, part_rows, answer, segments)
                for (position, _), (_, part_rows, segments), answer in zip(routes, selections, answers, strict=True)
            ]
            return RoutedSignal(parts, data.size, seconds, _packed_length(data))

        return _Combined([self.names[position] for position, _ in routes], pending, combine)

    def _routes(self, data: BatchedDataDict) -> list[tuple[int, torch.Tensor]]:
        """``(member, its rows)`` for every member with rows in ``data``, in member order."""
        if "teacher_index" not in data:
            raise ValueError("several teachers with routing need each row's teacher_index (set from the data)")
        index = data["teacher_index"]
        if "sequence_lengths" in data:  # packed: one teacher per sequence of the row
            index = index[0]
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= len(self.members)):
            raise ValueError(f"teacher_index outside 0..{len(self.members) - 1}")
        routes = [(position, (index == position).nonzero().squeeze(-1).cpu()) for position in range(len(self.members))]
        return [(position, rows) for position, rows in routes if rows.numel()]


def _packed_length(data: BatchedDataDict) -> int | None:
    """A packed micro-batch's tokens, None for right-padded rows."""
    return int(data["input_ids"].shape[1]) if "sequence_lengths" in data else None


def _routed_rows(
    data: BatchedDataDict, rows: torch.Tensor
) -> tuple[BatchedDataDict, torch.Tensor, torch.Tensor | None]:
    """``(micro-batch, part rows, segments)`` one member scores: its rows, or (packed) its sequences as a packed row."""
    if "sequence_lengths" not in data:
        return data.select_indices(rows), rows, None
    positions, selected = select_segments(data, rows)
    return selected, positions, rows


# --------------------------------------------------------------------------- mixture


@dataclass
class MixedSignal(SeveralTeachersSignal):
    """A mixture of teachers' answers, and each member's own answer (for the per-teacher metrics).

    ``mixed`` is None while members in other processes sent bare hidden states: it is made where their heads are
    (:meth:`mix_bound`). ``weights``: ``[B, members]``, rows summing to 1 (packed: ``[1, T, members]`` per token).
    """

    mixed: SingleTeacherSignal | None
    members: list[SingleTeacherSignal]
    weights: torch.Tensor
    seconds: dict[str, float] = field(default_factory=dict)
    temperature: float = 1.0

    def combined(self) -> SingleTeacherSignal:
        """The mixture; ValueError while the members' hidden states are not bound to their output layers."""
        if self.mixed is None:
            raise ValueError("the mixture's members sent hidden states: bind them to their output layers first")
        return self.mixed

    def mix_bound(self, members: Sequence[TeacherSignal]) -> MixedSignal:
        """This mixture, made (:func:`mix_logits`) from ``members``' answers with hidden states bound, if not yet."""
        if self.mixed is not None:
            return self
        dense = [_as_dense(member) for member in members]
        mixed = mix_logits(_all_of(torch.Tensor, dense), self.weights, self.temperature)
        return MixedSignal(mixed, dense, self.weights, dict(self.seconds), self.temperature)

    def to(self, device: torch.device) -> MixedSignal:
        """The mixture, every member's answer and the weights on ``device``."""
        members = [_single_to(member, device) for member in self.members]
        mixed = None if self.mixed is None else _single_to(self.mixed, device)
        return MixedSignal(mixed, members, self.weights.to(device), dict(self.seconds), self.temperature)

    def select_rows(self, rows: torch.Tensor, width: int) -> MixedSignal:
        """The mixture, answers and weights of ``rows``, cut to ``width`` positions; carries no scoring times."""
        members = [single_rows(member, rows, width) for member in self.members]
        mixed = None if self.mixed is None else single_rows(self.mixed, rows, width)
        return MixedSignal(mixed, members, self.weights[rows.to(self.weights.device)], temperature=self.temperature)

    def pack(self, lengths: list[int]) -> MixedSignal:
        """The mixture and each member's answer packed like the rows; the weights become per token."""
        packed = functools.partial(pack_rows, lengths=lengths)
        members = [map_single(member, packed) for member in self.members]
        mixed = None if self.mixed is None else map_single(self.mixed, packed)
        weights = _weights_per_token(self.weights, lengths)
        return MixedSignal(mixed, members, weights, dict(self.seconds), self.temperature)


class TeacherMixture(_SeveralTeachers):
    """Every row is scored by every member; full-vocabulary answers are mixed at the loss ``temperature``."""

    def __init__(self, names: Sequence[str], members: Sequence[TeacherInterface], temperature: float = 1.0) -> None:
        super().__init__(names, members)
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
        self.temperature = temperature

    def refusal(self, request: TeacherRequest) -> str | None:
        """A signal per teacher (they are mixed, so all answer one), else the first member's refusal."""
        if isinstance(request, PerTeacherRequest):
            return "a mixture combines one signal from every teacher; it cannot ask each for its own"
        return _refusal_of_members(self.names, self.members, [request] * len(self.members))

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> MixedSignal:
        """Every member scores every row; answers mixed with the rows' ``teacher_weights``.

        Raises:
            ValueError: no ``teacher_weights`` of one column per member, or a :class:`PerTeacherRequest`.
        """
        weights, request = self._checked(data, request)
        answers: list[TeacherSignal] = []
        seconds: dict[str, float] = {}
        for name, member in zip(self.names, self.members, strict=True):
            started = time.perf_counter()
            answers.append(member.score(data, request))
            seconds[name] = time.perf_counter() - started
        return self._mix(answers, weights, request, seconds)

    def score_async(self, data: BatchedDataDict, request: TeacherRequest) -> Pending[TeacherSignal]:
        """Starts every member on every row (in the background where it can); mixed as :meth:`score` does."""
        weights, request = self._checked(data, request)
        pending = [member.score_async(data, request) for member in self.members]
        return _Combined(self.names, pending, lambda answers, seconds: self._mix(answers, weights, request, seconds))

    def _checked(self, data: BatchedDataDict, request: TeacherRequest) -> tuple[torch.Tensor, TeacherRequest]:
        """The rows' weights, and the request every member answers."""
        if isinstance(request, PerTeacherRequest):
            raise ValueError(self.refusal(request))
        weights = data.get("teacher_weights")
        packed = "sequence_lengths" in data
        if packed and weights is not None:
            weights = weights[0]  # one row of weights per sequence of the packed row
        if weights is None or weights.dim() != 2 or weights.shape[1] != len(self.members):
            raise ValueError(
                f"a mixture of {len(self.members)} teachers needs each row's teacher_weights [B, {len(self.members)}]"
            )
        if packed:
            weights = _weights_per_token(weights, [int(length) for length in data["sequence_lengths"][0]])
        if isinstance(request, FullVocabRequest):
            request = FullVocabRequest(prefer_hidden_states=False)  # mixed position by position
        return weights, request

    def _mix(
        self, signals: list[TeacherSignal], weights: torch.Tensor, request: TeacherRequest, seconds: dict[str, float]
    ) -> MixedSignal:
        """The members' answers mixed with the rows' weights."""
        answers = [_as_dense(signal) for signal in signals]
        mixed: SingleTeacherSignal
        if isinstance(request, FullVocabRequest) and any(
            isinstance(answer, HIDDEN_STATE_SIGNALS) for answer in answers
        ):
            # Members in other processes sent hidden states alone: mixed where their heads are (mix_bound).
            return MixedSignal(None, answers, weights, seconds, self.temperature)
        if isinstance(request, FullVocabRequest):
            mixed = mix_logits(_all_of(torch.Tensor, answers), weights, self.temperature)
        elif isinstance(request, TopKRequest):
            mixed = mix_topk(_all_of(tuple, answers), weights, request.k)
        else:
            mixed = mix_token_logprobs(_all_of(torch.Tensor, answers), weights)
        return MixedSignal(mixed, answers, weights, seconds, self.temperature)


def _weights_per_token(weights: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``[1, Σ lengths, members]``: each sequence's ``[members]`` weights on each of its tokens (a packed row)."""
    counts = torch.tensor(lengths, device=weights.device)
    return torch.repeat_interleave(weights, counts, dim=0).unsqueeze(0)


def _member_weights(weights: torch.Tensor, member: int) -> torch.Tensor:
    """One member's weight at each position: ``[B, 1]`` from per-row ``[B, members]``, ``[B, L]`` from per-token."""
    return weights[..., member] if weights.dim() == 3 else weights[:, member].reshape(-1, 1)


def _log_weights(weights: torch.Tensor, like: torch.Tensor, extra_dims: int) -> torch.Tensor:
    """Log-weights broadcastable against ``[members, B, L, ...]``, from ``[B, members]`` or ``[B, L, members]``."""
    logs = weights.to(device=like.device, dtype=torch.float32).clamp_min(0).log()
    if weights.dim() == 3:
        logs = logs.permute(2, 0, 1)
        return logs.reshape(*logs.shape, *([1] * (extra_dims - 1)))
    logs = logs.transpose(0, 1)
    return logs.reshape(*logs.shape, *([1] * extra_dims))


def mix_logits(logits: Sequence[torch.Tensor], weights: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``T · log Σ_i w_i softmax(z_i / T)``, float32 ``[B, L, V]``: logits whose tempered softmax is the mixture.

    ``logits``: each member's ``[B, L, V_i]`` (cut to the narrowest); ``weights``: ``[B, members]`` rows summing to 1,
    or per token ``[B, L, members]``.
    """
    width = min(member.shape[-1] for member in logits)
    log_probs = torch.stack([torch.log_softmax(member[..., :width].float() / temperature, dim=-1) for member in logits])
    mixed = torch.logsumexp(log_probs + _log_weights(weights, log_probs, 2), dim=0)
    return mixed * temperature


def mix_token_logprobs(logprobs: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """``log Σ_i w_i p_i(token)`` at every position, from each member's ``[B, L]`` token log-probs."""
    stacked = torch.stack([member.float() for member in logprobs])
    return torch.logsumexp(stacked + _log_weights(weights, stacked, 1), dim=0)


def mix_topk(answers: Sequence[tuple[torch.Tensor, torch.Tensor]], weights: torch.Tensor, k: int) -> TopKLogprobs:
    """The mixture's ``min(k, candidates)`` most likely candidates, sorted, and its rest (see the module docstring).

    ``answers``: each member's ``[B, L, k_i]`` log-probs and ids (with its rest mass if a TopKLogprobs carries one);
    ``weights`` as in :func:`mix_logits`.
    """
    ids = torch.cat([answer[1] for answer in answers], dim=-1)  # [B, L, C] candidates
    probs = torch.zeros(ids.shape, dtype=torch.float64, device=ids.device)
    rest = torch.zeros(ids.shape[:-1], dtype=torch.float64, device=ids.device)
    member_weights = weights.to(device=ids.device, dtype=torch.float64)
    for member, answer in enumerate(answers):
        w = _member_weights(member_weights, member)
        probs += w.unsqueeze(-1) * _probability_where_listed(ids, answer[1], answer[0])
        member_rest = answer.rest_logprobs if isinstance(answer, TopKLogprobs) else None
        if member_rest is None:
            member_rest = rest_logprobs_from_topk(answer[0].double())
        rest += w * member_rest.double().exp()
    # A token listed by several members is one candidate: every occurrence after the first is dropped.
    sorted_ids, order = ids.sort(dim=-1, stable=True)
    repeat_sorted = torch.zeros_like(sorted_ids, dtype=torch.bool)
    repeat_sorted[..., 1:] = sorted_ids[..., 1:] == sorted_ids[..., :-1]
    repeated = torch.zeros_like(repeat_sorted).scatter(-1, order, repeat_sorted)
    probs = probs.masked_fill(repeated, -1.0)
    # Each member listed min(k, V) distinct tokens, so there are at least that many candidates.
    take = min(k, max(answer[1].shape[-1] for answer in answers))
    top, chosen = probs.topk(take, dim=-1)
    rest = rest + probs.scatter(-1, chosen, -1.0).clamp_min(0).sum(-1)  # candidates not sent
    rest_logprobs = torch.where(rest > 0, rest.log(), torch.full_like(rest, -math.inf))
    return TopKLogprobs(top.clamp_min(0).log().float(), ids.gather(-1, chosen), rest_logprobs.float())


def _probability_where_listed(candidates: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """``[..., C]`` float64: a member's probability of each candidate it listed, else 0 (binary search: O(C) memory)."""
    sorted_ids, order = ids.sort(dim=-1)
    place = torch.searchsorted(sorted_ids.contiguous(), candidates.contiguous()).clamp_max(ids.shape[-1] - 1)
    listed = sorted_ids.gather(-1, place) == candidates
    probs = logprobs.double().exp().gather(-1, order).gather(-1, place)
    return torch.where(listed, probs, torch.zeros_like(probs))
