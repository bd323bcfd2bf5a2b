"""The "rest" class of a top-k teacher signal: log(1 − Σ_k P) without cancellation.

A teacher that sends only its top k log-probs per position leaves a rest mass
1 − Σ_k P(v) on every other token, which the top-k loss keeps as one class
(:func:`~opd.losses.divergences.topk_token_kl`). Computed by subtraction in the
dtype of the log-probs, that mass is lost to cancellation when it is small: in float32,
Σ_k P carries an absolute rounding error of about 1e-7, so a rest mass of 1e-6 comes out
tens of percent wrong and one of 1e-7 can come out 0 or negative. Both ways of getting
it right live here, in log space:

* :func:`rest_logprobs_outside`: a teacher that holds its full log-softmax takes the
  logsumexp of the entries *outside* its top k. Every term is positive, so there is
  nothing to cancel and float32 keeps its relative precision (LocalTeacher sends this);
  :func:`rest_logprobs_outside_summed_in_float64` sums the same terms in float64 (what
  ``opd serve-teacher`` sends).
* :func:`rest_logprobs_from_topk`: anyone holding only the top-k log-probs computes
  ``log1mexp(logsumexp(top k))`` in float64. That is exact for the log-probs as given;
  what it cannot undo is their own rounding (float32 log-probs carry a relative error of
  about 1e-7 each), which is why a teacher that can send the rest itself should.

This module belongs to neither side: the teachers (``opd.models``) and the loss
(``opd.algorithms``) both import it.
"""

from __future__ import annotations

import math

import torch

_MINUS_LN2 = -math.log(2.0)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x ≤ 0, accurate over the whole range.

    Near 0, 1 − exp(x) is itself a cancellation, so it is taken as −expm1(x); far below
    0, exp(x) is tiny and log1p(−exp(x)) keeps it. The switch at −ln 2 is where both
    forms lose the least (Mächler, "Accurately computing log(1 − exp(−|a|))", 2012).
    log1mexp(0) = −inf (nothing is left), log1mexp(−inf) = 0; x > 0 gives NaN.

    Args:
        x: log-probabilities (any float dtype; computed in it).

    Returns:
        ``log(1 − exp(x))``, same shape and dtype.
    """
    # Each branch sees only inputs from its own range, so neither produces an infinite
    # (or NaN) value or derivative that torch.where would then multiply by 0.
    near_zero = x > _MINUS_LN2
    near = torch.where(near_zero, x, torch.full_like(x, _MINUS_LN2))
    far = torch.where(near_zero, torch.full_like(x, _MINUS_LN2), x)
    return torch.where(near_zero, torch.log(-torch.expm1(near)), torch.log1p(-torch.exp(far)))


def rest_logprobs_from_topk(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """log(1 − Σ_k P) per position from top-k log-probs alone, computed in float64.

    Rounding of the inputs can make Σ_k P reach or pass 1; the rest is then −inf (no mass
    left), never NaN. The caller decides what an empty rest means (the top-k loss floors
    it unless the k ids cover the vocabulary).

    Args:
        topk_logprobs: ``[..., k]`` log-probs normalised over the full vocabulary.

    Returns:
        ``[...]`` float64 log rest masses.
    """
    log_topk_mass = torch.logsumexp(topk_logprobs.to(torch.float64), dim=-1)
    return log1mexp(log_topk_mass.clamp(max=0.0))


def rest_logprobs_outside(log_probs: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """log Σ_{v ∉ top-k} P(v) per position from the full log-softmax (no subtraction).

    Args:
        log_probs: ``[..., V]`` log-probabilities over the whole vocabulary.
        topk_ids: ``[..., k]`` the ids sent as the top k.

    Returns:
        ``[...]`` log rest masses in the dtype of ``log_probs``; −inf where the ids cover
        the vocabulary (the rest is exactly empty).
    """
    outside = log_probs.scatter(-1, topk_ids, float("-inf"))
    return torch.logsumexp(outside, dim=-1)


def rest_logprobs_outside_summed_in_float64(log_probs: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """:func:`rest_logprobs_outside` as a float64 answer: what a teacher server sends.

    Each outside probability is exponentiated in the input's precision, relative to the
    largest of them (so that no tiny rest underflows), and they are summed in float64: the
    sum of positive terms loses nothing to cancellation or to accumulated rounding.

    Returns:
        ``[...]`` float64 log rest masses; −inf where the ids cover the vocabulary.
    """
    outside = log_probs.scatter(-1, topk_ids, float("-inf"))
    largest = outside.amax(dim=-1, keepdim=True)
    empty = torch.isneginf(largest)
    # In place: the [rows × vocab] copy above is the only one made.
    total = outside.sub_(torch.where(empty, 0.0, largest)).exp_().sum(dim=-1, dtype=torch.float64)
    return torch.where(empty.squeeze(-1), float("-inf"), total.log() + largest.squeeze(-1).double())
