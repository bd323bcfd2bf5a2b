"""A causal LM's output layer, apart from its decoder: hidden states in, logits out.

Shared by the fused loss, the teachers, the teacher server and the decode loop, so that the
``[positions × vocab]`` logits need never exist at once. :func:`output_layer_of` keeps the
architecture's logit transform (Gemma 2's soft-capping, Cohere's and Granite's scaling) and refuses
transforms opd cannot reproduce.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

T = TypeVar("T")

ROWS_BUDGET_ELEMENTS = 2**25
"""Default chunk size in logits elements (``chunk_rows × vocab``): 128 MiB per fp32 chunk."""

# Configs that change logits after the head's matmul; a bare (weight, bias) head would skip them.
_LOGIT_TRANSFORM_NEUTRAL: dict[str, tuple[float | None, ...]] = {
    "final_logit_softcapping": (None, 0, 0.0),  # a soft cap of 0 is no cap, as in logit_transform_of
    "logit_scale": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
    "output_multiplier_scale": (None, 1, 1.0),
}
"""Config attributes that transform the logits, and the values with which they change nothing."""


@dataclass
class LMHeadInput:
    """Final hidden states and the output layer that turns them into logits.

    Attributes:
        hidden_states: ``[..., D]`` hidden states after the model's final norm.
        weight: ``[V, D]`` output-embedding (``lm_head``) weight.
        bias: ``[V]`` output bias, or None (most LLMs have none).
        vocab_size: if set, only the first ``vocab_size`` outputs are real tokens; the rest are never computed.
        logit_multiplier: multiplies the logits after the matmul (1: none).
        logit_softcap: if set, logits become ``cap · tanh(logits / cap)`` after the multiplier (Gemma 2).
    """

    hidden_states: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    vocab_size: int | None = None
    logit_multiplier: float = 1.0
    logit_softcap: float | None = None

    @property
    def transforms_logits(self) -> bool:
        """The logits are not the plain matmul (a multiplier or a soft cap applies)."""
        return self.logit_multiplier != 1.0 or self.logit_softcap is not None

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias cut to the real vocabulary (views, no copy)."""
        if self.vocab_size is None:
            return self.weight, self.bias
        bias = self.bias[: self.vocab_size] if self.bias is not None else None
        return self.weight[: self.vocab_size], bias

    def logits(self, rows: slice | None = None) -> torch.Tensor:
        """The logits of ``hidden_states[rows]`` (all rows if None)."""
        weight, bias = self.head()
        hidden = self.hidden_states if rows is None else self.hidden_states[rows]
        return transform_logits(linear_logits(hidden, weight, bias), self.logit_multiplier, self.logit_softcap)

    def with_rows(self, hidden_states: torch.Tensor) -> LMHeadInput:
        """The same head over other hidden states (a selection of positions)."""
        return dataclasses.replace(self, hidden_states=hidden_states)


@dataclass(frozen=True)
class OutputLayer:
    """A model's output layer with the transform its architecture applies to the logits.

    Attributes:
        logit_multiplier: Cohere's ``logit_scale`` times the inverse of Granite's ``logits_scaling``; usually 1.
        logit_softcap: Gemma 2's ``final_logit_softcapping``, or None.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    logit_multiplier: float = 1.0
    logit_softcap: float | None = None

    @property
    def transforms_logits(self) -> bool:
        """The logits are not the plain matmul (a multiplier or a soft cap applies)."""
        return self.logit_multiplier != 1.0 or self.logit_softcap is not None

    def over(self, hidden_states: torch.Tensor, vocab_size: int | None = None) -> LMHeadInput:
        """This layer, detached, applied to ``hidden_states`` (lazily: an :class:`LMHeadInput`)."""
        bias = self.bias.detach() if self.bias is not None else None
        return LMHeadInput(
            hidden_states, self.weight.detach(), bias, vocab_size, self.logit_multiplier, self.logit_softcap
        )

    def trained_over(self, hidden_states: torch.Tensor) -> LMHeadInput:
        """This layer applied to ``hidden_states`` with its parameters as they are (a student's: gradients flow)."""
        return LMHeadInput(hidden_states, self.weight, self.bias, None, self.logit_multiplier, self.logit_softcap)


def logit_transform_of(config: object, model_name: str = "model") -> tuple[float, float | None]:
    """``(multiplier, soft cap)`` that a model's config applies to its logits after the head.

    Raises:
        ValueError: for a transform opd does not know how to reproduce.
    """
    multiplier, softcap = 1.0, None
    scale = getattr(config, "logit_scale", None)
    if scale not in (None, 1, 1.0):
        multiplier *= float(scale)
    scaling = getattr(config, "logits_scaling", None)
    if scaling not in (None, 1, 1.0):
        multiplier /= float(scaling)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap not in (None, 0, 0.0):
        softcap = float(cap)
    unknown = getattr(config, "output_multiplier_scale", None)
    if unknown not in (None, 1, 1.0):
        raise ValueError(f"{model_name} sets config.output_multiplier_scale = {unknown}, which opd does not apply")
    return multiplier, softcap


def output_layer_of(model: PreTrainedModel, model_name: str = "model") -> OutputLayer:
    """A causal LM's linear output layer (its own parameters) and its logit transform.

    Raises:
        ValueError: no plain linear output layer, or a logit transform opd does not know.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{model_name}'s output layer is {type(head).__name__}, not a linear layer")
    multiplier, softcap = logit_transform_of(getattr(model, "config", None), model_name)
    return OutputLayer(head.weight, head.bias, multiplier, softcap)


def transform_logits(logits: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """``logits · multiplier``, then soft-capped to ``cap · tanh(logits / cap)``: what the model's forward does.

    The soft cap follows transformers' steps in order, so it matches bit for bit; Granite's division
    by ``logits_scaling`` becomes a multiplication by its inverse (equal up to rounding).
    """
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def linear_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``hidden · weightᵀ + bias`` in the hidden states' dtype."""
    return torch.nn.functional.linear(hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype))


def output_head_of(model: PreTrainedModel, model_name: str = "model") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bare ``lm_head`` weight and bias of a Hugging Face causal LM, for callers that apply no logit transform.

    Raises:
        ValueError: the model transforms its logits after the head, or has no plain linear output layer.
    """
    config = getattr(model, "config", None)
    for attribute, neutral in _LOGIT_TRANSFORM_NEUTRAL.items():
        value = getattr(config, attribute, None)
        if value not in neutral:
            raise ValueError(
                f"{model_name} sets config.{attribute} = {value}, which a bare (weight, bias) head does not apply; "
                "take the head with its logit transform (opd.models.lm_head.output_layer_of)"
            )
    layer = output_layer_of(model, model_name)  # its transform is neutral: checked just above
    return layer.weight, layer.bias


def final_hidden_states(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The hidden states a causal LM's ``lm_head`` would read, from the decoder alone (no logits).

    Packed sequences pass ``position_ids`` and no attention mask.
    """
    return model.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state


def default_chunk_rows(vocab_size: int) -> int:
    """Positions per chunk so that one ``[chunk × vocab]`` fp32 tensor is 128 MiB."""
    return max(1, math.ceil(ROWS_BUDGET_ELEMENTS / max(vocab_size, 1)))


def map_log_softmax_chunks(
    head: LMHeadInput, per_chunk: Callable[[torch.Tensor, slice], T], temperature: float = 1.0
) -> list[T]:
    """``per_chunk(log_softmax(logits / temperature) [C, V] float32, rows)`` for each chunk of ``[N, D]`` hidden states.

    No grad. One chunk's log-probabilities exist at a time, so ``per_chunk`` should return something smaller (top-k,
    gathered log-probs). (A generator would not do: its consumer's loop variable keeps the last chunk alive while the
    next one is made.)
    """
    rows_per_chunk = default_chunk_rows(head.head()[0].shape[0])
    results = []
    with torch.no_grad():
        for begin in range(0, head.hidden_states.shape[0], rows_per_chunk):
            rows = slice(begin, begin + rows_per_chunk)
            log_p = torch.log_softmax(head.logits(rows).float() / temperature, dim=-1)
            results.append(per_chunk(log_p, rows))
            del log_p
    return results


def token_log_probs(log_probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``log_probs[..., token_ids]`` per position: ``[..., V]`` and ``[...]`` ids give ``[...]``."""
    return log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
