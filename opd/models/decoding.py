"""The values of ``generate_strategy.decoding_method``, each registered once.

A method says whether it takes the arg-max and which entries of the tempered logits it samples from
(:class:`SamplingFilter`, as transformers' ``TopKLogitsWarper`` / ``TopPLogitsWarper``). The decode loop and the
off-policy correction apply the filter here; each rollout engine spells it in its own sampling arguments. A new
method is one subclass here and one entry in the config's ``decoding_method`` choices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import Field

from opd.utils.config import StrictConfig


@dataclass(frozen=True)
class SamplingFilter:
    """Which entries of the tempered logits a sampling method draws from.

    Attributes:
        top_k: only the ``top_k`` most likely entries (ties at the threshold stay); None: no such cut.
        top_p: only the smallest most-likely set whose probability reaches ``top_p``; 1: no such cut.
    """

    top_k: int | None = None
    top_p: float = 1.0

    @property
    def leaves_out_tokens(self) -> bool:
        """Some entry may be cut (a ``top_k`` at least the vocabulary's size cuts none, which only the logits tell)."""
        return self.top_k is not None or self.top_p < 1.0

    def describe(self) -> str:
        """The cuts as config settings (``top_k = 50``), for messages."""
        cuts = ([f"top_k = {self.top_k}"] if self.top_k is not None else []) + (
            [f"top_p = {self.top_p}"] if self.top_p < 1.0 else []
        )
        return ", ".join(cuts) or "every token kept"

    def keep(self, logits: torch.Tensor) -> torch.Tensor:
        """The ``[B, V]`` float32 ``logits`` with the entries this filter cuts set to ``-inf``."""
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            threshold = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        if self.top_p < 1.0:
            # Sorted ascending, drop an entry while the mass up to it is at most 1 - top_p: the rest holds >= top_p.
            ascending, order = torch.sort(logits, dim=-1)
            mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = mass_up_to <= 1.0 - self.top_p
            drop_sorted[..., -1] = False  # the most likely entry always stays
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits


class DecodingMethod(ABC):
    """One value of ``generate_strategy.decoding_method``.

    Attributes:
        greedy: the arg-max is taken (temperature and filters ignored); log-probs are the unwarped softmax's.
    """

    name: ClassVar[str]
    greedy: ClassVar[bool] = False

    @abstractmethod
    def filter(self, strategy: GenerateStrategyConfig) -> SamplingFilter:
        """Which entries of the tempered logits this method samples from (a greedy method: all)."""

    def keep(self, logits: torch.Tensor, strategy: GenerateStrategyConfig) -> torch.Tensor:
        """The tempered ``[B, V]`` float32 ``logits`` with the entries this method never samples set to ``-inf``."""
        return self.filter(strategy).keep(logits)


class Greedy(DecodingMethod):
    """The arg-max token."""

    name = "greedy"
    greedy = True

    def filter(self, strategy: GenerateStrategyConfig) -> SamplingFilter:
        """No cut: the arg-max ignores the filters."""
        return SamplingFilter()


class TopK(DecodingMethod):
    """Sampling from the ``top_k`` most likely tokens."""

    name = "top_k"

    def filter(self, strategy: GenerateStrategyConfig) -> SamplingFilter:
        """``top_k`` with the nucleus off."""
        return SamplingFilter(top_k=strategy.top_k)


class TopP(DecodingMethod):
    """Nucleus sampling: the smallest most-likely set of tokens whose probability reaches ``top_p``."""

    name = "top_p"

    def filter(self, strategy: GenerateStrategyConfig) -> SamplingFilter:
        """``top_p`` with top-k off (``top_p = 1`` keeps every token)."""
        return SamplingFilter(top_p=strategy.top_p)


DECODING_METHODS: dict[str, DecodingMethod] = {method.name: method for method in (Greedy(), TopK(), TopP())}
"""Every decoding method, by its ``generate_strategy.decoding_method`` value."""


class GenerateStrategyConfig(StrictConfig):
    """How the student samples its responses.

    ``decoding_method``: ``greedy`` takes the arg-max (ignoring ``temperature``, ``top_k``, ``top_p``); ``top_k``
    and ``top_p`` (nucleus) sample at ``temperature`` from the kept tokens.
    """

    max_length: int = Field(2048, ge=1, description="maximum number of new tokens per response")
    temperature: float = Field(0.1, gt=0.0, description="sampling temperature")
    decoding_method: Literal["greedy", "top_k", "top_p"] = "greedy"
    top_k: int = Field(50, ge=1, description="candidates kept by decoding_method=top_k")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="probability mass kept by decoding_method=top_p")

    @property
    def method(self) -> DecodingMethod:
        """The decoding method ``decoding_method`` names (:data:`~opd.models.decoding.DECODING_METHODS`)."""
        return DECODING_METHODS[self.decoding_method]

    @property
    def sampling_filter(self) -> SamplingFilter:
        """Which entries of the tempered logits the method samples from (what each engine spells its own way)."""
        return self.method.filter(self)

    @property
    def is_greedy(self) -> bool:
        """The arg-max is taken: every sample of a prompt is the same response."""
        return self.method.greedy
