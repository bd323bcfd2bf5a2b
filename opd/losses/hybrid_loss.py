"""The task-reward hybrid with the distillation terms taken over the whole vocabulary.

The sampled-token loss (:class:`~opd.losses.sampled_token.SampledTokenLossFn`) follows ``−A · ∇ log q(x)`` with
``A = adv_tau · r + teacher_tau · log p(x) − student_tau · log q(x)``; its expectation over x ~ q is the gradient of

    L = Σ_t [ Σ_v q_t(v) (student_tau · log q_t(v) − teacher_tau · log p_t(v)) − adv_tau · r · log q_t(x_t) ]

whose first part (the reverse KL(q‖p) at τ = 1) is computed exactly here from both models' logits. The reward
term stays a policy gradient on the sampled tokens: the reward exists only for the sampled sequence. Stale samples
get the per-position weights of :mod:`opd.losses.off_policy`.
"""

from __future__ import annotations

from typing import Any

import torch

from opd.losses.distillation_losses import LossInputs, TokenLossFn, loss_rows
from opd.losses.divergences import log_probs_at_temperature, plogp_difference
from opd.losses.off_policy import OffPolicyCorrection
from opd.models.interfaces import FullVocabRequest, TeacherRequest
from opd.models.step_metrics import MetricValue, metric_share


class FullVocabHybridLossFn(TokenLossFn):
    """``loss_fn.type: hybrid_full_vocab``: the teacher's answer is its logits, or hidden states over its head.

    Metrics: ``loss``, ``kl_forward``, ``kl_reverse`` (at τ = 1), ``task_reward_term`` (before off-policy weights),
    ``num_valid_tokens``, and the ``is_*`` metrics of
    :func:`~opd.losses.distillation_losses.off_policy_row_weights` with ``off_policy`` (None: every weight 1).
    ``adv_tau`` weighs ``data["task_reward"]`` (on-policy steps only).
    """

    teacher_answer = "the teacher's logits"

    def __init__(
        self,
        teacher_tau: float = 1.0,
        student_tau: float = 1.0,
        adv_tau: float = 0.0,
        kl_reduction: str = "mean",
        vocab_size: int | None = None,
        off_policy: OffPolicyCorrection | None = None,
    ) -> None:
        # Never the fused head: the sampled tokens' log-probs are read off the student's logits.
        super().__init__(kl_reduction, vocab_size, fused_lm_head=False, off_policy=off_policy)
        self.teacher_tau = teacher_tau
        self.student_tau = student_tau
        self.adv_tau = adv_tau

    @property
    def teacher_request(self) -> TeacherRequest:
        """The teacher's full-vocabulary logits (the sampled tokens' log-probs need the student's too)."""
        return FullVocabRequest()

    @property
    def needs_task_reward(self) -> bool:
        """Whether ``adv_tau`` weighs a task reward in."""
        return self.adv_tau != 0.0

    def _loss_inputs(
        self, teacher_output: Any, data: dict[str, Any], loss_mask: torch.Tensor, fused: bool
    ) -> LossInputs:
        """The teacher's rows, and with a task reward each position's sampled token and reward."""
        reward_rows: tuple[torch.Tensor, ...] = ()
        if self.adv_tau != 0.0 and "task_reward" in data:
            reward = data["task_reward"]
            # [B] per sequence, or [B, T] per token in packed rows: one value per loss position.
            per_position = reward.unsqueeze(-1).expand_as(data["input_ids"]) if reward.dim() == 1 else reward
            reward_rows = (
                loss_rows(data["input_ids"], loss_mask, shift=1),
                loss_rows(per_position, loss_mask, shift=1),
            )
        sums: dict[str, MetricValue] = {"kl_forward": 0.0, "kl_reverse": 0.0, "task_reward_term": 0.0}

        def observe(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *rewards: torch.Tensor) -> None:
            log_q, log_p = log_probs_at_temperature(student_logits, teacher_logits, 1.0)
            sums["kl_forward"] += plogp_difference(log_p, log_q).sum().double()
            sums["kl_reverse"] += plogp_difference(log_q, log_p).sum().double()
            if rewards:
                sums["task_reward_term"] += self._reward_term(log_q, *rewards).sum().double()

        def metrics(tokens: float, normaliser: float) -> dict[str, MetricValue]:
            return {
                "kl_forward": metric_share(sums["kl_forward"], tokens),
                "kl_reverse": metric_share(sums["kl_reverse"], tokens),
                "task_reward_term": metric_share(sums["task_reward_term"], normaliser),
            }

        teacher_rows = loss_rows(self._cut_vocabulary(teacher_output), loss_mask)
        return LossInputs((teacher_rows, *reward_rows), observer=observe, metrics=metrics)

    def _divergence(self, student_logits: torch.Tensor, *row_inputs: Any) -> torch.Tensor:
        """Σ_v q (student_tau · log q − teacher_tau · log p), minus the reward term where there is one."""
        teacher_logits, *rewards = row_inputs
        log_q, log_p = log_probs_at_temperature(student_logits, teacher_logits, 1.0)
        exact = (log_q.exp() * (self.student_tau * log_q - self.teacher_tau * log_p)).sum(-1)
        if not rewards:
            return exact
        return exact + self._reward_term(log_q, *rewards)

    def _reward_term(self, log_q: torch.Tensor, targets: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        """−adv_tau · r · log q(x) at each position (x the sampled token, r its sequence's reward)."""
        sampled = log_q.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return -self.adv_tau * rewards.to(log_q.dtype) * sampled
