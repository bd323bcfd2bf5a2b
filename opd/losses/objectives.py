"""Distillation and supervised losses.

Two layers:

* Pure tensor kernels (:func:`token_kl`, :func:`generalized_jsd`, :func:`topk_token_kl`,
  :func:`sampled_token_advantages`, :func:`sampled_token_pg_loss`; the mask shift
  :func:`~opd.data.sequences.shift_token_mask` and the top-k rest-mass helpers
  :func:`~opd.kernels.topk_rest.log1mexp` and
  :func:`~opd.kernels.topk_rest.rest_logprobs_from_topk` are re-exported here)
  with no config and no I/O, so other frameworks can call them. They follow the
  next-token convention used everywhere in opd: the logits at position ``t`` predict
  token ``t + 1``. They check their scalar arguments (``temperature`` finite and > 0,
  ``mixed_kl_weight`` and ``beta`` in [0, 1]) and raise ``ValueError`` naming the
  argument, as the loss objects and the YAML config do.
* Loss-function objects that the trainer calls per micro-batch. Their base class
  :class:`TokenLossFn` selects the positions that carry loss, runs the per-position
  term (directly on logits, or chunk by chunk fused with the LM head, see
  :mod:`opd.kernels.fused_lm_head`), weighs positions (off-policy importance
  weights), and normalises by the number of valid tokens (or sequences) of the *global*
  batch, so gradient accumulation gives the same gradient as one large batch. Each
  variant says what it needs from the teacher (``teacher_request``) and defines only
  its per-position term: :class:`KLLossFn`, :class:`JSDLossFn` and
  :class:`TopKKLLossFn` (the teacher-distribution losses, :class:`DistillationLossFn`)
  and :class:`SampledTokenLossFn`. :class:`NLLLossFn` is the supervised loss.

Notation: P is the teacher distribution, Q the student's.
forward KL = KL(P‖Q) = Σ_v P(v)·(log P(v) − log Q(v)) (mass-covering);
reverse KL = KL(Q‖P) = Σ_v Q(v)·(log Q(v) − log P(v)) (mode-seeking);
mixed = w·forward + (1 − w)·reverse, with w = ``mixed_kl_weight``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from abc import ABCMeta, abstractmethod
from collections.abc import Callable
from typing import Any, Literal

import torch

from opd.data.sequences import shift_token_mask  # re-exported: part of the kernel API
from opd.data.token_alignment import pool_logits_by_class
from opd.kernels.compiled_kernels import compiled, kl_metrics_from_logits
from opd.kernels.fused_lm_head import chunked_lm_head_loss

# Re-exported: part of the kernel API (the ``as`` form marks the re-export for linters).
from opd.kernels.topk_rest import log1mexp as log1mexp
from opd.kernels.topk_rest import rest_logprobs_from_topk as rest_logprobs_from_topk
from opd.losses.off_policy import OffPolicyCorrection, importance_weights, learner_log_probs
from opd.models.interfaces import (
    FullVocabRequest,
    LossFunction,
    TeacherRequest,
    TokenLogprobsRequest,
    TopKLogprobs,
    TopKRequest,
)
from opd.models.lm_head import LMHeadInput, token_log_probs

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


_FORWARD_WEIGHTS: dict[str, float] = {"forward": 1.0, "reverse": 0.0}
"""The weight of the forward KL in each ``kl_type``; ``mixed`` takes ``mixed_kl_weight``."""


def forward_weight(kl_type: str, mixed_kl_weight: float) -> float:
    """The weight w of KL(P‖Q) in w·forward + (1 − w)·reverse that ``kl_type`` names."""
    _check_kl_type(kl_type)
    return _FORWARD_WEIGHTS.get(kl_type, mixed_kl_weight)


def _combine(log_q: torch.Tensor, log_p: torch.Tensor, kl_type: str, mixed_kl_weight: float) -> torch.Tensor:
    """The divergence named by ``kl_type`` from precomputed log-probabilities."""
    weight = forward_weight(kl_type, mixed_kl_weight)
    # A zero-weight direction is skipped, not multiplied by 0: it may be +inf (0·inf = NaN).
    if weight == 1.0:
        return _plogp_difference(log_p, log_q)
    if weight == 0.0:
        return _plogp_difference(log_q, log_p)
    forward = _plogp_difference(log_p, log_q)
    reverse = _plogp_difference(log_q, log_p)
    return weight * forward + (1.0 - weight) * reverse


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
    weight = forward_weight(kl_type, mixed_kl_weight)
    values = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
    grad = torch.zeros_like(q)
    if weight != 0.0:  # a zero-weight direction is skipped: it may be +inf
        values += weight * _plogp_difference(log_p, log_q)
        grad += (weight / temperature) * (q - log_p.exp())
    if weight != 1.0:
        values += (1.0 - weight) * _plogp_difference(log_q, log_p)
        grad += (1.0 - weight) * _softmax_chain(q, log_q - log_p, temperature)
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
    student_classes: torch.Tensor | None = None,
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
    ``log1mexp(logsumexp(top k))`` in float64 (:func:`~opd.kernels.topk_rest.rest_logprobs_from_topk`),
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
            vocabulary: its mass is in the rest, see :mod:`opd.teachers.cross_tokenizer`).
        kl_type: ``"forward"``, ``"reverse"`` or ``"mixed"``, as in :func:`token_kl`.
        mixed_kl_weight: weight of the forward term for ``"mixed"``, in [0, 1].
        tail: keep the rest class (True) or renormalise over the top k (False).
        temperature: the student's logits are divided by it; the teacher's log-probs
            must already be at the same temperature (the teacher applies it before its
            top-k, since the top-k set itself depends on it only through ties).
        teacher_rest_logprobs: optional ``[...]`` log of the teacher's mass outside its
            top k (−inf where it is exactly 0), as computed by the teacher; None computes
            it from ``teacher_topk_logprobs``. Unused with ``tail=False``.
        student_classes: ``[V]`` the class (root id) of each student id, when the teacher's
            ids name classes of student tokens (a teacher with another tokenizer,
            :class:`~opd.data.token_alignment.PrefixClasses`): the student's probabilities
            (at the temperature) are summed by class first. None: ids are tokens.

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
    log_q_full = _student_log_probs(student_logits.to(compute_dtype), temperature, student_classes)
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


def _student_log_probs(
    student_logits: torch.Tensor, temperature: float, student_classes: torch.Tensor | None
) -> torch.Tensor:
    """log softmax(logits / T), with each class's mass on its root id when ``student_classes`` is given."""
    scaled = student_logits if temperature == 1.0 else student_logits / temperature
    if student_classes is not None:
        scaled = pool_logits_by_class(scaled, student_classes)
    return torch.log_softmax(scaled, dim=-1)


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
    it in the same sequence: A_t = Σ_{t' ≥ t} γ^{k(t, t')} a_{t'}, where k(t, t') counts the
    masked-in tokens after t up to t' (the student's own tokens; on a multi-turn trajectory
    the observation tokens between two turns are holes in ``mask`` and are not steps, so a
    turn's tokens are discounted by how many student tokens lie between, not by how long
    the tool's answer was). On one contiguous response k(t, t') = t' − t. With τ = 1 and γ = 0,
    E[−A_t · ∇log Q(x_t)] is the gradient of the reverse KL(Q‖P) at that position.

    Args:
        student_logprobs: ``[B, T]`` log Q of the sampled tokens (detached here).
        teacher_logprobs: ``[B, T]`` log P of the same tokens.
        mask: ``[B, T]`` 1 on response tokens (the student's); advantages are 0 elsewhere,
            and positions outside it are not steps of the discount.
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
        # A position outside the mask (an observation between turns, padding) is no step:
        # the sum from the tokens after it passes through undiscounted.
        running = torch.where(weights[:, t] != 0, per_token[:, t] + discount * running, running)
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
        student_classes: torch.Tensor | None = None,
    ) -> None:
        """Metrics from the student's logits and the teacher's top-k (both at the loss temperature;
        ``student_classes`` as in :func:`topk_token_kl`)."""
        temperature = self.temperature
        if student_classes is not None:  # pooled once, at the temperature, for every metric below
            compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
            scaled = student_logits.to(compute_dtype) / temperature
            student_logits, temperature = pool_logits_by_class(scaled, student_classes), 1.0
        for kl_type in ("forward", "reverse"):
            self.sums[f"kl_{kl_type}"] += float(
                topk_token_kl(
                    student_logits,
                    teacher_topk_logprobs,
                    teacher_topk_ids,
                    kl_type,
                    temperature=temperature,
                    teacher_rest_logprobs=teacher_rest_logprobs,
                ).sum()
            )
        compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
        log_q = _student_log_probs(student_logits.to(compute_dtype), temperature, None)
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
    weights (:mod:`opd.losses.off_policy`).
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
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The importance weight of each loss position of a micro-batch, and its metrics.

    ``data["staleness"]`` is per sequence (``[B]``) or, in a packed row, per token
    (``[1, T]``); ``data["generation_logprobs"]`` is indexed by token position, like the
    targets. Rows of fresh samples are not computed: their weight is 1.

    Returns:
        ``([N] weights, metrics)``; the metrics are this micro-batch's share of the global
        means over response tokens (``is_ratio_mean``, ``is_abs_log_ratio_mean``,
        ``is_truncated_fraction``, ``is_masked_fraction``, ``is_outside_support_fraction``) and
        its ``is_ratio_max``. The weights are None (all 1) when the correction only
        monitors (``enabled: monitor``); the truncated and masked fractions then count the
        positions the correction would have cut or masked.
    """
    staleness = data["staleness"]
    per_token = staleness if staleness.dim() == 2 else staleness.unsqueeze(-1).expand_as(data["input_ids"])
    stale = _rows(per_token, loss_mask, shift=1) > 0
    sampler = _rows(data["generation_logprobs"], loss_mask, shift=1)
    learner = torch.zeros_like(sampler)
    if bool(stale.any()):
        rows = stale.nonzero().squeeze(-1)
        stale_rows = (
            student_rows.with_rows(student_rows.hidden_states[rows])  # the same head, its transform too
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
        "is_outside_support_fraction": sums["is_outside_support"] / tokens,
        "is_ratio_max": sums["is_ratio_max"],
    }
    return (None if correction.monitor_only else weights), metrics


@dataclasses.dataclass
class LossInputs:
    """What a :class:`TokenLossFn` variant hands the base class for one micro-batch.

    Attributes:
        row_inputs: the per-position inputs of the variant's ``_divergence`` after the
            student's logits, one row per loss position (tensors with the positions on
            dim 0, or an :class:`LMHeadInput` whose logits are made chunk by chunk).
        observer: called on each chunk's detached student logits and inputs (metrics).
        value_and_grad: a closed form of ``_divergence`` and its gradient for the fused
            path, or None for autograd through ``_divergence``.
        metrics: called after the loss with the global token count; returns this
            micro-batch's share of the variant's own metrics.
    """

    row_inputs: tuple[Any, ...]
    observer: Callable[..., None] | None = None
    value_and_grad: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    metrics: Callable[[float], dict[str, float]] = dataclasses.field(default=lambda tokens: {})


class TokenLossFn(LossFunction):
    """Base of the losses that sum a per-position term over the loss positions.

    It owns everything the objectives share, so that a variant only says what the
    teacher sends and what the per-position term is:

    * row selection: the positions whose next token carries loss (the shifted
      ``token_mask``) are selected once, for the student's output and the teacher's
      answer, so prompt and padding rows never see a softmax;
    * the vocabulary cut to ``vocab_size`` (padded output layers);
    * normalisation by the *global* batch's valid tokens (``kl_reduction="mean"``) or
      sequences (``"sum"``), so gradient accumulation gives the gradient of one batch;
    * the computation: on ``[B, L, V]`` logits, or with ``fused_lm_head`` chunk by chunk
      from hidden states (:func:`~opd.kernels.fused_lm_head.chunked_lm_head_loss`);
    * per-position weights: the off-policy importance weights of stale samples when
      ``off_policy`` is set (:func:`off_policy_row_weights`), 1 otherwise;
    * the per-position cap ``token_clip`` (:class:`_TokenClip`): a position whose term
      exceeds it contributes the cap and no gradient, on both the plain and the fused path;
    * the metrics dict: ``loss``, the variant's metrics, the weights' metrics,
      ``num_valid_tokens`` and, with a cap, ``clipped_token_fraction``.

    A variant implements :meth:`_loss_inputs` (the teacher's rows and how chunks are
    observed) and :meth:`_divergence` (the per-position term), and says what it asks the
    teacher for (``teacher_request``). A correction term that depends on the position
    joins the per-position term (extra row inputs, added in ``_divergence``); one that
    reweighs positions overrides :meth:`_row_weights`.

    Args:
        kl_reduction: ``"mean"`` (per token) or ``"sum"`` (per sequence).
        vocab_size: if set, logits are cut to their first ``vocab_size`` entries.
        fused_lm_head: take hidden states and compute the loss chunk by chunk.
        chunk_size: positions per fused chunk, >= 1 (None: ~128 MiB of fp32 logits per chunk).
        off_policy: weigh the positions of stale samples (a micro-batch with
            ``staleness`` and ``generation_logprobs``) by truncated importance weights
            (:mod:`opd.losses.off_policy`); None leaves every weight at 1.
        token_clip: cap on each position's term, a finite number > 0: a position above it
            contributes the cap and zero gradient (``clamp(max=token_clip)``); None: no cap.

    Raises:
        ValueError: naming the argument, for a value outside its range.
    """

    teacher_answer = "the teacher's output"
    """What the error for a missing ``teacher_output`` says the loss needs."""

    def __init__(
        self,
        kl_reduction: str = "mean",
        vocab_size: int | None = None,
        fused_lm_head: bool = False,
        chunk_size: int | None = None,
        off_policy: OffPolicyCorrection | None = None,
        token_clip: float | None = None,
    ) -> None:
        if kl_reduction not in ("mean", "sum"):
            raise ValueError(f"kl_reduction must be 'mean' or 'sum', got {kl_reduction!r}")
        if token_clip is not None and not (math.isfinite(token_clip) and token_clip > 0):
            raise ValueError(f"token_clip must be a finite number > 0 (or None: no cap), got {token_clip}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (or None: the whole output layer), got {vocab_size}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (or None: chosen from the vocabulary size), got {chunk_size}")
        self.kl_reduction = kl_reduction
        self.vocab_size = vocab_size
        self.fused_lm_head = fused_lm_head
        self.chunk_size = chunk_size
        self.off_policy = off_policy
        self.token_clip = token_clip

    @abstractmethod
    def _loss_inputs(
        self, teacher_output: Any, data: dict[str, Any], loss_mask: torch.Tensor, fused: bool
    ) -> LossInputs:
        """The per-position inputs of :meth:`_divergence` for this micro-batch, and its metric hooks.

        ``loss_mask`` is ``[B, L − 1]``, True where logit position ``t`` carries loss;
        ``fused``: the student's output is hidden states (the chunked path runs).
        """

    @abstractmethod
    def _divergence(self, student_logits: torch.Tensor, *row_inputs: Any) -> torch.Tensor:
        """The per-position term: ``(student logits [C, V], *row inputs [C, ...]) -> [C]``."""

    def _row_weights(
        self, student_output: Any, data: dict[str, Any], loss_mask: torch.Tensor, global_valid_tokens: int
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """``([N] weights or None for all 1, metrics)``: the off-policy weights when asked for and the data has them."""
        if self.off_policy is None or "staleness" not in data or "generation_logprobs" not in data:
            return None, {}
        return off_policy_row_weights(
            _rows(student_output, loss_mask), data, loss_mask, self.off_policy, global_valid_tokens
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
        """Computes this micro-batch's share of the global loss.

        Args:
            student_output: ``[B, L, V_s]`` logits for ``data["input_ids"]``, or (fused)
                an :class:`LMHeadInput` with ``[B, L, D]`` hidden states.
            data: micro-batch with ``token_mask [B, L]`` (and what the variant reads).
            global_valid_tokens: valid loss tokens in the whole global batch.
            global_valid_seqs: sequences in the whole global batch.
            teacher_output: the teacher's answer to :attr:`teacher_request`.

        Returns:
            ``(loss, metrics)``; metrics hold this micro-batch's contributions to the
            global ``loss``, the variant's metrics (token means, of the uncapped terms),
            the weights' metrics, ``num_valid_tokens`` and, with ``token_clip``, its
            share of ``clipped_token_fraction`` (capped positions / the global batch's
            loss tokens).

        Raises:
            ValueError: without ``teacher_output``.
        """
        if teacher_output is None:
            raise ValueError(f"{type(self).__name__} needs {self.teacher_answer}")
        loss_mask = shift_token_mask(data["token_mask"]).bool()
        # Only the selected positions ever see a softmax: prompt and padding rows are
        # skipped instead of computed and then masked to zero.
        student_rows = _rows(self._cut_vocabulary(student_output), loss_mask)
        fused = isinstance(student_rows, LMHeadInput)
        inputs = self._loss_inputs(teacher_output, data, loss_mask, fused)
        row_weights, weight_metrics = self._row_weights(student_output, data, loss_mask, global_valid_tokens)
        divergence, value_and_grad = self._divergence, inputs.value_and_grad
        clip = _TokenClip(self.token_clip) if self.token_clip is not None else None
        if clip is not None:
            divergence = clip.divergence(divergence)
            value_and_grad = clip.value_and_grad(value_and_grad) if value_and_grad is not None else None
        loss = _apply_loss(
            student_rows,
            divergence,
            inputs.row_inputs,
            _global_normalizer(self.kl_reduction, global_valid_tokens, global_valid_seqs),
            self.chunk_size,
            inputs.observer,
            value_and_grad,
            row_weights,
        )
        metrics = {
            "loss": float(loss.detach()),
            **inputs.metrics(float(max(global_valid_tokens, 1))),
            **weight_metrics,
            "num_valid_tokens": float(loss_mask.sum()),
        }
        if clip is not None:
            metrics["clipped_token_fraction"] = clip.fraction(global_valid_tokens)
        return loss, metrics


class _TokenClip:
    """``token_clip``: caps each position's term at ``cap`` and counts the positions it capped.

    A capped position contributes ``cap`` and no gradient, as ``clamp(max=cap)`` does: the
    plain path (and the fused path's autograd) clamps the per-position term; the fused
    path's closed form clamps its values and zeroes the gradient rows of the capped
    positions. The count stays a tensor on the device, added up over the chunks of a
    micro-batch, and is read once when the micro-batch's metrics are made.

    Args:
        cap: the largest term a position contributes (> 0).
    """

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self.clipped: torch.Tensor | None = None

    def _count(self, over: torch.Tensor) -> None:
        count = over.sum()
        self.clipped = count if self.clipped is None else self.clipped + count

    def divergence(self, divergence: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``divergence`` capped (autograd gives zero gradient above the cap)."""

        def capped(student_logits: torch.Tensor, *row_inputs: Any) -> torch.Tensor:
            per_position = divergence(student_logits, *row_inputs)
            self._count(per_position.detach() > self.cap)
            return per_position.clamp(max=self.cap)

        return capped

    def value_and_grad(
        self, value_and_grad: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    ) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """A closed form ``(values [C], gradient [C, V])`` capped: values clamped, capped rows' gradients zero."""

        def capped(student_logits: torch.Tensor, *row_inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            losses, grad = value_and_grad(student_logits, *row_inputs)
            over = losses.detach() > self.cap
            self._count(over)
            # In place: the gradient is this chunk's own temporary, and a copy would be [C, V] more.
            return losses.clamp(max=self.cap), grad.masked_fill_(over.unsqueeze(-1), 0.0)

        return capped

    def fraction(self, global_valid_tokens: int) -> float:
        """The capped positions as a share of the global batch's loss tokens (the one host sync)."""
        if self.clipped is None:
            return 0.0
        return float(self.clipped) / max(global_valid_tokens, 1)


class _OneClassConstructor(ABCMeta):
    """Lets ``DistillationLossFn(...)`` keep taking the arguments of the former single class.

    Calling :class:`DistillationLossFn` itself (not one of its variants) with those
    keyword arguments builds the variant they name (:func:`distillation_loss_fn`).
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is DistillationLossFn:
            return distillation_loss_fn(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class DistillationLossFn(TokenLossFn, metaclass=_OneClassConstructor):
    """Divergence between the teacher's and the student's next-token distributions.

    The loss is ``Σ_{valid positions} w_t · D_t / N`` (see :class:`TokenLossFn` for N and
    w). The variants choose D_t and the teacher signal:

    ==========================  ==========================================  ===========================
    variant                     D_t                                         teacher signal
    ==========================  ==========================================  ===========================
    :class:`KLLossFn`           forward / reverse / mixed KL (:func:`token_kl`)  logits or hidden states
    :class:`JSDLossFn`          generalized JSD(β) (:func:`generalized_jsd`)  logits or hidden states
    :class:`TopKKLLossFn`       KL over the top k + rest (:func:`topk_token_kl`)  top-k log-probs and ids
    ==========================  ==========================================  ===========================

    The metrics (``kl_forward``, ``kl_reverse``, ``teacher_topk_mass``,
    ``student_mass_on_teacher_topk``, ``topk_overlap``) are token means taken at the loss
    temperature for every teacher signal (see :class:`_TeacherMetrics` for why).

    ``DistillationLossFn(kl_type=..., teacher_signal=..., divergence=..., ...)`` with the
    arguments of :func:`distillation_loss_fn` builds the variant they name.

    Args:
        temperature: distillation temperature applied to both models' logits (separate
            from the sampling temperature); a finite number > 0.
        kl_reduction, vocab_size, fused_lm_head, chunk_size, off_policy, token_clip: as in
            :class:`TokenLossFn`. Models often pad their output layer beyond the tokenizer
            (Qwen2.5-32B has 152,064 outputs, 1.5B has 151,936, the tokenizer 151,665):
            ``vocab_size`` keeps those entries out of the divergence.
        metrics_topk: k of the top-k metrics (>= 1).
    """

    compile_kernels = False
    """Whether the per-chunk kernels (closed-form divergence, metrics) run compiled."""

    def __init__(
        self,
        temperature: float = 1.0,
        kl_reduction: str = "mean",
        vocab_size: int | None = None,
        metrics_topk: int = 64,
        fused_lm_head: bool = False,
        chunk_size: int | None = None,
        off_policy: OffPolicyCorrection | None = None,
        token_clip: float | None = None,
    ) -> None:
        _check_temperature(temperature)
        if metrics_topk < 1:
            raise ValueError(f"metrics_topk must be >= 1, got {metrics_topk}")
        super().__init__(kl_reduction, vocab_size, fused_lm_head, chunk_size, off_policy, token_clip)
        self.temperature = temperature
        self.metrics_topk = metrics_topk

    @abstractmethod
    def _teacher_rows(self, teacher_output: Any, loss_mask: torch.Tensor) -> tuple[Any, ...]:
        """The loss positions of the teacher's answer: the row inputs of :meth:`_divergence`."""

    @abstractmethod
    def _chunk_hooks(
        self, metrics: _TeacherMetrics, fused: bool
    ) -> tuple[Callable[..., None] | None, Callable[..., tuple[torch.Tensor, torch.Tensor]] | None]:
        """``(observer, value_and_grad)`` of :class:`LossInputs`, the observer feeding ``metrics``."""

    def _loss_inputs(
        self, teacher_output: Any, data: dict[str, Any], loss_mask: torch.Tensor, fused: bool
    ) -> LossInputs:
        collector = _TeacherMetrics(self.metrics_topk, self.temperature, self.vocab_size, self.compile_kernels)
        observer, value_and_grad = self._chunk_hooks(collector, fused)
        return LossInputs(self._teacher_rows(teacher_output, loss_mask), observer, value_and_grad, collector.metrics)


class FullVocabLossFn(DistillationLossFn):
    """A divergence over the whole vocabulary: the teacher sends logits (or hidden states and head).

    With ``fused_lm_head`` an in-process teacher sends hidden states too, and its logits
    are made chunk by chunk as well. A variant overrides :meth:`_divergence` (the
    per-position value; the fused path differentiates it by autograd chunk by chunk)
    and, where :func:`full_vocab_divergence_with_grad` computes the same divergence,
    :meth:`_closed_form_arguments`, so the fused path takes the closed-form gradient
    (fewer ``[chunk × vocab]`` temporaries) and the metrics reuse its log-probabilities.

    Args:
        compile_kernels: ``torch.compile`` the per-chunk kernels (the closed-form
            divergence with ``fused_lm_head``, and the metrics); see
            :mod:`opd.kernels.compiled_kernels`.
        the rest: as in :class:`DistillationLossFn`.
    """

    teacher_answer = "the teacher's logits"

    def __init__(
        self,
        temperature: float = 1.0,
        kl_reduction: str = "mean",
        vocab_size: int | None = None,
        metrics_topk: int = 64,
        fused_lm_head: bool = False,
        chunk_size: int | None = None,
        compile_kernels: bool = False,
        off_policy: OffPolicyCorrection | None = None,
        token_clip: float | None = None,
    ) -> None:
        super().__init__(
            temperature, kl_reduction, vocab_size, metrics_topk, fused_lm_head, chunk_size, off_policy, token_clip
        )
        self.compile_kernels = compile_kernels

    @property
    def teacher_request(self) -> TeacherRequest:
        """Full-vocabulary logits (hidden states and head for the fused loss)."""
        return FullVocabRequest(prefer_hidden_states=self.fused_lm_head)

    def _closed_form_arguments(self) -> tuple[str, float, float | None] | None:
        """``(kl_type, mixed_kl_weight, jsd_beta)`` of :func:`full_vocab_divergence_with_grad` when it
        computes this variant's divergence in closed form; None (the default): autograd
        through :meth:`_divergence` on the fused path."""
        return None

    def _divergence_with_grad(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        observe_log_probs: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Closed-form value and gradient of :meth:`_divergence` (the fused path's).

        Raises:
            NotImplementedError: for a variant without :meth:`_closed_form_arguments`.
        """
        arguments = self._closed_form_arguments()
        if arguments is None:
            raise NotImplementedError(f"{type(self).__name__} has no closed-form gradient")
        kernel = full_vocab_divergence_with_grad
        if self.compile_kernels and observe_log_probs is None:
            kernel = compiled(full_vocab_divergence_with_grad)
        kl_type, mixed_kl_weight, jsd_beta = arguments
        return kernel(
            student_logits, teacher_logits, kl_type, mixed_kl_weight, self.temperature, jsd_beta, observe_log_probs
        )

    def _teacher_rows(self, teacher_output: Any, loss_mask: torch.Tensor) -> tuple[Any, ...]:
        return (_rows(self._cut_vocabulary(teacher_output), loss_mask),)

    def _chunk_hooks(
        self, metrics: _TeacherMetrics, fused: bool
    ) -> tuple[Callable[..., None] | None, Callable[..., tuple[torch.Tensor, torch.Tensor]] | None]:
        if self._closed_form_arguments() is None:
            return metrics.full_vocab, None
        if fused and not self.compile_kernels:
            # The metrics are at the loss temperature: reuse the fused loss's log-probabilities.
            # (Compiled kernels recompute them instead: fused passes beat writing them out.)
            return None, functools.partial(self._divergence_with_grad, observe_log_probs=metrics.from_log_probs)
        return metrics.full_vocab, self._divergence_with_grad


class KLLossFn(FullVocabLossFn):
    """``loss_fn.type: full_vocab``: forward, reverse or mixed KL over the whole vocabulary (:func:`token_kl`).

    Args:
        kl_type: ``"forward"`` (KL(P‖Q)), ``"reverse"`` (KL(Q‖P)) or ``"mixed"``.
        mixed_kl_weight: weight of the forward KL in ``"mixed"``, in [0, 1].
        the rest: as in :class:`FullVocabLossFn`.
    """

    def __init__(
        self,
        kl_type: str = "reverse",
        mixed_kl_weight: float = 0.5,
        temperature: float = 1.0,
        kl_reduction: str = "mean",
        vocab_size: int | None = None,
        metrics_topk: int = 64,
        fused_lm_head: bool = False,
        chunk_size: int | None = None,
        compile_kernels: bool = False,
        off_policy: OffPolicyCorrection | None = None,
        token_clip: float | None = None,
    ) -> None:
        _check_kl_type(kl_type)
        _check_weight("mixed_kl_weight", mixed_kl_weight)
        super().__init__(
            temperature,
            kl_reduction,
            vocab_size,
            metrics_topk,
            fused_lm_head,
            chunk_size,
            compile_kernels,
            off_policy,
            token_clip,
        )
        self.kl_type = kl_type
        self.mixed_kl_weight = mixed_kl_weight

    def _divergence(self, student_logits: torch.Tensor, *row_inputs: Any) -> torch.Tensor:
        return token_kl(student_logits, row_inputs[0], self.kl_type, self.mixed_kl_weight, self.temperature)

    def _closed_form_arguments(self) -> tuple[str, float, float | None] | None:
        return self.kl_type, self.mixed_kl_weight, None

    @classmethod
    def from_arguments(cls, arguments: DistillationArguments) -> DistillationLossFn:
        return cls(
            arguments.kl_type,
            arguments.mixed_kl_weight,
            metrics_topk=arguments.teacher_topk,
            compile_kernels=arguments.compile_kernels,
            **arguments.shared(),
        )


class JSDLossFn(FullVocabLossFn):
    """``loss_fn.type: jsd``: the generalized Jensen-Shannon divergence of GKD / TRL (:func:`generalized_jsd`).

    Args:
        beta: β in [0, 1] (0 = forward KL, 1 = reverse KL).
        the rest: as in :class:`FullVocabLossFn`.
    """

    def __init__(
        self,
        beta: float = 0.5,
        temperature: float = 1.0,
        kl_reduction: str = "mean",
        vocab_size: int | None = None,
        metrics_topk: int = 64,
        fused_lm_head: bool = False,
        chunk_size: int | None = None,
        compile_kernels: bool = False,
        off_policy: OffPolicyCorrection | None = None,
        token_clip: float | None = None,
    ) -> None:
        _check_weight("jsd_beta", beta)
        super().__init__(
            temperature,
            kl_reduction,
            vocab_size,
            metrics_topk,
            fused_lm_head,
            chunk_size,
            compile_kernels,
            off_policy,
            token_clip,
        )
        self.beta = beta

    def _divergence(self, student_logits: torch.Tensor, *row_inputs: Any) -> torch.Tensor:
        return generalized_jsd(student_logits, row_inputs[0], self.beta, self.temperature)

    def _closed_form_arguments(self) -> tuple[str, float, float | None] | None:
        # The kernel's KL arguments are unused with a β (it maps β = 0 / 1 to the KLs itself).
        return "forward", 0.5, self.beta

    @classmethod
    def from_arguments(cls, arguments: DistillationArguments) -> DistillationLossFn:
        return cls(
            arguments.jsd_beta,
            metrics_topk=arguments.teacher_topk,
            compile_kernels=arguments.compile_kernels,
            **arguments.shared(),
        )


class TopKKLLossFn(DistillationLossFn):
    """``loss_fn.type: topk``: KL against a teacher that sends its top-k log-probs (:func:`topk_token_kl`).

    Args:
        kl_type, mixed_kl_weight: as in :class:`KLLossFn`.
        k: the teacher's tokens per position (also the k of the top-k metrics), >= 1.
        tail: keep the rest class (True) or renormalise over the top k (False, NeMo-RL's variant).
        the rest: as in :class:`DistillationLossFn`.

    Attributes:
        student_classes: None (the teacher's ids are student tokens), or what a teacher with
            another tokenizer names (:attr:`~opd.models.interfaces.TeacherInterface.student_classes`):
            the loss and its metrics then compare classes of student tokens.
    """

    teacher_answer = "the teacher's top-k log-probs"
    student_classes: torch.Tensor | None = None

    def __init__(
        self,
        kl_type: str = "reverse",
        mixed_kl_weight: float = 0.5,
        k: int = 64,
        tail: bool = True,
        temperature: float = 1.0,
        kl_reduction: str = "mean",
        vocab_size: int | None = None,
        fused_lm_head: bool = False,
        chunk_size: int | None = None,
        off_policy: OffPolicyCorrection | None = None,
        token_clip: float | None = None,
    ) -> None:
        _check_kl_type(kl_type)
        _check_weight("mixed_kl_weight", mixed_kl_weight)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        super().__init__(temperature, kl_reduction, vocab_size, k, fused_lm_head, chunk_size, off_policy, token_clip)
        self.kl_type = kl_type
        self.mixed_kl_weight = mixed_kl_weight
        self.k = k
        self.tail = tail

    @property
    def teacher_request(self) -> TeacherRequest:
        """The top-k log-probs and ids at the loss temperature."""
        return TopKRequest(self.k, self.temperature, self.vocab_size)

    def _divergence(self, student_logits: torch.Tensor, *row_inputs: Any) -> torch.Tensor:
        logprobs, ids, rest = row_inputs
        return topk_token_kl(
            student_logits,
            logprobs,
            ids,
            self.kl_type,
            self.mixed_kl_weight,
            tail=self.tail,
            temperature=self.temperature,
            teacher_rest_logprobs=rest,
            student_classes=self.student_classes,
        )

    def _teacher_rows(self, teacher_output: Any, loss_mask: torch.Tensor) -> tuple[Any, ...]:
        """``([B, L, k] log-probs, [B, L, k] ids)``: a :class:`TopKLogprobs` carrying the
        teacher's rest mass, a plain pair (the rest is then computed from the top-k), or a
        triple with ``[B, L]`` rest log-probs third."""
        return _topk_rows(teacher_output, loss_mask)

    def _chunk_hooks(
        self, metrics: _TeacherMetrics, fused: bool
    ) -> tuple[Callable[..., None] | None, Callable[..., tuple[torch.Tensor, torch.Tensor]] | None]:
        if self.student_classes is None:
            return metrics.topk, None
        return functools.partial(metrics.topk, student_classes=self.student_classes), None

    @classmethod
    def from_arguments(cls, arguments: DistillationArguments) -> DistillationLossFn:
        return cls(
            arguments.kl_type,
            arguments.mixed_kl_weight,
            k=arguments.teacher_topk,
            tail=arguments.topk_tail,
            **arguments.shared(),
        )


DIVERGENCES: tuple[str, ...] = ("kl", "jsd")
TEACHER_SIGNALS: tuple[str, ...] = ("full_vocab", "topk")
DISTILLATION_VARIANTS: dict[tuple[str, str], Callable[[DistillationArguments], DistillationLossFn]] = {
    ("full_vocab", "kl"): KLLossFn.from_arguments,
    ("full_vocab", "jsd"): JSDLossFn.from_arguments,
    ("topk", "kl"): TopKKLLossFn.from_arguments,
}
"""The variant for each ``(teacher_signal, divergence)`` of the single-class arguments."""


@dataclasses.dataclass(frozen=True)
class DistillationArguments:
    """The arguments of the former single ``DistillationLossFn`` class (see :func:`distillation_loss_fn`)."""

    kl_type: str = "reverse"
    mixed_kl_weight: float = 0.5
    temperature: float = 1.0
    kl_reduction: str = "mean"
    vocab_size: int | None = None
    divergence: str = "kl"
    jsd_beta: float = 0.5
    teacher_signal: str = "full_vocab"
    teacher_topk: int = 64
    topk_tail: bool = True
    fused_lm_head: bool = False
    chunk_size: int | None = None
    compile_kernels: bool = False
    off_policy: OffPolicyCorrection | None = None
    token_clip: float | None = None

    def shared(self) -> dict[str, Any]:
        """The keyword arguments every variant takes."""
        return {
            "temperature": self.temperature,
            "kl_reduction": self.kl_reduction,
            "vocab_size": self.vocab_size,
            "fused_lm_head": self.fused_lm_head,
            "chunk_size": self.chunk_size,
            "off_policy": self.off_policy,
            "token_clip": self.token_clip,
        }


def distillation_loss_fn(*args: Any, **kwargs: Any) -> DistillationLossFn:
    """The distillation variant that the single-class arguments name (what ``DistillationLossFn(...)`` returns).

    Takes the fields of :class:`DistillationArguments`, positionally in that order or by
    keyword: ``teacher_signal`` (``"full_vocab"`` or ``"topk"``) and ``divergence``
    (``"kl"`` or ``"jsd"``) pick the class in :data:`DISTILLATION_VARIANTS`; the rest are
    its settings (``teacher_topk`` is the top-k signal's k, or the metrics' k with the
    full vocabulary; ``jsd_beta`` the JSD's β). Every argument is checked, whether the
    variant reads it or not.

    Raises:
        ValueError: naming the argument, for a value outside its range, or for the JSD
            with a top-k signal.
    """
    arguments = DistillationArguments(*args, **kwargs)
    _check_kl_type(arguments.kl_type)
    _check_weight("mixed_kl_weight", arguments.mixed_kl_weight)
    _check_weight("jsd_beta", arguments.jsd_beta)
    _check_temperature(arguments.temperature)
    if arguments.kl_reduction not in ("mean", "sum"):
        raise ValueError(f"kl_reduction must be 'mean' or 'sum', got {arguments.kl_reduction!r}")
    if arguments.divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {arguments.divergence!r}")
    if arguments.teacher_signal not in TEACHER_SIGNALS:
        raise ValueError(f"teacher_signal must be one of {TEACHER_SIGNALS}, got {arguments.teacher_signal!r}")
    build = DISTILLATION_VARIANTS.get((arguments.teacher_signal, arguments.divergence))
    if build is None:
        raise ValueError("the generalized JSD needs the teacher's full vocabulary; use divergence='kl' with top-k")
    if arguments.teacher_topk < 1:
        raise ValueError(f"teacher_topk must be >= 1, got {arguments.teacher_topk}")
    return build(arguments)


class SampledTokenLossFn(TokenLossFn):
    """Reverse KL on the sampled tokens only, as a clipped policy gradient.

    The form used by the Thinking Machines cookbook, prime-rl and slime: the teacher
    sends one log-prob per position (that of the token the student sampled), the
    per-token advantage is ``teacher_tau · log P − student_tau · log Q_sampler``
    (:func:`sampled_token_advantages`, optionally discounted over later tokens and plus
    ``adv_tau ·`` the sequence's task reward from ``data["task_reward"]``), and the loss is
    :func:`sampled_token_pg_loss` with the importance ratio against the sampler's
    log-probs (``data["generation_logprobs"]``). Normalised like every :class:`TokenLossFn`.

    It needs on-policy samples: fixed data has no sampler log-probs. It takes no
    off-policy weights: its ratio is already taken against the sampler's log-probs.

    Metrics: ``loss``, ``kl_reverse_estimate`` (mean of log Q_sampler − log P over the
    sampled tokens, the single-sample reverse-KL estimate), ``advantage`` (mean),
    ``num_valid_tokens``.
    """

    teacher_answer = "the teacher's token log-probs"

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
        super().__init__(kl_reduction, vocab_size, fused_lm_head, chunk_size)
        self.teacher_tau = teacher_tau
        self.student_tau = student_tau
        self.discount = discount
        self.adv_tau = adv_tau
        self.clip_ratio = clip_ratio

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

    def _divergence(self, student_logits: torch.Tensor, *row_inputs: Any) -> torch.Tensor:
        targets, sampler_logprobs, advantages = row_inputs
        compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
        log_q = token_log_probs(torch.log_softmax(student_logits.to(compute_dtype), dim=-1), targets)
        return sampled_token_pg_loss(log_q, sampler_logprobs, advantages, self.clip_ratio)

    def _loss_inputs(
        self, teacher_output: Any, data: dict[str, Any], loss_mask: torch.Tensor, fused: bool
    ) -> LossInputs:
        """The sampled tokens, the sampler's log-probs and the advantages at the loss positions.

        Raises:
            ValueError: if ``data`` has no ``generation_logprobs``.
        """
        if "generation_logprobs" not in data:
            raise ValueError("the sampled-token loss needs on-policy samples with the sampler's log-probs")
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
            loss_mask,
            self.teacher_tau,
            self.student_tau,
            self.discount,
            task_reward,
            self.adv_tau,
            segment_ids,
        )

        def metrics(tokens: float) -> dict[str, float]:
            return {
                "kl_reverse_estimate": float((sampler_logprobs - teacher_logprobs)[loss_mask].sum()) / tokens,
                "advantage": float(advantages[loss_mask].sum()) / tokens,
            }

        row_inputs = (data["input_ids"][:, 1:][loss_mask], sampler_logprobs[loss_mask], advantages[loss_mask])
        return LossInputs(row_inputs, metrics=metrics)


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
