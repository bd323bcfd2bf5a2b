"""A frozen teacher that runs in the trainer's process.

It scores exactly the token ids it is given and answers in the form the loss requests
(:mod:`opd.models.interfaces`): full-vocabulary logits; final hidden states with its output head (the fused loss
makes the logits chunk by chunk); top-k log-probs and ids with the rest mass summed from the full log-softmax
(:mod:`opd.kernels.topk_rest`); or each actual token's log-prob. The last two are computed from the hidden states
in chunks of positions, never holding ``[B, L, V]`` logits. With ``share_prompt_forward``, rows that begin with the
same prompt share one forward pass over it (:mod:`opd.teachers.shared_prompt`), with the one-pass answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import model_inputs
from opd.kernels.topk_rest import rest_logprobs_outside
from opd.models.interfaces import (
    FullVocabRequest,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TokenLogprobsRequest,
    TopKLogprobs,
    TopKRequest,
)
from opd.models.lm_head import (
    LMHeadInput,
    final_hidden_states,
    map_log_softmax_chunks,
    output_layer_of,
    token_log_probs,
)
from opd.teachers.shared_prompt import prompt_groups, shared_prompt_hidden_states, sharing_problem

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

T = TypeVar("T")


class LocalTeacher(TeacherInterface):
    """``TeacherInterface`` over an in-process ``PreTrainedModel``, frozen here (eval mode, gradients off)."""

    def __init__(self, model: PreTrainedModel, share_prompt_forward: bool = True) -> None:
        # inference_mode is the cheapest no-gradient mode; a teacher whose weights are gathered in its forward
        # (FSDP2) uses no_grad: tensors made under inference_mode cannot take part in the student's backward pass.
        self.no_grad_mode: Callable[[], AbstractContextManager[Any]] = torch.inference_mode
        self.model = model
        # A model whose layers do not all attend to the whole context scores in one pass.
        self.share_prompt_forward = share_prompt_forward and sharing_problem(model) is None
        self.model.eval()
        self.model.requires_grad_(False)

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """None: the model is at hand, so every signal can be computed."""
        return None

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """Answers ``request`` for ``data``; ValueError for a :class:`~opd.models.interfaces.PerTeacherRequest`."""
        if isinstance(request, FullVocabRequest):
            return self.get_hidden_states(data) if request.prefer_hidden_states else self.get_logits(data)
        if isinstance(request, TopKRequest):
            return self.get_topk_logprobs(data, request.k, request.temperature, request.vocab_size)
        if isinstance(request, TokenLogprobsRequest):
            return self.get_token_logprobs(data, request.vocab_size)
        raise ValueError(self.refusal(request))

    def _inputs(self, data: BatchedDataDict) -> dict[str, torch.Tensor]:
        return model_inputs(data, next(self.model.parameters()).device)

    def get_logits(self, data: BatchedDataDict) -> torch.Tensor:
        """Teacher logits ``[B, L, V]`` for right-padded ``data["input_ids"]``."""
        with self.no_grad_mode():
            hidden = self._shared_prompt_hidden_states(data)
            if hidden is None:
                logits = self.model(**self._inputs(data), use_cache=False).logits
            else:
                logits = output_layer_of(self.model, "the teacher").over(hidden).logits()
        # Inference-mode tensors cannot be saved for backward; a clone made outside it is an ordinary tensor.
        return logits.clone()

    def get_hidden_states(self, data: BatchedDataDict) -> LMHeadInput:
        """Final hidden states ``[B, L, D]`` and the output head, for the fused loss."""
        with self.no_grad_mode():
            hidden = self._shared_prompt_hidden_states(data)
            if hidden is None:
                hidden = self.final_hidden_states(self._inputs(data))
        # Read after the forward: a sharded model's head is whole only once it has run.
        layer = output_layer_of(self.model, "the teacher")
        return layer.over(hidden.clone())  # an ordinary tensor, as in get_logits

    def final_hidden_states(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The decoder's final hidden states for model inputs (a sharded teacher runs them through FSDP)."""
        return final_hidden_states(self.model, **inputs)

    def _shared_prompt_hidden_states(self, data: BatchedDataDict) -> torch.Tensor | None:
        """``[B, L, D]`` with each distinct prompt run once, or None where sharing is off or saves nothing."""
        if not self.share_prompt_forward:
            return None
        groups = prompt_groups(data)
        if groups is None:
            return None
        return shared_prompt_hidden_states(self.model, data["input_ids"], groups, next(self.model.parameters()).device)

    def _map_log_prob_chunks(
        self,
        data: BatchedDataDict,
        vocab_size: int | None,
        temperature: float,
        per_chunk: Callable[[torch.Tensor, slice], T],
    ) -> list[T]:
        """``per_chunk(log_softmax(logits / T) [C, V], rows)`` over the flattened ``B × L`` positions, by chunks."""
        head = self.get_hidden_states(data)
        flat = dataclasses.replace(head, hidden_states=head.hidden_states.flatten(0, 1), vocab_size=vocab_size)
        return map_log_softmax_chunks(flat, per_chunk, temperature)

    def get_topk_logprobs(
        self, data: BatchedDataDict, k: int, temperature: float = 1.0, vocab_size: int | None = None
    ) -> TopKLogprobs:
        """Top-k log-probs and ids of softmax(logits / temperature) per position, sorted, with the rest mass.

        ``[B, L, k]`` float32 / int64 (k capped at the vocabulary; only the first ``vocab_size`` outputs are tokens) and
        ``rest_logprobs`` ``[B, L]`` (−inf when k covers the vocabulary); position ``t`` describes token ``t + 1``.
        """

        def chunk_topk(log_p: torch.Tensor, _: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            top = log_p.topk(min(k, log_p.shape[-1]), dim=-1)
            # Summed over the other entries (all positive): 1 − Σ_k P would cancel.
            return top.values, top.indices, rest_logprobs_outside(log_p, top.indices)

        values, ids, rests = zip(*self._map_log_prob_chunks(data, vocab_size, temperature, chunk_topk), strict=True)
        shape = data["input_ids"].shape
        return TopKLogprobs(
            torch.cat(values).reshape(*shape, -1), torch.cat(ids).reshape(*shape, -1), torch.cat(rests).reshape(shape)
        )

    def get_token_logprobs(self, data: BatchedDataDict, vocab_size: int | None = None) -> torch.Tensor:
        """``[B, L]`` log P(token t | tokens before t) at temperature 1; 0 at position 0."""
        input_ids = data["input_ids"]
        # Position t's logits predict token t + 1: gather the next token's log-prob there.
        next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1).flatten()
        next_ids = next_ids.to(next(self.model.parameters()).device)
        predicted = torch.cat(
            self._map_log_prob_chunks(data, vocab_size, 1.0, lambda log_p, rows: token_log_probs(log_p, next_ids[rows]))
        ).reshape(input_ids.shape)
        return torch.cat([torch.zeros_like(predicted[:, :1]), predicted[:, :-1]], dim=1)
