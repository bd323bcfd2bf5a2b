"""Exact divergences fused with the LM head, in chunks of positions.

With Qwen's 151,669-token vocabulary a naive loss holds several ``[tokens × vocab]``
fp32 tensors at once (student logits, both log-softmaxes, their gradients): 8,192
tokens make 5 GB *each*. The fused path never builds them. It takes the student's final
hidden states and its ``lm_head`` weight, and for each chunk of positions it

1. makes that chunk's student logits (and, for an in-process teacher, the teacher's
   logits from the teacher's hidden states and head),
2. computes the divergence and its gradient with respect to the chunk's logits, by
   autograd through the same kernel the unfused path calls, or by a closed form of that
   gradient when the loss supplies one (``value_and_grad``; fewer temporaries),
3. turns that gradient into the gradients of the hidden states and of the head weight
   (two matmuls) and drops the chunk's logits.

The gradients are computed during the forward pass and handed to autograd in
``backward`` (the approach of Liger-Kernel's fused-linear losses), so nothing is
recomputed and peak memory is one chunk's worth of ``[chunk × vocab]`` tensors plus the
weight gradient that any backward pass needs anyway (held once: autograd adopts it).
Values and gradients equal the unfused computation's to floating-point rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

ROWS_BUDGET_ELEMENTS = 2**25
"""Default chunk size in logits elements (``chunk_rows × vocab``): 128 MiB per fp32
``[chunk × vocab]`` tensor, a few of which are alive while a chunk is processed."""

# Configs that change logits after the head's matmul; the fused path would skip them.
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
    """

    hidden_states: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    vocab_size: int | None = None

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias cut to the real vocabulary (views, no copy)."""
        if self.vocab_size is None:
            return self.weight, self.bias
        bias = self.bias[: self.vocab_size] if self.bias is not None else None
        return self.weight[: self.vocab_size], bias

    def select(self, mask: torch.Tensor) -> "LMHeadInput":
        """The same head over the hidden-state rows where ``mask`` is True (``[N, D]``)."""
        return LMHeadInput(self.hidden_states[mask], self.weight, self.bias, self.vocab_size)

    def logits(self, rows: slice | None = None) -> torch.Tensor:
        """The logits of ``hidden_states[rows]`` (all rows if None)."""
        weight, bias = self.head()
        hidden = self.hidden_states if rows is None else self.hidden_states[rows]
        return _linear(hidden, weight, bias)


def _linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype))


def output_head_of(model: torch.nn.Module, model_name: str = "model") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``lm_head`` weight and bias of a Hugging Face causal LM, for the fused path.

    Raises:
        ValueError: if the model transforms its logits after the head (soft-capping,
            scaling) or has no plain linear output layer: the fused path would compute a
            different distribution than the model's own ``forward``.
    """
    config = getattr(model, "config", None)
    for attribute in _LOGIT_TRANSFORM_ATTRIBUTES:
        value = getattr(config, attribute, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"{model_name} sets config.{attribute} = {value}, which the fused LM-head loss does not apply; "
                "set loss_fn.fused_lm_head = false"
            )
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"{model_name}'s output layer is {type(head).__name__}, not a linear layer; "
            "set loss_fn.fused_lm_head = false"
        )
    return head.weight, head.bias


def final_hidden_states(
    model: torch.nn.Module,
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


RowInputs = tuple[Any, ...]
"""Per-position inputs of the divergence (teacher logits, top-k log-probs and ids, target
ids, ...): tensors with the positions on dim 0, or an :class:`LMHeadInput` whose logits
are made chunk by chunk."""

DivergenceFn = Callable[..., torch.Tensor]
"""``(student_logits [C, V], *row_inputs_chunk) -> [C]`` per-position losses."""

ValueAndGradFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``(student_logits [C, V], *row_inputs_chunk) -> (losses [C], ∂losses/∂logits [C, V])``:
a closed-form alternative to autograd through ``divergence`` (same values)."""

ChunkObserver = Callable[..., None]
"""``(student_logits [C, V] detached, *row_inputs_chunk)``: collects metrics, no gradient."""


def _chunk_of(row_input: Any, rows: slice) -> Any:
    """Rows ``rows`` of one row input: sliced tensors, computed logits for an LM head."""
    if isinstance(row_input, LMHeadInput):
        with torch.no_grad():
            return row_input.logits(rows)
    if isinstance(row_input, torch.Tensor):
        return row_input[rows]
    return row_input  # a per-call constant (e.g. None)


class _ChunkedLMHeadLoss(torch.autograd.Function):
    """Σ_i w_i · divergence_i with the gradients made in forward, chunk by chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        position_weights: torch.Tensor,
        divergence: DivergenceFn,
        row_inputs: RowInputs,
        chunk_rows: int,
        observer: ChunkObserver | None,
        value_and_grad: ValueAndGradFn | None,
    ) -> torch.Tensor:
        accumulate = torch.promote_types(hidden.dtype, torch.float32)
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
        grad_bias = torch.zeros(bias.shape, dtype=accumulate, device=bias.device) if bias is not None else None
        total = torch.zeros((), dtype=accumulate, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            chunk_hidden = hidden[rows]
            chunk_inputs = tuple(_chunk_of(row_input, rows) for row_input in row_inputs)
            if value_and_grad is not None:
                logits = _linear(chunk_hidden, weight, bias)
                losses, grad_logits = value_and_grad(logits, *chunk_inputs)
                chunk_weights = position_weights[rows].to(losses.dtype)
                chunk_total = (losses * chunk_weights).sum()
                grad_logits.mul_(chunk_weights.unsqueeze(-1))
            else:
                with torch.enable_grad():
                    logits = _linear(chunk_hidden, weight, bias).detach().requires_grad_(True)
                    losses = divergence(logits, *chunk_inputs)
                    chunk_total = (losses * position_weights[rows].to(losses.dtype)).sum()
                    (grad_logits,) = torch.autograd.grad(chunk_total, logits)
            total += chunk_total.detach()
            if observer is not None:
                observer(logits.detach(), *chunk_inputs)
            del logits, losses
            # d loss / d hidden = g·W and d loss / d W = gᵀ·h for logits = h·Wᵀ + b.
            grad_logits = grad_logits.to(accumulate)
            # In the weight's own dtype, as autograd would: casting a bf16 [V, D] weight
            # to fp32 here would copy it once per chunk.
            grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight.addmm_(grad_logits.T, chunk_hidden.to(accumulate))
            if grad_bias is not None:
                grad_bias += grad_logits.sum(dim=0)
            del grad_logits
        # Kept on ctx rather than save_for_backward: backward hands them to autograd and
        # drops its own reference, so the weight's gradient is adopted, not copied.
        ctx.gradients = (grad_hidden, grad_weight.to(weight.dtype),
                         grad_bias.to(bias.dtype) if grad_bias is not None else None)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:  # type: ignore[override]
        if ctx.gradients is None:
            raise RuntimeError("chunked_lm_head_loss supports one backward pass per forward (its gradients were handed over)")
        grad_hidden, grad_weight, grad_bias = ctx.gradients
        ctx.gradients = None
        # The loss is usually the graph's root (grad_output = 1): hand the saved gradients
        # over as they are. Scaling would allocate a second [V, D] weight gradient, which
        # at Qwen's vocabulary is most of this loss's memory.
        unit = bool(grad_output == 1)

        def scaled(gradient: torch.Tensor | None, needed: bool) -> torch.Tensor | None:
            if gradient is None or not needed:
                return None
            return gradient if unit else gradient * grad_output.to(gradient.dtype)

        return (
            scaled(grad_hidden, ctx.needs_input_grad[0]),
            scaled(grad_weight, ctx.needs_input_grad[1]),
            scaled(grad_bias, ctx.needs_input_grad[2]),
            None, None, None, None, None, None,
        )


def chunked_lm_head_loss(
    student: LMHeadInput,
    divergence: DivergenceFn,
    row_inputs: RowInputs,
    position_weights: torch.Tensor,
    chunk_rows: int | None = None,
    observer: ChunkObserver | None = None,
    value_and_grad: ValueAndGradFn | None = None,
) -> torch.Tensor:
    """Σ_i w_i · divergence(student_logits_i, row_inputs_i) without materialising the logits.

    The value equals ``(divergence(student.logits(), *row_inputs) * position_weights).sum()``
    and so do its gradients with respect to the hidden states, the head weight and bias,
    to floating-point rounding; only one chunk of ``[chunk_rows × V]`` logits exists at a
    time.

    Args:
        student: ``[N, D]`` student hidden states (one row per loss position) and head.
        divergence: per-position loss of a chunk: ``(logits [C, V], *inputs) -> [C]``.
        row_inputs: per-position inputs, sliced (or, for an :class:`LMHeadInput`, turned
            into logits without gradient) chunk by chunk.
        position_weights: ``[N]`` weight of each position (e.g. 1 / global token count).
        chunk_rows: positions per chunk; None picks :func:`default_chunk_rows`.
        observer: called on each chunk's detached logits and inputs, e.g. for metrics.
        value_and_grad: optional closed-form ``(losses, gradient)`` of ``divergence``;
            used instead of autograd when given (fewer ``[chunk × V]`` temporaries).

    Returns:
        The scalar loss, differentiable with respect to ``student``'s tensors.
    """
    weight, bias = student.head()
    hidden = student.hidden_states
    if hidden.dim() != 2:
        raise ValueError(f"chunked_lm_head_loss takes [N, D] hidden states, got {tuple(hidden.shape)}")
    if position_weights.shape != hidden.shape[:1]:
        raise ValueError(f"position_weights {tuple(position_weights.shape)} do not match {hidden.shape[0]} positions")
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    return _ChunkedLMHeadLoss.apply(
        hidden, weight, bias, position_weights, divergence, tuple(row_inputs), rows, observer, value_and_grad
    )
