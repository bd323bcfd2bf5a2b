"""A frozen teacher that runs in the trainer's process.

It scores exactly the token ids it is given, in ``torch.inference_mode``, and answers in
whichever form the loss asks for (see each loss's ``query_teacher``):

* full-vocabulary logits ``[B, L, V]`` (the plain exact loss);
* final hidden states and its output head (the fused loss makes the logits chunk by
  chunk, so no ``[B, L, V]`` teacher tensor ever exists);
* its top-k log-probs and token ids per position (what a served teacher would send);
* the log-prob of each actual token (the sampled-token loss).

The last two are computed from the hidden states in chunks of positions, so they too
never hold the full ``[B, L, V]`` logits. Everything is produced one micro-batch at a
time, when the student's trainer asks for it.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from opd.algorithms.fused_lm_head import LMHeadInput, default_chunk_rows, final_hidden_states, output_head_of
from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import model_inputs


class LocalTeacher:
    """``TeacherInterface`` over an in-process, frozen ``PreTrainedModel``.

    Args:
        model: the teacher; it is switched to eval mode with gradients off.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.model.eval()
        self.model.requires_grad_(False)
        self.seconds_spent = 0.0
        """Wall time spent scoring since the last :meth:`pop_seconds_spent`."""

    def _inputs(self, data: BatchedDataDict) -> dict[str, torch.Tensor]:
        return model_inputs(data, next(self.model.parameters()).device)

    def get_logits(self, data: BatchedDataDict) -> torch.Tensor:
        """Teacher logits ``[B, L, V]`` for right-padded ``data["input_ids"]``."""
        start = time.perf_counter()
        with torch.inference_mode():
            logits = self.model(**self._inputs(data), use_cache=False).logits
        # Inference-mode tensors cannot be saved for the student's backward pass; a clone
        # made outside inference mode is an ordinary constant tensor.
        logits = logits.clone()
        self.seconds_spent += time.perf_counter() - start
        return logits

    def get_hidden_states(self, data: BatchedDataDict) -> LMHeadInput:
        """Final hidden states ``[B, L, D]`` and the output head, for the fused loss."""
        start = time.perf_counter()
        weight, bias = output_head_of(self.model, "the teacher")
        with torch.inference_mode():
            hidden = final_hidden_states(self.model, **self._inputs(data))
        hidden = hidden.clone()  # an ordinary tensor, as in get_logits
        self.seconds_spent += time.perf_counter() - start
        return LMHeadInput(hidden, weight.detach(), bias.detach() if bias is not None else None)

    def _log_prob_chunks(
        self, data: BatchedDataDict, vocab_size: int | None, temperature: float
    ) -> Iterator[tuple[torch.Tensor, slice]]:
        """Yields ``(log_softmax(logits / T) [C, V], rows)`` over the flattened ``B × L`` positions."""
        head = self.get_hidden_states(data)
        start = time.perf_counter()
        flat = LMHeadInput(head.hidden_states.flatten(0, 1), head.weight, head.bias, vocab_size)
        rows_per_chunk = default_chunk_rows(flat.head()[0].shape[0])
        with torch.no_grad():
            for begin in range(0, flat.hidden_states.shape[0], rows_per_chunk):
                rows = slice(begin, begin + rows_per_chunk)
                yield torch.log_softmax(flat.logits(rows).float() / temperature, dim=-1), rows
        self.seconds_spent += time.perf_counter() - start

    def get_topk_logprobs(
        self, data: BatchedDataDict, k: int, temperature: float = 1.0, vocab_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k log-probs and token ids at every position.

        Args:
            data: right-padded ``input_ids`` / ``input_lengths``.
            k: tokens per position (capped at the vocabulary size).
            temperature: log-probs are of softmax(logits / temperature).
            vocab_size: only the first ``vocab_size`` outputs are real tokens.

        Returns:
            ``([B, L, k] float32 log-probs, [B, L, k] int64 ids)``, sorted by probability;
            position ``t`` describes the token that follows it (like logits).
        """
        values, ids = [], []
        for log_p, _ in self._log_prob_chunks(data, vocab_size, temperature):
            top = log_p.topk(min(k, log_p.shape[-1]), dim=-1)
            values.append(top.values)
            ids.append(top.indices)
        shape = data["input_ids"].shape
        return torch.cat(values).reshape(*shape, -1), torch.cat(ids).reshape(*shape, -1)

    def get_token_logprobs(self, data: BatchedDataDict, vocab_size: int | None = None) -> torch.Tensor:
        """``[B, L]`` log P(token t | tokens before t) at temperature 1; 0 at position 0."""
        input_ids = data["input_ids"]
        # Position t's logits predict token t + 1: gather the next token's log-prob there.
        next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1).flatten()
        next_ids = next_ids.to(next(self.model.parameters()).device)
        predicted = torch.cat([
            log_p.gather(-1, next_ids[rows, None]).squeeze(-1)
            for log_p, rows in self._log_prob_chunks(data, vocab_size, 1.0)
        ]).reshape(input_ids.shape)
        return torch.cat([torch.zeros_like(predicted[:, :1]), predicted[:, :-1]], dim=1)

    def pop_seconds_spent(self) -> float:
        """Returns the scoring time accumulated so far and resets the counter."""
        seconds, self.seconds_spent = self.seconds_spent, 0.0
        return seconds
