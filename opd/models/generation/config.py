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


class GenerationConfig(StrictConfig):
    """Which engine samples the student's responses.

    ``decode_loop`` (backend ``hf``): ``opd`` runs opd's KV-cache loop
    (:mod:`opd.models.generation.decode_loop`: finished rows leave the batch, tokens are
    drawn by an exact inverse-CDF lookup); ``generate`` calls transformers'
    ``model.generate`` (for architectures the loop does not cover, or to compare).

    ``compile_decode`` compiles the loop's one-token forward with ``torch.compile``. It is
    off by default because compiling takes seconds at the start of every run (about 5 s for
    a 2-layer model on the 2-core CPU machine with a warm inductor cache, 15 s cold), and
    only a small model is limited by the per-operator overhead it removes.
    """

    backend: Literal["hf"] = Field("hf", description="generation engine: hf = the in-process student model")
    decode_loop: Literal["opd", "generate"] = Field("opd", description="hf backend: opd's decode loop or model.generate")
    compile_decode: Literal["auto"] | bool = Field(
        False,
        description="hf backend, opd loop: torch.compile the one-token decode step (auto = where a compiler "
                    "toolchain exists); costs a few seconds of compilation per run, pays off over many steps",
    )
