"""Off-policy correction: truncated importance weights for samples drawn by an older policy.

An asynchronous schedule (:mod:`opd.distillation.step`) trains on samples drawn with weights one or two updates
old; each carries ``generation_logprobs`` and its ``staleness``. A stale sample's response position ``t`` weighs

    ρ_t = π_learner(y_t | y_<t) / π_sampler(y_t | y_<t),     w_t = min(ρ_t, cap)

both under the *sampling* distribution (temperature and top-k / top-p filter; greedy: plain softmax), so ρ_t = 1
when the models agree. ``level: sequence`` gives every position w = min(ρ̄, cap), ρ̄ = exp(mean_t log ρ_t) the
geometric-mean ratio. A token whose ρ_t leaves ``token_bounds``, or a sequence whose ρ̄ leaves ``sequence_bounds``,
gets weight 0 but stays in the loss's normaliser, so it lowers the loss instead of re-weighting the rest.

Weights are detached. Staleness 0 gives weights of exactly 1 and no computation: a synchronous run is unchanged,
bit for bit. For the sampled-token loss ρ_t corrects the sampled action; for the full-vocabulary and top-k losses
it stands in for the prefix's likelihood ratio ∏_{s<t} ρ_s (guide: "Overlapping rollout, teacher and training").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, model_validator

from opd.models.decoding import GenerateStrategyConfig
from opd.models.lm_head import LMHeadInput
from opd.rollout.sampling import warp_logits
from opd.utils.config import StrictConfig, resolve_auto

_LEARNER_CHUNK_ROWS = 1024
"""Rows of ``[rows × V]`` logits made at a time when the learner's log-probs come from hidden states."""


class OffPolicyCorrectionConfig(StrictConfig):
    """``training.off_policy_correction``: truncated importance weights for stale samples."""

    enabled: Literal["auto", "monitor"] | bool = Field(
        "auto",
        description="auto = on under one_step_off and two_step_off for hybrid_full_vocab (its reward term is a "
        "policy gradient on the sampled token), off for full_vocab, jsd and topk (measured: it slowed learning) "
        "and under sync (nothing is stale); monitor = under an asynchronous schedule, compute and log the ratios "
        "(train/is_*) but weigh nothing: the loss is that of the correction off",
    )
    level: Literal["token", "sequence"] = Field(
        "token",
        description="token = each position weighs min(its ratio, cap); sequence = every position of a sequence "
        "weighs min(the sequence's geometric-mean ratio, cap)",
    )
    cap: float = Field(2.0, ge=1.0, description="truncation: each weight is min(ratio, cap)")
    token_bounds: tuple[float, float] | None = Field(
        None, description="[low, high]: a token whose ratio lies outside gets weight 0; null keeps every token"
    )
    sequence_bounds: tuple[float, float] | None = Field(
        None,
        description="[low, high]: every token of a sequence whose geometric-mean ratio lies outside gets "
        "weight 0; null keeps every sequence",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> OffPolicyCorrectionConfig:
        for name in ("token_bounds", "sequence_bounds"):
            bounds = getattr(self, name)
            if bounds is not None and not 0.0 <= bounds[0] < 1.0 < bounds[1]:
                raise ValueError(
                    f"training.off_policy_correction.{name} = {list(bounds)} must be [low, high] with "
                    "0 <= low < 1 < high (a ratio of 1 means the learner and the sampler agree)"
                )
        return self

    def is_on(self, asynchronous: bool, by_default: bool = True) -> bool:
        """Whether the correction applies; ``by_default``: the objective's ``weighs_stale_samples_by_default``."""
        if not self.weighs:  # monitor: the ratios are computed whenever samples are stale
            return asynchronous
        return bool(resolve_auto(self.enabled, lambda: asynchronous and by_default))

    @property
    def weighs(self) -> bool:
        """Whether the ratios weigh the loss (``monitor`` only logs them)."""
        return self.enabled != "monitor"


@dataclass(frozen=True)
class OffPolicyCorrection:
    """What the loss needs to weigh stale samples (built from the config; sent to trainer workers).

    ``strategy`` is the rollout's sampling strategy (the distribution of both log-probs); ``monitor_only``
    (``enabled: monitor``) computes the ratios and metrics but leaves every weight at 1.
    """

    cap: float
    token_bounds: tuple[float, float] | None
    sequence_bounds: tuple[float, float] | None
    strategy: GenerateStrategyConfig
    level: str = "token"
    monitor_only: bool = False

    @classmethod
    def from_config(cls, config: OffPolicyCorrectionConfig, strategy: GenerateStrategyConfig) -> OffPolicyCorrection:
        """The runtime form of ``training.off_policy_correction`` for rollouts drawn with ``strategy``."""
        return cls(config.cap, config.token_bounds, config.sequence_bounds, strategy, config.level, not config.weighs)


def filtered_sampling_warning(correction: OffPolicyCorrection) -> str | None:
    """A warning when the correction weighs samples drawn through a top-k or top-p filter; else None.

    A sampled token may fall outside the learner's filtered set one update later: ratio and weight 0.
    """
    strategy = correction.strategy
    kept = strategy.sampling_filter
    if correction.monitor_only or not kept.leaves_out_tokens:
        return None
    return (
        f"training.off_policy_correction weighs stale samples drawn with decoding_method = "
        f"{strategy.decoding_method} ({kept.describe()}, "
        f"temperature = {strategy.temperature}): a sampled token outside the learner's filtered set one update "
        "later gets ratio 0 and weight 0 (in the guide's study, 6-7% of stale tokens at temperature 0.1; "
        "train/is_outside_support_fraction counts them). enabled: monitor logs the ratios without weighing."
    )


def sampling_log_probs(logits: torch.Tensor, targets: torch.Tensor, strategy: GenerateStrategyConfig) -> torch.Tensor:
    """``[N]`` float32 log-probs of ``targets`` under the distribution ``strategy`` samples from (``-inf`` if filtered).

    The same distribution the samplers report (:func:`opd.rollout.sampling.next_tokens`).
    """
    warped = logits.float() if strategy.is_greedy else warp_logits(logits, strategy)
    return warped.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(warped, dim=-1)


@torch.no_grad()
def learner_log_probs(
    student_rows: torch.Tensor | LMHeadInput, targets: torch.Tensor, strategy: GenerateStrategyConfig
) -> torch.Tensor:
    """``[N]`` log-probs of ``targets`` under the learner's sampling distribution, without gradient.

    ``student_rows``: ``[N, V]`` logits, or an :class:`LMHeadInput` (``[N, D]``) whose logits are made in chunks.
    """
    if not isinstance(student_rows, LMHeadInput):
        return sampling_log_probs(student_rows.detach(), targets, strategy)
    # The sampler drew from the whole output layer (no vocabulary cut), with the head's logit transform.
    head = dataclasses.replace(student_rows, vocab_size=None)
    parts = [
        sampling_log_probs(head.logits(rows), targets[rows], strategy)
        for rows in (
            slice(start, start + _LEARNER_CHUNK_ROWS)
            for start in range(0, head.hidden_states.shape[0], _LEARNER_CHUNK_ROWS)
        )
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32, device=targets.device)


def importance_weights(
    learner_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    stale: torch.Tensor,
    sequence_ids: torch.Tensor,
    correction: OffPolicyCorrection,
    sequence_id_bound: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``([N] float64 weights, metric sums)`` from ``[N]`` learner and sampler log-probs; exactly 1 on fresh rows.

    ``stale``: ``[N]`` bool; ``sequence_ids``: ``[N]`` each row's sequence (a micro-batch holds whole sequences),
    each below ``sequence_id_bound`` where given (no host sync then). The sums are 0-dim tensors, not yet read.
    Sums over all rows, a fresh row counting as ρ = 1: ``is_ratio`` (Σ ρ), ``is_abs_log_ratio`` (Σ |log ρ|),
    ``is_truncated`` (weight cut by the cap), ``is_outside_support`` (ρ = 0), ``is_masked`` (weight 0 by a bound),
    ``is_ratio_max`` (0 without rows).
    """
    log_ratio = (learner_logprobs.double() - sampler_logprobs.double()).masked_fill(~stale, 0.0)
    ratio = log_ratio.exp()
    per_sequence = correction.level == "sequence"
    # Without stale rows every log-ratio is 0 and the geometric mean 1: no test needed (it would be a host sync).
    geometric_mean = (
        _sequence_geometric_mean(log_ratio, sequence_ids, sequence_id_bound)
        if per_sequence or correction.sequence_bounds is not None
        else torch.ones_like(ratio)
    )
    # Exactly 1 on fresh rows: exp(0) = 1 <= cap (a sequence is stale or fresh as a whole).
    weighed = geometric_mean if per_sequence else ratio
    weights = weighed.clamp(max=correction.cap)
    keep = torch.ones_like(stale)
    if correction.token_bounds is not None:
        low, high = correction.token_bounds
        keep &= (ratio >= low) & (ratio <= high)
    if correction.sequence_bounds is not None:
        low, high = correction.sequence_bounds
        keep &= (geometric_mean >= low) & (geometric_mean <= high)
    keep |= ~stale  # fresh rows are never masked: they are on-policy
    weights = torch.where(keep, weights, torch.zeros_like(weights))
    sums = {
        "is_ratio": ratio.sum(),
        "is_abs_log_ratio": log_ratio.abs().sum(),
        "is_truncated": (weighed > correction.cap).sum().double(),
        "is_masked": (~keep).sum().double(),
        "is_outside_support": (ratio == 0).sum().double(),
        "is_ratio_max": ratio.max() if ratio.numel() else ratio.new_zeros(()),
    }
    return weights, sums


def _sequence_geometric_mean(
    log_ratio: torch.Tensor, sequence_ids: torch.Tensor, sequence_id_bound: int | None
) -> torch.Tensor:
    """``[N]`` each row's sequence's geometric-mean ratio exp(mean log ρ) over the sequence's rows.

    With ``sequence_id_bound`` the ids index the sums directly; without, they are renumbered first (``unique``,
    which reads its output size from the device).
    """
    if sequence_id_bound is None:
        _, sequence = torch.unique(sequence_ids, return_inverse=True)
        sequence_id_bound = sequence.numel()
    else:
        sequence = sequence_ids
    count = torch.zeros(sequence_id_bound, dtype=torch.float64, device=log_ratio.device)
    total = torch.zeros_like(count)
    count.index_add_(0, sequence, torch.ones_like(log_ratio))
    total.index_add_(0, sequence, log_ratio)
    return (total / count).exp()[sequence]
