"""Prompt log-probs of token-id sequences, in the shape vLLM's ``prompt_logprobs`` has.

What ``opd serve-teacher`` computes for each request: for every position ``t ≥ 1`` of a
sequence, the log-probability (temperature 1, over the tokenizer's real vocabulary) of
the token at ``t`` given the tokens before it, and the ``k`` most likely tokens there,
each with its rank. Position 0 has no prediction (``None``), as in vLLM. With ``k > 0``
each position also carries the probability mass outside those ``k`` tokens, which vLLM
does not send: it is summed over the other tokens of the full distribution
(:func:`~opd.models.topk_rest.rest_logprobs_outside`), so it stays exact where
1 − Σ_k P computed by the client would cancel.

Sequences are scored together: one padded forward pass through the decoder, then the
output layer chunk by chunk over the positions, so no ``[B, L, V]`` logits tensor is
held at once when the model has a plain linear head (models that transform their logits
after the head run their full ``forward`` instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from opd.models.lm_head import LMHeadInput, final_hidden_states, log_softmax_chunks, output_head_of, token_log_probs
from opd.models.topk_rest import rest_logprobs_outside


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


class PromptScorer:
    """Scores token-id sequences with a frozen causal LM.

    Args:
        model: the teacher (switched to eval mode, gradients off).
        vocab_size: the tokenizer's size; outputs beyond it (padding rows of the
            embedding matrix) are not tokens and are excluded from the softmax.
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int) -> None:
        self.model = model.eval().requires_grad_(False)
        self.vocab_size = vocab_size
        self.device = next(model.parameters()).device
        try:
            output_head_of(model)
            self.fused_head = True
        except ValueError:
            self.fused_head = False

    def _log_probs(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """Per sequence, ``[n, V]`` float32 log-probs at each of its ``n`` positions (chunked when fused)."""
        attention = (torch.arange(input_ids.shape[1], device=self.device)[None, :] < lengths[:, None]).long()
        if not self.fused_head:
            logits = self.model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
            return [
                torch.log_softmax(logits[row, : int(n), : self.vocab_size].float(), dim=-1)
                for row, n in enumerate(lengths)
            ]
        hidden = final_hidden_states(self.model, input_ids, attention)
        weight, bias = output_head_of(self.model)
        return [
            torch.cat(
                [
                    log_p
                    for log_p, _ in log_softmax_chunks(
                        LMHeadInput(hidden[row, : int(n)], weight, bias, self.vocab_size)
                    )
                ]
            )
            for row, n in enumerate(lengths)
        ]

    @torch.inference_mode()
    def score(self, sequences: list[list[int]], k: int) -> list[list[PositionLogprobs | None]]:
        """Prompt log-probs of each sequence.

        Args:
            sequences: token ids (each non-empty, each id < ``vocab_size``).
            k: how many most likely tokens to report per position (0 = only the actual one).

        Returns:
            Per sequence, one entry per position: ``None`` at position 0, then the
            :class:`PositionLogprobs` of the token at that position.
        """
        width = max(len(sequence) for sequence in sequences)
        input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            input_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        lengths = torch.tensor([len(sequence) for sequence in sequences])
        answers = []
        for sequence, log_p in zip(sequences, self._log_probs(input_ids.to(self.device), lengths.to(self.device))):
            # Position t - 1's distribution predicts the token at t.
            predicting = log_p[:-1]
            actual = torch.tensor(sequence[1:], dtype=torch.long, device=self.device)
            actual_logprobs = token_log_probs(predicting, actual)
            ranks = (predicting > actual_logprobs[:, None]).sum(dim=-1) + 1
            top = predicting.topk(min(k, self.vocab_size), dim=-1) if k > 0 else None
            rest_logprobs = rest_logprobs_outside(predicting, top.indices).tolist() if top is not None else None
            entries: list[PositionLogprobs | None] = [None]
            for t in range(len(sequence) - 1):
                entries.append(
                    PositionLogprobs(
                        token_id=sequence[t + 1],
                        logprob=float(actual_logprobs[t]),
                        rank=int(ranks[t]),
                        top_ids=top.indices[t].tolist() if top is not None else [],
                        top_logprobs=top.values[t].tolist() if top is not None else [],
                        # exp in float64: a rest below float32's range (1e-38) still has a value.
                        rest_mass=math.exp(rest_logprobs[t]) if rest_logprobs is not None else None,
                    )
                )
            answers.append(entries)
        return answers
