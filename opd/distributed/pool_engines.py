"""What a teacher pool's workers score with: the values of ``cluster.teacher.engine``, each registered once.

A :class:`PoolEngine` answers everything opd asks of an engine (signals, config problems, devices, placement for
``opd plan``, building and answering); config, workers, pool and plan all go through :data:`POOL_ENGINES`. A new
engine is its teacher class plus, here, a subclass, a :data:`POOL_ENGINES` entry and a :data:`PoolEngineName`
value. Engines read ``cluster.teacher`` through protocols, so this module need not import the config, which
imports it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar

import torch
from torch.distributed.fsdp import FSDPModule

from opd.data.batched_data_dict import BatchedDataDict
from opd.models.config import ModelLoadingConfig
from opd.models.interfaces import (
    FullVocabRequest,
    TeacherHiddenStates,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TopKRequest,
)
from opd.models.loading import load_causal_lm, resolve_device, resolve_dtype
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.vllm_teacher import VllmScoringConfig, VllmTeacher
from opd.utils.refusals import Check, Refusal, all_problems

SettingsT = TypeVar("SettingsT", contravariant=True)
"""What an engine reads of ``cluster.teacher``: a protocol declared beside it."""


class PoolSettings(Protocol):
    """What every pool engine may read of ``cluster.teacher``."""

    @property
    def in_pool(self) -> bool: ...

    @property
    def shards_per_replica(self) -> int: ...


class VllmPoolSettings(PoolSettings, Protocol):
    """What the vLLM pool engine reads of ``cluster.teacher``."""

    @property
    def vllm(self) -> VllmScoringConfig: ...


@dataclass(frozen=True)
class PlannedPool:
    """How ``opd plan`` shows a pool of this engine.

    ``dry_run_shards``: devices of one replica, whose scoring the dry run measures; None when the engine manages
    its own memory.
    """

    label: str
    dry_run_shards: int | None


class PoolEngine(ABC, Generic[SettingsT]):
    """One value (``name``) of ``cluster.teacher.engine``; ``teacher_class`` is the replica's class."""

    name: ClassVar[str]
    teacher_class: ClassVar[type[TeacherInterface]]

    def unsupported_reason(self, request: TeacherRequest) -> str | None:
        """Why a replica of this engine cannot answer ``request``, or None."""
        return self.teacher_class.unsupported_reason(request)

    def devices_per_worker(self, pool: SettingsT) -> int:
        """Devices one teacher worker spans (default: one)."""
        return 1

    def config_problems(self, pool: SettingsT, request: TeacherRequest | None, colocated: bool) -> list[str]:
        """Why this engine cannot run as ``pool`` (``cluster.teacher``) says; ``colocated``: sharing trainer devices."""
        return []

    @abstractmethod
    def build_replica(
        self,
        pool: SettingsT,
        model_path: str,
        loading: ModelLoadingConfig,
        seed: int,
        share_prompt_forward: bool,
    ) -> TeacherInterface:
        """A whole replica in this worker (a replica sharded over workers is built by them together)."""

    def answer(self, replica: TeacherInterface, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The replica's answer to ``request`` for ``data`` (default: the replica scores it)."""
        return replica.score(data, request)

    @abstractmethod
    def planned_placement(self, pool: SettingsT) -> PlannedPool:
        """How ``opd plan`` shows a pool of this engine."""


class HFPoolEngine(PoolEngine[PoolSettings]):
    """``hf``: the teacher's Hugging Face model, whole in each worker or sharded with FSDP2 over a replica's workers.

    Sends every signal; the full vocabulary as final hidden states, bound in the trainer workers.
    """

    name = "hf"
    teacher_class = LocalTeacher

    def build_replica(
        self,
        pool: PoolSettings,
        model_path: str,
        loading: ModelLoadingConfig,
        seed: int,
        share_prompt_forward: bool,
    ) -> TeacherInterface:
        """Loads the whole teacher onto this worker's device."""
        device = resolve_device(loading.device)
        model = load_causal_lm(model_path, resolve_dtype(loading.dtype, device), device, loading)
        return LocalTeacher(model, share_prompt_forward=share_prompt_forward)

    def answer(self, replica: TeacherInterface, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The full vocabulary as hidden states (never ``[B, L, V]`` logits); an FSDP2 replica then frees its root's
        gathered weights (as ``trainer_worker.release_gathered_root``, not imported: it reaches the config)."""
        assert isinstance(replica, LocalTeacher)  # what build_replica and a sharded replica's start build
        if isinstance(request, FullVocabRequest):
            signal: TeacherSignal = TeacherHiddenStates(replica.get_hidden_states(data).hidden_states)
        else:
            signal = replica.score(data, request)
        if isinstance(replica.model, FSDPModule):
            replica.model.reshard()
        return signal

    def planned_placement(self, pool: PoolSettings) -> PlannedPool:
        """Dry-run: one replica's first device scoring a micro-batch."""
        shards = pool.shards_per_replica
        return PlannedPool(
            f"pool, {'whole replicas' if shards == 1 else f'replicas sharded over {shards} devices'}", shards
        )


@dataclass(frozen=True)
class _PoolAsked:
    """What a pool engine's checks read: ``cluster.teacher``, the loss's request, whether workers share devices."""

    pool: VllmPoolSettings
    request: TeacherRequest | None
    colocated: bool


_VLLM_POOL_NOT_IN_POOL = (
    "cluster.teacher.engine = vllm runs teacher workers of their own; set cluster.teacher.placement = pool"
)

_VLLM_POOL_REFUSALS: tuple[Check[_PoolAsked], ...] = (
    Refusal(
        lambda asked: asked.pool.shards_per_replica > 1,
        "cluster.teacher.engine = vllm spreads a teacher over several devices with tensor parallelism "
        "(cluster.teacher.vllm.tensor_parallel_size), not FSDP2 shards: set cluster.teacher.shards_per_replica = 1",
    ),
    Refusal(
        lambda asked: asked.pool.vllm.tensor_parallel_size > 1 and asked.colocated,
        lambda asked: (
            f"cluster.teacher.vllm.tensor_parallel_size = {asked.pool.vllm.tensor_parallel_size} spans "
            "several devices, but a colocated teacher worker shares one trainer device; set cluster.placement = split"
        ),
    ),
    Refusal(
        lambda asked: isinstance(asked.request, TopKRequest) and asked.request.k > asked.pool.vllm.max_logprobs,
        lambda asked: (
            f"loss_fn.k = {getattr(asked.request, 'k', None)} is more than the vLLM teacher engine returns "
            f"per position (cluster.teacher.vllm.max_logprobs = {asked.pool.vllm.max_logprobs}); raise max_logprobs"
        ),
    ),
)
"""The vLLM pool's refusals, all reported (each names its keys and the fix)."""


class VllmPoolEngine(PoolEngine[VllmPoolSettings]):
    """``vllm``: a vLLM engine per worker, tensor parallel within it; sends top-k and token log-probs only."""

    name = "vllm"
    teacher_class = VllmTeacher

    def devices_per_worker(self, pool: VllmPoolSettings) -> int:
        """``cluster.teacher.vllm.tensor_parallel_size``."""
        return pool.vllm.tensor_parallel_size

    def config_problems(self, pool: VllmPoolSettings, request: TeacherRequest | None, colocated: bool) -> list[str]:
        """Workers of its own, one worker per replica, a device per tensor-parallel rank, and the loss's k."""
        if not pool.in_pool:
            return [_VLLM_POOL_NOT_IN_POOL]
        reason = self.unsupported_reason(request) if request is not None else None
        return all_problems(_VLLM_POOL_REFUSALS, _PoolAsked(pool, request, colocated)) + ([reason] if reason else [])

    def build_replica(
        self,
        pool: VllmPoolSettings,
        model_path: str,
        loading: ModelLoadingConfig,
        seed: int,
        share_prompt_forward: bool,
    ) -> TeacherInterface:
        """A vLLM engine that loads the teacher itself, over the devices Ray gave this worker."""
        return VllmTeacher(model_path, pool.vllm, on_gpu=torch.cuda.is_available(), seed=seed)

    def planned_placement(self, pool: VllmPoolSettings) -> PlannedPool:
        """Not dry-run: vLLM manages its memory itself (a share of each device)."""
        devices = pool.vllm.tensor_parallel_size
        return PlannedPool(f"pool of vLLM engines over {devices} device(s), not dry-run", None)


HF_POOL_ENGINE = HFPoolEngine()
"""The default engine (``cluster.teacher.engine: hf``)."""

# The config hands every engine the whole cluster.teacher section; each reads it through its own protocol.
_ENGINES: tuple[PoolEngine[Any], ...] = (HF_POOL_ENGINE, VllmPoolEngine())
POOL_ENGINES: dict[str, PoolEngine[Any]] = {engine.name: engine for engine in _ENGINES}
"""Every pool engine, by its ``cluster.teacher.engine`` value."""

PoolEngineName = Literal["hf", "vllm"]
"""The values of ``cluster.teacher.engine``: one per entry of :data:`POOL_ENGINES`."""
