"""opd's binary scoring protocol: what ``POST /opd/v1/score`` takes and answers.

vLLM's JSON spends bytes and time on one object per candidate per position. This protocol sends flat arrays in a
safetensors body (a JSON header with each tensor's name, dtype and shape, then raw bytes), read without such a loop.

**Request** (JSON)::

    {"model": name, "sequences": [[ids], ...], "first_positions": [p, ...],
     "signal": "topk" | "token_logprobs" | "hidden_states",
     "k": 16,                      # topk only
     "hidden_dtype": "bfloat16"}   # hidden_states only: float32, bfloat16, float16 or "auto"

Sequence ``i`` is scored at positions ``first_positions[i] … len_i − 2``; position ``p`` describes token ``p + 1``.
A client asks only for the positions its loss reads, so a long prompt costs nothing on the wire.

**Answer** (``application/vnd.opd.tensors``): one row per scored position, ``N = Σ_i (len_i − 1 − first_i)``:

=================== ========= ======================================================
``token_ids``       int32     ``[T]`` every sequence's ids, concatenated (an echo)
``lengths``         int32     ``[S]`` tokens per sequence (an echo)
``first_positions`` int32     ``[S]`` (an echo)
``topk_ids``        int32     ``[N, k]`` most likely first (topk)
``topk_logprobs``   float32   ``[N, k]`` (topk)
``rest_logprobs``   float64   ``[N]`` log mass outside the k ids, summed in float64 over the full
                              distribution; −inf when they cover the vocabulary (topk)
``token_logprobs``  float32   ``[N]`` log P(token p + 1) (token_logprobs)
``hidden_states``   as asked  ``[N, D]`` final hidden states, after the final norm (hidden_states)
=================== ========= ======================================================

The metadata carries ``format`` (:data:`FORMAT`), ``signal`` and ``checksum`` (CRC-32 over every tensor's bytes in
name order). The client checks names, dtypes, shapes, echoes, checksum and value ranges before anything reaches the
loss (:class:`WireError` names the first mismatch). Each signal is a :class:`SignalCodec` in :data:`CODECS`, which
both ends go through: a new signal is one subclass and one entry.
"""

from __future__ import annotations

import json
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

if TYPE_CHECKING:  # the server's side only: a client never loads the model
    from opd.teachers.scoring import PromptScorer

FORMAT = "opd-tensors/1"
MEDIA_TYPE = "application/vnd.opd.tensors"
SCORE_PATH = "/opd/v1/score"
INFO_PATH = "/opd/v1/info"
Signal = Literal["topk", "token_logprobs", "hidden_states"]
REST_MASS_TOLERANCE = 1e-3
"""How far Σ_k P + rest may be from 1 before an answer is taken to describe other tokens."""
HIDDEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""``(shape, dtype)`` of each tensor of an answer, by name."""
Hidden = tuple[int, torch.dtype]
"""The hidden states an answer should hold: ``(hidden size, dtype)``."""


class WireError(Exception):
    """An answer that is not what was asked for: damaged, truncated, or describing other tokens."""


def checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """CRC-32 over the tensors' raw bytes, in name order, as ``crc32:<8 hex digits>``."""
    value = 0
    for name in sorted(tensors):
        data = tensors[name].detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        value = zlib.crc32(data.data, value)  # the bytes in place, no copy
    return f"crc32:{value:08x}"


def encode(tensors: Mapping[str, torch.Tensor], signal: str) -> bytes:
    """An answer body: the tensors in safetensors layout, with format, signal and checksum."""
    contiguous = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    metadata = {"format": FORMAT, "signal": signal, "checksum": checksum(contiguous)}
    return save_safetensors(contiguous, metadata=metadata)


def scored_rows(lengths: list[int], first_positions: list[int]) -> int:
    """Rows an answer holds: ``Σ_i max(len_i − 1 − first_i, 0)``."""
    return sum(max(length - 1 - first, 0) for length, first in zip(lengths, first_positions))


def _metadata(body: bytes) -> dict[str, str]:
    if len(body) < 8:
        raise WireError(f"the answer has {len(body)} bytes, too few for a tensor payload (truncated?)")
    (header_bytes,) = struct.unpack("<Q", body[:8])
    if header_bytes > len(body) - 8:
        raise WireError("the answer's header runs past its end (truncated?)")
    try:
        header = json.loads(body[8 : 8 + header_bytes])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireError(f"the answer's header is not JSON ({error})") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise WireError("the answer's header has no metadata (format, signal, checksum)")
    return metadata


def decode(
    body: bytes,
    sequences: list[list[int]],
    first_positions: list[int],
    signal: Signal,
    k: int = 0,
    hidden: Hidden | None = None,
    vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Reads an answer and checks it against the request (``sequences``, ``first_positions``, ``signal``, ``k``).

    ``hidden``: the expected ``(hidden size, dtype)`` (hidden_states); ``vocab_size`` bounds top-k ids (None: no check).
    Returns the signal's tensors by name, echoes removed; raises :class:`WireError` at the first mismatch.
    """
    metadata = _metadata(body)
    if metadata.get("format") != FORMAT:
        raise WireError(f"the answer's format is {metadata.get('format')!r}, not {FORMAT!r}")
    if metadata.get("signal") != signal:
        raise WireError(f"asked for {signal}, the answer holds {metadata.get('signal')!r}")
    try:
        tensors = load_safetensors(body)
    except (SafetensorError, ValueError) as error:
        raise WireError(f"the answer is not a readable tensor payload ({error}); truncated?") from None
    if checksum(tensors) != metadata.get("checksum"):
        raise WireError(f"checksum mismatch: computed {checksum(tensors)}, the answer says {metadata.get('checksum')}")
    rows = scored_rows([len(ids) for ids in sequences], first_positions)
    codec = CODECS[signal]
    own = codec.expected(rows, k, hidden)
    echoes = _echoes(sequences, first_positions)
    expected: Layout = {**{name: (tuple(echo.shape), echo.dtype) for name, echo in echoes.items()}, **own}
    if set(tensors) != set(expected):
        raise WireError(f"the answer holds tensors {sorted(tensors)}, expected {sorted(expected)}")
    for name, (shape, dtype) in expected.items():
        if tensors[name].dtype != dtype:
            raise WireError(f"{name} is {tensors[name].dtype}, expected {dtype}")
        if tuple(tensors[name].shape) != shape:
            raise WireError(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    if not torch.equal(tensors["token_ids"], echoes["token_ids"]):
        raise WireError("the server scored other token ids than were sent")
    if not all(torch.equal(tensors[name], echoes[name]) for name in ("lengths", "first_positions")):
        raise WireError("the answer's sequence lengths or first positions differ from the request's")
    codec.check_values(tensors, vocab_size)
    return {name: tensors[name] for name in own}


def build_answer(
    sequences: list[list[int]], first_positions: list[int], signal: str, values: Mapping[str, torch.Tensor]
) -> bytes:
    """The server's side of :func:`decode`: echoes plus the signal's tensors, encoded."""
    return encode({**_echoes(sequences, first_positions), **values}, signal)


def _echoes(sequences: list[list[int]], first_positions: list[int]) -> dict[str, torch.Tensor]:
    """What every answer repeats of its request: the token ids, each sequence's length and first scored position."""
    return {
        "token_ids": torch.tensor([token for ids in sequences for token in ids], dtype=torch.int32),
        "lengths": torch.tensor([len(ids) for ids in sequences], dtype=torch.int32),
        "first_positions": torch.tensor(first_positions, dtype=torch.int32),
    }


# ---------------------------------------------------------------------------- one codec per signal


class BadRequest(ValueError):
    """A score request whose options for its signal are malformed (the server answers HTTP 400 with the message)."""


Answerer = Callable[[torch.Tensor], dict[str, torch.Tensor]]
"""The server's side of one request: the ``[N, D]`` hidden rows it scored → the signal's tensors."""


class SignalCodec(ABC):
    """One value of a request's ``signal``: its tensors, an answer's checks and the server's side (:data:`CODECS`)."""

    name: ClassVar[Signal]

    @abstractmethod
    def expected(self, rows: int, k: int, hidden: Hidden | None) -> Layout:
        """``(shape, dtype)`` of each tensor the answer holds for ``rows`` scored positions (echoes apart)."""

    @abstractmethod
    def check_values(self, tensors: Mapping[str, torch.Tensor], vocab_size: int | None) -> None:
        """Raises :class:`WireError` for values a correct scorer cannot produce (a NaN, a positive log-prob, ...)."""

    @abstractmethod
    def answerer(
        self,
        scorer: PromptScorer,
        body: Mapping[str, Any],
        sequences: list[list[int]],
        first_positions: list[int],
        read_k: Callable[[Any], int],
    ) -> Answerer:
        """Reads the signal's options from ``body`` and returns what makes its answer.

        ``read_k`` checks a width against the server's limit. Raises :class:`BadRequest` for bad options.
        """


class TopKCodec(SignalCodec):
    """``topk``: the k most likely ids, their log-probs, and the rest log-mass summed in float64."""

    name = "topk"

    def expected(self, rows: int, k: int, hidden: Hidden | None) -> Layout:
        """``topk_ids`` / ``topk_logprobs`` ``[rows, k]`` and ``rest_logprobs`` ``[rows]``."""
        return {
            "topk_ids": ((rows, k), torch.int32),
            "topk_logprobs": ((rows, k), torch.float32),
            "rest_logprobs": ((rows,), torch.float64),
        }

    def check_values(self, tensors: Mapping[str, torch.Tensor], vocab_size: int | None) -> None:
        """Log-probs ≤ 0, ids inside the vocabulary, and top-k mass plus rest mass that make one distribution."""
        logprobs, ids, rest = tensors["topk_logprobs"], tensors["topk_ids"], tensors["rest_logprobs"]
        if bool(torch.isnan(logprobs).any()) or bool((logprobs > 0).any()):
            raise WireError("a top-k log-prob is NaN or positive")
        if bool((ids < 0).any()) or (vocab_size is not None and bool((ids >= vocab_size).any())):
            raise WireError(f"a top-k id is outside the vocabulary [0, {vocab_size})")
        total = logprobs.double().exp().sum(dim=-1) + rest.exp()
        if bool(torch.isnan(rest).any()) or bool(((total - 1.0).abs() > REST_MASS_TOLERANCE).any()):
            raise WireError("a position's top-k mass and rest mass do not add up to 1")

    def answerer(
        self,
        scorer: PromptScorer,
        body: Mapping[str, Any],
        sequences: list[list[int]],
        first_positions: list[int],
        read_k: Callable[[Any], int],
    ) -> Answerer:
        """Reads ``k``; the answer is the scorer's top-k of every row."""
        k = read_k(body.get("k"))

        def topk(rows: torch.Tensor) -> dict[str, torch.Tensor]:
            ids, logprobs, rest = scorer.topk(rows, k)
            return {"topk_ids": ids, "topk_logprobs": logprobs, "rest_logprobs": rest}

        return topk


class TokenLogprobsCodec(SignalCodec):
    """``token_logprobs``: the log-prob of each actual next token."""

    name = "token_logprobs"

    def expected(self, rows: int, k: int, hidden: Hidden | None) -> Layout:
        """``token_logprobs`` ``[rows]`` float32."""
        return {"token_logprobs": ((rows,), torch.float32)}

    def check_values(self, tensors: Mapping[str, torch.Tensor], vocab_size: int | None) -> None:
        """Every log-prob finite and ≤ 0."""
        values = tensors["token_logprobs"]
        if not bool(torch.isfinite(values).all()) or bool((values > 0).any()):
            # −inf would put log 0 into the loss for a token the student did produce.
            raise WireError("a token log-prob is not finite or positive (a token of probability 0?)")

    def answerer(
        self,
        scorer: PromptScorer,
        body: Mapping[str, Any],
        sequences: list[list[int]],
        first_positions: list[int],
        read_k: Callable[[Any], int],
    ) -> Answerer:
        """No options; the tokens after each first position are the ones whose log-probs are sent."""
        next_ids = torch.tensor(
            [token for ids, first in zip(sequences, first_positions) for token in ids[first + 1 :]], dtype=torch.long
        )

        def token_logprobs(rows: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"token_logprobs": scorer.token_logprobs(rows, next_ids)}

        return token_logprobs


class HiddenStatesCodec(SignalCodec):
    """``hidden_states``: the final hidden states themselves, in the dtype the request named."""

    name = "hidden_states"

    def expected(self, rows: int, k: int, hidden: Hidden | None) -> Layout:
        """``hidden_states`` ``[rows, hidden size]`` in the expected dtype."""
        assert hidden is not None, "decode(hidden_states) needs the expected (hidden size, dtype)"
        return {"hidden_states": ((rows, hidden[0]), hidden[1])}

    def check_values(self, tensors: Mapping[str, torch.Tensor], vocab_size: int | None) -> None:
        """Every value finite."""
        if not bool(torch.isfinite(tensors["hidden_states"]).all()):
            raise WireError("a hidden state is not finite")

    def answerer(
        self,
        scorer: PromptScorer,
        body: Mapping[str, Any],
        sequences: list[list[int]],
        first_positions: list[int],
        read_k: Callable[[Any], int],
    ) -> Answerer:
        """Reads ``hidden_dtype`` (``auto``: the model's own dtype)."""
        name = body.get("hidden_dtype", "auto")
        dtypes = {"auto": scorer.dtype, **HIDDEN_DTYPES}
        if name not in dtypes:
            raise BadRequest(f"'hidden_dtype' must be auto or one of {list(HIDDEN_DTYPES)}, got {name!r}")
        dtype = dtypes[name]

        def hidden_states(rows: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"hidden_states": rows.to(dtype)}

        return hidden_states


CODECS: dict[str, SignalCodec] = {
    codec.name: codec for codec in (TopKCodec(), TokenLogprobsCodec(), HiddenStatesCodec())
}
"""Every signal of the binary protocol, by its ``signal`` value."""
SIGNALS: tuple[str, ...] = tuple(CODECS)
