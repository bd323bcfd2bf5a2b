"""Sampling settings for the student (the specification's ``generate_strategy``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from opd.utils.config import StrictConfig


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
