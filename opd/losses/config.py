"""The ``loss_fn:`` section: one typed choice of objective (``type``), each with only the keys it reads.

So a meaningless combination (a top-k ``k`` on the full-vocabulary loss, say) cannot be written:

========================  ==================================================  ==============================
``type``                  objective                                            teacher signal
========================  ==================================================  ==============================
``full_vocab``            forward / reverse / mixed KL over the vocabulary      logits, or hidden states + head
``jsd``                   generalized Jensen-Shannon divergence (GKD's β)       logits, or hidden states + head
``topk``                  KL over the teacher's top k plus a "rest" class       top-k log-probs and ids
``sampled_token``         reverse KL on the sampled token, a policy gradient    the sampled tokens' log-probs
``hybrid_full_vocab``     τ-weighted reverse KL + task-reward policy gradient   logits
========================  ==================================================  ==============================

A new objective is its loss class plus one config class here decorated with :func:`loss_variant`, which feeds
:data:`LossFnConfig`, :data:`LOSS_VARIANTS` and :data:`LOSS_CLASSES`; the teacher request is the loss's own. Its
keys are named as the loss class's arguments (:meth:`_LossSettings.loss_arguments`). The loss classes take no
config and can be built directly.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeAlias, TypeVar

from pydantic import Discriminator, Field, Tag

from opd.losses.distillation_losses import JSDLossFn, KLLossFn, TopKKLLossFn
from opd.losses.divergences import KLType
from opd.losses.hybrid_loss import FullVocabHybridLossFn
from opd.losses.sampled_token import SampledTokenLossFn
from opd.models.interfaces import LossFunction, TeacherRequest
from opd.utils.compile_cache import resolve_compile_kernels
from opd.utils.config import StrictConfig
from opd.utils.devices import is_cpu


class _LossSettings(StrictConfig):
    """Keys every objective has."""

    reduction: Literal["mean", "sum"] = Field(
        "mean", description="mean = over the global batch's response tokens; sum = per sequence, then mean"
    )

    type: str
    loss_class: ClassVar[Callable[..., LossFunction]]
    """The loss these keys build (set by :func:`loss_variant`)."""

    compares_across_tokenizers: ClassVar[bool] = False
    """The objective works against a teacher with another tokenizer (its top k mapped onto shared strings)."""

    weighs_stale_samples_by_default: ClassVar[bool] = False
    """Whether ``training.off_policy_correction.enabled: auto`` weighs this objective's stale samples.

    Off where the loss is an exact expectation over the next token (full vocabulary, JSD, top-k): the ratio only
    stands in for the prefix's, and it slowed learning (guide section 20). The sampled-token loss needs none: its
    clipped ratio is taken against the sampler.
    """

    def needs_own_samples(self, key: str) -> str | None:
        """Why this objective needs the student's own samples on every step (``key``: its section), or None."""
        return None

    def lambda_problem(self, key: str, lambda_: float) -> str | None:
        """Why this objective cannot train on fixed-data steps (``distillation.lambda`` < 1); None when it can."""
        reason = self.needs_own_samples(key)
        if reason is None or lambda_ >= 1.0:
            return None
        return f"{reason}, but distillation.lambda = {lambda_}; set distillation.lambda = 1.0"

    def build(self, vocab_size: int, device_type: str) -> LossFunction:
        """The :attr:`loss_class` object of these keys (``vocab_size``: tokenizer's; ``device_type``: student's)."""
        return self.loss_class(**self.loss_arguments(vocab_size, device_type))

    def loss_arguments(self, vocab_size: int | None, device_type: str | None) -> dict[str, Any]:
        """The loss class's keyword arguments: each key under its own name, ``reduction`` as ``kl_reduction``.

        ``device_type`` None: built only to ask what it needs (no compiling).
        """
        keys = self.model_dump(exclude={"type", "reduction"})
        return {**keys, "kl_reduction": self.reduction, "vocab_size": vocab_size}

    def teacher_request(self, vocab_size: int | None) -> TeacherRequest:
        """The signal the built loss asks the teacher for (also before the tokenizer is loaded: ``vocab_size`` None)."""
        request = self.loss_class(**self.loss_arguments(vocab_size, None)).teacher_request
        assert request is not None, f"{self.type}: every distillation objective asks its teacher for a signal"
        return request


_Variant = TypeVar("_Variant", bound=_LossSettings)

LOSS_VARIANTS: dict[str, type[_LossSettings]] = {}
"""Each ``loss_fn.type`` and its keys, in the order registered (used to say where a misplaced key belongs)."""


def loss_variant(loss_class: Callable[..., LossFunction]) -> Callable[[type[_Variant]], type[_Variant]]:
    """Registers a config class as the ``loss_fn.type`` its ``type`` field names, building ``loss_class``."""

    def register(variant: type[_Variant]) -> type[_Variant]:
        variant.loss_class = loss_class
        LOSS_VARIANTS[variant.model_fields["type"].default] = variant
        return variant

    return register


class _KLDirection(StrictConfig):
    """Which KL: ``kl_type`` and ``mixed_kl_weight``."""

    kl_type: KLType = Field("reverse", description="forward = KL(teacher‖student), reverse = KL(student‖teacher)")
    mixed_kl_weight: float = Field(0.5, ge=0.0, le=1.0, description="weight of forward KL when kl_type = mixed")


class _Temperature(StrictConfig):
    temperature: float = Field(1.0, gt=0.0, description="softmax temperature of both models inside the divergence")


class _TokenClip(StrictConfig):
    """The per-position cap of a divergence over the teacher's distribution (full vocabulary, JSD, top-k)."""

    token_clip: float | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="cap on each response position's divergence: a position above it contributes the cap and no "
        "gradient (metric clipped_token_fraction); null = no cap",
    )


class _Diagnostics(StrictConfig):
    """How often the teacher-vs-student metrics are taken: vocabulary-wide work in every loss chunk."""

    diagnostics_every: int = Field(
        1,
        ge=0,
        description="take train/kl_forward, kl_reverse, teacher_topk_mass, student_mass_on_teacher_topk and "
        "topk_overlap on the steps that are multiples of this (two top-k and both log-normalisers over the "
        "vocabulary per chunk); 1 = every step, 0 = never; the loss and its gradient are the same either way",
    )


class FusedHeadSettings(StrictConfig):
    """Memory-lean computation: logits made chunk by chunk from hidden states."""

    fused_lm_head: bool = Field(True, description="compute logits and loss chunk by chunk from hidden states")
    chunk_size: int | None = Field(None, ge=1, description="positions per fused chunk; null: ~128 MiB of logits")


CPU_COMPILE_MIN_VOCAB = 1024
"""On CPU, ``compile_kernels: auto`` compiles the loss kernels from this vocabulary size up (GPU: any size).

Below it (tiny test models), a run does not win back the compile time (guide section 5).
"""


def compile_loss_kernels(setting: bool | str, device_type: str, vocab_size: int) -> bool:
    """Whether the full-vocabulary loss kernels are compiled (``auto`` per :data:`CPU_COMPILE_MIN_VOCAB`)."""
    pays_off = not is_cpu(device_type) or vocab_size >= CPU_COMPILE_MIN_VOCAB
    return resolve_compile_kernels(setting, device_type, pays_off=pays_off)


class FullVocabKernelSettings(FusedHeadSettings):
    compile_kernels: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile the full-vocabulary loss kernels; auto: where a compiler toolchain exists, "
        f"and on CPU from a vocabulary of {CPU_COMPILE_MIN_VOCAB} entries up",
    )
    metrics_topk: int = Field(64, ge=1, description="k of the teacher_topk_mass / topk_overlap metrics")

    def compiles_kernels(self, vocab_size: int | None, device_type: str | None) -> bool:
        """The loss's ``compile_kernels``: ``auto`` resolved for the device; never when only asked what it needs."""
        if device_type is None or vocab_size is None:
            return False
        return compile_loss_kernels(self.compile_kernels, device_type, vocab_size)


@loss_variant(KLLossFn)
class FullVocabLossConfig(_LossSettings, _KLDirection, _Temperature, FullVocabKernelSettings, _TokenClip, _Diagnostics):
    """``type: full_vocab``: the exact KL over the whole vocabulary (the default)."""

    type: Literal["full_vocab"] = "full_vocab"

    def loss_arguments(self, vocab_size: int | None, device_type: str | None) -> dict[str, Any]:
        compile_kernels = self.compiles_kernels(vocab_size, device_type)
        return {**super().loss_arguments(vocab_size, device_type), "compile_kernels": compile_kernels}


@loss_variant(JSDLossFn)
class JSDLossConfig(_LossSettings, _Temperature, FullVocabKernelSettings, _TokenClip, _Diagnostics):
    """``type: jsd``: the generalized Jensen-Shannon divergence of GKD / TRL."""

    type: Literal["jsd"] = "jsd"
    beta: float = Field(0.5, ge=0.0, le=1.0, description="interpolation: 0 = forward KL, 1 = reverse KL")

    def loss_arguments(self, vocab_size: int | None, device_type: str | None) -> dict[str, Any]:
        compile_kernels = self.compiles_kernels(vocab_size, device_type)
        return {**super().loss_arguments(vocab_size, device_type), "compile_kernels": compile_kernels}


@loss_variant(TopKKLLossFn)
class TopKLossConfig(_LossSettings, _KLDirection, _Temperature, FusedHeadSettings, _TokenClip, _Diagnostics):
    """``type: topk``: the teacher sends its top ``k`` log-probs per position (what a served teacher sends)."""

    type: Literal["topk"] = "topk"
    compares_across_tokenizers: ClassVar[bool] = True
    k: int = Field(64, ge=1, description="teacher tokens per position")
    tail: bool = Field(True, description="keep a 'rest' class (a true divergence); false renormalises over the k")


class _Taus(StrictConfig):
    teacher_tau: float = Field(1.0, description="weight of the teacher's log-prob")
    student_tau: float = Field(1.0, description="weight of the student's log-prob")
    adv_tau: float = Field(0.0, description="weight of the task reward (the math verifier); needs lambda = 1")


@loss_variant(SampledTokenLossFn)
class SampledTokenLossConfig(_LossSettings, _Taus, FusedHeadSettings):
    """``type: sampled_token``: reverse KL on the sampled tokens as a policy gradient (needs lambda = 1)."""

    type: Literal["sampled_token"] = "sampled_token"
    discount: float = Field(0.0, ge=0.0, le=1.0, description="discount over future tokens' advantages")
    clip_ratio: float | None = Field(0.2, gt=0.0, description="importance-ratio clip; null: none")

    def needs_own_samples(self, key: str) -> str | None:
        """The sampled-token gradient needs the student's own samples, which a fixed-data step does not have."""
        return f"{key}.type = sampled_token needs the student's own samples on every step"


@loss_variant(FullVocabHybridLossFn)
class HybridFullVocabLossConfig(_LossSettings, _Taus):
    """``type: hybrid_full_vocab``: Σ_v q(student_tau·log q − teacher_tau·log p) exactly, plus the task reward."""

    type: Literal["hybrid_full_vocab"] = "hybrid_full_vocab"
    weighs_stale_samples_by_default: ClassVar[bool] = True
    """Its task-reward term is a policy gradient, which a stale sample makes off-policy."""

    def needs_own_samples(self, key: str) -> str | None:
        """A task reward (``adv_tau``) rewards the student's own answers, which only on-policy steps have."""
        if self.adv_tau == 0.0:
            return None
        return f"{key}.adv_tau = {self.adv_tau} rewards the student's own answers, which only on-policy steps have"


def _loss_type(value: Any) -> str:
    """The variant's tag; a section without ``type`` is the default objective."""
    if isinstance(value, dict):
        return str(value.get("type", "full_vocab"))
    return str(getattr(value, "type", "full_vocab"))


if TYPE_CHECKING:
    # A type checker cannot read a union made at run time; it sees what every variant has.
    LossFnConfig: TypeAlias = _LossSettings
else:
    LossFnConfig = Annotated[
        functools.reduce(operator.or_, [Annotated[variant, Tag(tag)] for tag, variant in LOSS_VARIANTS.items()]),
        Discriminator(_loss_type),
    ]
"""``loss_fn:``, one of the registered variants, chosen by ``type``."""

LOSS_CLASSES: dict[str, Callable[..., LossFunction]] = {
    tag: variant.loss_class for tag, variant in LOSS_VARIANTS.items()
}
"""The loss class each ``loss_fn.type`` builds."""
