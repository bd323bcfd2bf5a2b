"""Reading vLLM's ``prompt_logprobs`` answers: the served teacher's JSON route, e.g. against ``vllm serve``.

Every answer is checked against what was sent before use (:func:`parse_prompt_logprobs`);
:class:`~opd.teachers.served.wire.WireError` names the first mismatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from opd.kernels.topk_rest import rest_logprobs_from_topk
from opd.teachers.served.wire import REST_MASS_TOLERANCE, WireError

REST_MASS_FIELD = "prompt_topk_rest_mass"
"""The choice field with each position's probability mass outside its top k (not in vLLM's API)."""
TopKBuffers = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""float64 top-k log-probs ``[B, L, k]``, int64 ids ``[B, L, k]`` and float64 rest log-mass ``[B, L]``, filled in."""


@dataclass(frozen=True)
class ScoredSequence:
    """One sequence's ``{token id: log-prob}`` and rest mass (if sent) per position; index 0 is no prediction."""

    candidates: list[dict[int, float]]
    rest_mass: list[float] | None


def top_k(candidates: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ``(token, log-prob)`` of a position (the answer may add the actual token)."""
    return sorted(candidates.items(), key=lambda item: -item[1])[:k]


def _parse_rest_mass(
    choice: dict[str, Any], number: int, candidates: list[dict[int, float]], k: int
) -> list[float] | None:
    """The choice's ``prompt_topk_rest_mass`` or None; WireError unless each is in [0, 1] and adds up with the top k."""
    served = choice.get(REST_MASS_FIELD)
    if served is None or k == 0:
        return None
    if not isinstance(served, list) or len(served) != len(candidates):
        raise WireError(f"sequence {number}: {REST_MASS_FIELD} is not a list of one entry per token")
    for position in range(1, len(candidates)):
        mass = served[position]
        if not isinstance(mass, (int, float)) or not 0.0 <= mass <= 1.0 + REST_MASS_TOLERANCE:
            raise WireError(f"sequence {number}, position {position}: rest mass {mass!r} is not in [0, 1]")
        topk_mass = math.fsum(math.exp(logprob) for _, logprob in top_k(candidates[position], k))
        if abs(topk_mass + mass - 1.0) > REST_MASS_TOLERANCE:
            raise WireError(
                f"sequence {number}, position {position}: the top-{k} mass {topk_mass:.6g} and the rest mass "
                f"{mass:.6g} do not add up to 1"
            )
    return [0.0] + [min(float(mass), 1.0) for mass in served[1:]]


def parse_prompt_logprobs(payload: dict[str, Any], sequences: list[list[int]], k: int) -> list[ScoredSequence]:
    """The log-probs (and rest masses) of a ``/v1/completions`` answer, checked against the ids sent (WireError)."""
    choices = payload.get("choices")
    if not isinstance(choices, list) or len(choices) != len(sequences):
        raise WireError(
            f"expected {len(sequences)} choices, got "
            f"{len(choices) if isinstance(choices, list) else type(choices).__name__}"
        )
    ordered = sorted(choices, key=lambda choice: choice.get("index", 0) if isinstance(choice, dict) else 0)
    answers = []
    for number, (choice, sent) in enumerate(zip(ordered, sequences)):
        if not isinstance(choice, dict) or choice.get("index", number) != number:
            raise WireError(f"choice {number} is missing or out of order")
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and echoed != sent:
            raise WireError(f"sequence {number}: the server scored other token ids than were sent")
        positions = choice.get("prompt_logprobs")
        if not isinstance(positions, list) or len(positions) != len(sent):
            got = len(positions) if isinstance(positions, list) else type(positions).__name__
            raise WireError(f"sequence {number}: {got} prompt_logprobs entries for {len(sent)} tokens")
        answer: list[dict[int, float]] = [{}]
        for position in range(1, len(sent)):
            entry = positions[position]
            if not isinstance(entry, dict):
                raise WireError(f"sequence {number}, position {position}: no log-probs")
            candidates: dict[int, float] = {}
            for token, info in entry.items():
                logprob = info.get("logprob") if isinstance(info, dict) else info
                if not isinstance(logprob, (int, float)) or math.isnan(logprob) or logprob > 0:
                    raise WireError(f"sequence {number}, position {position}: log-prob {logprob!r} for token {token}")
                candidates[int(token)] = float(logprob)
            if sent[position] not in candidates:
                raise WireError(
                    f"sequence {number}, position {position}: the answer does not score the token "
                    f"sent there ({sent[position]})"
                )
            if not math.isfinite(candidates[sent[position]]):
                # The loss would take log 0 for a token the student did produce.
                raise WireError(
                    f"sequence {number}, position {position}: the teacher gives the token sent there "
                    f"({sent[position]}) probability 0"
                )
            if len(candidates) < k:
                raise WireError(
                    f"sequence {number}, position {position}: {len(candidates)} candidates, fewer than k = {k}"
                )
            answer.append(candidates)
        answers.append(ScoredSequence(answer, _parse_rest_mass(choice, number, answer, k)))
    return answers


def placeholder_topk(rows: int, width: int, k: int) -> TopKBuffers:
    """float64 top-k log-probs, ids and rest log-mass ``[rows, width(, k)]`` for the positions no answer covers.

    A finite placeholder the loss masks: ids ``0 … k-1`` at ``1 / (2k)`` each, rest 1/2. float64 because JSON carries
    doubles and a rest computed from the top k needs them.
    """
    values = torch.full((rows, width, k), math.log(0.5 / k), dtype=torch.float64)
    ids = torch.arange(k, dtype=torch.long).expand(rows, width, k).clone()
    rest = torch.full((rows, width), math.log(0.5), dtype=torch.float64)
    return values, ids, rest


def fill_topk_from_scored(
    answers: list[ScoredSequence], k: int, values: torch.Tensor, ids: torch.Tensor, rest: torch.Tensor
) -> None:
    """Writes each sequence's top k (position t describes token t + 1) into ``values``, ``ids`` and ``rest``.

    The rest is the answer's own where it has one, else log(1 − Σ_k P) in float64 (exact for the values received).
    """
    has_rest = torch.zeros(rest.shape, dtype=torch.bool)
    served_rest = torch.ones(rest.shape, dtype=torch.float64)
    for row, answer in enumerate(answers):
        if len(answer.candidates) < 2:
            continue
        # One tensor per row, not per position: this loop runs over every scored token.
        tops = [top_k(candidates, k) for candidates in answer.candidates[1:]]
        ids[row, : len(tops)] = torch.tensor([[token for token, _ in top] for top in tops])
        values[row, : len(tops)] = torch.tensor([[logprob for _, logprob in top] for top in tops])
        if answer.rest_mass is not None:
            served_rest[row, : len(tops)] = torch.tensor(answer.rest_mass[1:], dtype=torch.float64)
            has_rest[row, : len(tops)] = True
        else:
            rest[row, : len(tops)] = rest_logprobs_from_topk(values[row, : len(tops)])
    rest.copy_(torch.where(has_rest, served_rest.log(), rest))


def fill_token_logprobs_from_scored(
    answers: list[ScoredSequence], input_ids: torch.Tensor, result: torch.Tensor
) -> None:
    """Writes log P(token t | tokens before t) of each scored position into ``result`` ``[B, L]``."""
    for row, answer in enumerate(answers):
        for position in range(1, len(answer.candidates)):
            result[row, position] = answer.candidates[position][int(input_ids[row, position])]
