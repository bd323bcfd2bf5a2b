"""What ``opd serve-teacher`` computes: a frozen causal LM's view of token-id sequences.

Two stages, so that a server can coalesce requests into one forward pass (:mod:`opd.teachers.batching`) and still
answer each in its own form: :meth:`PromptScorer.hidden_rows` runs one padded decoder pass and keeps each sequence's
final hidden states at the positions asked for (position ``p`` describes token ``p + 1``); then, per request and
chunk by chunk so that no ``[positions × vocab]`` logits exist at once, :meth:`~PromptScorer.topk` (rest mass summed
in float64), :meth:`~PromptScorer.token_logprobs`, :meth:`~PromptScorer.prompt_logprobs` (vLLM's shape), or the
rows themselves. Log-probs are at temperature 1 over the tokenizer's vocabulary, with the architecture's logit
transform (:class:`~opd.models.lm_head.OutputLayer`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from opd.kernels.topk_rest import rest_logprobs_outside_summed_in_float64
from opd.models.lm_head import (
    LMHeadInput,
    final_hidden_states,
    map_log_softmax_chunks,
    output_layer_of,
    token_log_probs,
)

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

HEAD_CHECKSUM_ROWS = 4096
"""Rows of the output layer hashed at a time (bounds the float32 copy's memory)."""


@dataclass(frozen=True)
class PositionLogprobs:
    """One position's answer: the actual token's log-prob and rank, the top k and the mass left outside them."""

    token_id: int
    logprob: float
    rank: int
    """1 + the number of vocabulary entries strictly more likely than the actual token."""
    top_ids: list[int]
    top_logprobs: list[float]
    rest_mass: float | None = None
    """Σ of the probabilities outside ``top_ids`` (0.0 when they cover the vocabulary); None for k = 0."""


def right_padded(sequences: Sequence[Sequence[int] | torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[N, longest]`` ids right-padded with 0 (at least one sequence), and the attention mask (1: a token)."""
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
        attention[row, : len(sequence)] = 1
    return input_ids, attention


def head_checksum(weight: torch.Tensor, dtype: torch.dtype) -> str:
    """``sha256:<hex>`` of an output layer's weight rounded to ``dtype`` (the served model's), hashed as float32.

    A trainer that loaded the same layer in another precision gets the same digest.
    """
    digest = hashlib.sha256()
    digest.update(str(tuple(weight.shape)).encode())
    for begin in range(0, weight.shape[0], HEAD_CHECKSUM_ROWS):
        block = weight[begin : begin + HEAD_CHECKSUM_ROWS].detach().to(dtype).float().contiguous().cpu()
        digest.update(block.numpy().tobytes())
    return f"sha256:{digest.hexdigest()}"


class PromptScorer:
    """Scores token-id sequences with a frozen causal LM (on several devices, the hidden states come from its last).

    Outputs beyond ``vocab_size`` (embedding padding) are excluded from the softmax. Raises ValueError for a model
    without a linear output layer, or with a logit transform opd does not reproduce.
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int) -> None:
        self.model = model.eval().requires_grad_(False)
        self.vocab_size = vocab_size
        self.input_device: torch.device = next(model.get_input_embeddings().parameters()).device
        self.layer = output_layer_of(model, "the teacher")
        self.hidden_size = int(self.layer.weight.shape[1])
        self.dtype = self.layer.weight.dtype

    def head_info(self) -> dict[str, object]:
        """What a trainer needs to apply this output layer itself, and to check it holds the same one."""
        weight = self.layer.weight
        return {
            "rows": int(weight.shape[0]),
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "dtype": str(self.dtype).replace("torch.", ""),
            "bias": self.layer.bias is not None,
            "logit_multiplier": self.layer.logit_multiplier,
            "logit_softcap": self.layer.logit_softcap,
            "checksum": head_checksum(weight, self.dtype),
        }

    @torch.inference_mode()
    def hidden_rows(self, sequences: list[list[int]], first_positions: list[int]) -> list[torch.Tensor]:
        """One padded decoder pass; per sequence, ``[n_i, D]`` hidden states at positions ``first_i … len_i − 2``."""
        input_ids, attention = right_padded(sequences)
        hidden = final_hidden_states(self.model, input_ids.to(self.input_device), attention.to(self.input_device))
        return [
            hidden[row, first : max(len(sequence) - 1, first)]
            for row, (sequence, first) in enumerate(zip(sequences, first_positions))
        ]

    def _head(self, rows: torch.Tensor) -> LMHeadInput:
        return self.layer.over(rows.to(self.layer.weight.device), self.vocab_size)

    @torch.inference_mode()
    def topk(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids int32 [N, k], log-probs float32 [N, k], rest log-mass float64 [N])`` for ``[N, D]`` rows."""
        k = min(k, self.vocab_size)

        def chunk_topk(log_p: torch.Tensor, _: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            top = log_p.topk(k, dim=-1)
            # Σ over the other tokens' probabilities (all positive) in float64: no cancellation.
            return top.indices.int(), top.values, rest_logprobs_outside_summed_in_float64(log_p, top.indices)

        chunks = map_log_softmax_chunks(self._head(rows), chunk_topk)
        if not chunks:
            empty = torch.zeros((0, k))
            return empty.int(), empty.float(), torch.zeros(0, dtype=torch.float64)
        ids, values, rests = (torch.cat(parts).cpu() for parts in zip(*chunks, strict=True))
        return ids, values, rests

    @torch.inference_mode()
    def token_logprobs(self, rows: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[N]``: log P(``next_ids[i]``) under row ``i``'s distribution."""
        next_ids = next_ids.to(self.layer.weight.device)
        parts = map_log_softmax_chunks(self._head(rows), lambda log_p, span: token_log_probs(log_p, next_ids[span]))
        return torch.cat(parts).cpu() if parts else torch.zeros(0)

    @torch.inference_mode()
    def prompt_logprobs(self, rows: torch.Tensor, sequence: list[int], k: int) -> list[PositionLogprobs | None]:
        """vLLM's ``prompt_logprobs`` of a sequence from its rows (positions ``0 … len − 2``); None at position 0."""
        actual = torch.tensor(sequence[1:], dtype=torch.long, device=self.layer.weight.device)

        def chunk_entries(log_p: torch.Tensor, span: slice) -> list[PositionLogprobs]:
            entries = []
            tokens = actual[span]
            actual_logprobs = token_log_probs(log_p, tokens)
            ranks = (log_p > actual_logprobs[:, None]).sum(dim=-1) + 1
            top = log_p.topk(min(k, self.vocab_size), dim=-1) if k > 0 else None
            rests = rest_logprobs_outside_summed_in_float64(log_p, top.indices).tolist() if top is not None else None
            for offset in range(log_p.shape[0]):
                entries.append(
                    PositionLogprobs(
                        token_id=int(tokens[offset]),
                        logprob=float(actual_logprobs[offset]),
                        rank=int(ranks[offset]),
                        top_ids=top.indices[offset].tolist() if top is not None else [],
                        top_logprobs=top.values[offset].tolist() if top is not None else [],
                        rest_mass=math.exp(rests[offset]) if rests is not None else None,
                    )
                )
            return entries

        per_chunk = map_log_softmax_chunks(self._head(rows), chunk_entries)
        return [None, *(entry for entries in per_chunk for entry in entries)]
