"""Exact divergences fused with the LM head, in chunks of positions.

A naive loss holds several fp32 ``[tokens × vocab]`` tensors at once (student logits, both log-softmaxes, their
gradients): at Qwen's 151,669-token vocabulary, 5 GB each for 8,192 tokens. The fused path takes the student's final
hidden states and ``lm_head`` weight and, for each chunk of positions, (1) makes the chunk's logits, with the
architecture's logit transform (a multiplier, Gemma 2's soft cap) and, for an in-process teacher, the teacher's
logits; (2) computes the divergence and its gradient with respect to the logits, by autograd through the unfused
path's kernel or by the loss's closed form (``value_and_grad``; fewer temporaries), chained through the transform;
(3) turns it into the gradients of the hidden states and the weight (two matmuls) and drops the chunk.

Gradients are made in forward and handed to autograd in ``backward`` (as Liger-Kernel's fused-linear losses do):
nothing is recomputed, and peak memory is one chunk plus the weight gradient (held once: autograd adopts it).
Values and gradients equal the unfused computation's up to floating-point rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from opd.models.lm_head import LMHeadInput, default_chunk_rows, linear_logits, transform_logits

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

_ALIKE_CHUNKS_ONCE: ContextVar[bool] = ContextVar("alike_chunks_once", default=False)


@contextmanager
def alike_chunks_traced_once() -> Iterator[None]:
    """For a memory trace on fake tensors (``opd plan``): the chunk loop runs its first two chunks and its last.

    The chunks before the last have one shape, and each allocates and frees alike: the gradients accumulate in place
    into buffers made before the loop, and a chunk's tensors live on at most into the next chunk. So the first two
    chunks and the last have the memory of the whole loop, at a fraction of the trace's time on a long response.
    The loss's value is then a partial sum, which a trace on fake tensors never reads.
    """
    token = _ALIKE_CHUNKS_ONCE.set(True)
    try:
        yield
    finally:
        _ALIKE_CHUNKS_ONCE.reset(token)


def chunk_starts(rows: int, chunk_rows: int) -> list[int]:
    """The first position of each chunk; under :func:`alike_chunks_traced_once`, of the first two and the last."""
    starts = list(range(0, rows, chunk_rows))
    if _ALIKE_CHUNKS_ONCE.get() and len(starts) > 3:
        return [starts[0], starts[1], starts[-1]]
    return starts


def _chunk_of(row_input: Any, rows: slice) -> Any:
    """Rows ``rows`` of one row input: sliced tensors, computed logits for an LM head."""
    if isinstance(row_input, LMHeadInput):
        with torch.no_grad():
            return row_input.logits(rows)
    if isinstance(row_input, torch.Tensor):
        return row_input[rows]
    return row_input  # a per-call constant (e.g. None)


def _transformed_with_slope(
    raw: torch.Tensor, multiplier: float, softcap: float | None, accumulate: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | float | None]:
    """``(logits, d logits / d raw)`` for the head's transform of the raw matmul (as in ``transform_logits``).

    The slope is elementwise in ``accumulate``: ``m · (1 − tanh²(m · raw / cap))`` with a soft cap (autograd's formula),
    ``m`` without one, None for no transform.
    """
    if softcap is None:
        return transform_logits(raw, multiplier), (multiplier if multiplier != 1.0 else None)
    scaled = raw * multiplier if multiplier != 1.0 else raw
    squashed = torch.tanh(scaled / softcap)
    logits = squashed * softcap
    squashed = squashed.to(accumulate)
    return logits, (1.0 - squashed * squashed).mul_(multiplier)


_SIXTEEN_BIT = (torch.bfloat16, torch.float16)
_WEIGHT_GRADIENT_BLOCK_BYTES = 64 * 2**20
"""The most bytes of a 16-bit weight-gradient product held at once (:func:`add_weight_gradient`)."""


def add_weight_gradient(
    grad_weight: torch.Tensor, grad_logits: torch.Tensor, grad_logits_as_weight: torch.Tensor, hidden: torch.Tensor
) -> None:
    """``grad_weight += grad_logitsᵀ · hidden`` for one chunk of positions; ``grad_weight`` is fp32 (or fp64).

    A model that computes in fp32 gets the product in fp32. One that computes in 16 bits gets it from a 16-bit
    matmul (``grad_logits_as_weight``, the gradient already cast to the weight's dtype for the hidden states'
    gradient, times the 16-bit ``hidden``): on a GPU that is the tensor cores' rate, with fp32 accumulation inside
    the matmul, where an fp32 matmul over ``[V, rows] × [rows, D]`` was the largest of the head's costs. Its result
    is rounded once to 16 bits per chunk, then summed over the chunks in fp32: as autograd computes a 16-bit
    weight's gradient, but without autograd's rounding of the running sum: each element is within 2u·Σ|g·h| (u =
    2⁻⁸ for bf16, 2⁻¹¹ for fp16: one rounding of the cast gradient, one of the chunk's product) plus fp32's
    rounding of the sums (tested against float64).
    """
    if hidden.dtype in _SIXTEEN_BIT and grad_logits_as_weight.dtype == hidden.dtype:
        # The 16-bit product is a temporary before it is added: made for a block of vocabulary rows at a time,
        # it stays small beside the fp32 gradient it is added to (one [V, D] product would be half its size).
        block = max(1, _WEIGHT_GRADIENT_BLOCK_BYTES // (hidden.shape[1] * hidden.element_size()))
        for start in range(0, grad_weight.shape[0], block):
            rows = slice(start, start + block)
            grad_weight[rows].add_(grad_logits_as_weight[:, rows].T @ hidden)
    else:
        grad_weight.addmm_(grad_logits.T, hidden.to(grad_weight.dtype))


class _ChunkedLMHeadLoss(torch.autograd.Function):
    """Σ_i w_i · divergence_i with the gradients made in forward, chunk by chunk."""

    @staticmethod
    def forward(
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
        logit_multiplier: float,
        logit_softcap: float | None,
    ) -> torch.Tensor:
        accumulate = torch.promote_types(hidden.dtype, torch.float32)
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
        grad_bias = torch.zeros(bias.shape, dtype=accumulate, device=bias.device) if bias is not None else None
        total = torch.zeros((), dtype=accumulate, device=hidden.device)
        for start in chunk_starts(hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            chunk_hidden = hidden[rows]
            chunk_inputs = tuple(_chunk_of(row_input, rows) for row_input in row_inputs)
            # grad_logits below is the gradient of the raw matmul's output (before the transform).
            if value_and_grad is not None:
                raw = linear_logits(chunk_hidden, weight, bias)
                logits, slope = _transformed_with_slope(raw, logit_multiplier, logit_softcap, accumulate)
                losses, grad_logits = value_and_grad(logits, *chunk_inputs)
                chunk_weights = position_weights[rows].to(losses.dtype)
                chunk_total = (losses * chunk_weights).sum()
                grad_logits.mul_(chunk_weights.unsqueeze(-1))
                if slope is not None:  # the chain rule through the transform, elementwise
                    grad_logits = grad_logits.to(accumulate).mul_(slope)
                del raw, slope
            else:
                with torch.enable_grad():
                    raw = linear_logits(chunk_hidden, weight, bias).detach().requires_grad_(True)
                    logits = transform_logits(raw, logit_multiplier, logit_softcap)
                    losses = divergence(logits, *chunk_inputs)
                    chunk_total = (losses * position_weights[rows].to(losses.dtype)).sum()
                    (grad_logits,) = torch.autograd.grad(chunk_total, raw)
                del raw
            total += chunk_total.detach()
            if observer is not None:
                observer(logits.detach(), *chunk_inputs)
            del logits, losses
            # d loss / d hidden = g·W and d loss / d W = gᵀ·h for logits = h·Wᵀ + b.
            grad_logits = grad_logits.to(accumulate)
            # In the weight's own dtype, as autograd would: casting a bf16 [V, D] weight
            # to fp32 here would copy it once per chunk.
            grad_logits_as_weight = grad_logits.to(weight.dtype)
            grad_hidden[rows] = (grad_logits_as_weight @ weight).to(hidden.dtype)
            add_weight_gradient(grad_weight, grad_logits, grad_logits_as_weight, chunk_hidden)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(dim=0)
            # Both names: in the weight's dtype the second is the first, and either left alive would hold a
            # [chunk × V] tensor through the next chunk's logits (one more chunk in the loss's peak).
            del grad_logits, grad_logits_as_weight
        # Kept on ctx rather than save_for_backward: backward hands them to autograd and
        # drops its own reference, so the weight's gradient is adopted, not copied.
        ctx.gradients = (
            grad_hidden,
            grad_weight.to(weight.dtype),
            grad_bias.to(bias.dtype) if grad_bias is not None and bias is not None else None,
        )
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        if ctx.gradients is None:
            raise RuntimeError(
                "chunked_lm_head_loss supports one backward pass per forward (its gradients were handed over)"
            )
        grad_hidden, grad_weight, grad_bias = ctx.gradients
        ctx.gradients = None
        # Scaled in place: the gradients are this function's own, and a scaled copy would be a second [V, D]
        # weight gradient, most of this loss's memory at a large vocabulary. Always scaled, even by the usual 1:
        # testing grad_output == 1 would read it from the device (a host sync at every backward).

        def scaled(gradient: torch.Tensor | None, needed: bool) -> torch.Tensor | None:
            if gradient is None or not needed:
                return None
            return gradient.mul_(grad_output.to(gradient.dtype))

        return (
            scaled(grad_hidden, ctx.needs_input_grad[0]),
            scaled(grad_weight, ctx.needs_input_grad[1]),
            scaled(grad_bias, ctx.needs_input_grad[2]),
            *([None] * 8),  # forward's other arguments take no gradient
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

    Value and gradients (hidden states, head weight and bias, through any logit transform) equal those of
    ``(divergence(student.logits(), *row_inputs) * position_weights).sum()`` up to rounding, with one
    ``[chunk_rows × V]`` chunk at a time (None: :func:`default_chunk_rows`). ``student``: ``[N, D]`` hidden states and
    head; ``row_inputs``: :data:`RowInputs`; ``position_weights``: ``[N]``; ``observer`` sees each chunk's detached
    logits and inputs (metrics); ``value_and_grad``: a closed form of ``divergence`` used instead of autograd.
    """
    weight, bias = student.head()
    hidden = student.hidden_states
    if hidden.dim() != 2:
        raise ValueError(f"chunked_lm_head_loss takes [N, D] hidden states, got {tuple(hidden.shape)}")
    if position_weights.shape != hidden.shape[:1]:
        raise ValueError(f"position_weights {tuple(position_weights.shape)} do not match {hidden.shape[0]} positions")
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    return _ChunkedLMHeadLoss.apply(
        hidden,
        weight,
        bias,
        position_weights,
        divergence,
        tuple(row_inputs),
        rows,
        observer,
        value_and_grad,
        student.logit_multiplier,
        student.logit_softcap,
    )
