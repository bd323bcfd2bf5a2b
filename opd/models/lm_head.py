"""A causal LM's output layer, apart from its decoder: hidden states in, logits out.

Everything that turns a model's final hidden states into token probabilities without
building the ``[positions × vocab]`` logits at once lives here, for every component that
needs it: the student's fused loss, the in-process teacher, the teacher server and the
decode loop.

* :class:`LMHeadInput` pairs hidden states with the head (weight, bias, the real
  vocabulary size) and makes logits for any slice of positions;
* :func:`output_layer_of` takes a causal LM's head with the transform its architecture
  applies after the matmul (Gemma 2's soft-capping, Cohere's and Granite's scaling), as
  an :class:`OutputLayer`, for a teacher and for the student's fused loss (which
  differentiates through the transform); it refuses only what opd cannot reproduce (a
  head that is not a linear layer, a transform it does not know);
* :func:`output_head_of` takes the bare ``(weight, bias)`` for callers that apply no
  transform, refusing models whose logits the matmul alone would not reproduce;
  :func:`final_hidden_states` runs the decoder alone;
* :func:`log_softmax_chunks` walks the positions chunk by chunk, and
  :func:`token_log_probs` picks the log-probability of given tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

ROWS_BUDGET_ELEMENTS = 2**25
"""Default chunk size in logits elements (``chunk_rows × vocab``): 128 MiB per fp32
``[chunk × vocab]`` tensor, a few of which are alive while a chunk is processed."""

# Configs that change logits after the head's matmul; a bare (weight, bias) head would skip them.
_LOGIT_TRANSFORM_ATTRIBUTES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass
class LMHeadInput:
    """Final hidden states and the output layer that turns them into logits.

    Attributes:
        hidden_states: ``[..., D]`` hidden states after the model's final norm.
        weight: ``[V, D]`` output-embedding (``lm_head``) weight.
        bias: ``[V]`` output bias, or None (most LLMs have none).
        vocab_size: if set, only the first ``vocab_size`` outputs are real tokens (padded
            output layers); the rest are never computed.
        logit_multiplier: the logits are multiplied by it after the matmul (1: none).
        logit_softcap: if set, the logits become ``cap · tanh(logits / cap)`` (after the
            multiplier), as Gemma 2 does.
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
        weight: ``[V, D]`` output-embedding weight.
        bias: ``[V]`` output bias, or None.
        logit_multiplier: logits are multiplied by it (Cohere's ``logit_scale``, the
            inverse of Granite's ``logits_scaling``); 1 for most models.
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
    """A causal LM's linear output layer and its logit transform.

    The layer holds the model's own parameters: a teacher's answer detaches them
    (:meth:`OutputLayer.over`), the student's fused loss differentiates through them
    and through the transform (:meth:`OutputLayer.trained_over`).

    Raises:
        ValueError: the model has no plain linear output layer, or transforms its logits
            in a way opd does not know.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{model_name}'s output layer is {type(head).__name__}, not a linear layer")
    multiplier, softcap = logit_transform_of(getattr(model, "config", None), model_name)
    return OutputLayer(head.weight, head.bias, multiplier, softcap)


def transform_logits(logits: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """``logits · multiplier``, then soft-capped to ``cap · tanh(logits / cap)``: what the model's forward does.

    The soft cap takes transformers' own steps in their order (divide by the cap, tanh,
    multiply back), so the result is the model's logits bit for bit; Granite's division
    by ``logits_scaling`` is a multiplication by its inverse here (equal to rounding).
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

    The student's fused loss and the teachers take :func:`output_layer_of` instead, which
    carries the transform along.

    Raises:
        ValueError: if the model transforms its logits after the head (soft-capping,
            scaling), which the bare matmul does not reproduce, or has no plain linear
            output layer.
    """
    config = getattr(model, "config", None)
    for attribute in _LOGIT_TRANSFORM_ATTRIBUTES:
        value = getattr(config, attribute, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"{model_name} sets config.{attribute} = {value}, which a bare (weight, bias) head does not apply; "
                "take the head with its logit transform (opd.models.lm_head.output_layer_of)"
            )
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{model_name}'s output layer is {type(head).__name__}, not a linear layer")
    return head.weight, head.bias


def final_hidden_states(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The hidden states that a causal LM's ``lm_head`` would read (after the final norm).

    Runs the decoder alone (``model.get_decoder()``), so no logits are computed. Packed
    sequences pass ``position_ids`` and no attention mask.
    """
    return model.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state


def default_chunk_rows(vocab_size: int) -> int:
    """Positions per chunk so that one ``[chunk × vocab]`` fp32 tensor is 128 MiB."""
    return max(1, math.ceil(ROWS_BUDGET_ELEMENTS / max(vocab_size, 1)))


def log_softmax_chunks(head: LMHeadInput, temperature: float = 1.0) -> Iterator[tuple[torch.Tensor, slice]]:
    """Yields ``(log_softmax(logits / temperature) [C, V] float32, rows)`` over the positions.

    ``head.hidden_states`` is ``[N, D]``; each chunk holds at most 128 MiB of logits, so
    the ``[N, V]`` log-probabilities never exist at once. No gradient is recorded.
    """
    rows_per_chunk = default_chunk_rows(head.head()[0].shape[0])
    with torch.no_grad():
        for begin in range(0, head.hidden_states.shape[0], rows_per_chunk):
            rows = slice(begin, begin + rows_per_chunk)
            yield torch.log_softmax(head.logits(rows).float() / temperature, dim=-1), rows


def token_log_probs(log_probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``log_probs[..., token_ids]`` per position: ``[..., V]`` and ``[...]`` ids give ``[...]``."""
    return log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
