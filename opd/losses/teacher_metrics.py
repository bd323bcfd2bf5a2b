"""The per-step diagnostics of teacher vs student that the teacher-distribution losses report."""

from __future__ import annotations

import torch

from opd.data.token_alignment import pool_logits_by_class
from opd.kernels.compiled_kernels import compiled, kl_metrics_from_logits
from opd.losses.divergences import log_probs_at_temperature, plogp_difference, scaled_log_probs, topk_token_kl
from opd.models.step_metrics import MetricValue, metric_share


class TeacherMetrics:
    """Sums, over the loss positions, the per-step diagnostics of teacher vs student (never under autograd).

    ``kl_forward`` / ``kl_reverse`` (over the k + 1 classes for a top-k teacher: a lower bound), the teacher's mass
    on its top k, the student's mass there, and the top-k overlap |top-k_P ∩ top-k_Q| / k. All at the loss
    temperature T: a top-k teacher's distribution is known only at T, and T is what the loss optimises.
    The sums stay on the device: no host sync per chunk.
    """

    def __init__(self, k: int, temperature: float, compile_kernels: bool = False) -> None:
        self.k = k
        self.temperature = temperature
        self.compile_kernels = compile_kernels
        keys = ("kl_forward", "kl_reverse", "teacher_topk_mass", "student_mass_on_teacher_topk", "topk_overlap")
        self.sums: dict[str, MetricValue] = dict.fromkeys(keys, 0.0)

    @torch.no_grad()
    def full_vocab(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
        """Metrics from both models' full logits (``[C, V]``), at the loss temperature."""
        if not self.compile_kernels:
            self.from_log_probs(*log_probs_at_temperature(student_logits, teacher_logits, self.temperature))
            return
        if self.temperature != 1.0:
            # Scaled in float32 at least: bf16 logits / T would round once more.
            compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
            student_logits = student_logits.to(compute_dtype) / self.temperature
            teacher_logits = teacher_logits.to(compute_dtype) / self.temperature
        # Compiled: KLs in a few fused passes; top-k from logits and log-normalisers (same order as log-probs).
        kl_forward, kl_reverse, log_norm_q, log_norm_p = compiled(kl_metrics_from_logits)(
            student_logits, teacher_logits
        )
        self.sums["kl_forward"] += kl_forward.double()
        self.sums["kl_reverse"] += kl_reverse.double()
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
        self.sums["kl_forward"] += plogp_difference(log_p, log_q).sum().double()
        self.sums["kl_reverse"] += plogp_difference(log_q, log_p).sum().double()
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
        """Metrics from the student's logits and the teacher's top k (``student_classes``: :func:`topk_token_kl`)."""
        temperature = self.temperature
        compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
        if student_classes is not None:  # pooled once, at the temperature, for every metric below
            scaled = student_logits.to(compute_dtype) / temperature
            student_logits, temperature = pool_logits_by_class(scaled, student_classes), 1.0
        for kl_type in ("forward", "reverse"):
            self.sums[f"kl_{kl_type}"] += (
                topk_token_kl(
                    student_logits,
                    teacher_topk_logprobs,
                    teacher_topk_ids,
                    kl_type,
                    temperature=temperature,
                    teacher_rest_logprobs=teacher_rest_logprobs,
                )
                .sum()
                .double()
            )
        log_q = scaled_log_probs(student_logits.to(compute_dtype), temperature, None)
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
        self.sums["teacher_topk_mass"] += teacher_topk_logprobs.exp().sum().double()
        self.sums["student_mass_on_teacher_topk"] += student_logprobs_at_teacher_topk.exp().sum().double()
        shared = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(dim=-1).sum()
        self.sums["topk_overlap"] += shared.double() / k

    def metrics(self, token_normalizer: float) -> dict[str, MetricValue]:
        """The sums as this micro-batch's share of the global token means (0-dim tensors, not yet read)."""
        return {key: metric_share(value, token_normalizer) for key, value in self.sums.items()}
