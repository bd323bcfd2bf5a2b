"""Distillation and supervised losses.

Two layers:

* Pure tensor kernels (:func:`token_kl`, :func:`generalized_jsd`, :func:`topk_token_kl`,
  :func:`sampled_token_advantages`, :func:`sampled_token_pg_loss`, :func:`shift_token_mask`)
  with no config and no I/O, so other frameworks can call them. They follow the
  next-token convention used everywhere in opd: the logits at position ``t`` predict
  token ``t + 1``.
* Loss-function objects (:class:`DistillationLossFn`, :class:`NLLLossFn`) that the
  trainer calls per micro-batch. They select the positions that carry loss, call the
  kernels, and normalise by the number of valid tokens (or sequences) of the *global*
  batch, so gradient accumulation gives the same gradient as one large batch.

Notation: P is the teacher distribution, Q the student's.
forward KL = KL(P‖Q) = Σ_v P(v)·(log P(v) − log Q(v)) (mass-covering);
reverse KL = KL(Q‖P) = Σ_v Q(v)·(log Q(v) − log P(v)) (mode-seeking);
mixed = w·forward + (1 − w)·reverse, with w = ``mixed_kl_weight``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

KLType = Literal["forward", "reverse", "mixed"]
KL_TYPES: tuple[str, ...] = ("forward", "reverse", "mixed")
KLReduction = Literal["mean", "sum"]


def shift_token_mask(token_mask: torch.Tensor) -> torch.Tensor:
    """Aligns a per-token loss mask with next-token logits.

    ``token_mask[b, t]`` is 1 when token ``t`` carries loss. That token is predicted by
    the logits at position ``t - 1``, so the mask for ``logits[:, :-1]`` is
    ``token_mask[:, 1:]``. This is the one place where opd shifts masks.

    Args:
        token_mask: ``[B, L]`` 0/1 mask over the tokens of ``input_ids``.

    Returns:
        ``[B, L - 1]`` mask over the logit positions ``0 .. L - 2``.
    """
    return token_mask[:, 1:]


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
        mixed_kl_weight: weight w of the forward term for ``"mixed"``.
        temperature: both logits are divided by it before the softmax.

    Returns:
        ``student_logits.shape[:-1]`` divergences, in float32 (or float64 when the
        inputs are float64). No masking, no reduction.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
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
    log_q = torch.log_softmax(student_logits.to(compute_dtype) / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits.to(compute_dtype) / temperature, dim=-1)
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
        temperature: both logits are divided by it before the softmax.

    Returns:
        ``student_logits.shape[:-1]`` divergences in float32 (float64 for float64 inputs).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    if beta == 0.0:
        return _plogp_difference(log_p, log_q)
    if beta == 1.0:
        return _plogp_difference(log_q, log_p)
    # log M by logsumexp of the weighted logs: exact where either distribution underflows.
    log_m = torch.logsumexp(torch.stack([log_q + math.log(1.0 - beta), log_p + math.log(beta)]), dim=0)
    return beta * _plogp_difference(log_p, log_m) + (1.0 - beta) * _plogp_difference(log_q, log_m)


def topk_token_kl(
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    kl_type: str,
    mixed_kl_weight: float = 0.5,
    tail: bool = True,
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

    Args:
        student_logits: ``[..., V]`` student logits (full vocabulary).
        teacher_topk_logprobs: ``[..., k]`` teacher log-probabilities of its top-k tokens,
            normalised over the teacher's full vocabulary.
        teacher_topk_ids: ``[..., k]`` the ids of those tokens (distinct per position).
        kl_type: ``"forward"``, ``"reverse"`` or ``"mixed"``, as in :func:`token_kl`.
        mixed_kl_weight: weight of the forward term for ``"mixed"``.
        tail: keep the rest class (True) or renormalise over the top k (False).

    Returns:
        ``student_logits.shape[:-1]`` divergences in float32 (float64 for float64 inputs).
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    if teacher_topk_logprobs.shape != teacher_topk_ids.shape:
        raise ValueError(
            f"teacher top-k log-probs and ids differ in shape: {tuple(teacher_topk_logprobs.shape)} "
            f"vs {tuple(teacher_topk_ids.shape)}"
        )
    if teacher_topk_ids.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(
            f"teacher top-k positions {tuple(teacher_topk_ids.shape[:-1])} do not match the student's "
            f"{tuple(student_logits.shape[:-1])}"
        )
    compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_q_full = torch.log_softmax(student_logits.to(compute_dtype), dim=-1)
    log_q = log_q_full.gather(-1, teacher_topk_ids)
    log_p = teacher_topk_logprobs.to(compute_dtype)
    if not tail:
        return _combine(
            log_q - torch.logsumexp(log_q, dim=-1, keepdim=True),
            log_p - torch.logsumexp(log_p, dim=-1, keepdim=True),
            kl_type, mixed_kl_weight,
        )
    in_topk = torch.zeros_like(log_q_full, dtype=torch.bool).scatter_(-1, teacher_topk_ids, True)
    # Student rest mass as a logsumexp over the other tokens: exact even when Σ_k Q ≈ 1.
    log_q_rest = torch.logsumexp(log_q_full.masked_fill(in_topk, float("-inf")), dim=-1, keepdim=True)
    # Teacher rest mass 1 − Σ_k P. Below the dtype's smallest normal number it is lost to
    # rounding (it can even come out negative), although a teacher with finite logits
    # always has some: it is floored there, so a student with mass outside the teacher's
    # top k gets a large finite penalty instead of an infinite loss with NaN gradients.
    p_rest = -torch.expm1(torch.logsumexp(log_p, dim=-1, keepdim=True))
    log_p_rest = torch.log(p_rest.clamp(min=torch.finfo(compute_dtype).tiny))
    # When the k ids cover the vocabulary the rest class is empty for both models; any
    # teacher "rest" left by rounding is not mass the student could match.
    covers_vocabulary = in_topk.all(dim=-1, keepdim=True)
    log_p_rest = log_p_rest.masked_fill(covers_vocabulary, float("-inf"))
    return _combine(torch.cat([log_q, log_q_rest], dim=-1), torch.cat([log_p, log_p_rest], dim=-1),
                    kl_type, mixed_kl_weight)


def sampled_token_advantages(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    teacher_tau: float = 1.0,
    student_tau: float = 1.0,
    discount: float = 0.0,
    task_reward: torch.Tensor | None = None,
    adv_tau: float = 0.0,
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
            accepts the answer).
        adv_tau: weight of the task reward.

    Returns:
        ``[B, T]`` advantages in float32 (float64 for float64 inputs).
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    dtype = torch.promote_types(student_logprobs.dtype, torch.float32)
    weights = mask.to(dtype)
    per_token = teacher_tau * teacher_logprobs.detach().to(dtype) - student_tau * student_logprobs.detach().to(dtype)
    if task_reward is not None and adv_tau != 0.0:
        per_token = per_token + adv_tau * task_reward.detach().to(dtype).unsqueeze(-1)
    per_token = per_token * weights
    if discount == 0.0:
        return per_token
    advantages = torch.zeros_like(per_token)
    running = torch.zeros_like(per_token[:, 0])
    for t in range(per_token.shape[1] - 1, -1, -1):  # reverse cumulative sum, right to left
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


class DistillationLossFn:
    """Token-level KL between the teacher and the student on response tokens.

    The loss is ``Σ_{valid positions} KL_t / N`` where, for ``kl_reduction="mean"``, N is
    the number of valid (response, non-padding) tokens in the whole global batch, and for
    ``"sum"`` N is the number of sequences in the global batch (each response's KL is
    summed over its tokens, then averaged over sequences).

    Args:
        kl_type: ``"forward"``, ``"reverse"`` or ``"mixed"``.
        mixed_kl_weight: weight of the forward KL in ``"mixed"``.
        temperature: softmax temperature applied to both models' logits.
        kl_reduction: ``"mean"`` (per token) or ``"sum"`` (per sequence).
        vocab_size: if set, both logits are cut to their first ``vocab_size`` entries.
            Models often pad their output layer beyond the tokenizer (Qwen2.5-32B has
            152,064 outputs, 1.5B has 151,936, the tokenizer 151,665): the extra entries
            are not real tokens and must not enter the divergence.
    """

    def __init__(
        self,
        kl_type: str = "reverse",
        mixed_kl_weight: float = 0.5,
        temperature: float = 1.0,
        kl_reduction: str = "mean",
        vocab_size: int | None = None,
    ) -> None:
        if kl_type not in KL_TYPES:
            raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
        if kl_reduction not in ("mean", "sum"):
            raise ValueError(f"kl_reduction must be 'mean' or 'sum', got {kl_reduction!r}")
        self.kl_type = kl_type
        self.mixed_kl_weight = mixed_kl_weight
        self.temperature = temperature
        self.kl_reduction = kl_reduction
        self.vocab_size = vocab_size

    def __call__(
        self,
        student_logits: torch.Tensor,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Computes this micro-batch's share of the global distillation loss.

        Args:
            student_logits: ``[B, L, V_s]`` logits for ``data["input_ids"]``.
            data: micro-batch with ``token_mask [B, L]``.
            global_valid_tokens: valid loss tokens in the whole global batch.
            global_valid_seqs: sequences in the whole global batch.
            teacher_logits: ``[B, L, V_t]`` teacher logits for the same ids.

        Returns:
            ``(loss, metrics)``; metrics hold this micro-batch's contributions to the
            global ``loss``, ``kl_forward`` and ``kl_reverse`` (token means) and
            ``num_valid_tokens``.
        """
        if teacher_logits is None:
            raise ValueError("DistillationLossFn needs teacher_logits")
        if self.vocab_size is not None:
            student_logits = student_logits[..., : self.vocab_size]
            teacher_logits = teacher_logits[..., : self.vocab_size]
        loss_mask = shift_token_mask(data["token_mask"]).bool()
        # Only the selected positions ever see a softmax: prompt and padding rows of the
        # [B, L, V] logits are skipped instead of computed and then masked to zero.
        student_rows = student_logits[:, :-1][loss_mask]
        teacher_rows = teacher_logits[:, :-1][loss_mask]
        log_q, log_p = _log_probs(student_rows, teacher_rows, self.temperature)
        divergence = _combine(log_q, log_p, self.kl_type, self.mixed_kl_weight)
        normalizer = _global_normalizer(self.kl_reduction, global_valid_tokens, global_valid_seqs)
        # sum() of an empty selection is 0 with a graph attached, so an all-masked
        # micro-batch contributes zero loss and zero gradient.
        loss = divergence.sum() / normalizer
        with torch.no_grad():
            # The metrics are both KL directions at temperature 1. At temperature 1 they
            # reuse the loss's log-probabilities instead of a second pair of softmaxes.
            if self.temperature != 1.0:
                log_q, log_p = _log_probs(student_rows, teacher_rows, 1.0)
            log_q, log_p = log_q.detach(), log_p.detach()
            forward_sum = _plogp_difference(log_p, log_q).sum()
            reverse_sum = _plogp_difference(log_q, log_p).sum()
            token_normalizer = float(max(global_valid_tokens, 1))
        metrics = {
            "loss": float(loss.detach()),
            "kl_forward": float(forward_sum) / token_normalizer,
            "kl_reverse": float(reverse_sum) / token_normalizer,
            "num_valid_tokens": float(loss_mask.sum()),
        }
        return loss, metrics


class NLLLossFn:
    """Negative log-likelihood of the masked tokens (supervised fine-tuning).

    Normalised by the global number of valid tokens, like :class:`DistillationLossFn`.
    """

    def __call__(
        self,
        student_logits: torch.Tensor,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns this micro-batch's share of the global mean token NLL, and metrics."""
        loss_mask = shift_token_mask(data["token_mask"]).bool()
        targets = data["input_ids"][:, 1:][loss_mask]
        rows = student_logits[:, :-1][loss_mask]
        compute_dtype = torch.promote_types(rows.dtype, torch.float32)
        log_probs = torch.log_softmax(rows.to(compute_dtype), dim=-1)
        token_nll = -log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss = token_nll.sum() / float(max(global_valid_tokens, 1))
        return loss, {"loss": float(loss.detach()), "num_valid_tokens": float(loss_mask.sum())}
