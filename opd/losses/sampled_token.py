"""The sampled-token objective: reverse KL on the tokens the student sampled, as a clipped policy gradient.

The form of the Thinking Machines cookbook, prime-rl and slime. The tensor math is in two pure functions;
:class:`SampledTokenLossFn` is the loss object.
"""

from __future__ import annotations

from typing import Any

import torch

from opd.losses.distillation_losses import LossInputs, TokenLossFn
from opd.models.interfaces import TeacherRequest, TokenLogprobsRequest
from opd.models.lm_head import token_log_probs
from opd.models.step_metrics import MetricValue, metric_share


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
    """``[B, T]`` per-token advantages of the sampled-token objective, float32 or wider, no gradient.

    a_t = teacher_tau · log P(x_t) − student_tau · log Q(x_t) + adv_tau · (the sequence's reward). With ``discount``
    γ > 0, A_t = Σ_{t' ≥ t} γ^{k(t, t')} a_{t'} within the sequence, k counting the ``mask``-ed-in tokens between:
    tool observations between turns are not steps. With τ = 1 and γ = 0, E[−A_t · ∇log Q(x_t)] is the gradient of
    the reverse KL(Q‖P).

    Args:
        mask: ``[B, T]`` 1 on the student's response tokens; advantages are 0 elsewhere.
        task_reward: ``[B]`` per sequence, or ``[B, T]`` per token (packed rows).
        segment_ids: ``[B, T]`` each position's sequence in packed rows (the sum stops at a change); None: one per row.

    Raises ``ValueError`` for ``discount`` outside [0, 1].
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
        # A position outside the mask (an observation, padding) is no step: the sum passes through undiscounted.
        running = torch.where(weights[:, t] != 0, per_token[:, t] + discount * running, running)
        advantages[:, t] = running
    return advantages * weights


def sampled_token_pg_loss(
    student_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio: float | None = 0.2,
) -> torch.Tensor:
    """``[B, T]`` clipped policy-gradient losses −min(r·A, clip(r, 1 − ε, 1 + ε)·A), ε = ``clip_ratio`` (None: −r·A).

    r = exp(log Q − log Q_sampler) corrects for an older (or other engine's) sampler. Gradients flow only through
    ``student_logprobs``; no masking or reduction (advantages are 0 off the response).
    """
    ratio = torch.exp(student_logprobs - sampler_logprobs.detach().to(student_logprobs.dtype))
    unclipped = ratio * advantages
    if clip_ratio is None:
        return -unclipped
    clipped = ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio) * advantages
    return -torch.minimum(unclipped, clipped)


class SampledTokenLossFn(TokenLossFn):
    """Reverse KL on the sampled tokens only, as a clipped policy gradient; needs on-policy samples.

    The teacher sends one log-prob per position; the advantages (:func:`sampled_token_advantages`, with Q_sampler)
    feed :func:`sampled_token_pg_loss` against ``data["generation_logprobs"]``, so no off-policy weights apply.

    Metrics: ``loss``, ``kl_reverse_estimate`` (mean log Q_sampler − log P), ``advantage`` (mean), ``num_valid_tokens``.
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

        Raises ``ValueError`` if ``data`` has no ``generation_logprobs``.
        """
        if "generation_logprobs" not in data:
            raise ValueError("the sampled-token loss needs on-policy samples with the sampler's log-probs")
        sampler_logprobs = data["generation_logprobs"][:, 1:]
        teacher_logprobs = teacher_output[:, 1:].to(sampler_logprobs.device)
        # Packed rows: the advantages of one sequence never collect the next one's.
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

        def metrics(tokens: float, normaliser: float) -> dict[str, MetricValue]:
            return {
                "kl_reverse_estimate": metric_share((sampler_logprobs - teacher_logprobs)[loss_mask].sum(), tokens),
                "advantage": metric_share(advantages[loss_mask].sum(), tokens),
            }

        row_inputs = (data["input_ids"][:, 1:][loss_mask], sampler_logprobs[loss_mask], advantages[loss_mask])
        return LossInputs(row_inputs, metrics=metrics)
