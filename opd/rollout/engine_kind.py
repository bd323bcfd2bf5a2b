"""What every rollout engine answers for the rest of opd (:class:`EngineKind`), and what ``opd plan`` asks it.

Each engine's module holds its kind (:class:`~opd.rollout.hf_generation.HFEngine`,
:class:`~opd.rollout.vllm_generation.VllmEngine`); :data:`opd.rollout.engines.ENGINES` only lists them. A kind
reads the ``generation`` section through a protocol of its own, so the engines need not import the section's
class, which imports them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from opd.models.interfaces import InProcessGenerationInterface

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PretrainedConfig, PreTrainedModel

GIB = 1024**3
RUNTIME_RESERVE = int(1.5 * GIB)
"""Held outside PyTorch's tensors by each process on a device: the CUDA context, NCCL's buffers, allocator slack."""

SettingsT = TypeVar("SettingsT", contravariant=True)
"""What a kind reads of the ``generation`` section: a protocol its module declares."""


def gib(value: int) -> str:
    """``value`` bytes in GiB, two decimals, no padding (the plan's tables)."""
    return f"{value / GIB:.2f}"


def kv_bytes_per_token(config: PretrainedConfig, element_bytes: int = 2) -> int:
    """Bytes of keys and values one token holds over all of the model's layers (16 bits by default)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element_bytes


def layer_activation_bytes_per_token(config: PretrainedConfig) -> int:
    """One decoder layer's 16-bit activations per token: ≈ 4 × hidden (residual, attention) + 3 × intermediate (MLP)."""
    return 2 * (4 * config.hidden_size + 3 * config.intermediate_size)


@dataclass(frozen=True)
class PlannedRollout:
    """One rollout engine's work on one device, as ``opd plan`` sizes it.

    Attributes:
        trainer_resident: bytes the trainer keeps on the device while the engine samples
            (colocated: its weights, Adam moments and teacher unless offloaded; split: 0).
        student_parameters: the student's distinct weights.
        prompt_tokens: the longest prompt (``response_tokens``: the longest response).
        rows: sequences one engine samples in a rollout (its share of the prompts × samples per prompt).
    """

    device_bytes: int
    trainer_resident: int
    student: PretrainedConfig
    student_parameters: int
    vocab_size: int
    prompt_tokens: int
    response_tokens: int
    rows: int
    student_element_bytes: int = 2
    """Bytes of one of the student's weights as a rollout worker loads it (``model.dtype``; ``auto`` is bfloat16 on a
    GPU)."""

    @property
    def row_tokens(self) -> int:
        """Prompt plus response: the longest sequence."""
        return self.prompt_tokens + self.response_tokens

    @property
    def kv_bytes_per_token(self) -> int:
        """The student's 16-bit keys and values of one token (:func:`kv_bytes_per_token`)."""
        return kv_bytes_per_token(self.student)

    @property
    def layer_activation_bytes_per_token(self) -> int:
        """One student layer's 16-bit activations per token (:func:`layer_activation_bytes_per_token`)."""
        return layer_activation_bytes_per_token(self.student)


@dataclass(frozen=True)
class HeldMemory:
    """Bytes one part of a device holds at one moment, as the plan's check names them.

    Attributes:
        what: the part, in the plan's words (``vLLM share``).
        remedy: the setting that makes it smaller, as an instruction; empty when no setting does.
    """

    size: int
    what: str
    remedy: str = ""


@dataclass(frozen=True)
class RolloutWorkerMemory:
    """What a rollout worker's process holds on its device besides its engine's budget, in bytes.

    Attributes:
        context: the process's CUDA context and runtime (:data:`RUNTIME_RESERVE`: a process of its own, as each
            trainer rank is).
        student_copy: the student the worker loaded and samples with in place (the HF engine); 0 where the engine
            holds its weights in its own budget (vLLM).
        copy_note: what the copy is, or why there is none (the plan's words).
    """

    context: int
    student_copy: int
    copy_note: str

    @property
    def total(self) -> int:
        """The process's bytes on the device beside the engine's budget."""
        return self.context + self.student_copy

    def describe(self) -> str:
        """The worker's bytes as one line of the plan (GiB)."""
        context = f"CUDA context and runtime {gib(self.context)} (the runtime reserve: a process of its own)"
        if not self.student_copy:
            return f"{context} = {gib(self.total)} GiB; no copy of the student ({self.copy_note})"
        copy = f"its copy of the student {gib(self.student_copy)} ({self.copy_note})"
        return f"{context} + {copy} = {gib(self.total)} GiB"


class EngineMemory(Protocol):
    """An engine's planned share of one device: a dataclass (``opd plan --json`` writes its fields).

    Its two moments are those of a device the engine shares with a trainer rank (``cluster.placement: colocated``),
    counted beside the rollout worker's own memory (:class:`RolloutWorkerMemory`).
    """

    def describe(self) -> str:
        """The share as one line of the plan's table (GiB)."""
        ...

    @property
    def while_sampling(self) -> HeldMemory:
        """What the engine holds on the device while it samples."""
        ...

    @property
    def at_refit(self) -> HeldMemory:
        """What it holds while the trainer refits it, right after the trainer's step."""
        ...


class EngineKind(ABC, Generic[SettingsT]):
    """One value of ``generation.backend`` (:attr:`name`); :attr:`memory_arithmetic` heads its plan."""

    name: ClassVar[str]
    memory_arithmetic: ClassVar[str]
    untraced_memory: ClassVar[str] = ""
    """What the engine holds that its plan does not count (printed under it), if anything."""

    def check_environment(self, settings: SettingsT) -> None:
        """Fails at once, with the way to fix it, when this machine cannot run the engine (default: it can)."""

    def devices(self, settings: SettingsT) -> int:
        """Devices one engine spans (a rollout worker is given that many)."""
        return 1

    def config_problems(self, settings: SettingsT, max_new_tokens: int, key: str, colocated: bool = False) -> list[str]:
        """Why the engine cannot run as configured (default: nothing).

        ``max_new_tokens`` is the longest answer asked of it, ``key`` names that setting for the message;
        ``colocated``: each engine shares one trainer device (``cluster.placement: colocated``).
        """
        return []

    @abstractmethod
    def planned_memory(self, settings: SettingsT, rollout: PlannedRollout) -> EngineMemory:
        """What one engine holds on one device while it samples ``rollout`` (``opd plan``)."""

    @abstractmethod
    def worker_memory(self, settings: SettingsT, rollout: PlannedRollout) -> RolloutWorkerMemory:
        """What a rollout worker's process holds on one of its devices beside the engine's budget (``opd plan``).

        Every worker loads the student (:class:`~opd.distributed.rollout.RolloutWorker`) and builds its engine on it
        with ``own_copy=False``: an engine that samples in place keeps that copy, one that copies it into weights of
        its own drops it.
        """

    @abstractmethod
    def build(
        self, settings: SettingsT, model: PreTrainedModel, tokenizer: Any, seed: int, own_copy: bool
    ) -> InProcessGenerationInterface:
        """The engine, sampling from ``model`` (``own_copy``: from a copy refreshed by refits only)."""
