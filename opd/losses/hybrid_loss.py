"""The hybrid objective of seed 003 with the distillation terms taken over the whole vocabulary.

The sampled-token form (:class:`~opd.losses.objectives.SampledTokenLossFn`) gives
each sampled token x the advantage ``adv_tau · r + teacher_tau · log p(x) − student_tau ·
log q(x)`` (``r`` the sequence's task reward, ``p`` the teacher, ``q`` the student) and
follows the policy gradient ``−A · ∇ log q(x)``. Its expectation over x ~ q is the
gradient of

    L = Σ_t [ Σ_v q_t(v) (student_tau · log q_t(v) − teacher_tau · log p_t(v)) − adv_tau · r · log q_t(x_t) ]

whose first part is exact, needing no sampling at all: with both τ = 1 it is the reverse
KL(q‖p) at each position. :class:`FullVocabHybridLossFn` computes L from the two models'
full logits (so it needs the teacher's logits: an in-process teacher) and keeps the
task-reward term as a policy gradient on the sampled tokens, since the reward exists only
for the sequence that was sampled. Normalised like the other losses
(``distillation.kl_reduction``).

Under an asynchronous schedule (``training.off_policy_correction``) each position of a
stale sample is weighted by the truncated importance weight
``w_t = min(q_learner(x_t) / q_sampler(x_t), cap)`` of :mod:`opd.losses.off_policy`
(the learner's probability of the sampled token now, against the sampler's when it drew
it; zero where a bound masks it). For the task-reward term, a policy gradient on the sampled
token, ``w_t`` is the token-level correction of the sampled action; the exact term is an
expectation over the next token and gets the same per-position weight as the
full-vocabulary losses do (a bounded stand-in for the stale prefix's likelihood ratio).
Fresh samples have ``w_t = 1`` exactly, so a synchronous run is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from opd.losses.objectives import _global_normalizer, _rows, off_policy_row_weights, shift_token_mask
from opd.losses.off_policy import OffPolicyCorrection
from opd.models.interfaces import FullVocabRequest, LossFunction, TeacherRequest
from opd.models.lm_head import LMHeadInput


class FullVocabHybridLossFn(LossFunction):
    """``loss_fn.type: hybrid_full_vocab`` (see the module docstring).

    Args:
        teacher_tau: weight of the teacher's log-probs.
        student_tau: weight of the student's log-probs (an entropy term).
        adv_tau: weight of the task reward (``data["task_reward"]``, on-policy steps).
        kl_reduction: ``mean`` (per response token) or ``sum`` (per sequence).
        vocab_size: the tokenizer's vocabulary (logits past it, padding, are cut).
        off_policy: weigh the positions of stale samples (a micro-batch with
            ``staleness`` and ``generation_logprobs``) by truncated importance weights;
            None leaves every weight at 1.
    """

    fused_lm_head = False  # needs the student's logits for the log-prob of the sampled tokens

    def __init__(
        self,
        teacher_tau: float = 1.0,
        student_tau: float = 1.0,
        adv_tau: float = 0.0,
        kl_reduction: str = "mean",
        vocab_size: int | None = None,
        off_policy: OffPolicyCorrection | None = None,
    ) -> None:
        if kl_reduction not in ("mean", "sum"):
            raise ValueError(f"kl_reduction must be 'mean' or 'sum', got {kl_reduction!r}")
        self.teacher_tau = teacher_tau
        self.student_tau = student_tau
        self.adv_tau = adv_tau
        self.kl_reduction = kl_reduction
        self.vocab_size = vocab_size
        self.off_policy = off_policy

    @property
    def teacher_request(self) -> TeacherRequest:
        """The teacher's full-vocabulary logits (the sampled tokens' log-probs need the student's too)."""
        return FullVocabRequest()

    @property
    def needs_task_reward(self) -> bool:
        """Whether ``adv_tau`` weighs a task reward in."""
        return self.adv_tau != 0.0

    def __call__(
        self,
        student_output: torch.Tensor,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_output: torch.Tensor | LMHeadInput | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the global loss, and metrics.

        The teacher's answer is its logits, or its final hidden states over its output
        layer (a teacher that runs apart sends those: a pool, a served teacher, a batch
        scored ahead), whose logits are made here.

        Metrics (contributions to global token means): ``loss``, ``kl_forward``,
        ``kl_reverse`` (at τ = 1), ``task_reward_term`` (the reward part of the loss),
        ``num_valid_tokens``, and with the off-policy correction the ``is_*`` metrics of
        :func:`~opd.losses.objectives.off_policy_row_weights`.
        """
        if teacher_output is None:
            raise ValueError("FullVocabHybridLossFn needs the teacher's logits")
        if isinstance(teacher_output, LMHeadInput):
            teacher_output = teacher_output.logits()
        loss_mask = shift_token_mask(data["token_mask"]).bool()
        vocab = self.vocab_size or student_output.shape[-1]
        compute_dtype = torch.promote_types(student_output.dtype, torch.float32)
        log_q = torch.log_softmax(_rows(student_output[..., :vocab], loss_mask).to(compute_dtype), dim=-1)
        log_p = torch.log_softmax(_rows(teacher_output[..., :vocab], loss_mask).to(compute_dtype), dim=-1)
        q = log_q.exp()
        exact = (q * (self.student_tau * log_q - self.teacher_tau * log_p)).sum(-1)  # [N] per position
        correction_metrics: dict[str, float] = {}
        if self.off_policy is not None and "staleness" in data and "generation_logprobs" in data:
            row_weights, correction_metrics = off_policy_row_weights(
                _rows(student_output, loss_mask), data, loss_mask, self.off_policy, global_valid_tokens
            )
        else:
            row_weights = None
        # None: no correction, or one that only monitors (every weight 1).
        weights = (
            torch.ones_like(exact) if row_weights is None else row_weights.to(device=log_q.device, dtype=compute_dtype)
        )
        loss_sum = (weights * exact).sum()
        reward_term = torch.zeros((), dtype=compute_dtype, device=log_q.device)
        if self.adv_tau != 0.0 and "task_reward" in data:
            targets = _rows(data["input_ids"], loss_mask, shift=1)
            reward = data["task_reward"]
            # [B] per sequence, or [B, T] per token in packed rows: one value per loss position.
            per_position = reward.unsqueeze(-1).expand_as(data["input_ids"]) if reward.dim() == 1 else reward
            rewards = _rows(per_position, loss_mask, shift=1).to(compute_dtype)
            sampled = log_q.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            reward_term = -self.adv_tau * (weights * rewards * sampled).sum()
        normalizer = _global_normalizer(self.kl_reduction, global_valid_tokens, global_valid_seqs)
        loss = (loss_sum + reward_term) / normalizer
        with torch.no_grad():
            tokens = float(max(global_valid_tokens, 1))
            p = log_p.exp()
            metrics = {
                "loss": float(loss.detach()),
                "kl_forward": float((p * (log_p - log_q)).sum()) / tokens,
                "kl_reverse": float((q * (log_q - log_p)).sum()) / tokens,
                "task_reward_term": float(reward_term) / normalizer,
                **correction_metrics,
                "num_valid_tokens": float(loss_mask.sum()),
            }
        return loss, metrics
