"""Distillation and supervised losses.

Two layers:

* Pure tensor kernels (:func:`token_kl`, :func:`generalized_jsd`, :func:`topk_token_kl`,
  :func:`sampled_token_advantages`, :func:`sampled_token_pg_loss`; the mask shift
  :func:`~opd.data.sequences.shift_token_mask` and the top-k rest-mass helpers
  :func:`~opd.models.topk_rest.log1mexp` and
  :func:`~opd.models.topk_rest.rest_logprobs_from_topk` are re-exported here)
  with no config and no I/O, so other frameworks can call them. They follow the
  next-token convention used everywhere in opd: the logits at position ``t`` predict
  token ``t + 1``. They check their scalar arguments (``temperature`` finite and > 0,
  ``mixed_kl_weight`` and ``beta`` in [0, 1]) and raise ``ValueError`` naming the
  argument, as the loss objects and the YAML config do.
* Loss-function objects (:class:`DistillationLossFn`, :class:`SampledTokenLossFn`,
  :class:`NLLLossFn`) that the trainer calls per micro-batch. They say what they need
  from the teacher (``teacher_request``), select the positions that carry loss, call the
  kernels (directly on logits, or chunk by chunk fused with the LM head, see
  :mod:`opd.algorithms.fused_lm_head`), and normalise by the number of valid tokens (or
  sequences) of the *global* batch, so gradient accumulation gives the same gradient as
  one large batch.

Notation: P is the teacher distribution, Q the student's.
forward KL = KL(P‖Q) = Σ_v P(v)·(log P(v) − log Q(v)) (mass-covering);
reverse KL = KL(Q‖P) = Σ_v Q(v)·(log Q(v) − log P(v)) (mode-seeking);
mixed = w·forward + (1 − w)·reverse, with w = ``mixed_kl_weight``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import torch

from opd.algorithms.compiled_kernels import compiled, kl_metrics_from_logits
from opd.algorithms.fused_lm_head import chunked_lm_head_loss
from opd.algorithms.off_policy import OffPolicyCorrection, importance_weights, learner_log_probs
from opd.data.sequences import shift_token_mask  # re-exported: part of the kernel API
from opd.models.interfaces import (
    FullVocabRequest,
    LossFunction,
    TeacherRequest,
    TokenLogprobsRequest,
    TopKLogprobs,
    TopKRequest,
)
from opd.models.lm_head import LMHeadInput, token_log_probs

# Re-exported: part of the kernel API (the ``as`` form marks the re-export for linters).
from opd.models.topk_rest import log1mexp as log1mexp
from opd.models.topk_rest import rest_logprobs_from_topk as rest_logprobs_from_topk

KLType = Literal["forward", "reverse", "mixed"]
KL_TYPES: tuple[str, ...] = ("forward", "reverse", "mixed")
KLReduction = Literal["mean", "sum"]


def _check_kl_type(kl_type: str) -> None:
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")


def _check_temperature(temperature: float) -> None:
    # NaN fails every comparison, so it is caught here too.
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")


def _check_weight(name: str, value: float) -> None:
    """A convex weight: outside [0, 1] the mixture has a negative coefficient, and the
    "divergence" can go negative."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _plogp_difference(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-position Σ_v P(v)·(log P(v) − log Q(v)) with the convention 0·log 0 = 0.

    Terms where P(v) = 0 exactly (log P = −inf, e.g. a masked-out vocabulary entry or an
    extreme logit) contribute 0 instead of NaN. Both logs are replaced by 0 there *before*
    the product, so no −inf ever enters the graph and the gradient stays finite (a
    ``where`` applied after the product would still back-propagate 0·inf = NaN).
    """
    p = log_p.exp()
    support = p > 0
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    safe_log_p = torch.where(support, log_p, zero)
    safe_log_q = torch.where(support, log_q, zero)
    return (p * (safe_log_p - safe_log_q)).sum(dim=-1)


def token_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kl_type: str,
    mixed_kl_weight: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-position KL divergence between teacher and student on the full vocabulary.

    Args:
        student_logits: ``[..., V]`` student logits (gradients flow through these).
        teacher_logits: ``[..., V]`` teacher logits (treated as given; no gradient is
            needed, but none is blocked either).
        kl_type: ``"forward"`` (KL(P‖Q)), ``"reverse"`` (KL(Q‖P)) or ``"mixed"``.
        mixed_kl_weight: weight w of the forward term for ``"mixed"``, in [0, 1].
        temperature: both logits are divided by it before the softmax (finite, > 0).

    Returns:
        ``student_logits.shape[:-1]`` divergences, in float32 (or float64 when the
        inputs are float64). No masking, no reduction.

    Raises:
        ValueError: for an unknown ``kl_type``, ``mixed_kl_weight`` outside [0, 1], a
            temperature that is not a finite positive number, or logits of different shapes.
    """
    _check_kl_type(kl_type)
    _check_weight("mixed_kl_weight", mixed_kl_weight)
    _check_temperature(temperature)
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    return _combine(log_q, log_p, kl_type, mixed_kl_weight)


def _log_probs(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher log-probabilities at ``temperature``, in at least float32.

    bf16 log-probs lose ~3 significant digits, so the softmax never runs in it.

    Raises:
        ValueError: if the two logits differ in shape (e.g. vocabularies of different size).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits differ in shape: {tuple(student_logits.shape)} "
            f"vs {tuple(teacher_logits.shape)}"
        )
    compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
    # Dividing by 1 would still copy a [positions × vocab] tensor.
    scale = (lambda logits: logits) if temperature == 1.0 else (lambda logits: logits / temperature)
    log_q = torch.log_softmax(scale(student_logits.to(compute_dtype)), dim=-1)
    log_p = torch.log_softmax(scale(teacher_logits.to(compute_dtype)), dim=-1)
    return log_q, log_p


def _combine(log_q: torch.Tensor, log_p: torch.Tensor, kl_type: str, mixed_kl_weight: float) -> torch.Tensor:
    """The divergence named by ``kl_type`` from precomputed log-probabilities."""
    if kl_type == "forward":
        return _plogp_difference(log_p, log_q)
    if kl_type == "reverse":
        return _plogp_difference(log_q, log_p)
    # A zero-weight direction is skipped, not multiplied by 0: it may be +inf (0·inf = NaN).
    if mixed_kl_weight == 1.0:
        return _plogp_difference(log_p, log_q)
    if mixed_kl_weight == 0.0:
        return _plogp_difference(log_q, log_p)
    forward = _plogp_difference(log_p, log_q)
    reverse = _plogp_difference(log_q, log_p)
    return mixed_kl_weight * forward + (1.0 - mixed_kl_weight) * reverse


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-position generalized Jensen-Shannon divergence JSD(β) (GKD, TRL's convention).

    With M = (1 − β)·Q + β·P, JSD(β) = β·KL(P‖M) + (1 − β)·KL(Q‖M). The end points are
    the two KLs themselves: β = 0 gives forward KL(P‖Q) and β = 1 reverse KL(Q‖P) (the
    mixture formula would give 0 there). Values lie in [0, ∞); for 0 < β < 1 they are
    bounded by the binary entropy of β, so JSD stays finite even where one distribution
    has zeros.

    Args:
        student_logits: ``[..., V]`` student logits Q (gradients flow through these).
        teacher_logits: ``[..., V]`` teacher logits P.
        beta: interpolation weight in [0, 1].
        temperature: both logits are divided by it before the softmax (finite, > 0).

    Returns:
        ``student_logits.shape[:-1]`` divergences in float32 (float64 for float64 inputs).

    Raises:
        ValueError: for ``beta`` outside [0, 1] or a temperature that is not a finite
            positive number.
    """
    _check_weight("beta", beta)
    _check_temperature(temperature)
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    if beta == 0.0:
        return _plogp_difference(log_p, log_q)
    if beta == 1.0:
        return _plogp_difference(log_q, log_p)
    # log M by logsumexp of the weighted logs: exact where either distribution underflows.
    log_m = torch.logsumexp(torch.stack([log_q + math.log(1.0 - beta), log_p + math.log(beta)]), dim=0)
    return beta * _plogp_difference(log_p, log_m) + (1.0 - beta) * _plogp_difference(log_q, log_m)


def full_vocab_divergence_with_grad(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kl_type: str = "forward",
    mixed_kl_weight: float = 0.5,
    temperature: float = 1.0,
    jsd_beta: float | None = None,
    observe_log_probs: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position divergence and its gradient with respect to the student's logits.

    The same values as :func:`token_kl` (or :func:`generalized_jsd` when ``jsd_beta`` is
    given), with the gradient in closed form instead of autograd, for the fused loss:
    autograd would keep about a dozen ``[positions × vocab]`` intermediates of the
    softmaxes and the mixture alive for its backward pass; this keeps about five.
    With Q = softmax(s / T) and g = ∂D/∂Q, the chain rule through the softmax gives
    ∂D/∂s = Q ⊙ (g − Σ_v Q_v g_v) / T, where

    * forward KL(P‖Q): ∂D/∂s = (Q − P) / T;
    * reverse KL(Q‖P): g = log Q − log P (+1, which the centring cancels);
    * JSD(β), M = βP + (1 − β)Q: g = (1 − β)(log Q − log M) (the P/M and Q/M terms cancel).

    Terms where Q = 0 exactly contribute nothing (0·log 0 = 0), as in the kernels.

    Args:
        student_logits: ``[C, V]`` student logits.
        teacher_logits: ``[C, V]`` teacher logits.
        kl_type: ``"forward"``, ``"reverse"`` or ``"mixed"`` (ignored for JSD).
        mixed_kl_weight: weight of the forward KL for ``"mixed"``.
        temperature: applied to both models' logits.
        jsd_beta: if not None, the generalized JSD with this β instead of a KL.
        observe_log_probs: called with ``(log Q, log P)`` once they exist, so that
            per-step metrics can reuse them instead of a second pair of softmaxes.

    Returns:
        ``(values [C], gradient [C, V])`` in float32 (float64 for float64 input).

    Raises:
        ValueError: for the arguments :func:`token_kl` and :func:`generalized_jsd` refuse.
    """
    _check_kl_type(kl_type)
    _check_weight("mixed_kl_weight", mixed_kl_weight)
    _check_temperature(temperature)
    if jsd_beta is not None:
        _check_weight("jsd_beta", jsd_beta)
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    if observe_log_probs is not None:
        observe_log_probs(log_q, log_p)
    q = log_q.exp()
    if jsd_beta is not None and jsd_beta in (0.0, 1.0):
        kl_type, mixed_kl_weight, jsd_beta = ("forward" if jsd_beta == 0.0 else "reverse"), 0.5, None
    if jsd_beta is not None:
        log_m = torch.logaddexp(log_q + math.log(1.0 - jsd_beta), log_p + math.log(jsd_beta))
        values = jsd_beta * _plogp_difference(log_p, log_m) + (1.0 - jsd_beta) * _plogp_difference(log_q, log_m)
        return values, _softmax_chain(q, (1.0 - jsd_beta) * (log_q - log_m), temperature)
    forward_weight = {"forward": 1.0, "reverse": 0.0}.get(kl_type, mixed_kl_weight)
    values = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
    grad = torch.zeros_like(q)
    if forward_weight != 0.0:  # a zero-weight direction is skipped: it may be +inf
        values += forward_weight * _plogp_difference(log_p, log_q)
        grad += (forward_weight / temperature) * (q - log_p.exp())
    if forward_weight != 1.0:
        values += (1.0 - forward_weight) * _plogp_difference(log_q, log_p)
        grad += (1.0 - forward_weight) * _softmax_chain(q, log_q - log_p, temperature)
    return values, grad


def _softmax_chain(q: torch.Tensor, grad_q: torch.Tensor, temperature: float) -> torch.Tensor:
    """∂D/∂s = Q ⊙ (g − Σ_v Q_v g_v) / T for Q = softmax(s / T), with 0 where Q = 0."""
    grad_q = torch.where(q > 0, grad_q, torch.zeros((), dtype=q.dtype, device=q.device))
    centred = grad_q - (q * grad_q).sum(dim=-1, keepdim=True)
    return q * centred / temperature


def topk_token_kl(
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    kl_type: str,
    mixed_kl_weight: float = 0.5,
    tail: bool = True,
    temperature: float = 1.0,
    teacher_rest_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-position KL against a teacher that sent only its top-k log-probs and token ids.

    With ``tail=True`` (the default) the divergence is taken over k + 1 classes: the k
    teacher tokens and one "rest" class holding the teacher's remaining mass
    1 − Σ_k P(v) and the student's mass on every other token. That is the exact KL of
    the two distributions coarsened to those classes, so it is a true divergence:
    never negative, zero when the distributions agree, a lower bound of the full KL, and
    equal to it when the k ids cover the vocabulary. With ``tail=False`` both
    distributions are renormalised over the k tokens (NeMo-RL's top-k approximation,
    kept for comparison): it ignores mass outside the top k, so it can be zero while the
    full distributions differ.

    Both rest masses are handled in log space, never as ``1 − Σ``: the student's is a
    logsumexp over its other tokens; the teacher's is the one it sent
    (``teacher_rest_logprobs``, summed from its full distribution), or else
    ``log1mexp(logsumexp(top k))`` in float64 (:func:`~opd.models.topk_rest.rest_logprobs_from_topk`),
    exact for the log-probs as given. (Subtracting in float32 loses a rest mass of 1e-7
    to rounding and moves the divergence by several percent. The fallback cannot undo
    the rounding of the log-probs themselves, e.g. the shared error of a float32
    normaliser, so a teacher-sent rest is the exact one; see
    ``benchmarks/rest_mass_precision.py``.)

    Args:
        student_logits: ``[..., V]`` student logits (full vocabulary).
        teacher_topk_logprobs: ``[..., k]`` teacher log-probabilities of its top-k tokens,
            normalised over the teacher's full vocabulary.
        teacher_topk_ids: ``[..., k]`` the ids of those tokens (distinct per position). An
            id of −1 marks an empty slot, which takes part in neither class (a
            cross-tokenizer teacher's token with no counterpart in the student's
            vocabulary: its mass is in the rest, see :mod:`opd.models.teacher.cross_tokenizer`).
        kl_type: ``"forward"``, ``"reverse"`` or ``"mixed"``, as in :func:`token_kl`.
        mixed_kl_weight: weight of the forward term for ``"mixed"``, in [0, 1].
        tail: keep the rest class (True) or renormalise over the top k (False).
        temperature: the student's logits are divided by it; the teacher's log-probs
            must already be at the same temperature (the teacher applies it before its
            top-k, since the top-k set itself depends on it only through ties).
        teacher_rest_logprobs: optional ``[...]`` log of the teacher's mass outside its
            top k (−inf where it is exactly 0), as computed by the teacher; None computes
            it from ``teacher_topk_logprobs``. Unused with ``tail=False``.

    Returns:
        ``student_logits.shape[:-1]`` divergences in float32 (float64 for float64 inputs).

    Raises:
        ValueError: for an unknown ``kl_type``, ``mixed_kl_weight`` outside [0, 1], a
            temperature that is not a finite positive number, no top-k entries (k = 0),
            or inputs whose shapes do not match.
    """
    _check_kl_type(kl_type)
    _check_weight("mixed_kl_weight", mixed_kl_weight)
    _check_temperature(temperature)
    _check_topk_shapes(student_logits, teacher_topk_logprobs, teacher_topk_ids, teacher_rest_logprobs)
    compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
    scaled = student_logits.to(compute_dtype)
    log_q_full = torch.log_softmax(scaled if temperature == 1.0 else scaled / temperature, dim=-1)
    empty = teacher_topk_ids < 0
    listed_ids = teacher_topk_ids.clamp_min(0)
    log_q = log_q_full.gather(-1, listed_ids).masked_fill(empty, float("-inf"))
    log_p = teacher_topk_logprobs.to(compute_dtype).masked_fill(empty, float("-inf"))
    if not tail:
        return _combine(
            log_q - torch.logsumexp(log_q, dim=-1, keepdim=True),
            log_p - torch.logsumexp(log_p, dim=-1, keepdim=True),
            kl_type,
            mixed_kl_weight,
        )
    # Counted, not written: an empty slot's placeholder id must not unmark a listed one.
    in_topk = torch.zeros_like(log_q_full, dtype=torch.int32).scatter_add_(-1, listed_ids, (~empty).int()) > 0
    # Student rest mass as a logsumexp over the other tokens: exact even when Σ_k Q ≈ 1.
    log_q_rest = torch.logsumexp(log_q_full.masked_fill(in_topk, float("-inf")), dim=-1, keepdim=True)
    if teacher_rest_logprobs is None:
        teacher_rest_logprobs = rest_logprobs_from_topk(teacher_topk_logprobs.masked_fill(empty, float("-inf")))
    log_p_rest = teacher_rest_logprobs.to(compute_dtype).unsqueeze(-1)
    # A teacher with finite logits always has some rest mass, but below the dtype's
    # smallest normal number it is lost to rounding (and Σ_k P can round to 1): it is
    # floored there, so a student with mass outside the teacher's top k gets a large
    # finite penalty instead of an infinite loss with NaN gradients.
    log_p_rest = log_p_rest.clamp(min=math.log(torch.finfo(compute_dtype).tiny))
    # When the k ids cover the vocabulary the rest class is empty for both models; any
    # teacher "rest" left by rounding is not mass the student could match.
    covers_vocabulary = in_topk.all(dim=-1, keepdim=True)
    log_p_rest = log_p_rest.masked_fill(covers_vocabulary, float("-inf"))
    return _combine(
        torch.cat([log_q, log_q_rest], dim=-1), torch.cat([log_p, log_p_rest], dim=-1), kl_type, mixed_kl_weight
    )


def _check_topk_shapes(
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_rest_logprobs: torch.Tensor | None,
) -> None:
    """The top-k inputs of :func:`topk_token_kl` agree with each other and with the student's positions."""
    if teacher_topk_logprobs.shape != teacher_topk_ids.shape:
        raise ValueError(
            f"teacher top-k log-probs and ids differ in shape: {tuple(teacher_topk_logprobs.shape)} "
            f"vs {tuple(teacher_topk_ids.shape)}"
        )
    if teacher_topk_ids.dim() == 0 or teacher_topk_ids.shape[-1] < 1:
        raise ValueError(
            f"the teacher's top-k needs k >= 1 entries per position, got shape {tuple(teacher_topk_ids.shape)}"
        )
    if teacher_topk_ids.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(
            f"teacher top-k positions {tuple(teacher_topk_ids.shape[:-1])} do not match the student's "
            f"{tuple(student_logits.shape[:-1])}"
        )
    if teacher_rest_logprobs is not None and teacher_rest_logprobs.shape != teacher_topk_ids.shape[:-1]:
        raise ValueError(
            f"teacher_rest_logprobs has shape {tuple(teacher_rest_logprobs.shape)}, expected one value per "
            f"position {tuple(teacher_topk_ids.shape[:-1])}"
        )


def sampled_token_advantages(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    teacher_tau: float = 1.0,
    student_tau: float = 1.0,
    discount: float = 0.0,
    task_reward: torch.Tensor | None = None,
    adv_tau: float = 0.0,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token advantages of the sampled-token distillation objective (no gradient).

    a_t = teacher_tau · log P(x_t) − student_tau · log Q(x_t) for each sampled token x_t,
    plus ``adv_tau · task_reward`` of its sequence on every token (the hybrid of seed 003).
    With ``discount`` γ > 0 each token also collects the discounted a of the tokens after
    it in the same sequence: A_t = Σ_{t' ≥ t} γ^{t'−t} a_{t'}. With τ = 1 and γ = 0,
    E[−A_t · ∇log Q(x_t)] is the gradient of the reverse KL(Q‖P) at that position.

    Args:
        student_logprobs: ``[B, T]`` log Q of the sampled tokens (detached here).
        teacher_logprobs: ``[B, T]`` log P of the same tokens.
        mask: ``[B, T]`` 1 on response tokens; advantages are 0 elsewhere.
        teacher_tau, student_tau: weights of the two log-probabilities.
        discount: γ in [0, 1].
        task_reward: optional ``[B]`` per-sequence reward (e.g. 1.0 if the verifier
            accepts the answer), or ``[B, T]`` with each token holding its sequence's
            reward (packed rows).
        adv_tau: weight of the task reward.
        segment_ids: optional ``[B, T]`` index of the sequence each position belongs to,
            for rows that pack several sequences: the discounted sum stops at a change of
            segment. None: each row is one sequence.

    Returns:
        ``[B, T]`` advantages in float32 (float64 for float64 inputs).
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    dtype = torch.promote_types(student_logprobs.dtype, torch.float32)
    weights = mask.to(dtype)
    per_token = teacher_tau * teacher_logprobs.detach().to(dtype) - student_tau * student_logprobs.detach().to(dtype)
    if task_reward is not None and adv_tau != 0.0:
        reward = task_reward.detach().to(dtype)
        per_token = per_token + adv_tau * (reward if reward.dim() == 2 else reward.unsqueeze(-1))
    per_token = per_token * weights
    if discount == 0.0:
        return per_token
    advantages = torch.zeros_like(per_token)
    running = torch.zeros_like(per_token[:, 0])
    for t in range(per_token.shape[1] - 1, -1, -1):  # reverse cumulative sum, right to left
        if segment_ids is not None and t + 1 < per_token.shape[1]:
            # Position t + 1 starts another packed sequence: nothing of it flows back.
            running = running * (segment_ids[:, t] == segment_ids[:, t + 1]).to(dtype)
        running = per_token[:, t] + discount * running
        advantages[:, t] = running
    return advantages * weights


def sampled_token_pg_loss(
    student_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio: float | None = 0.2,
) -> torch.Tensor:
    """Per-token clipped policy-gradient loss −min(r·A, clip(r, 1 − ε, 1 + ε)·A).

    r = exp(log Q − log Q_sampler) corrects for the sampler's weights being older than
    the student's (or a different engine's); with ``clip_ratio`` None the loss is −r·A.
    Gradients flow only through ``student_logprobs``. No masking or reduction: the
    advantages are already 0 off the response.

    Args:
        student_logprobs: ``[B, T]`` log Q of the sampled tokens under the current student.
        sampler_logprobs: ``[B, T]`` log-probs the sampler drew them with.
        advantages: ``[B, T]`` from :func:`sampled_token_advantages`.
        clip_ratio: ε, or None for no clipping.

    Returns:
        ``[B, T]`` per-token losses.
    """
    ratio = torch.exp(student_logprobs - sampler_logprobs.detach().to(student_logprobs.dtype))
    unclipped = ratio * advantages
    if clip_ratio is None:
        return -unclipped
    clipped = ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio) * advantages
    return -torch.minimum(unclipped, clipped)


def _global_normalizer(reduction: str, global_valid_tokens: int, global_valid_seqs: int) -> float:
    """The denominator of the global-batch loss (at least 1, so an all-masked batch gives 0)."""
    count = global_valid_tokens if reduction == "mean" else global_valid_seqs
    return float(max(count, 1))


DIVERGENCES: tuple[str, ...] = ("kl", "jsd")
TEACHER_SIGNALS: tuple[str, ...] = ("full_vocab", "topk")


class _TeacherMetrics:
    """Sums, over the loss positions, the per-step diagnostics of teacher vs student.

    ``kl_forward`` / ``kl_reverse`` (over the k + 1 top-k classes when the teacher sent
    only its top k, which is a lower bound of the full KL), the teacher's probability
    mass on its top-k tokens, the student's mass on those same tokens, and the overlap of
    the two models' top-k sets (|top-k_P ∩ top-k_Q| / k).

    All of them are taken at the loss temperature T, i.e. between softmax(logits / T) of
    both models, whichever signal the teacher sent. Why T and not 1: a top-k teacher
    answers at T only (its top-k log-probs are normalised at T), and its distribution at
    1 cannot be recovered from them (the normaliser at 1 needs the tokens it did not
    send), so T is the one temperature at which both signals can report the same
    quantity; it is also the one the loss optimises (for a forward or reverse KL loss the
    matching metric equals the loss per token). At T = 1, the usual case and the only one
    a served teacher supports, this is the models' own distributions.
    Called on detached chunks, so it never adds to the autograd graph.
    """

    def __init__(self, k: int, temperature: float, vocab_size: int | None, compile_kernels: bool = False) -> None:
        self.k = k
        self.temperature = temperature
        self.vocab_size = vocab_size
        self.compile_kernels = compile_kernels
        self.sums = {
            "kl_forward": 0.0,
            "kl_reverse": 0.0,
            "teacher_topk_mass": 0.0,
            "student_mass_on_teacher_topk": 0.0,
            "topk_overlap": 0.0,
        }

    @torch.no_grad()
    def full_vocab(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
        """Metrics from both models' full logits (``[C, V]``), at the loss temperature."""
        if not self.compile_kernels:
            self.from_log_probs(*_log_probs(student_logits, teacher_logits, self.temperature))
            return
        if self.temperature != 1.0:
            # Scaled in float32 at least: bf16 logits / T would round once more.
            compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
            student_logits = student_logits.to(compute_dtype) / self.temperature
            teacher_logits = teacher_logits.to(compute_dtype) / self.temperature
        # Compiled: the KLs in a few fused passes, the top-k metrics from the logits and
        # log-normalisers (top-k of the logits = top-k of the log-probs, row by row).
        kl_forward, kl_reverse, log_norm_q, log_norm_p = compiled(kl_metrics_from_logits)(
            student_logits, teacher_logits
        )
        self.sums["kl_forward"] += float(kl_forward)
        self.sums["kl_reverse"] += float(kl_reverse)
        k = min(self.k, teacher_logits.shape[-1])
        compute_dtype = log_norm_q.dtype
        teacher_top_logits, teacher_topk_ids = teacher_logits.topk(k, dim=-1)
        teacher_topk_logprobs = teacher_top_logits.to(compute_dtype) - log_norm_p.unsqueeze(-1)
        student_logprobs_at = student_logits.gather(-1, teacher_topk_ids).to(compute_dtype) - log_norm_q.unsqueeze(-1)
        student_topk_ids = student_logits.topk(k, dim=-1).indices
        self._add_topk(teacher_topk_logprobs, teacher_topk_ids, student_logprobs_at, student_topk_ids)

    @torch.no_grad()
    def from_log_probs(self, log_q: torch.Tensor, log_p: torch.Tensor) -> None:
        """Metrics from both models' log-probabilities at the loss temperature (``[C, V]``)."""
        self.sums["kl_forward"] += float(_plogp_difference(log_p, log_q).sum())
        self.sums["kl_reverse"] += float(_plogp_difference(log_q, log_p).sum())
        k = min(self.k, log_p.shape[-1])
        teacher_topk_logprobs, teacher_topk_ids = log_p.topk(k, dim=-1)
        self._topk(log_q, teacher_topk_logprobs, teacher_topk_ids)

    @torch.no_grad()
    def topk(
        self,
        student_logits: torch.Tensor,
        teacher_topk_logprobs: torch.Tensor,
        teacher_topk_ids: torch.Tensor,
        teacher_rest_logprobs: torch.Tensor | None = None,
    ) -> None:
        """Metrics from the student's logits and the teacher's top-k (both at the loss temperature)."""
        for kl_type in ("forward", "reverse"):
            self.sums[f"kl_{kl_type}"] += float(
                topk_token_kl(
                    student_logits,
                    teacher_topk_logprobs,
                    teacher_topk_ids,
                    kl_type,
                    temperature=self.temperature,
                    teacher_rest_logprobs=teacher_rest_logprobs,
                ).sum()
            )
        compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
        log_q = torch.log_softmax(student_logits.to(compute_dtype) / self.temperature, dim=-1)
        self._topk(log_q, teacher_topk_logprobs.to(compute_dtype), teacher_topk_ids)

    def _topk(self, log_q: torch.Tensor, teacher_topk_logprobs: torch.Tensor, teacher_topk_ids: torch.Tensor) -> None:
        k = teacher_topk_ids.shape[-1]
        student_topk_ids = log_q.topk(min(k, log_q.shape[-1]), dim=-1).indices
        empty = teacher_topk_ids < 0  # empty slots (see topk_token_kl) hold no mass on either side
        at_teacher_topk = log_q.gather(-1, teacher_topk_ids.clamp_min(0)).masked_fill(empty, float("-inf"))
        self._add_topk(
            teacher_topk_logprobs.masked_fill(empty, float("-inf")), teacher_topk_ids, at_teacher_topk, student_topk_ids
        )

    def _add_topk(
        self,
        teacher_topk_logprobs: torch.Tensor,
        teacher_topk_ids: torch.Tensor,
        student_logprobs_at_teacher_topk: torch.Tensor,
        student_topk_ids: torch.Tensor,
    ) -> None:
        k = teacher_topk_ids.shape[-1]
        self.sums["teacher_topk_mass"] += float(teacher_topk_logprobs.exp().sum())
        self.sums["student_mass_on_teacher_topk"] += float(student_logprobs_at_teacher_topk.exp().sum())
        shared = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(dim=-1).sum()
        self.sums["topk_overlap"] += float(shared) / k

    def metrics(self, token_normalizer: float) -> dict[str, float]:
        """The sums as this micro-batch's share of the global token means."""
        return {key: value / token_normalizer for key, value in self.sums.items()}


def _rows(value: Any, mask: torch.Tensor, shift: int = 0) -> Any:
    """The loss positions of a per-position input laid out ``[B, L, ...]``.

    ``shift = 0`` for inputs indexed by logit position (``t`` predicts token ``t + 1``:
    logits, top-k), ``1`` for inputs indexed by token position (a token's own log-prob).
    """
    if isinstance(value, LMHeadInput):
        return value.with_rows(value.hidden_states[:, :-1][mask])
    if shift == 0:
        return value[:, :-1][mask]
    return value[:, 1:][mask]


def _topk_rows(teacher_output: Any, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss positions of a top-k answer: ``(log-probs [N, k], ids [N, k], rest log-probs [N])``.

    The rest is the teacher's own where it sent one (a :class:`TopKLogprobs` with
    ``rest_logprobs``, or a triple), else computed here from the top-k log-probs in
    float64, without cancellation, for the selected positions only.
    """
    if len(teacher_output) == 3:
        logprobs, ids, rest = teacher_output
    else:
        logprobs, ids = teacher_output
        rest = teacher_output.rest_logprobs if isinstance(teacher_output, TopKLogprobs) else None
    logprob_rows = _rows(logprobs, mask)
    if rest is None:
        rest_rows = rest_logprobs_from_topk(logprob_rows).to(torch.promote_types(logprob_rows.dtype, torch.float32))
    else:
        rest_rows = _rows(rest, mask)
    return logprob_rows, _rows(ids, mask), rest_rows


def _apply_loss(
    student_rows: torch.Tensor | LMHeadInput,
    divergence: Callable[..., torch.Tensor],
    row_inputs: tuple[Any, ...],
    normalizer: float,
    chunk_rows: int | None,
    observer: Callable[..., None] | None,
    value_and_grad: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_positions w · divergence / normalizer, fused with the LM head when given hidden states.

    ``row_weights`` (``[N]``, detached; None = all 1) are the off-policy importance
    weights (:mod:`opd.algorithms.off_policy`).
    """
    if isinstance(student_rows, LMHeadInput):
        device = student_rows.hidden_states.device
        if row_weights is None:
            rows = student_rows.hidden_states.shape[:1]
            weights = torch.full(rows, 1.0 / normalizer, dtype=torch.float64, device=device)
        else:
            weights = row_weights.to(device=device, dtype=torch.float64) / normalizer
        return chunked_lm_head_loss(student_rows, divergence, row_inputs, weights, chunk_rows, observer, value_and_grad)
    materialised = tuple(
        row_input.logits() if isinstance(row_input, LMHeadInput) else row_input for row_input in row_inputs
    )
    # sum() of an empty selection is 0 with a graph attached, so an all-masked
    # micro-batch contributes zero loss and zero gradient.
    per_position = divergence(student_rows, *materialised)
    if row_weights is not None:
        per_position = per_position * row_weights.to(device=per_position.device, dtype=per_position.dtype)
    loss = per_position.sum() / normalizer
    if observer is not None:
        observer(student_rows.detach(), *materialised)
    return loss


def off_policy_row_weights(
    student_rows: torch.Tensor | LMHeadInput,
    data: dict[str, Any],
    loss_mask: torch.Tensor,
    correction: OffPolicyCorrection,
    global_valid_tokens: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The importance weight of each loss position of a micro-batch, and its metrics.

    ``data["staleness"]`` is per sequence (``[B]``) or, in a packed row, per token
    (``[1, T]``); ``data["generation_logprobs"]`` is indexed by token position, like the
    targets. Rows of fresh samples are not computed: their weight is 1.

    Returns:
        ``([N] weights, metrics)``; the metrics are this micro-batch's share of the global
        means over response tokens (``is_ratio_mean``, ``is_abs_log_ratio_mean``,
        ``is_truncated_fraction``, ``is_masked_fraction``) and its ``is_ratio_max``.
    """
    staleness = data["staleness"]
    per_token = staleness if staleness.dim() == 2 else staleness.unsqueeze(-1).expand_as(data["input_ids"])
    stale = _rows(per_token, loss_mask, shift=1) > 0
    sampler = _rows(data["generation_logprobs"], loss_mask, shift=1)
    learner = torch.zeros_like(sampler)
    if bool(stale.any()):
        rows = stale.nonzero().squeeze(-1)
        stale_rows = (
            LMHeadInput(student_rows.hidden_states[rows], student_rows.weight, student_rows.bias)
            if isinstance(student_rows, LMHeadInput)
            else student_rows[rows]
        )
        targets = _rows(data["input_ids"], loss_mask, shift=1)
        learner[rows] = learner_log_probs(stale_rows, targets[rows], correction.strategy).to(learner.dtype)
    # Sequence of each position: its row, and its segment in a packed row.
    input_ids = data["input_ids"]
    row_index = torch.arange(input_ids.shape[0], device=input_ids.device).unsqueeze(-1).expand_as(input_ids)
    sequence_ids = _rows(row_index, loss_mask, shift=1)
    if "segment_ids" in data:
        segments = data["segment_ids"]
        sequence_ids = sequence_ids * (int(segments.max()) + 1) + _rows(segments, loss_mask, shift=1)
    weights, sums = importance_weights(learner, sampler, stale, sequence_ids, correction)
    tokens = float(max(global_valid_tokens, 1))
    metrics = {
        "is_ratio_mean": sums["is_ratio"] / tokens,
        "is_abs_log_ratio_mean": sums["is_abs_log_ratio"] / tokens,
        "is_truncated_fraction": sums["is_truncated"] / tokens,
        "is_masked_fraction": sums["is_masked"] / tokens,
        "is_ratio_max": sums["is_ratio_max"],
    }
    return weights, metrics


class DistillationLossFn(LossFunction):
    """Token-level divergence between the teacher and the student on response tokens.

    The loss is ``Σ_{valid positions} D_t / N`` where, for ``kl_reduction="mean"``, N is
    the number of valid (response, non-padding) tokens in the whole global batch, and for
    ``"sum"`` N is the number of sequences in the global batch (each response's
    divergence is summed over its tokens, then averaged over sequences).

    D_t is chosen by ``divergence`` and ``teacher_signal``:

    * ``kl`` over the full vocabulary (:func:`token_kl`: forward, reverse or mixed), or
      the generalized ``jsd`` with ``jsd_beta`` (:func:`generalized_jsd`);
    * with ``teacher_signal="topk"`` the teacher sends only its top ``teacher_topk``
      log-probs per position and D_t is :func:`topk_token_kl` (``topk_tail`` keeps the
      rest class; False is NeMo-RL's renormalised variant). JSD needs the full vocabulary.

    With ``fused_lm_head`` the student's logits are never materialised: the policy hands
    over final hidden states and the head (:class:`~opd.algorithms.fused_lm_head.LMHeadInput`)
    and the loss runs chunk by chunk (:func:`~opd.algorithms.fused_lm_head.chunked_lm_head_loss`),
    with the same value and gradients. An in-process teacher then sends hidden states
    too, and its logits are made per chunk as well.

    The metrics (:meth:`__call__`) are taken at the loss temperature for every teacher
    signal (see :class:`_TeacherMetrics` for why).

    Args:
        kl_type: ``"forward"``, ``"reverse"`` or ``"mixed"`` (for ``divergence="kl"``).
        mixed_kl_weight: weight of the forward KL in ``"mixed"``, in [0, 1].
        temperature: distillation temperature applied to both models' logits (separate
            from the sampling temperature); a finite number > 0.
        kl_reduction: ``"mean"`` (per token) or ``"sum"`` (per sequence).
        vocab_size: if set, both logits are cut to their first ``vocab_size`` entries.
            Models often pad their output layer beyond the tokenizer (Qwen2.5-32B has
            152,064 outputs, 1.5B has 151,936, the tokenizer 151,665): the extra entries
            are not real tokens and must not enter the divergence.
        divergence: ``"kl"`` or ``"jsd"``.
        jsd_beta: β of the generalized JSD (0 = forward KL, 1 = reverse KL), in [0, 1].
        teacher_signal: ``"full_vocab"`` or ``"topk"``.
        teacher_topk: k of the top-k teacher signal and of the top-k metrics (>= 1).
        topk_tail: keep the top-k rest class (True) or renormalise (False).
        fused_lm_head: take hidden states and compute the loss chunk by chunk.
        chunk_size: positions per fused chunk, >= 1 (None: ~128 MiB of fp32 logits per chunk).
        compile_kernels: ``torch.compile`` the per-chunk kernels of the full-vocabulary
            loss (the closed-form divergence with ``fused_lm_head``, and the metrics);
            see :mod:`opd.algorithms.compiled_kernels`.
        off_policy: weigh the positions of stale samples (a micro-batch with
            ``staleness`` and ``generation_logprobs``) by truncated importance weights
            (:mod:`opd.algorithms.off_policy`); None leaves every weight at 1.

    Raises:
        ValueError: naming the argument, for a value outside its range.
    """

    def __init__(
        self,
        kl_type: str = "reverse",
        mixed_kl_weight: float = 0.5,
        temperature: float = 1.0,
        kl_reduction: str = "mean",
        vocab_size: int | None = None,
        divergence: str = "kl",
        jsd_beta: float = 0.5,
        teacher_signal: str = "full_vocab",
        teacher_topk: int = 64,
        topk_tail: bool = True,
        fused_lm_head: bool = False,
        chunk_size: int | None = None,
        compile_kernels: bool = False,
        off_policy: OffPolicyCorrection | None = None,
    ) -> None:
        _check_kl_type(kl_type)
        _check_weight("mixed_kl_weight", mixed_kl_weight)
        _check_weight("jsd_beta", jsd_beta)
        _check_temperature(temperature)
        if kl_reduction not in ("mean", "sum"):
            raise ValueError(f"kl_reduction must be 'mean' or 'sum', got {kl_reduction!r}")
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
        if teacher_signal not in TEACHER_SIGNALS:
            raise ValueError(f"teacher_signal must be one of {TEACHER_SIGNALS}, got {teacher_signal!r}")
        if divergence == "jsd" and teacher_signal == "topk":
            raise ValueError("the generalized JSD needs the teacher's full vocabulary; use divergence='kl' with top-k")
        if teacher_topk < 1:
            raise ValueError(f"teacher_topk must be >= 1, got {teacher_topk}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (or None: the whole output layer), got {vocab_size}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (or None: chosen from the vocabulary size), got {chunk_size}")
        self.kl_type = kl_type
        self.mixed_kl_weight = mixed_kl_weight
        self.temperature = temperature
        self.kl_reduction = kl_reduction
        self.vocab_size = vocab_size
        self.divergence = divergence
        self.jsd_beta = jsd_beta
        self.teacher_signal = teacher_signal
        self.teacher_topk = teacher_topk
        self.topk_tail = topk_tail
        self.fused_lm_head = fused_lm_head
        self.chunk_size = chunk_size
        self.compile_kernels = compile_kernels
        self.off_policy = off_policy

    @property
    def teacher_request(self) -> TeacherRequest:
        """Full-vocabulary logits (hidden states and head for the fused loss), or the top-k
        log-probs and ids at the loss temperature."""
        if self.teacher_signal == "topk":
            return TopKRequest(self.teacher_topk, self.temperature, self.vocab_size)
        return FullVocabRequest(prefer_hidden_states=self.fused_lm_head)

    def _divergence(self, student_logits: torch.Tensor, *teacher: torch.Tensor) -> torch.Tensor:
        if self.teacher_signal == "topk":
            return topk_token_kl(
                student_logits,
                teacher[0],
                teacher[1],
                self.kl_type,
                self.mixed_kl_weight,
                tail=self.topk_tail,
                temperature=self.temperature,
                teacher_rest_logprobs=teacher[2],
            )
        if self.divergence == "jsd":
            return generalized_jsd(student_logits, teacher[0], self.jsd_beta, self.temperature)
        return token_kl(student_logits, teacher[0], self.kl_type, self.mixed_kl_weight, self.temperature)

    def _divergence_with_grad(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        observe_log_probs: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Closed-form value and gradient of the full-vocabulary divergence (fused path)."""
        kernel = full_vocab_divergence_with_grad
        if self.compile_kernels and observe_log_probs is None:
            kernel = compiled(full_vocab_divergence_with_grad)
        return kernel(
            student_logits,
            teacher_logits,
            self.kl_type,
            self.mixed_kl_weight,
            self.temperature,
            self.jsd_beta if self.divergence == "jsd" else None,
            observe_log_probs,
        )

    def _cut_vocabulary(self, value: Any) -> Any:
        if self.vocab_size is None:
            return value
        if isinstance(value, LMHeadInput):
            return dataclasses.replace(value, vocab_size=self.vocab_size)
        return value[..., : self.vocab_size]

    def __call__(
        self,
        student_output: torch.Tensor | LMHeadInput,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_output: Any = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Computes this micro-batch's share of the global distillation loss.

        Args:
            student_output: ``[B, L, V_s]`` logits for ``data["input_ids"]``, or (fused)
                an :class:`LMHeadInput` with ``[B, L, D]`` hidden states.
            data: micro-batch with ``token_mask [B, L]``.
            global_valid_tokens: valid loss tokens in the whole global batch.
            global_valid_seqs: sequences in the whole global batch.
            teacher_output: the teacher's answer to :attr:`teacher_request`: ``[B, L, V_t]`` logits,
                an :class:`LMHeadInput`, or ``([B, L, k] log-probs, [B, L, k] ids)``: a
                :class:`~opd.models.interfaces.TopKLogprobs` carrying the teacher's rest
                mass, a plain pair (the rest is then computed from the top-k), or a triple
                with ``[B, L]`` rest log-probs third.

        Returns:
            ``(loss, metrics)``; metrics hold this micro-batch's contributions to the
            global ``loss``, ``kl_forward``, ``kl_reverse``, ``teacher_topk_mass``,
            ``student_mass_on_teacher_topk``, ``topk_overlap`` (token means, all at the
            loss temperature, for either teacher signal) and ``num_valid_tokens``.
        """
        if teacher_output is None:
            raise ValueError("DistillationLossFn needs the teacher's output")
        loss_mask = shift_token_mask(data["token_mask"]).bool()
        # Only the selected positions ever see a softmax: prompt and padding rows are
        # skipped instead of computed and then masked to zero.
        student_rows = _rows(self._cut_vocabulary(student_output), loss_mask)
        if self.teacher_signal == "topk":
            teacher_rows: tuple[Any, ...] = _topk_rows(teacher_output, loss_mask)
        else:
            teacher_rows = (_rows(self._cut_vocabulary(teacher_output), loss_mask),)
        collector = _TeacherMetrics(self.teacher_topk, self.temperature, self.vocab_size, self.compile_kernels)
        observer: Callable[..., None] | None = collector.topk if self.teacher_signal == "topk" else collector.full_vocab
        normalizer = _global_normalizer(self.kl_reduction, global_valid_tokens, global_valid_seqs)
        closed_form = self._divergence_with_grad if self.teacher_signal == "full_vocab" else None
        if closed_form is not None and isinstance(student_rows, LMHeadInput) and not self.compile_kernels:
            # The metrics are at the loss temperature: reuse the fused loss's log-probabilities.
            # (Compiled kernels recompute them instead: fused passes beat writing them out.)
            closed_form = functools.partial(self._divergence_with_grad, observe_log_probs=collector.from_log_probs)
            observer = None
        row_weights: torch.Tensor | None = None
        correction_metrics: dict[str, float] = {}
        if self.off_policy is not None and "staleness" in data and "generation_logprobs" in data:
            row_weights, correction_metrics = off_policy_row_weights(
                _rows(student_output, loss_mask), data, loss_mask, self.off_policy, global_valid_tokens
            )
        loss = _apply_loss(
            student_rows,
            self._divergence,
            teacher_rows,
            normalizer,
            self.chunk_size,
            observer,
            closed_form,
            row_weights,
        )
        metrics = {
            "loss": float(loss.detach()),
            **collector.metrics(float(max(global_valid_tokens, 1))),
            **correction_metrics,
            "num_valid_tokens": float(loss_mask.sum()),
        }
        return loss, metrics


class SampledTokenLossFn(LossFunction):
    """Reverse KL on the sampled tokens only, as a clipped policy gradient.

    The form used by the Thinking Machines cookbook, prime-rl and slime: the teacher
    sends one log-prob per position (that of the token the student sampled), the
    per-token advantage is ``teacher_tau · log P − student_tau · log Q_sampler``
    (:func:`sampled_token_advantages`, optionally discounted over later tokens and plus
    ``adv_tau ·`` the sequence's task reward from ``data["task_reward"]``), and the loss is
    :func:`sampled_token_pg_loss` with the importance ratio against the sampler's
    log-probs (``data["generation_logprobs"]``). Normalised like :class:`DistillationLossFn`.

    It needs on-policy samples: fixed data has no sampler log-probs.
    """

    def __init__(
        self,
        teacher_tau: float = 1.0,
        student_tau: float = 1.0,
        discount: float = 0.0,
        adv_tau: float = 0.0,
        clip_ratio: float | None = 0.2,
        kl_reduction: str = "mean",
        fused_lm_head: bool = False,
        chunk_size: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if kl_reduction not in ("mean", "sum"):
            raise ValueError(f"kl_reduction must be 'mean' or 'sum', got {kl_reduction!r}")
        self.teacher_tau = teacher_tau
        self.student_tau = student_tau
        self.discount = discount
        self.adv_tau = adv_tau
        self.clip_ratio = clip_ratio
        self.kl_reduction = kl_reduction
        self.fused_lm_head = fused_lm_head
        self.chunk_size = chunk_size
        self.vocab_size = vocab_size

    @property
    def teacher_request(self) -> TeacherRequest:
        """The teacher's log-prob of each token of ``data["input_ids"]`` (``[B, L]``)."""
        return TokenLogprobsRequest(self.vocab_size)

    @property
    def needs_task_reward(self) -> bool:
        """Whether ``adv_tau`` weighs a task reward in."""
        return self.adv_tau != 0.0

    @property
    def needs_sampler_logprobs(self) -> bool:
        """Always: the importance ratio is against the sampler's log-probs."""
        return True

    def _divergence(
        self,
        student_logits: torch.Tensor,
        targets: torch.Tensor,
        sampler_logprobs: torch.Tensor,
        advantages: torch.Tensor,
    ) -> torch.Tensor:
        compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
        log_q = token_log_probs(torch.log_softmax(student_logits.to(compute_dtype), dim=-1), targets)
        return sampled_token_pg_loss(log_q, sampler_logprobs, advantages, self.clip_ratio)

    def __call__(
        self,
        student_output: torch.Tensor | LMHeadInput,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_output: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the global policy-gradient loss, and metrics.

        Metrics: ``loss``, ``kl_reverse_estimate`` (mean of log Q_sampler − log P over the
        sampled tokens, the single-sample reverse-KL estimate), ``advantage`` (mean),
        ``num_valid_tokens``.
        """
        if teacher_output is None:
            raise ValueError("SampledTokenLossFn needs the teacher's token log-probs")
        if "generation_logprobs" not in data:
            raise ValueError("the sampled-token loss needs on-policy samples with the sampler's log-probs")
        token_mask = shift_token_mask(data["token_mask"])
        loss_mask = token_mask.bool()
        sampler_logprobs = data["generation_logprobs"][:, 1:]
        teacher_logprobs = teacher_output[:, 1:].to(sampler_logprobs.device)
        # Packed rows (sequence packing) carry each token's sequence index: the advantages
        # of one sequence never collect the next one's.
        segment_ids = data["segment_ids"][:, 1:] if "segment_ids" in data else None
        task_reward = data.get("task_reward")
        if task_reward is not None and task_reward.dim() == 2:  # per token (packed): align with the targets
            task_reward = task_reward[:, 1:]
        advantages = sampled_token_advantages(
            sampler_logprobs,
            teacher_logprobs,
            token_mask,
            self.teacher_tau,
            self.student_tau,
            self.discount,
            task_reward,
            self.adv_tau,
            segment_ids,
        )
        student = student_output
        if self.vocab_size is not None:
            student = (
                LMHeadInput(student.hidden_states, student.weight, student.bias, self.vocab_size)
                if isinstance(student, LMHeadInput)
                else student[..., : self.vocab_size]
            )
        row_inputs = (data["input_ids"][:, 1:][loss_mask], sampler_logprobs[loss_mask], advantages[loss_mask])
        normalizer = _global_normalizer(self.kl_reduction, global_valid_tokens, global_valid_seqs)
        loss = _apply_loss(_rows(student, loss_mask), self._divergence, row_inputs, normalizer, self.chunk_size, None)
        token_normalizer = float(max(global_valid_tokens, 1))
        metrics = {
            "loss": float(loss.detach()),
            "kl_reverse_estimate": float((sampler_logprobs - teacher_logprobs)[loss_mask].sum()) / token_normalizer,
            "advantage": float(advantages[loss_mask].sum()) / token_normalizer,
            "num_valid_tokens": float(loss_mask.sum()),
        }
        return loss, metrics


class NLLLossFn(LossFunction):
    """Negative log-likelihood of the masked tokens (supervised fine-tuning).

    Normalised by the global number of valid tokens, like :class:`DistillationLossFn`.
    """

    def __call__(
        self,
        student_output: torch.Tensor,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_output: Any = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns this micro-batch's share of the global mean token NLL, and metrics.

        ``student_output`` is the ``[B, L, V]`` logits; ``teacher_output`` is ignored.
        """
        student_logits = student_output
        loss_mask = shift_token_mask(data["token_mask"]).bool()
        targets = data["input_ids"][:, 1:][loss_mask]
        rows = student_logits[:, :-1][loss_mask]
        compute_dtype = torch.promote_types(rows.dtype, torch.float32)
        log_probs = torch.log_softmax(rows.to(compute_dtype), dim=-1)
        token_nll = -token_log_probs(log_probs, targets)
        loss = token_nll.sum() / float(max(global_valid_tokens, 1))
        return loss, {"loss": float(loss.detach()), "num_valid_tokens": float(loss_mask.sum())}
