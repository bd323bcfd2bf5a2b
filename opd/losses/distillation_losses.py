"""The losses that compare the teacher's and the student's next-token distributions.

:class:`DistillationLossFn` is their base: the temperature and the teacher metrics, on
top of :class:`~opd.losses.token_loss.TokenLossFn`'s rows, normalisation, fused path and
weights. :class:`FullVocabLossFn` takes the teacher's whole distribution; a divergence
over it is one subclass overriding one method, :meth:`FullVocabLossFn.token_divergence`
(as :class:`KLLossFn` and :class:`JSDLossFn` do). :class:`TopKKLLossFn` takes only the
teacher's top k.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from opd.kernels.compiled_kernels import compiled
from opd.kernels.topk_rest import rest_logprobs_from_topk
from opd.losses.divergences import (
    check_kl_type,
    check_temperature,
    check_weight,
    forward_weight,
    full_vocab_divergence_with_grad,
    jsd_from_log_probs,
    kl_from_log_probs,
    log_probs_at_temperature,
    topk_token_kl,
)
from opd.losses.off_policy import OffPolicyCorrection
from opd.losses.teacher_metrics import TeacherMetrics
from opd.losses.token_loss import LossInputs, TokenLossFn, loss_rows
from opd.models.interfaces import FullVocabRequest, TeacherRequest, TopKLogprobs, TopKRequest

ChunkHooks = tuple[Callable[..., None] | None, Callable[..., tuple[torch.Tensor, torch.Tensor]] | None]
"""``(observer, value_and_grad)`` of :class:`~opd.losses.token_loss.LossInputs`."""


class DistillationLossFn(TokenLossFn):
    """Divergence between the teacher's and the student's next-token distributions.

    The loss is ``Σ_{valid positions} w_t · D_t / N`` (see :class:`TokenLossFn` for N and
    w). The variants choose D_t and the teacher signal:

    ==========================  ==============================================  ===========================
    variant                     D_t                                             teacher signal
    ==========================  ==============================================  ===========================
    :class:`KLLossFn`           forward / reverse / mixed KL (:func:`token_kl`)  logits or hidden states
    :class:`JSDLossFn`          generalized JSD(β) (:func:`generalized_jsd`)     logits or hidden states
    :class:`TopKKLLossFn`       KL over the top k + rest (:func:`topk_token_kl`)  top-k log-probs and ids
    ==========================  ==============================================  ===========================

    The metrics (``kl_forward``, ``kl_reverse``, ``teacher_topk_mass``,
    ``student_mass_on_teacher_topk``, ``topk_overlap``) are token means taken at the loss
    temperature for every teacher signal (see :class:`TeacherMetrics` for why).

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
        check_temperature(temperature)
        if metrics_topk < 1:
            raise ValueError(f"metrics_topk must be >= 1, got {metrics_topk}")
        super().__init__(kl_reduction, vocab_size, fused_lm_head, chunk_size, off_policy, token_clip)
        self.temperature = temperature
        self.metrics_topk = metrics_topk

    @abstractmethod
    def _teacher_rows(self, teacher_output: Any, loss_mask: torch.Tensor) -> tuple[Any, ...]:
        """The loss positions of the teacher's answer: the row inputs of :meth:`_divergence`."""

    @abstractmethod
    def _chunk_hooks(self, metrics: TeacherMetrics, fused: bool) -> ChunkHooks:
        """``(observer, value_and_grad)`` of :class:`LossInputs`, the observer feeding ``metrics``."""

    def _loss_inputs(
        self, teacher_output: Any, data: dict[str, Any], loss_mask: torch.Tensor, fused: bool
    ) -> LossInputs:
        collector = TeacherMetrics(self.metrics_topk, self.temperature, self.vocab_size, self.compile_kernels)
        observer, value_and_grad = self._chunk_hooks(collector, fused)
        return LossInputs(
            self._teacher_rows(teacher_output, loss_mask),
            observer,
            value_and_grad,
            lambda tokens, normaliser: collector.metrics(tokens),
        )


class FullVocabLossFn(DistillationLossFn):
    """A divergence over the whole vocabulary: the teacher sends logits (or hidden states and head).

    A new divergence is a subclass that overrides one method, :meth:`token_divergence`:
    the per-position value from both models' log-probabilities at the loss temperature.
    The base class makes those log-probabilities (in float32 at least), and everything
    else: row selection, normalisation, the fused path (autograd chunk by chunk), weights,
    the cap and the metrics. With ``fused_lm_head`` an in-process teacher sends hidden
    states too, and its logits are made chunk by chunk as well.

    Where :func:`~opd.losses.divergences.full_vocab_divergence_with_grad` computes the same
    divergence, a subclass may also override :meth:`_closed_form_arguments`, so the fused
    path takes the closed-form gradient (fewer ``[chunk × vocab]`` temporaries) and the
    metrics reuse its log-probabilities.

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

    @abstractmethod
    def token_divergence(self, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
        """The divergence at each position: ``(log Q [C, V], log P [C, V]) -> [C]``, both at the loss temperature."""

    @property
    def teacher_request(self) -> TeacherRequest:
        """Full-vocabulary logits (hidden states and head for the fused loss)."""
        return FullVocabRequest(prefer_hidden_states=self.fused_lm_head)

    def _divergence(self, student_logits: torch.Tensor, *row_inputs: Any) -> torch.Tensor:
        return self.token_divergence(*log_probs_at_temperature(student_logits, row_inputs[0], self.temperature))

    def _closed_form_arguments(self) -> tuple[str, float, float | None] | None:
        """``(kl_type, mixed_kl_weight, jsd_beta)`` of :func:`full_vocab_divergence_with_grad` when it
        computes this variant's divergence in closed form; None (the default): autograd
        through :meth:`token_divergence` on the fused path."""
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
        return (loss_rows(self._cut_vocabulary(teacher_output), loss_mask),)

    def _chunk_hooks(self, metrics: TeacherMetrics, fused: bool) -> ChunkHooks:
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
        check_kl_type(kl_type)
        check_weight("mixed_kl_weight", mixed_kl_weight)
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
        self.forward_weight = forward_weight(kl_type, mixed_kl_weight)

    def token_divergence(self, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
        return kl_from_log_probs(student_log_probs, teacher_log_probs, self.forward_weight)

    def _closed_form_arguments(self) -> tuple[str, float, float | None] | None:
        return self.kl_type, self.mixed_kl_weight, None


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
        check_weight("jsd_beta", beta)
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

    def token_divergence(self, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
        return jsd_from_log_probs(student_log_probs, teacher_log_probs, self.beta)

    def _closed_form_arguments(self) -> tuple[str, float, float | None] | None:
        # The kernel's KL arguments are unused with a β (it maps β = 0 / 1 to the KLs itself).
        return "forward", 0.5, self.beta


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
    logprob_rows = loss_rows(logprobs, mask)
    if rest is None:
        rest_rows = rest_logprobs_from_topk(logprob_rows).to(torch.promote_types(logprob_rows.dtype, torch.float32))
    else:
        rest_rows = loss_rows(rest, mask)
    return logprob_rows, loss_rows(ids, mask), rest_rows


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
        check_kl_type(kl_type)
        check_weight("mixed_kl_weight", mixed_kl_weight)
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
        """``([N, k] log-probs, [N, k] ids, [N] rest)`` from a :class:`TopKLogprobs` carrying the
        teacher's rest mass, a plain pair (the rest is then computed from the top-k), or a
        triple with ``[B, L]`` rest log-probs third."""
        return _topk_rows(teacher_output, loss_mask)

    def _chunk_hooks(self, metrics: TeacherMetrics, fused: bool) -> ChunkHooks:
        if self.student_classes is None:
            return metrics.topk, None
        return functools.partial(metrics.topk, student_classes=self.student_classes), None
