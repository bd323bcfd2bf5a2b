"""A teacher served over HTTP: vLLM's OpenAI-compatible server or ``opd serve-teacher``.

The client sends the student's token ids as prompts of ``POST /v1/completions`` with
``max_tokens: 1`` and ``prompt_logprobs: k`` (the request vLLM answers with each prompt
position's log-probs) and turns the answers into the signal the loss requested
(:meth:`RemoteTeacher.score`):

* a :class:`~opd.models.interfaces.TopKRequest`: the teacher's top-k log-probs and ids at
  each position ``t`` (describing token ``t + 1``), from the answer at position ``t + 1``,
  with the log of the mass outside them: the one ``opd serve-teacher`` sends
  (``prompt_topk_rest_mass``, summed from its full distribution), or, from a server that
  does not send it (vLLM), log(1 − Σ_k P) computed here in float64 from the top-k
  (:func:`~opd.models.topk_rest.rest_logprobs_from_topk`);
* a :class:`~opd.models.interfaces.TokenLogprobsRequest`: the log-prob of each actual token.

Full-vocabulary logits never cross the wire: a
:class:`~opd.models.interfaces.FullVocabRequest` is refused.

Robustness: sequences go out in requests of ``sequences_per_request``, at most
``max_concurrency`` at a time; a request that fails in transport (refused connection,
timeout, truncated body), with HTTP 408 / 429 / 5xx, or with an answer that does not
match what was sent is retried up to ``max_retries`` times with exponential backoff.
Every answer is checked before use: one choice per sequence, ``prompt_token_ids`` (when
returned) equal to the ids sent, one entry per position, each position naming the very
token that was sent there with a finite log-prob, at least ``k`` candidates, and a rest
mass (when sent) in [0, 1] that adds up with the top k to 1. Anything
else is an error: a misaligned answer is never fed to the loss. Other HTTP errors (400,
401, 404, 413) stop at once with the server's message.
"""

from __future__ import annotations

import json
import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.models.interfaces import (
    FullVocabRequest,
    Pending,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TokenLogprobsRequest,
    TopKLogprobs,
    TopKRequest,
)
from opd.models.teacher.server import REST_MASS_FIELD
from opd.models.topk_rest import rest_logprobs_from_topk
from opd.utils.errors import OpdError

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
REST_MASS_TOLERANCE = 1e-3
"""How far Σ_k P + rest may be from 1 before a served rest mass is taken to describe other tokens."""


class TeacherServiceError(OpdError):
    """The served teacher could not give a usable answer (after retries, where retrying made sense)."""


class _Retryable(Exception):
    """A failure worth another attempt (transport, overload, a malformed or misaligned answer)."""


class _InThread(Pending[TeacherSignal]):
    """A score running on a background thread."""

    def __init__(self, future: Future[TeacherSignal]) -> None:
        self.future = future

    def result(self) -> TeacherSignal:
        """Waits for the thread; re-raises what scoring raised."""
        return self.future.result()


class RemoteTeacher(TeacherInterface):
    """``TeacherInterface`` over a served teacher.

    Args:
        url: base URL of the server, e.g. ``http://127.0.0.1:8000``.
        model: the served model name sent with each request (None: the server's first model).
        api_key: bearer token, if the server requires one.
        max_concurrency: requests in flight at once.
        sequences_per_request: sequences per ``/v1/completions`` request.
        timeout_s: per-request timeout (connect, read and write).
        max_retries: further attempts after a retryable failure.
        backoff_s: wait before the first retry; doubled for each next one.
    """

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api_key: str | None = None,
        max_concurrency: int = 4,
        sequences_per_request: int = 8,
        timeout_s: float = 60.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
    ) -> None:
        self.url = url.rstrip("/")
        self.max_concurrency = max_concurrency
        self.sequences_per_request = sequences_per_request
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout_s, limits=httpx.Limits(max_connections=max_concurrency)
        )
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="opd-teacher")
        self._background: ThreadPoolExecutor | None = None  # score_async's thread, made on first use
        self.model = model
        self.retries = 0
        """Retried requests so far (logged; a growing count means an unhealthy server)."""

    # ------------------------------------------------------------------ set-up checks

    def connect(self, tokenizer: Any) -> None:
        """Checks, before training, that the server answers and tokenizes like ``tokenizer``.

        Resolves the served model name when none was given, then asks the server to
        tokenize a probe text; different ids mean a different tokenizer, whose
        log-probs would describe other tokens.

        Raises:
            TeacherServiceError: unreachable server, unknown model, or a tokenizer mismatch.
        """
        models = self._request("GET", "/v1/models", None)
        served = [entry.get("id") for entry in models.get("data", []) if isinstance(entry, dict)]
        if self.model is None:
            if not served:
                raise TeacherServiceError(f"teacher server {self.url} lists no models at /v1/models")
            self.model = served[0]
        elif self.model not in served:
            raise TeacherServiceError(f"teacher server {self.url} does not serve {self.model!r} (it serves {served})")
        probe = "The teacher and the student must split text into the same tokens: 12 + 30 = 42."
        expected = tokenizer(probe, add_special_tokens=False)["input_ids"]
        answer = self._request("POST", "/tokenize", {"model": self.model, "prompt": probe, "add_special_tokens": False})
        if answer.get("tokens") != expected:
            raise TeacherServiceError(
                f"the teacher server {self.url} ({self.model}) tokenizes differently from the student's tokenizer "
                f"(probe text → {answer.get('tokens')} there, {expected} here); teacher and student must share a "
                "tokenizer"
            )

    # ------------------------------------------------------------------ TeacherInterface

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """Full-vocabulary requests, and top-k at a temperature other than 1, are refused."""
        if isinstance(request, FullVocabRequest):
            return "a served teacher sends top-k or token log-probs, not its full vocabulary"
        if isinstance(request, TopKRequest) and request.temperature != 1.0:
            return f"a served teacher answers at temperature 1, not {request.temperature}"
        return None

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """Answers a top-k or token log-prob request (see :meth:`TeacherInterface.score`).

        Raises:
            TeacherServiceError: for a request :meth:`unsupported_reason` refuses.
        """
        reason = self.unsupported_reason(request)
        if reason is not None:
            raise TeacherServiceError(reason)
        if isinstance(request, TopKRequest):
            return self.get_topk_logprobs(data, request.k, request.temperature, request.vocab_size)
        assert isinstance(request, TokenLogprobsRequest)  # the only kind left
        return self.get_token_logprobs(data, request.vocab_size)

    def score_async(self, data: BatchedDataDict, request: TeacherRequest) -> Pending[TeacherSignal]:
        """Scores on a background thread (the server does the work) and returns at once.

        One background thread: requests started this way are answered in order.
        """
        if self._background is None:
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opd-teacher-async")
        return _InThread(self._background.submit(self.score, data, request))

    def get_topk_logprobs(
        self, data: BatchedDataDict, k: int, temperature: float = 1.0, vocab_size: int | None = None
    ) -> TopKLogprobs:
        """The teacher's top-k log-probs and ids at each position (position t describes token t + 1).

        ``rest_logprobs`` holds log(1 − Σ_k P): the server's own rest mass where it sends one,
        else computed from the top-k in float64 (exact for the log-probs received, which a
        float32 subtraction would not be).

        Positions that predict nothing real (a sequence's last token, padding) hold a
        placeholder distribution (ids ``0 … k-1``, each with probability ``1 / (2k)``, rest
        1/2): the loss masks them, and they keep every value finite.

        Raises:
            TeacherServiceError: if ``temperature`` is not 1 (servers answer at temperature 1).
        """
        if temperature != 1.0:
            raise TeacherServiceError(
                f"a served teacher answers at temperature 1, not {temperature}; set loss_fn.temperature = 1"
            )
        input_ids, lengths = data["input_ids"], data["input_lengths"]
        rows, width = input_ids.shape
        # float64 until the rest is known: JSON carries doubles, and the fallback needs them.
        values = torch.full((rows, width, k), math.log(0.5 / k), dtype=torch.float64)
        ids = torch.arange(k, dtype=torch.long).expand(rows, width, k).clone()
        served_rest = torch.full((rows, width), 0.5, dtype=torch.float64)
        has_rest = torch.zeros((rows, width), dtype=torch.bool)
        for row, answer in enumerate(self._score(input_ids, lengths, k)):
            if len(answer.candidates) < 2:
                continue
            # One tensor per row, not per position: this loop runs over every scored token.
            tops = [_top_k(candidates, k) for candidates in answer.candidates[1:]]
            ids[row, : len(tops)] = torch.tensor([[token for token, _ in top] for top in tops])
            values[row, : len(tops)] = torch.tensor([[logprob for _, logprob in top] for top in tops])
            if answer.rest_mass is not None:
                served_rest[row, : len(tops)] = torch.tensor(answer.rest_mass[1:], dtype=torch.float64)
                has_rest[row, : len(tops)] = True
        rest = torch.where(has_rest, served_rest.log(), rest_logprobs_from_topk(values))
        return TopKLogprobs(values.float(), ids, rest.float())

    def get_token_logprobs(self, data: BatchedDataDict, vocab_size: int | None = None) -> torch.Tensor:
        """``[B, L]`` log P(token t | tokens before t); 0 at position 0 and on padding."""
        input_ids, lengths = data["input_ids"], data["input_lengths"]
        result = torch.zeros(input_ids.shape, dtype=torch.float32)
        for row, answer in enumerate(self._score(input_ids, lengths, 0)):
            for position in range(1, len(answer.candidates)):
                result[row, position] = answer.candidates[position][int(input_ids[row, position])]
        return result

    def close(self) -> None:
        """Closes the connections and the request threads."""
        if self._background is not None:
            self._background.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._client.close()

    # ------------------------------------------------------------------ requests

    def _score(self, input_ids: torch.Tensor, lengths: torch.Tensor, k: int) -> list[_ScoredSequence]:
        """Per sequence: ``{token id: log-prob}`` per position ``t ≥ 1`` (index 0: ``{}``), and the rest mass."""
        sequences = [input_ids[row, : int(lengths[row])].tolist() for row in range(input_ids.shape[0])]
        groups = [
            sequences[begin : begin + self.sequences_per_request]
            for begin in range(0, len(sequences), self.sequences_per_request)
        ]
        return [
            answer for group in self._pool.map(lambda group: self._score_group(group, k), groups) for answer in group
        ]

    def _score_group(self, sequences: list[list[int]], k: int) -> list[_ScoredSequence]:
        body = {
            "model": self.model,
            "prompt": sequences,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": k,
            "return_token_ids": True,
        }
        return self._with_retries(
            lambda: _parse_prompt_logprobs(self._send("POST", "/v1/completions", body), sequences, k),
            "/v1/completions",
        )

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        return self._with_retries(lambda: self._send(method, path, body), path)

    def _send(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """One HTTP exchange; raises :class:`_Retryable` or :class:`TeacherServiceError`."""
        try:
            response = self._client.request(method, path, json=body)
        except httpx.TransportError as error:  # refused, reset, timed out, cut short
            raise _Retryable(f"{type(error).__name__}: {error}") from None
        if response.status_code in RETRYABLE_STATUS:
            raise _Retryable(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code != 200:
            raise TeacherServiceError(
                f"teacher server {self.url}{path} answered HTTP {response.status_code}: {response.text[:500]}"
            )
        try:
            payload = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise _Retryable(f"the answer is not valid JSON ({error}); truncated?") from None
        if not isinstance(payload, dict):
            raise _Retryable("the answer is not a JSON object")
        return payload

    def _with_retries(self, attempt: Any, path: str) -> Any:
        wait = self.backoff_s
        for attempt_number in range(self.max_retries + 1):
            try:
                return attempt()
            except _Retryable as problem:
                if attempt_number == self.max_retries:
                    raise TeacherServiceError(
                        f"teacher server {self.url}{path} gave no usable answer after {self.max_retries + 1} "
                        f"attempts; last problem: {problem}"
                    ) from None
                self.retries += 1
                log.warning("teacher server %s%s: %s; retrying in %.1f s", self.url, path, problem, wait)
                time.sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class _ScoredSequence:
    """One sequence's answer: per position ``{token id: log-prob}`` and, if the server sent it, the rest mass.

    Index 0 of both lists stands for position 0, which has no prediction (``{}`` / None).
    """

    candidates: list[dict[int, float]]
    rest_mass: list[float] | None


def _top_k(candidates: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ``(token, log-prob)`` of a position (the answer may add the actual token)."""
    return sorted(candidates.items(), key=lambda item: -item[1])[:k]


def _parse_rest_mass(
    choice: dict[str, Any], number: int, candidates: list[dict[int, float]], k: int
) -> list[float] | None:
    """The choice's ``prompt_topk_rest_mass``, checked against its top-k log-probs; None if absent.

    Raises:
        _Retryable: a malformed list, a mass outside [0, 1], or one that does not add up
            with the top k to 1 (it would describe other tokens than those sent).
    """
    served = choice.get(REST_MASS_FIELD)
    if served is None or k == 0:
        return None
    if not isinstance(served, list) or len(served) != len(candidates):
        raise _Retryable(f"sequence {number}: {REST_MASS_FIELD} is not a list of one entry per token")
    for position in range(1, len(candidates)):
        mass = served[position]
        if not isinstance(mass, (int, float)) or not 0.0 <= mass <= 1.0 + REST_MASS_TOLERANCE:
            raise _Retryable(f"sequence {number}, position {position}: rest mass {mass!r} is not in [0, 1]")
        topk_mass = math.fsum(math.exp(logprob) for _, logprob in _top_k(candidates[position], k))
        if abs(topk_mass + mass - 1.0) > REST_MASS_TOLERANCE:
            raise _Retryable(
                f"sequence {number}, position {position}: the top-{k} mass {topk_mass:.6g} and the rest mass "
                f"{mass:.6g} do not add up to 1"
            )
    return [0.0] + [min(float(mass), 1.0) for mass in served[1:]]


def _parse_prompt_logprobs(payload: dict[str, Any], sequences: list[list[int]], k: int) -> list[_ScoredSequence]:
    """Checks a ``/v1/completions`` answer against the ids sent and extracts the log-probs (and rest masses).

    Raises:
        _Retryable: naming the first thing that does not match.
    """
    choices = payload.get("choices")
    if not isinstance(choices, list) or len(choices) != len(sequences):
        raise _Retryable(
            f"expected {len(sequences)} choices, got "
            f"{len(choices) if isinstance(choices, list) else type(choices).__name__}"
        )
    ordered = sorted(choices, key=lambda choice: choice.get("index", 0) if isinstance(choice, dict) else 0)
    answers = []
    for number, (choice, sent) in enumerate(zip(ordered, sequences)):
        if not isinstance(choice, dict) or choice.get("index", number) != number:
            raise _Retryable(f"choice {number} is missing or out of order")
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and echoed != sent:
            raise _Retryable(f"sequence {number}: the server scored other token ids than were sent")
        positions = choice.get("prompt_logprobs")
        if not isinstance(positions, list) or len(positions) != len(sent):
            got = len(positions) if isinstance(positions, list) else type(positions).__name__
            raise _Retryable(f"sequence {number}: {got} prompt_logprobs entries for {len(sent)} tokens")
        answer: list[dict[int, float]] = [{}]
        for position in range(1, len(sent)):
            entry = positions[position]
            if not isinstance(entry, dict):
                raise _Retryable(f"sequence {number}, position {position}: no log-probs")
            candidates: dict[int, float] = {}
            for token, info in entry.items():
                logprob = info.get("logprob") if isinstance(info, dict) else info
                if not isinstance(logprob, (int, float)) or math.isnan(logprob) or logprob > 0:
                    raise _Retryable(f"sequence {number}, position {position}: log-prob {logprob!r} for token {token}")
                candidates[int(token)] = float(logprob)
            if sent[position] not in candidates:
                raise _Retryable(
                    f"sequence {number}, position {position}: the answer does not score the token "
                    f"sent there ({sent[position]})"
                )
            if not math.isfinite(candidates[sent[position]]):
                # The loss would take log 0 for a token the student did produce.
                raise _Retryable(
                    f"sequence {number}, position {position}: the teacher gives the token sent there "
                    f"({sent[position]}) probability 0"
                )
            if len(candidates) < k:
                raise _Retryable(
                    f"sequence {number}, position {position}: {len(candidates)} candidates, fewer than k = {k}"
                )
            answer.append(candidates)
        answers.append(_ScoredSequence(answer, _parse_rest_mass(choice, number, answer, k)))
    return answers
