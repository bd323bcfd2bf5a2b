"""The values of ``generate_strategy.decoding_method``, each registered once.

A decoding method says everything the samplers ask of it: whether it takes the arg-max
(:attr:`DecodingMethod.greedy`), which entries of the tempered logits it keeps
(:meth:`DecodingMethod.keep`, the same filter as transformers' ``TopKLogitsWarper`` /
``TopPLogitsWarper``), and how it is spelled for ``model.generate`` and for vLLM's
``SamplingParams``. opd's decode loop, the off-policy correction, the HF and vLLM engines
all go through :data:`DECODING_METHODS`; a new method is one subclass here and one entry
in the config's ``decoding_method`` choices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal, Protocol

import torch
from pydantic import Field

from opd.utils.config import StrictConfig


class SamplingSettings(Protocol):
    """What a method reads of ``generate_strategy`` (:class:`GenerateStrategyConfig`)."""

    @property
    def temperature(self) -> float: ...

    @property
    def top_k(self) -> int: ...

    @property
    def top_p(self) -> float: ...


class DecodingMethod(ABC):
    """One value of ``generate_strategy.decoding_method``.

    Attributes:
        name: the value of ``decoding_method``.
        greedy: the arg-max is taken (temperature and filters are ignored); the reported
            log-probs are then the unwarped softmax's, as ``generate``'s scores give.
    """

    name: ClassVar[str]
    greedy: ClassVar[bool] = False

    def keep(self, logits: torch.Tensor, strategy: SamplingSettings) -> torch.Tensor:
        """The tempered ``[B, V]`` float32 ``logits`` with the entries this method never samples set to ``-inf``
        (default: all kept)."""
        return logits

    @abstractmethod
    def hf_kwargs(self, strategy: SamplingSettings) -> dict[str, Any]:
        """``model.generate`` keyword arguments for this method (every sampling knob explicit)."""

    @abstractmethod
    def vllm_kwargs(self, strategy: SamplingSettings) -> dict[str, Any]:
        """vLLM ``SamplingParams`` keyword arguments for this method (every sampling knob explicit)."""


class Greedy(DecodingMethod):
    """The arg-max token."""

    name = "greedy"
    greedy = True

    def hf_kwargs(self, strategy: SamplingSettings) -> dict[str, Any]:
        """No sampling; the model's own temperature / top-k / top-p are cleared."""
        return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}

    def vllm_kwargs(self, strategy: SamplingSettings) -> dict[str, Any]:
        """vLLM's greedy is ``temperature=0``."""
        return {"temperature": 0.0, "top_k": -1, "top_p": 1.0}


class TopK(DecodingMethod):
    """Sampling from the ``top_k`` most likely tokens."""

    name = "top_k"

    def keep(self, logits: torch.Tensor, strategy: SamplingSettings) -> torch.Tensor:
        """Keeps every entry at least as large as the k-th largest (ties at the threshold stay)."""
        k = strategy.top_k
        if k >= logits.shape[-1]:
            return logits
        threshold = torch.topk(logits, k, dim=-1).values[..., -1:]
        return logits.masked_fill(logits < threshold, float("-inf"))

    def hf_kwargs(self, strategy: SamplingSettings) -> dict[str, Any]:
        """``top_k`` with the nucleus off."""
        return {"do_sample": True, "temperature": strategy.temperature, "top_k": strategy.top_k, "top_p": 1.0}

    def vllm_kwargs(self, strategy: SamplingSettings) -> dict[str, Any]:
        """``top_k`` with the nucleus off."""
        return {"temperature": strategy.temperature, "top_k": strategy.top_k, "top_p": 1.0}


class TopP(DecodingMethod):
    """Nucleus sampling: the smallest most-likely set of tokens whose probability reaches ``top_p``."""

    name = "top_p"

    def keep(self, logits: torch.Tensor, strategy: SamplingSettings) -> torch.Tensor:
        """Keeps the smallest most-likely set whose probability reaches ``top_p`` (at least one entry).

        Sorted ascending, an entry is dropped when the mass of it and everything below it is
        at most ``1 - top_p``: whatever remains holds at least ``top_p``. ``top_p = 1`` keeps all.
        """
        top_p = strategy.top_p
        if top_p >= 1.0:
            return logits
        ascending, order = torch.sort(logits, dim=-1)
        mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = mass_up_to <= 1.0 - top_p
        drop_sorted[..., -1] = False  # the most likely entry always stays
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        return logits.masked_fill(drop, float("-inf"))

    def hf_kwargs(self, strategy: SamplingSettings) -> dict[str, Any]:
        """``top_p`` with top-k off."""
        return {"do_sample": True, "temperature": strategy.temperature, "top_k": 0, "top_p": strategy.top_p}

    def vllm_kwargs(self, strategy: SamplingSettings) -> dict[str, Any]:
        """``top_p`` with top-k off."""
        return {"temperature": strategy.temperature, "top_k": -1, "top_p": strategy.top_p}


DECODING_METHODS: dict[str, DecodingMethod] = {method.name: method for method in (Greedy(), TopK(), TopP())}
"""Every decoding method, by its ``generate_strategy.decoding_method`` value."""


class GenerateStrategyConfig(StrictConfig):
    """How the student samples its responses.

    ``decoding_method``: ``greedy`` takes the arg-max token (``temperature``, ``top_k``
    and ``top_p`` are ignored); ``top_k`` samples at ``temperature`` from the ``top_k``
    most likely tokens; ``top_p`` samples at ``temperature`` from the smallest set of
    tokens whose probability reaches ``top_p`` (nucleus sampling).
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
    def is_greedy(self) -> bool:
        """The arg-max is taken: every sample of a prompt is the same response."""
        return self.method.greedy
