"""The "rest" class of a top-k teacher signal: log(1 − Σ_k P) without cancellation.

The top-k loss (:func:`~opd.losses.divergences.topk_token_kl`) keeps the mass outside a teacher's top k as one
class. By subtraction in float32, Σ_k P's rounding error (about 1e-7) makes a small rest mass tens of percent wrong,
or even 0 or negative. Both ways of getting it right, in log space:

* :func:`rest_logprobs_outside`: a holder of the full log-softmax takes the logsumexp of the entries outside its top
  k, all positive (LocalTeacher); :func:`rest_logprobs_outside_summed_in_float64` sums them in float64
  (``opd serve-teacher``).
* :func:`rest_logprobs_from_topk`: from the top-k log-probs alone, ``log1mexp(logsumexp(top k))`` in float64. Exact
  for the values given but not for their own rounding, so a teacher that can send the rest itself should.

Teachers and losses both import this module.
"""

from __future__ import annotations

import math

import torch

_MINUS_LN2 = -math.log(2.0)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x ≤ 0, accurate over the whole range, in ``x``'s shape and dtype (x > 0 gives NaN).

    −expm1(x) near 0, log1p(−exp(x)) far below it, switching at −ln 2 (Mächler, "Accurately computing
    log(1 − exp(−|a|))", 2012); log1mexp(0) = −inf, log1mexp(−inf) = 0.
    """
    # Each branch sees only inputs from its own range, so neither produces an infinite
    # (or NaN) value or derivative that torch.where would then multiply by 0.
    near_zero = x > _MINUS_LN2
    near = torch.where(near_zero, x, torch.full_like(x, _MINUS_LN2))
    far = torch.where(near_zero, torch.full_like(x, _MINUS_LN2), x)
    return torch.where(near_zero, torch.log(-torch.expm1(near)), torch.log1p(-torch.exp(far)))


def rest_logprobs_from_topk(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """``[...]`` float64 log(1 − Σ_k P) from ``[..., k]`` top-k log-probs normalised over the full vocabulary.

    Σ_k P rounded to or past 1 gives −inf, never NaN; the caller decides what an empty rest means.
    """
    log_topk_mass = torch.logsumexp(topk_logprobs.to(torch.float64), dim=-1)
    return log1mexp(log_topk_mass.clamp(max=0.0))


def rest_logprobs_outside(log_probs: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """log Σ_{v ∉ top-k} P(v) per position from ``[..., V]`` log-probs, in their dtype; −inf where the ids cover all."""
    return _logsumexp_outside(log_probs, topk_ids, log_probs.dtype)


def rest_logprobs_outside_summed_in_float64(log_probs: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """:func:`rest_logprobs_outside` in float64, as a teacher server sends it (−inf where the ids cover the vocabulary).

    Terms are exponentiated relative to the largest (no tiny rest underflows) and summed in float64.
    """
    return _logsumexp_outside(log_probs, topk_ids, torch.float64)


def _logsumexp_outside(log_probs: torch.Tensor, topk_ids: torch.Tensor, sum_dtype: torch.dtype) -> torch.Tensor:
    """``torch.logsumexp``'s steps over the entries outside ``topk_ids``, summed in ``sum_dtype``.

    The largest entry, the exponentials relative to it and their sum, in place on the one ``[..., V]`` copy with the
    top k masked: ``torch.logsumexp`` would hold its exponentials as a second vocabulary-wide tensor, in a teacher's
    peak.
    """
    outside = log_probs.scatter(-1, topk_ids, float("-inf"))
    largest = outside.amax(dim=-1, keepdim=True)
    empty = torch.isneginf(largest)
    total = outside.sub_(torch.where(empty, 0.0, largest)).exp_().sum(dim=-1, dtype=sum_dtype)
    return torch.where(empty.squeeze(-1), float("-inf"), total.log() + largest.squeeze(-1).to(sum_dtype))
