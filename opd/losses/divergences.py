"""The per-token divergences between teacher and student: pure tensor functions, no config, no I/O.

The public functions take ``[..., V]`` logits (position ``t`` predicts token ``t + 1``) and return ``shape[:-1]``
values (no masking, no reduction) in float32 at least (float64 for float64 input). They raise ``ValueError``, naming
the argument, for an unknown ``kl_type``, ``temperature`` not finite and > 0, ``mixed_kl_weight`` or ``beta``
outside [0, 1], or mismatched shapes. The loss classes build on the log-prob forms (:func:`kl_from_log_probs`,
:func:`jsd_from_log_probs`; :class:`~opd.losses.distillation_losses.FullVocabLossFn`).

P is the teacher distribution, Q the student's. Forward KL(P‖Q) = Σ_v P(v)·(log P(v) − log Q(v)) (mass-covering);
reverse KL(Q‖P) (mode-seeking); mixed = w·forward + (1 − w)·reverse, w = ``mixed_kl_weight``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

from opd.data.token_alignment import pool_logits_by_class
from opd.kernels.topk_rest import rest_logprobs_from_topk

KLType = Literal["forward", "reverse", "mixed"]
KL_TYPES: tuple[str, ...] = ("forward", "reverse", "mixed")

_FORWARD_WEIGHTS: dict[str, float] = {"forward": 1.0, "reverse": 0.0}
"""The weight of the forward KL in each ``kl_type``; ``mixed`` takes ``mixed_kl_weight``."""


def check_kl_type(kl_type: str) -> None:
    """Raises ``ValueError`` for a ``kl_type`` other than those of :data:`KL_TYPES`."""
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")


def check_temperature(temperature: float) -> None:
    """Raises ``ValueError`` unless ``temperature`` is a finite number > 0."""
    # NaN fails every comparison, so it is caught here too.
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")


def check_weight(name: str, value: float) -> None:
    """Raises ``ValueError`` outside [0, 1], where a mixture gets a negative coefficient and can go negative."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def plogp_difference(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-position Σ_v P(v)·(log P(v) − log Q(v)) with 0·log 0 = 0.

    Where P(v) = 0 both logs are zeroed *before* the product, so no −inf enters the graph (a ``where`` after it would
    still back-propagate 0·inf = NaN).
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
    """Per-position forward, reverse or mixed KL over the full vocabulary, both logits divided by ``temperature``.

    Gradients flow through both logits (the teacher's are not detached).
    """
    check_kl_type(kl_type)
    check_weight("mixed_kl_weight", mixed_kl_weight)
    check_temperature(temperature)
    log_q, log_p = log_probs_at_temperature(student_logits, teacher_logits, temperature)
    return kl_from_log_probs(log_q, log_p, forward_weight(kl_type, mixed_kl_weight))


def log_probs_at_temperature(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher log-probabilities at ``temperature``, in at least float32 (never bf16: it loses digits).

    Raises ``ValueError`` if the two logits differ in shape.
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


def forward_weight(kl_type: str, mixed_kl_weight: float) -> float:
    """The weight w of KL(P‖Q) in w·forward + (1 − w)·reverse that ``kl_type`` names."""
    check_kl_type(kl_type)
    return _FORWARD_WEIGHTS.get(kl_type, mixed_kl_weight)


def kl_from_log_probs(log_q: torch.Tensor, log_p: torch.Tensor, weight: float) -> torch.Tensor:
    """w·KL(P‖Q) + (1 − w)·KL(Q‖P) per position from ``[..., V]`` log-probs; w from :func:`forward_weight`."""
    # A zero-weight direction is skipped, not multiplied by 0: it may be +inf (0·inf = NaN).
    if weight == 1.0:
        return plogp_difference(log_p, log_q)
    if weight == 0.0:
        return plogp_difference(log_q, log_p)
    forward = plogp_difference(log_p, log_q)
    reverse = plogp_difference(log_q, log_p)
    return weight * forward + (1.0 - weight) * reverse


def jsd_from_log_probs(log_q: torch.Tensor, log_p: torch.Tensor, beta: float) -> torch.Tensor:
    """JSD(β) per position (see :func:`generalized_jsd`), from both models' log-probabilities (``[..., V]``)."""
    if beta in (0.0, 1.0):  # forward KL at β = 0, reverse at β = 1
        return kl_from_log_probs(log_q, log_p, 1.0 - beta)
    # log M by logsumexp of the weighted logs: exact where either distribution underflows.
    log_m = torch.logsumexp(torch.stack([log_q + math.log(1.0 - beta), log_p + math.log(beta)]), dim=0)
    return beta * plogp_difference(log_p, log_m) + (1.0 - beta) * plogp_difference(log_q, log_m)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-position generalized Jensen-Shannon divergence JSD(β) (GKD, TRL's convention).

    With M = (1 − β)·Q + β·P, JSD(β) = β·KL(P‖M) + (1 − β)·KL(Q‖M). β = 0 gives forward KL(P‖Q) and β = 1 reverse
    KL(Q‖P) (the mixture formula would give 0 there); for 0 < β < 1 it is bounded by the binary entropy of β.
    """
    check_weight("beta", beta)
    check_temperature(temperature)
    return jsd_from_log_probs(*log_probs_at_temperature(student_logits, teacher_logits, temperature), beta)


def full_vocab_divergence_with_grad(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kl_type: str = "forward",
    mixed_kl_weight: float = 0.5,
    temperature: float = 1.0,
    jsd_beta: float | None = None,
    observe_log_probs: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [C], ∂/∂student_logits [C, V])`` of :func:`token_kl`, or of :func:`generalized_jsd` with ``jsd_beta``.

    The gradient is in closed form for the fused loss: autograd would keep about a dozen ``[C, V]`` intermediates
    alive, this about five. With Q = softmax(s / T) and g = ∂D/∂Q, ∂D/∂s = Q ⊙ (g − Σ_v Q_v g_v) / T, where

    * forward KL(P‖Q): ∂D/∂s = (Q − P) / T;
    * reverse KL(Q‖P): g = log Q − log P (+1, which the centring cancels);
    * JSD(β), M = βP + (1 − β)Q: g = (1 − β)(log Q − log M) (the P/M and Q/M terms cancel).

    Terms where Q = 0 contribute nothing. ``observe_log_probs(log Q, log P)`` lets metrics reuse the softmaxes.
    """
    check_kl_type(kl_type)
    check_weight("mixed_kl_weight", mixed_kl_weight)
    check_temperature(temperature)
    if jsd_beta is not None:
        check_weight("jsd_beta", jsd_beta)
    log_q, log_p = log_probs_at_temperature(student_logits, teacher_logits, temperature)
    if observe_log_probs is not None:
        observe_log_probs(log_q, log_p)
    q = log_q.exp()
    if jsd_beta is not None and jsd_beta in (0.0, 1.0):
        kl_type, mixed_kl_weight, jsd_beta = ("forward" if jsd_beta == 0.0 else "reverse"), 0.5, None
    if jsd_beta is not None:
        log_m = torch.logaddexp(log_q + math.log(1.0 - jsd_beta), log_p + math.log(jsd_beta))
        values = jsd_beta * plogp_difference(log_p, log_m) + (1.0 - jsd_beta) * plogp_difference(log_q, log_m)
        return values, _softmax_chain(q, (1.0 - jsd_beta) * (log_q - log_m), temperature)
    weight = forward_weight(kl_type, mixed_kl_weight)
    values = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
    grad = torch.zeros_like(q)
    if weight != 0.0:  # a zero-weight direction is skipped: it may be +inf
        values += weight * plogp_difference(log_p, log_q)
        grad += (weight / temperature) * (q - log_p.exp())
    if weight != 1.0:
        values += (1.0 - weight) * plogp_difference(log_q, log_p)
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

    ``tail=True``: the exact KL over k + 1 classes, the k teacher tokens and a "rest" class; a true divergence (a
    lower bound of the full KL, equal when the k ids cover the vocabulary). ``tail=False``: both renormalised over
    the k (NeMo-RL's approximation, kept for comparison; can be zero while the distributions differ).

    Args:
        teacher_topk_logprobs: ``[..., k]`` (k >= 1), normalised over the teacher's full vocabulary, already at
            ``temperature`` (which divides only the student's logits here).
        teacher_topk_ids: ``[..., k]`` distinct ids; −1 marks an empty slot, in neither class (a cross-tokenizer
            token with no student counterpart, :mod:`opd.teachers.cross_tokenizer`).
        teacher_rest_logprobs: ``[...]`` log of the teacher's mass outside its top k, as the teacher computed it;
            None derives it from the top k. Unused with ``tail=False``.
        student_classes: ``[V]`` each student id's class when the ids name
            :class:`~opd.data.token_alignment.PrefixClasses` (the student's probabilities are summed by class first).
    """
    check_kl_type(kl_type)
    check_weight("mixed_kl_weight", mixed_kl_weight)
    check_temperature(temperature)
    _check_topk_shapes(student_logits, teacher_topk_logprobs, teacher_topk_ids, teacher_rest_logprobs)
    compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_q_full = scaled_log_probs(student_logits.to(compute_dtype), temperature, student_classes)
    empty = teacher_topk_ids < 0
    listed_ids = teacher_topk_ids.clamp_min(0)
    log_q = log_q_full.gather(-1, listed_ids).masked_fill(empty, float("-inf"))
    log_p = teacher_topk_logprobs.to(compute_dtype).masked_fill(empty, float("-inf"))
    if tail:
        log_q_rest, log_p_rest = _rest_class_log_probs(
            log_q_full, listed_ids, empty, teacher_topk_logprobs, teacher_rest_logprobs
        )
        log_q, log_p = torch.cat([log_q, log_q_rest], dim=-1), torch.cat([log_p, log_p_rest], dim=-1)
    else:
        log_q = log_q - torch.logsumexp(log_q, dim=-1, keepdim=True)
        log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
    return kl_from_log_probs(log_q, log_p, forward_weight(kl_type, mixed_kl_weight))


def _rest_class_log_probs(
    log_q_full: torch.Tensor,
    listed_ids: torch.Tensor,
    empty: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_rest_logprobs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's and the teacher's log-mass outside the teacher's top k, each ``[..., 1]``.

    Both in log space, never ``1 − Σ`` (in float32 that loses a 1e-7 rest and moves the divergence by percents):
    the student's is a logsumexp over its other tokens; the teacher's the one it sent, which is exact, or else
    :func:`~opd.kernels.topk_rest.rest_logprobs_from_topk` (float64, but cannot undo the log-probs' own rounding).
    ``listed_ids``: the ids with the ``empty`` slots (id −1) clamped to 0.
    """
    # Counted, not written: an empty slot's placeholder id must not unmark a listed one.
    in_topk = torch.zeros_like(log_q_full, dtype=torch.int32).scatter_add_(-1, listed_ids, (~empty).int()) > 0
    # Student rest mass as a logsumexp over the other tokens: exact even when Σ_k Q ≈ 1.
    log_q_rest = torch.logsumexp(log_q_full.masked_fill(in_topk, float("-inf")), dim=-1, keepdim=True)
    if teacher_rest_logprobs is None:
        teacher_rest_logprobs = rest_logprobs_from_topk(teacher_topk_logprobs.masked_fill(empty, float("-inf")))
    log_p_rest = teacher_rest_logprobs.to(log_q_full.dtype).unsqueeze(-1)
    # A rest mass below the dtype's smallest normal is lost to rounding; flooring it gives a student with mass
    # outside the top k a large finite penalty, not an infinite loss with NaN gradients.
    log_p_rest = log_p_rest.clamp(min=math.log(torch.finfo(log_q_full.dtype).tiny))
    # k ids covering the vocabulary leave no rest for either model; a rounding "rest" is not matchable mass.
    covers_vocabulary = in_topk.all(dim=-1, keepdim=True)
    return log_q_rest, log_p_rest.masked_fill(covers_vocabulary, float("-inf"))


def scaled_log_probs(logits: torch.Tensor, temperature: float, student_classes: torch.Tensor | None) -> torch.Tensor:
    """log softmax(logits / T), with each class's mass on its root id when ``student_classes`` is given."""
    scaled = logits if temperature == 1.0 else logits / temperature
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
