"""The per-token losses: :class:`TokenLossFn`, their shared base, and the losses comparing both models' distributions.

The hybrid and NLL losses build on :class:`TokenLossFn` too. :class:`DistillationLossFn` adds the temperature and
the teacher metrics; its variants (:class:`KLLossFn`, :class:`JSDLossFn`, :class:`TopKKLLossFn`) say only what
the teacher sends and what the per-position term is.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from opd.data.sequences import shift_token_mask
from opd.kernels.compiled_kernels import compiled
from opd.kernels.fused_lm_head import ChunkObserver, DivergenceFn, ValueAndGradFn, chunked_lm_head_loss
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
from opd.losses.off_policy import OffPolicyCorrection, importance_weights, learner_log_probs
from opd.losses.teacher_metrics import TeacherMetrics
from opd.models.interfaces import FullVocabRequest, LossFunction, TeacherRequest, TopKLogprobs, TopKRequest
from opd.models.lm_head import LMHeadInput
from opd.models.step_metrics import MetricValue, metric_share

_NORMALISER_COUNTS: dict[str, Callable[[int, int], int]] = {
    "mean": lambda tokens, sequences: tokens,
    "sum": lambda tokens, sequences: sequences,
}
"""The count each ``kl_reduction`` divides the global batch's loss by: its valid tokens or its sequences."""


def _global_normalizer(reduction: str, global_valid_tokens: int, global_valid_seqs: int) -> float:
    """The denominator of the global-batch loss (at least 1, so an all-masked batch gives 0)."""
    return float(max(_NORMALISER_COUNTS[reduction](global_valid_tokens, global_valid_seqs), 1))


def loss_rows(value: Any, mask: torch.Tensor, shift: int = 0) -> Any:
    """The loss positions of a per-position input laid out ``[B, L, ...]``.

    ``shift`` is 0 for inputs indexed by logit position (``t`` predicts token ``t + 1``: logits, top-k), 1 for
    inputs indexed by token position (a token's own log-prob).
    """
    if isinstance(value, LMHeadInput):
        return value.with_rows(value.hidden_states[:, :-1][mask])
    if shift == 0:
        return value[:, :-1][mask]
    return value[:, 1:][mask]


def _apply_loss(
    student_rows: torch.Tensor | LMHeadInput,
    divergence: DivergenceFn,
    inputs: LossInputs,
    normalizer: float,
    chunk_rows: int | None,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_positions w · divergence / normalizer, fused with the LM head when given hidden states.

    ``row_weights``: ``[N]`` detached off-policy importance weights (:mod:`opd.losses.off_policy`); None = all 1.
    """
    row_inputs, observer = inputs.row_inputs, inputs.observer
    if isinstance(student_rows, LMHeadInput):
        device = student_rows.hidden_states.device
        if row_weights is None:
            rows = student_rows.hidden_states.shape[:1]
            weights = torch.full(rows, 1.0 / normalizer, dtype=torch.float64, device=device)
        else:
            weights = row_weights.to(device=device, dtype=torch.float64) / normalizer
        value_and_grad = inputs.value_and_grad
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
) -> tuple[torch.Tensor | None, dict[str, MetricValue]]:
    """The importance weight of each loss position of a micro-batch, and its metrics (not yet read).

    ``data["staleness"]`` is ``[B]``, or ``[1, T]`` in a packed row; fresh samples' rows keep weight 1. The metrics
    are this micro-batch's share of the global means over response tokens, and its ``is_ratio_max``. With
    ``enabled: monitor`` the weights are None (all 1) and the fractions count what the correction would cut or mask.
    The learner's log-probs are computed for every row, fresh ones too: choosing the stale rows first would read
    the device (a host sync per micro-batch), and fresh rows' values are masked out by ``importance_weights``.
    """
    staleness = data["staleness"]
    per_token = staleness if staleness.dim() == 2 else staleness.unsqueeze(-1).expand_as(data["input_ids"])
    stale = loss_rows(per_token, loss_mask, shift=1) > 0
    sampler = loss_rows(data["generation_logprobs"], loss_mask, shift=1)
    targets = loss_rows(data["input_ids"], loss_mask, shift=1)
    learner = learner_log_probs(student_rows, targets, correction.strategy).to(sampler.dtype)
    # Sequence of each position: its row, and its segment in a packed row (a segment id is below the row length).
    input_ids = data["input_ids"]
    rows, width = input_ids.shape
    row_index = torch.arange(rows, device=input_ids.device).unsqueeze(-1).expand_as(input_ids)
    sequence_ids = loss_rows(row_index, loss_mask, shift=1)
    sequence_id_bound = rows
    if "segment_ids" in data:
        sequence_ids = sequence_ids * (width + 1) + loss_rows(data["segment_ids"], loss_mask, shift=1)
        sequence_id_bound = rows * (width + 1)
    weights, sums = importance_weights(learner, sampler, stale, sequence_ids, correction, sequence_id_bound)
    tokens = float(max(global_valid_tokens, 1))
    metrics: dict[str, MetricValue] = {
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
        row_inputs: ``_divergence``'s inputs after the student's logits, one row per loss position (dim 0), or an
            :class:`LMHeadInput` whose logits are made chunk by chunk.
        observer: called on each chunk's detached student logits and inputs (metrics).
        value_and_grad: closed-form value and gradient of ``_divergence`` for the fused path (None: autograd).
        metrics: ``(global tokens, normaliser) ->`` this micro-batch's share of the variant's own metrics (0-dim
            tensors, not yet read: :mod:`opd.models.step_metrics`).
    """

    row_inputs: tuple[Any, ...]
    observer: ChunkObserver | None = None
    value_and_grad: ValueAndGradFn | None = None
    metrics: Callable[[float, float], dict[str, MetricValue]] = dataclasses.field(default=lambda tokens, normaliser: {})


class TokenLossFn(LossFunction):
    """Base of the losses that sum a per-position term over the loss positions; it owns what they all share.

    Only positions whose next token carries loss (the shifted ``token_mask``) are selected, for student and
    teacher, so prompt and padding rows never see a softmax. The sum is divided by the *global* batch's valid
    tokens (``kl_reduction="mean"``) or sequences (``"sum"``), so gradient accumulation gives one batch's gradient.
    A variant implements :meth:`_loss_inputs` and :meth:`_divergence` and sets ``teacher_request`` (None, the
    default: never asked for ``teacher_output``). A per-position correction joins ``_divergence`` as extra row
    inputs; one that reweighs positions overrides :meth:`_row_weights`.

    Args:
        kl_reduction: ``"mean"`` (per token) or ``"sum"`` (per sequence).
        vocab_size: if set, logits are cut to their first ``vocab_size`` entries (padded output layers).
        fused_lm_head: take hidden states; the loss runs chunk by chunk (:mod:`opd.kernels.fused_lm_head`).
        chunk_size: positions per fused chunk, >= 1 (None: ~128 MiB of fp32 logits per chunk).
        off_policy: weigh stale samples' positions (a micro-batch with ``staleness`` and ``generation_logprobs``)
            by truncated importance weights (:func:`off_policy_row_weights`); None: every weight 1.
        token_clip: cap on each position's term, finite and > 0 (:class:`_TokenClip`); None: no cap.

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
        if kl_reduction not in _NORMALISER_COUNTS:
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

        ``loss_mask``: ``[B, L − 1]``, True where logit position ``t`` carries loss; ``fused``: the chunked path runs.
        """

    @abstractmethod
    def _divergence(self, student_logits: torch.Tensor, *row_inputs: Any) -> torch.Tensor:
        """The per-position term: ``(student logits [C, V], *row inputs [C, ...]) -> [C]``."""

    def _row_weights(
        self, student_output: Any, data: dict[str, Any], loss_mask: torch.Tensor, global_valid_tokens: int
    ) -> tuple[torch.Tensor | None, dict[str, MetricValue]]:
        """``([N] weights or None for all 1, metrics)``: the off-policy weights when asked for and the data has them."""
        if self.off_policy is None or "staleness" not in data or "generation_logprobs" not in data:
            return None, {}
        return off_policy_row_weights(
            loss_rows(student_output, loss_mask), data, loss_mask, self.off_policy, global_valid_tokens
        )

    def _cut_vocabulary(self, value: Any) -> Any:
        if self.vocab_size is None:
            return value
        if isinstance(value, LMHeadInput):
            return dataclasses.replace(value, vocab_size=self.vocab_size)
        return value[..., : self.vocab_size]

    def loss_and_metrics(
        self,
        student_output: torch.Tensor | LMHeadInput,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_output: Any = None,
    ) -> tuple[torch.Tensor, dict[str, MetricValue]]:
        """This micro-batch's share of the global loss, and its metrics (0-dim tensors, not yet read).

        ``student_output`` is ``[B, L, V_s]`` logits or (fused) an :class:`LMHeadInput` with ``[B, L, D]`` hidden
        states; ``data`` holds ``token_mask [B, L]``; the global counts are the whole batch's loss tokens and
        sequences. The metrics are this micro-batch's shares of the global ``loss``, the variant's metrics (of the
        uncapped terms), the weights' metrics, ``num_valid_tokens`` and, with ``token_clip``,
        ``clipped_token_fraction`` (capped positions / the global batch's loss tokens).

        Raises:
            ValueError: without ``teacher_output``, for a loss that asks the teacher for one.
        """
        if teacher_output is None and self.teacher_request is not None:
            raise ValueError(f"{type(self).__name__} needs {self.teacher_answer}")
        loss_mask = shift_token_mask(data["token_mask"]).bool()
        student_rows = loss_rows(self._cut_vocabulary(student_output), loss_mask)
        fused = isinstance(student_rows, LMHeadInput)
        inputs = self._loss_inputs(teacher_output, data, loss_mask, fused)
        row_weights, weight_metrics = self._row_weights(student_output, data, loss_mask, global_valid_tokens)
        divergence = self._divergence
        clip = _TokenClip(self.token_clip) if self.token_clip is not None else None
        if clip is not None:
            divergence = clip.divergence(divergence)
            if inputs.value_and_grad is not None:
                inputs = dataclasses.replace(inputs, value_and_grad=clip.value_and_grad(inputs.value_and_grad))
        normaliser = _global_normalizer(self.kl_reduction, global_valid_tokens, global_valid_seqs)
        loss = _apply_loss(student_rows, divergence, inputs, normaliser, self.chunk_size, row_weights)
        metrics = {
            "loss": loss.detach(),
            **inputs.metrics(float(max(global_valid_tokens, 1)), normaliser),
            **weight_metrics,
            "num_valid_tokens": loss_mask.sum(),
        }
        if clip is not None:
            metrics["clipped_token_fraction"] = clip.fraction(global_valid_tokens)
        return loss, metrics


class _TokenClip:
    """``token_clip``: caps each position's term at ``cap`` (> 0) and counts the positions it capped.

    A capped position contributes ``cap`` and no gradient, as ``clamp(max=cap)`` does, on the plain and the fused
    path. The count stays a device tensor, summed over a micro-batch's chunks (:meth:`fraction`, not read).
    """

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self.clipped: torch.Tensor | None = None

    def _count(self, over: torch.Tensor) -> None:
        count = over.sum()
        self.clipped = count if self.clipped is None else self.clipped + count

    def divergence(self, divergence: DivergenceFn) -> DivergenceFn:
        """``divergence`` capped (autograd gives zero gradient above the cap)."""

        def capped(student_logits: torch.Tensor, *row_inputs: Any) -> torch.Tensor:
            per_position = divergence(student_logits, *row_inputs)
            self._count(per_position.detach() > self.cap)
            return per_position.clamp(max=self.cap)

        return capped

    def value_and_grad(self, value_and_grad: ValueAndGradFn) -> ValueAndGradFn:
        """A closed form ``(values [C], gradient [C, V])`` capped: values clamped, capped rows' gradients zero."""

        def capped(student_logits: torch.Tensor, *row_inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            losses, grad = value_and_grad(student_logits, *row_inputs)
            over = losses.detach() > self.cap
            self._count(over)
            # In place: the gradient is this chunk's own temporary, and a copy would be [C, V] more.
            return losses.clamp(max=self.cap), grad.masked_fill_(over.unsqueeze(-1), 0.0)

        return capped

    def fraction(self, global_valid_tokens: int) -> MetricValue:
        """The capped positions as a share of the global batch's loss tokens (a tensor once a chunk has run)."""
        if self.clipped is None:
            return 0.0
        return metric_share(self.clipped, max(global_valid_tokens, 1))


ChunkHooks = tuple[ChunkObserver | None, ValueAndGradFn | None]
"""``(observer, value_and_grad)`` of :class:`LossInputs`."""


class DistillationLossFn(TokenLossFn):
    """Divergence between the teacher's and the student's next-token distributions: ``Σ_positions w_t · D_t / N``.

    N and w are :class:`TokenLossFn`'s; each variant chooses D_t and the teacher signal. The metrics (``kl_forward``,
    ``kl_reverse``, ``teacher_topk_mass``, ``student_mass_on_teacher_topk``, ``topk_overlap``) are token means at
    the loss temperature for every signal (:class:`TeacherMetrics` says why).

    The metrics cost vocabulary-wide work in every chunk (two top-k, both log-normalisers), so they can be taken
    on every ``diagnostics_every``-th step only (:meth:`for_step`); the loss and its gradient never change.

    Args:
        temperature: applied to both models' logits (not the sampling temperature); finite and > 0.
        metrics_topk: k of the top-k metrics (>= 1), by keyword.
        diagnostics_every: the metrics on steps that are multiples of it (>= 0; 0: never), by keyword.
        kl_reduction, vocab_size, options: as in :class:`TokenLossFn` (the rest by keyword).
    """

    compile_kernels = False
    """Whether the per-chunk kernels (closed-form divergence, metrics) run compiled."""

    def __init__(
        self,
        temperature: float = 1.0,
        kl_reduction: str = "mean",
        vocab_size: int | None = None,
        *,
        metrics_topk: int = 64,
        diagnostics_every: int = 1,
        **options: Any,
    ) -> None:
        check_temperature(temperature)
        if metrics_topk < 1:
            raise ValueError(f"metrics_topk must be >= 1, got {metrics_topk}")
        if diagnostics_every < 0:
            raise ValueError(f"diagnostics_every must be >= 0 (0: never), got {diagnostics_every}")
        super().__init__(kl_reduction, vocab_size, **options)
        self.temperature = temperature
        self.metrics_topk = metrics_topk
        self.diagnostics_every = diagnostics_every
        self.diagnoses = diagnostics_every == 1
        """Whether this object takes the metrics (set per step by :meth:`for_step`)."""

    def for_step(self, step: int) -> LossFunction:
        """This loss for optimizer step ``step``: a copy with the metrics on or off, or itself where they agree."""
        diagnoses = self.diagnostics_every > 0 and step % self.diagnostics_every == 0
        if diagnoses == self.diagnoses:
            return self
        stepped = copy.copy(self)
        stepped.diagnoses = diagnoses
        return stepped

    @abstractmethod
    def _teacher_rows(self, teacher_output: Any, loss_mask: torch.Tensor) -> tuple[Any, ...]:
        """The loss positions of the teacher's answer: the row inputs of :meth:`_divergence`."""

    @abstractmethod
    def _chunk_hooks(self, metrics: TeacherMetrics | None, fused: bool) -> ChunkHooks:
        """``(observer, value_and_grad)`` of :class:`LossInputs`, the observer feeding ``metrics`` (None: no metrics,
        no observer)."""

    def _loss_inputs(
        self, teacher_output: Any, data: dict[str, Any], loss_mask: torch.Tensor, fused: bool
    ) -> LossInputs:
        if not self.diagnoses:
            return LossInputs(self._teacher_rows(teacher_output, loss_mask), *self._chunk_hooks(None, fused))
        collector = TeacherMetrics(self.metrics_topk, self.temperature, self.compile_kernels)
        observer, value_and_grad = self._chunk_hooks(collector, fused)
        return LossInputs(
            self._teacher_rows(teacher_output, loss_mask),
            observer,
            value_and_grad,
            lambda tokens, normaliser: collector.metrics(tokens),
        )


class FullVocabLossFn(DistillationLossFn):
    """A divergence over the whole vocabulary: the teacher sends logits (or, fused, hidden states and head).

    A new divergence overrides :meth:`token_divergence` only (both log-probabilities in float32 at least; the fused
    path runs autograd chunk by chunk). Where :func:`~opd.losses.divergences.full_vocab_divergence_with_grad`
    computes the same divergence, :meth:`_closed_form_arguments` gives the fused path its closed-form gradient
    (fewer ``[chunk × vocab]`` temporaries) and the metrics its log-probabilities.

    Args:
        compile_kernels: ``torch.compile`` the per-chunk kernels (:mod:`opd.kernels.compiled_kernels`), by keyword.
        the rest: as in :class:`DistillationLossFn`.
    """

    teacher_answer = "the teacher's logits"

    def __init__(self, *args: Any, compile_kernels: bool = False, **options: Any) -> None:
        super().__init__(*args, **options)
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
        """``(kl_type, mixed_kl_weight, jsd_beta)`` of :func:`full_vocab_divergence_with_grad` for this divergence,
        or None (the default): autograd through :meth:`token_divergence` on the fused path."""
        return None

    def _divergence_with_grad(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        observe_log_probs: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Closed-form value and gradient of :meth:`_divergence` (fused path); NotImplementedError without one."""
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

    def _chunk_hooks(self, metrics: TeacherMetrics | None, fused: bool) -> ChunkHooks:
        if self._closed_form_arguments() is None:
            return (metrics.full_vocab if metrics is not None else None), None
        if metrics is None:
            return None, self._divergence_with_grad
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

    def __init__(self, kl_type: str = "reverse", mixed_kl_weight: float = 0.5, *args: Any, **options: Any) -> None:
        check_kl_type(kl_type)
        check_weight("mixed_kl_weight", mixed_kl_weight)
        super().__init__(*args, **options)
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

    def __init__(self, beta: float = 0.5, *args: Any, **options: Any) -> None:
        check_weight("jsd_beta", beta)
        super().__init__(*args, **options)
        self.beta = beta

    def token_divergence(self, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
        return jsd_from_log_probs(student_log_probs, teacher_log_probs, self.beta)

    def _closed_form_arguments(self) -> tuple[str, float, float | None] | None:
        # The kernel's KL arguments are unused with a β (it maps β = 0 / 1 to the KLs itself).
        return "forward", 0.5, self.beta


class TopKKLLossFn(DistillationLossFn):
    """``loss_fn.type: topk``: KL against a teacher that sends its top-k log-probs (:func:`topk_token_kl`).

    ``student_classes``: None (the teacher's ids are student tokens), or the classes of student tokens a teacher
    with another tokenizer names (:attr:`~opd.models.interfaces.TeacherInterface.student_classes`).

    Args:
        kl_type, mixed_kl_weight: as in :class:`KLLossFn`.
        k: the teacher's tokens per position (also the k of the top-k metrics), >= 1.
        tail: keep the rest class (True) or renormalise over the top k (False, NeMo-RL's variant).
        the rest: as in :class:`DistillationLossFn`, but for ``metrics_topk`` (which is ``k``).
    """

    teacher_answer = "the teacher's top-k log-probs"
    student_classes: torch.Tensor | None = None

    def __init__(
        self,
        kl_type: str = "reverse",
        mixed_kl_weight: float = 0.5,
        k: int = 64,
        tail: bool = True,
        *args: Any,
        **options: Any,
    ) -> None:
        check_kl_type(kl_type)
        check_weight("mixed_kl_weight", mixed_kl_weight)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        super().__init__(*args, metrics_topk=k, **options)
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
        """The loss positions of a top-k answer: ``(log-probs [N, k], ids [N, k], rest log-probs [N])``.

        The rest is the teacher's own where it sent one (:class:`TopKLogprobs` with ``rest_logprobs``, or a triple
        with ``[B, L]`` rest third), else computed from the top-k in float64, without cancellation.
        """
        if len(teacher_output) == 3:
            logprobs, ids, rest = teacher_output
        else:
            logprobs, ids = teacher_output
            rest = teacher_output.rest_logprobs if isinstance(teacher_output, TopKLogprobs) else None
        logprob_rows = loss_rows(logprobs, loss_mask)
        if rest is None:
            rest_rows = rest_logprobs_from_topk(logprob_rows).to(torch.promote_types(logprob_rows.dtype, torch.float32))
        else:
            rest_rows = loss_rows(rest, loss_mask)
        return logprob_rows, loss_rows(ids, loss_mask), rest_rows

    def _chunk_hooks(self, metrics: TeacherMetrics | None, fused: bool) -> ChunkHooks:
        if metrics is None:
            return None, None
        return functools.partial(metrics.topk, student_classes=self.student_classes), None
