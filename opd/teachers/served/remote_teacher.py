"""A teacher served over HTTP: ``opd serve-teacher`` or vLLM's OpenAI-compatible server.

The client sends the student's token ids and turns the answers into the signal the loss requested. It speaks one
:class:`WireProtocol` of :data:`PROTOCOLS` per server, chosen on connecting (``protocol: auto``: the first of
:data:`AUTO_ORDER` the server speaks):

* ``opd`` (:mod:`opd.teachers.served.wire`, ``opd serve-teacher``): flat tensors, only at the positions the loss
  reads; every signal. Full-vocabulary requests get the final hidden states, which the trainer turns into logits with
  the teacher's output layer, loaded locally and checked against the server's (shape, logit transform, checksum) on
  connecting; on a cluster (``binds_output_layer=False``) the bare hidden states go to the trainer workers, which
  hold the layer. Top-k comes with the rest log-mass the server summed in float64.
* ``openai`` (``/v1/completions`` with ``prompt_logprobs``, :mod:`opd.teachers.served.openai_protocol`): top-k and
  token log-probs only; the rest mass is the server's where sent, else log(1 − Σ_k P) in float64 here.

Sequences go out ``sequences_per_request`` per request, ``max_concurrency`` requests at a time. Transport failures,
HTTP 408 / 429 / 5xx and answers that do not match the request (:class:`~opd.teachers.served.wire.WireError`) are
retried up to ``max_retries`` times with exponential backoff, so a misaligned answer never reaches the loss and a
restarted server is picked up. Other HTTP errors fail at once with the server's message.
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, Literal, TypeVar

import httpx
import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.models.interfaces import (
    FullVocabRequest,
    Pending,
    TeacherHiddenStates,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TokenLogprobsRequest,
    TopKLogprobs,
    TopKRequest,
)
from opd.models.lm_head import LMHeadInput, OutputLayer
from opd.teachers.scoring import head_checksum
from opd.teachers.served import wire
from opd.teachers.served.openai_protocol import (
    ScoredSequence,
    TopKBuffers,
    fill_token_logprobs_from_scored,
    fill_topk_from_scored,
    parse_prompt_logprobs,
    placeholder_topk,
)
from opd.utils.errors import ResumableError

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
REQUEST_TIMEOUT_S = 120.0
"""Default per-request timeout of a served teacher: ``teacher.remote.timeout_s`` and the clients' own default."""
_FULL_VOCABULARY_NEEDS = (
    "a full-vocabulary loss with a served teacher needs opd serve-teacher and the teacher's output "
    "layer (model.teacher_model_path), checked when connecting"
)
Protocol = Literal["auto", "opd", "openai"]
AnswerT = TypeVar("AnswerT")
ItemT = TypeVar("ItemT")


class TeacherServiceError(ResumableError):
    """The served teacher could not give a usable answer (after retries, where retrying made sense).

    Mid-run it stops the run resumably: the server is outside the run, and a rerun resumes once it answers.
    """


class _Retryable(Exception):
    """A failure worth another attempt (transport, overload, a malformed or misaligned answer)."""


class _InThread(Pending[TeacherSignal]):
    """A score running on a background thread."""

    def __init__(self, future: Future[TeacherSignal]) -> None:
        self.future = future

    def result(self) -> TeacherSignal:
        """Waits for the thread; re-raises what scoring raised."""
        return self.future.result()


def first_loss_positions(data: BatchedDataDict) -> list[int]:
    """Per row, the first position a loss reads: one before the first token of ``token_mask``.

    Position ``p`` predicts token ``p + 1``, so the response's first token is predicted
    one position earlier. Rows without ``token_mask`` start at 0; a row with no loss token
    starts at its last token, which predicts nothing (no row is scored).
    """
    lengths = data["input_lengths"].tolist()
    if "token_mask" not in data:
        return [0] * len(lengths)
    firsts = []
    for row, length in enumerate(lengths):
        marked = data["token_mask"][row, :length].nonzero()
        firsts.append(max(int(marked[0, 0]) - 1, 0) if marked.numel() else max(length - 1, 0))
    return firsts


class ServedClient:
    """HTTP to a teacher server: JSON exchanges retried as the module docstring says (``client_options``: httpx's)."""

    def __init__(
        self, url: str, api_key: str | None, timeout_s: float, max_retries: int, backoff_s: float, **client_options: Any
    ) -> None:
        self.url = url.rstrip("/")
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, **client_options)
        self.retries = 0
        """Retried requests so far (logged; a growing count means an unhealthy server)."""
        self.bytes_received = 0
        """Answer bytes received so far (the wire cost of the teacher signal)."""

    def close(self) -> None:
        """Closes the connections."""
        self._client.close()

    def _served_models(self) -> list[Any]:
        """The model names the server lists at ``/v1/models``; TeacherServiceError if it lists none."""
        listed = self._request("GET", "/v1/models", None).get("data") or []
        names = [entry.get("id") for entry in listed if isinstance(entry, dict)]
        if not names:
            raise TeacherServiceError(f"teacher server {self.url} lists no models at /v1/models")
        return names

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        return self._with_retries(lambda: self._send(method, path, body), path)

    def _exchange(self, method: str, path: str, body: dict[str, Any] | None) -> httpx.Response:
        """One HTTP exchange with a 200 answer; raises :class:`_Retryable` or :class:`TeacherServiceError`."""
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
        self.bytes_received += len(response.content)
        return response

    def _send(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """A JSON exchange."""
        response = self._exchange(method, path, body)
        try:
            payload = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise _Retryable(f"the answer is not valid JSON ({error}); truncated?") from None
        if not isinstance(payload, dict):
            raise _Retryable("the answer is not a JSON object")
        return payload

    def _with_retries(self, attempt: Callable[[], AnswerT], path: str) -> AnswerT:
        wait = self.backoff_s
        for attempt_number in range(self.max_retries + 1):
            try:
                return attempt()
            except (_Retryable, wire.WireError) as problem:
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


class RemoteTeacher(ServedClient, TeacherInterface):
    """``TeacherInterface`` over a served teacher; arguments as in :class:`~opd.teachers.backends.RemoteTeacherConfig`.

    Args:
        output_layer: the teacher's output layer, loaded locally: needed for full-vocabulary requests, checked
            against the server's in :meth:`connect`.
        binds_output_layer: False answers full-vocabulary requests with bare
            :class:`~opd.models.interfaces.TeacherHiddenStates` for trainer workers that hold the layer, and drops
            the layer here once :meth:`connect` checked it.
    """

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api_key: str | None = None,
        max_concurrency: int = 4,
        sequences_per_request: int = 8,
        timeout_s: float = REQUEST_TIMEOUT_S,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        protocol: Protocol = "auto",
        hidden_dtype: str = "auto",
        output_layer: OutputLayer | None = None,
        binds_output_layer: bool = True,
    ) -> None:
        super().__init__(
            url, api_key, timeout_s, max_retries, backoff_s, limits=httpx.Limits(max_connections=max_concurrency)
        )
        self.max_concurrency = max_concurrency
        self.sequences_per_request = sequences_per_request
        self.protocol_setting: Protocol = protocol
        self._chosen: WireProtocol | None = None  # set by connect
        self.hidden_dtype = hidden_dtype
        self.output_layer = output_layer
        self.binds_output_layer = binds_output_layer
        self.head_checked = False
        """Whether an output layer was checked against the served model's (full-vocabulary answers need it)."""
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="opd-teacher")
        self._background: ThreadPoolExecutor | None = None  # score_async's thread, made on first use
        self.model = model
        self.head_info: dict[str, Any] | None = None

    # ------------------------------------------------------------------ set-up checks

    def connect(self, tokenizer: Any) -> None:
        """Checks before training that the server answers, tokenizes like ``tokenizer`` and holds ``output_layer``.

        Also resolves the served model name and, for ``protocol: auto``, the protocol.

        Raises:
            TeacherServiceError: unreachable server, unknown model, another tokenizer, no opd protocol where required,
                or another output layer.
        """
        served = self._served_models()
        if self.model is None:
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
        self._resolve_protocol()
        if self.output_layer is not None:
            self.check_output_layer(self.output_layer)

    def _resolve_protocol(self) -> None:
        """Chooses the wire protocol once: the configured one, or (``auto``) the first of :data:`AUTO_ORDER` offered."""
        explicit = PROTOCOLS.get(self.protocol_setting)
        for candidate in (explicit,) if explicit is not None else AUTO_ORDER:
            try:
                self.head_info = candidate.connect(self)
            except ProtocolNotOffered as missing:
                if explicit is not None:
                    raise TeacherServiceError(str(missing)) from None
                continue
            self._chosen = candidate
            return
        raise TeacherServiceError(f"teacher server {self.url} speaks none of {', '.join(PROTOCOLS)}")

    @property
    def wire_protocol(self) -> WireProtocol:
        """The protocol :meth:`connect` chose; before it, the configured one (``auto``: ``openai``, spoken by all)."""
        return self._chosen or PROTOCOLS.get(self.protocol_setting) or PROTOCOLS["openai"]

    @property
    def protocol(self) -> str:
        """The name of :attr:`wire_protocol` (``opd`` or ``openai``)."""
        return self.wire_protocol.name

    def check_output_layer(self, layer: OutputLayer) -> None:
        """Raises TeacherServiceError unless the server sends hidden states and ``layer`` is its output layer."""
        if not self.wire_protocol.sends_hidden_states or self.head_info is None:
            raise TeacherServiceError(
                f"teacher server {self.url} does not send hidden states (it speaks vLLM's JSON); a full-vocabulary "
                "loss needs opd serve-teacher"
            )
        served = self.head_info
        shape = (int(served["rows"]), int(served["hidden_size"]))
        if tuple(layer.weight.shape) != shape:
            raise TeacherServiceError(
                f"the teacher's output layer loaded here is {tuple(layer.weight.shape)}, the served model's is "
                f"{shape}: model.teacher_model_path must be the model the server serves"
            )
        transform = (layer.logit_multiplier, layer.logit_softcap, layer.bias is not None)
        served_transform = (served["logit_multiplier"], served["logit_softcap"], served["bias"])
        if transform != tuple(served_transform):
            raise TeacherServiceError(
                f"the output layer loaded here (multiplier, soft cap, bias) = {transform} differs from the served "
                f"model's {tuple(served_transform)}"
            )
        local = head_checksum(layer.weight, getattr(torch, served["dtype"]))
        if local != served["checksum"]:
            raise TeacherServiceError(
                f"the teacher's output layer loaded here has checksum {local}, the served model's "
                f"{served['checksum']}: model.teacher_model_path must hold the weights the server serves"
            )
        self.head_checked = True
        # Where the loss runs elsewhere, its processes hold their own copy: this one is not kept.
        self.output_layer = layer if self.binds_output_layer else None

    # ------------------------------------------------------------------ TeacherInterface

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """Refuses top-k at a temperature other than 1 (servers answer at temperature 1)."""
        if isinstance(request, TopKRequest) and request.temperature != 1.0:
            return f"a served teacher answers top-k at temperature 1, not {request.temperature}"
        return None

    def refusal(self, request: TeacherRequest) -> str | None:
        """Also refuses full-vocabulary requests unless :meth:`connect` checked the output layer with opd's protocol."""
        reason = super().refusal(request)
        if reason is None and isinstance(request, FullVocabRequest) and not self.sends_hidden_states:
            return _FULL_VOCABULARY_NEEDS
        return reason

    @property
    def sends_hidden_states(self) -> bool:
        """Whether full-vocabulary requests can be answered: an output layer checked against the server's."""
        return self.head_checked and self.head_info is not None

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """Answers ``request`` for ``data``; TeacherServiceError for an unanswerable request or no usable answer."""
        reason = self.unsupported_reason(request)
        if reason is not None:
            raise TeacherServiceError(reason)
        if isinstance(request, FullVocabRequest):
            head = self.get_hidden_states(data)
            if isinstance(head, LMHeadInput) and not request.prefer_hidden_states:
                return head.logits()
            return head
        if isinstance(request, TopKRequest):
            return self.get_topk_logprobs(data, request.k, request.temperature, request.vocab_size)
        assert isinstance(request, TokenLogprobsRequest)  # the only kind left
        return self.get_token_logprobs(data, request.vocab_size)

    def score_async(self, data: BatchedDataDict, request: TeacherRequest) -> Pending[TeacherSignal]:
        """Scores on one background thread (requests started this way are answered in order) and returns at once."""
        if self._background is None:
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opd-teacher-async")
        return _InThread(self._background.submit(self.score, data, request))

    def get_hidden_states(self, data: BatchedDataDict) -> LMHeadInput | TeacherHiddenStates:
        """The teacher's final hidden states ``[B, L, D]`` over its output layer, zeros where the loss does not read.

        With ``binds_output_layer=False``: bare :class:`~opd.models.interfaces.TeacherHiddenStates` in the wire's dtype.
        Raises TeacherServiceError without opd's protocol or a checked output layer.
        """
        layer, head = self.output_layer, self.head_info
        if not self.sends_hidden_states or head is None:
            raise TeacherServiceError(_FULL_VOCABULARY_NEEDS)
        dtype = wire.HIDDEN_DTYPES.get(self.hidden_dtype, getattr(torch, head["dtype"]))
        shape = (int(head["hidden_size"]), dtype)
        input_ids = data["input_ids"]
        hidden = torch.zeros((*input_ids.shape, shape[0]), dtype=dtype if layer is None else layer.weight.dtype)
        body = {"signal": "hidden_states", "hidden_dtype": self.hidden_dtype}
        for row, first, values in self._score_binary(data, body, shape):
            hidden[row, first : first + values["hidden_states"].shape[0]] = values["hidden_states"].to(hidden.dtype)
        if layer is None:
            return TeacherHiddenStates(hidden)
        return layer.over(hidden.to(layer.weight.device))

    def get_topk_logprobs(
        self, data: BatchedDataDict, k: int, temperature: float = 1.0, vocab_size: int | None = None
    ) -> TopKLogprobs:
        """Top-k log-probs and ids per position (position t describes token t + 1), with ``rest_logprobs``.

        The rest is the server's where sent, else log(1 − Σ_k P) in float64 (exact for the values received). Unscored
        positions hold a finite placeholder that the loss masks (:func:`.openai_protocol.placeholder_topk`).
        Raises TeacherServiceError unless ``temperature`` is 1.
        """
        if temperature != 1.0:
            raise TeacherServiceError(
                f"a served teacher answers at temperature 1, not {temperature}; set loss_fn.temperature = 1"
            )
        input_ids = data["input_ids"]
        topk = placeholder_topk(input_ids.shape[0], input_ids.shape[1], k)
        self.wire_protocol.fill_topk(self, data, k, topk)
        values, ids, rest = topk
        device = input_ids.device
        return TopKLogprobs(values.float().to(device), ids.to(device), rest.float().to(device))

    def get_token_logprobs(self, data: BatchedDataDict, vocab_size: int | None = None) -> torch.Tensor:
        """``[B, L]`` log P(token t | tokens before t); 0 where the server did not score (prompt, padding)."""
        input_ids = data["input_ids"]
        result = torch.zeros(input_ids.shape, dtype=torch.float32)
        self.wire_protocol.fill_token_logprobs(self, data, result)
        return result.to(input_ids.device)

    def close(self) -> None:
        """Closes the connections and the request threads."""
        if self._background is not None:
            self._background.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        super().close()

    # ------------------------------------------------------------------ requests

    def _per_request(self, count: int, one_request: Callable[[range], list[ItemT]]) -> list[ItemT]:
        """``one_request`` over ``sequences_per_request`` rows at a time, requests in parallel; items in row order."""
        per = self.sequences_per_request
        groups = [range(begin, min(begin + per, count)) for begin in range(0, count, per)]
        return [item for group in self._pool.map(one_request, groups) for item in group]

    def _score_binary(
        self, data: BatchedDataDict, body: dict[str, Any], hidden: wire.Hidden | None, k: int = 0
    ) -> list[tuple[int, int, dict[str, torch.Tensor]]]:
        """Per row ``(row, first position, that row's tensors)`` from ``/opd/v1/score``, requests in parallel."""
        input_ids, lengths = data["input_ids"].cpu(), data["input_lengths"].tolist()
        sequences = [input_ids[row, : lengths[row]].tolist() for row in range(len(lengths))]
        firsts = first_loss_positions(data)
        vocab = int(self.head_info["vocab_size"]) if self.head_info else None

        def one_request(rows: range) -> list[tuple[int, int, dict[str, torch.Tensor]]]:
            sent = [sequences[row] for row in rows]
            starts = [firsts[row] for row in rows]
            request = {"model": self.model, "sequences": sent, "first_positions": starts, **body}

            def attempt() -> dict[str, torch.Tensor]:
                answer = self._send_binary(request)
                return wire.decode(answer, sent, starts, body["signal"], k, hidden, vocab)

            tensors = self._with_retries(attempt, wire.SCORE_PATH)
            split = [max(len(ids) - 1 - first, 0) for ids, first in zip(sent, starts)]
            parts = {name: value.split(split) for name, value in tensors.items()}
            return [
                (row, first, {name: pieces[index] for name, pieces in parts.items()})
                for index, (row, first) in enumerate(zip(rows, starts))
            ]

        return self._per_request(len(sequences), one_request)

    def _send_binary(self, body: dict[str, Any]) -> bytes:
        """A ``/opd/v1/score`` exchange: the raw tensor payload."""
        response = self._exchange("POST", wire.SCORE_PATH, body)
        media_type = response.headers.get("content-type", "")
        if not media_type.startswith(wire.MEDIA_TYPE):
            raise _Retryable(f"the answer is {media_type or 'untyped'}, not {wire.MEDIA_TYPE}")
        return response.content

    def _score_json(self, input_ids: torch.Tensor, lengths: torch.Tensor, k: int) -> list[ScoredSequence]:
        """Per sequence: ``{token id: log-prob}`` per position ``t ≥ 1`` (index 0: ``{}``), and the rest mass."""
        sequences = [input_ids[row, : int(lengths[row])].tolist() for row in range(input_ids.shape[0])]

        def one_request(rows: range) -> list[ScoredSequence]:
            sent = [sequences[row] for row in rows]
            body = {
                "model": self.model,
                "prompt": sent,
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": k,
                "return_token_ids": True,
            }
            return self._with_retries(
                lambda: parse_prompt_logprobs(self._send("POST", "/v1/completions", body), sent, k), "/v1/completions"
            )

        return self._per_request(len(sequences), one_request)


# ---------------------------------------------------------------------------- wire protocols


class ProtocolNotOffered(Exception):
    """The server does not speak this protocol (its message says which setting to use instead)."""


class WireProtocol(ABC):
    """One value of ``teacher.remote.protocol``: how a client asks a server for each signal.

    A new protocol is one subclass and one entry of :data:`PROTOCOLS`. ``sends_hidden_states``: the server can send
    final hidden states (full-vocabulary losses need them).
    """

    name: ClassVar[str]
    sends_hidden_states: ClassVar[bool]
    description: ClassVar[str]
    """The protocol in words, for messages."""

    @abstractmethod
    def connect(self, client: RemoteTeacher) -> dict[str, Any] | None:
        """The output layer the server describes, if any.

        Raises ProtocolNotOffered if the server does not speak this protocol, TeacherServiceError if it answers wrongly.
        """

    def refusal(self, request: TeacherRequest) -> str | None:
        """What ``request`` needs that this protocol cannot carry (completes "a served teacher needs ..."), or None."""
        if isinstance(request, FullVocabRequest) and not self.sends_hidden_states:
            return f"its hidden states, which {self.description} does not carry"
        return None

    @abstractmethod
    def fill_topk(self, client: RemoteTeacher, data: BatchedDataDict, k: int, topk: TopKBuffers) -> None:
        """Writes the top-k answer for ``data`` into ``topk``'s values / ids / rest (float64, at scored positions)."""

    @abstractmethod
    def fill_token_logprobs(self, client: RemoteTeacher, data: BatchedDataDict, result: torch.Tensor) -> None:
        """Writes log P(token t | tokens before t) into ``result[row, t]`` at the scored positions."""


class OpdProtocol(WireProtocol):
    """opd's binary protocol (:mod:`opd.teachers.served.wire`): flat tensors at the positions the loss reads."""

    name = "opd"
    sends_hidden_states = True
    description = "opd's binary protocol"

    def connect(self, client: RemoteTeacher) -> dict[str, Any] | None:
        """Reads ``/opd/v1/info``: the format and the output layer the server applies."""
        try:
            info = client._request("GET", wire.INFO_PATH, None)
        except TeacherServiceError as error:
            if "HTTP 404" not in str(error):
                raise
            raise ProtocolNotOffered(
                f"teacher server {client.url} does not speak opd's binary protocol ({wire.INFO_PATH} is missing; "
                "vllm serve?); set teacher.remote.protocol = openai, which sends top-k and token log-probs only"
            ) from None
        if info.get("format") != wire.FORMAT or not isinstance(info.get("head"), dict):
            raise TeacherServiceError(
                f"teacher server {client.url} speaks {info.get('format')!r}, not {wire.FORMAT!r}; "
                "update opd on one side"
            )
        head: dict[str, Any] = info["head"]
        return head

    def fill_topk(self, client: RemoteTeacher, data: BatchedDataDict, k: int, topk: TopKBuffers) -> None:
        """The server's top-k and float64 rest mass, row by row."""
        values, ids, rest = topk
        for row, first, answer in client._score_binary(data, {"signal": "topk", "k": k}, None, k):
            end = first + answer["topk_ids"].shape[0]
            ids[row, first:end] = answer["topk_ids"].long()
            values[row, first:end] = answer["topk_logprobs"].double()
            rest[row, first:end] = answer["rest_logprobs"]

    def fill_token_logprobs(self, client: RemoteTeacher, data: BatchedDataDict, result: torch.Tensor) -> None:
        """The server's log-probs of the tokens after each row's first scored position."""
        for row, first, answer in client._score_binary(data, {"signal": "token_logprobs"}, None):
            values = answer["token_logprobs"]
            # Row p describes the token at p + 1, which is where its log-prob sits.
            result[row, first + 1 : first + 1 + values.shape[0]] = values


class OpenAIProtocol(WireProtocol):
    """vLLM's JSON (``/v1/completions`` with ``prompt_logprobs``): top-k and token log-probs only."""

    name = "openai"
    sends_hidden_states = False
    description = "vLLM's JSON"

    def connect(self, client: RemoteTeacher) -> dict[str, Any] | None:
        """Every server speaks it (the model list and tokenizer were checked already); it describes no head."""
        return None

    def fill_topk(self, client: RemoteTeacher, data: BatchedDataDict, k: int, topk: TopKBuffers) -> None:
        """The top-k of each position; the rest mass the server's where it sends one, else log(1 − Σ_k P) here."""
        fill_topk_from_scored(client._score_json(data["input_ids"], data["input_lengths"], k), k, *topk)

    def fill_token_logprobs(self, client: RemoteTeacher, data: BatchedDataDict, result: torch.Tensor) -> None:
        """Each actual token's log-prob from the JSON's per-position candidates."""
        input_ids = data["input_ids"]
        fill_token_logprobs_from_scored(client._score_json(input_ids, data["input_lengths"], 0), input_ids, result)


PROTOCOLS: dict[str, WireProtocol] = {protocol.name: protocol for protocol in (OpdProtocol(), OpenAIProtocol())}
"""Every wire protocol, by its ``teacher.remote.protocol`` value."""
AUTO_ORDER: tuple[WireProtocol, ...] = (PROTOCOLS["opd"], PROTOCOLS["openai"])
"""``protocol: auto`` takes the first of these the server speaks (opd's where offered: it carries every signal)."""


def protocol_refusal(setting: str, request: TeacherRequest) -> str | None:
    """What ``request`` needs that the protocol ``setting`` names cannot carry (None for ``auto``: it picks opd's)."""
    chosen = PROTOCOLS.get(setting)
    return None if chosen is None else chosen.refusal(request)
