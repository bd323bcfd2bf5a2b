"""Rollout workers: engines that sample from the student, refit from the trainer in buckets.

:class:`RolloutWorker` is one Ray actor with its own HF or vLLM engine over a copy of the student.
:class:`RayGeneration`, the driver's ``GenerationInterface``, deals prompts to workers in contiguous blocks (a
prompt's samples stay on one worker) and draws one seed per call from the controller's torch generator (saved in
checkpoints); worker ``r`` samples with ``seed + r``, so rollouts are reproducible across a resume. Its ``refit``
sends the trainer's weights in buckets of the engines' dtype over :mod:`opd.distributed.refit.transport`.
:class:`TeacherOnRolloutWorkers` samples a teacher on the same workers (validation baselines).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any

import ray
import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.distributed.refit.buckets import put_in_buckets
from opd.distributed.refit.transport import TRANSPORTS, RefitReport
from opd.distributed.refit.wire import (
    BucketLayout,
    IpcHandle,
    RefitBuffers,
    layout_bytes,
    open_broadcast_group,
    open_ipc_handle,
    start_broadcast,
    unpack,
)
from opd.distributed.workers.worker_group import WorkerGroup
from opd.models.config import ModelLoadingConfig
from opd.models.decoding import GenerateStrategyConfig
from opd.models.interfaces import GenerationInterface, InProcessGenerationInterface, Pending, PolicyInterface
from opd.models.loading import load_causal_lm, resolve_device, resolve_dtype
from opd.rollout.engines import GenerationConfig
from opd.rollout.hf_generation import HFGeneration
from opd.utils.errors import WorkerError

_SEED_RANGE = 2**31 - 1


@dataclass(frozen=True)
class RolloutSpec:
    """What every rollout worker builds; ``seed`` is the engine's seed, to which each worker adds its rank."""

    model_path: str
    loading: ModelLoadingConfig
    tokenizer: Any
    generation: GenerationConfig
    threads: int
    seed: int = 0


class RolloutWorker:
    """One rollout engine (a Ray actor) over the student's weights; ``rank`` is among the rollout workers."""

    def __init__(self, rank: int, spec: RolloutSpec) -> None:
        torch.set_num_threads(spec.threads)
        self.rank = rank
        self.spec = spec
        self.device = resolve_device(spec.loading.device)
        # An HF engine samples with this model in place; vLLM loads it once into its own copy, and the worker keeps
        # no reference: a vLLM rollout worker holds the student once, in the engine.
        self.engine: InProcessGenerationInterface = spec.generation.build(
            self._load_frozen(spec.model_path), spec.tokenizer, spec.seed + rank, False
        )
        self._refit_group: Any = None
        self._receive_buffers: RefitBuffers | None = None
        self._ipc_mappings: dict[IpcHandle, torch.Tensor] = {}
        self.teacher_engines: dict[str, HFGeneration] = {}
        """Teachers loaded for the validation baselines, by key (:meth:`load_teacher`)."""

    def _load_frozen(self, path: str) -> Any:
        """The model at ``path`` on this worker's device, loaded as ``loading`` says, without gradients."""
        model = load_causal_lm(
            path, resolve_dtype(self.spec.loading.dtype, self.device), self.device, self.spec.loading
        )
        return model.requires_grad_(False)

    def engine_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in: the trainer casts to it before sending."""
        return self.engine.weights_dtype

    # ------------------------------------------------------------------ refit

    def load_buckets(self, bucket_refs: list[Any]) -> int:
        """Copies the trainer's weights from Ray's object store into the engine; returns the tensors loaded."""
        self.engine.begin_refit()
        loaded = sum(self._load(list(ray.get(ref).items())) for ref in bucket_refs)
        self.engine.finish_refit()
        return loaded

    def join_refit_group(self, address: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        """Joins the broadcast group of trainer rank 0 (its rank 0) and the rollout workers, as ``rank``."""
        self._refit_group = open_broadcast_group(address, port, rank, world_size, self.device, timeout_s)

    def receive_broadcast(self, layouts: list[BucketLayout]) -> int:
        """Receives every bucket trainer rank 0 broadcasts and loads it; returns the tensors loaded.

        Double-buffered: bucket i+1 arrives in one buffer while bucket i loads from the other. Both buffers are
        this worker's for its lifetime (:class:`RefitBuffers`).
        """
        if self._receive_buffers is None:
            self._receive_buffers = RefitBuffers(max(map(layout_bytes, layouts)), self.device)
        buffers = self._receive_buffers
        self.engine.begin_refit()
        loaded = 0
        arriving = start_broadcast(self._refit_group, buffers.view(0, layout_bytes(layouts[0])))
        for index, layout in enumerate(layouts):
            arriving.wait()
            if index + 1 < len(layouts):  # the other buffer's bucket (index - 1) is loaded already
                arriving = start_broadcast(self._refit_group, buffers.view(index + 1, layout_bytes(layouts[index + 1])))
            loaded += self._load(unpack(buffers.view(index, layout_bytes(layout)), layout))
        self.engine.finish_refit()
        return loaded

    def refit_buffer_addresses(self) -> tuple[int, int] | None:
        """Where this worker's broadcast receive buffers are (None before its first): refits reuse them."""
        return None if self._receive_buffers is None else self._receive_buffers.pointers()

    def begin_refit(self) -> None:
        """Opens a refit whose buckets arrive one call each (:meth:`load_ipc_bucket`)."""
        self.engine.begin_refit()

    def finish_refit(self) -> None:
        """Closes the refit :meth:`begin_refit` opened: the engine's post-load work and cache reset, once."""
        self.engine.finish_refit()

    def load_ipc_bucket(self, handle: IpcHandle, layout: BucketLayout) -> int:
        """Copies one bucket from the trainer rank on this GPU (a CUDA IPC handle) into the engine.

        The trainer's buffers live as long as it does: each handle is opened once and its mapping kept.
        """
        if handle not in self._ipc_mappings:
            self._ipc_mappings[handle] = open_ipc_handle(handle, self.device)
        buffer = self._ipc_mappings[handle][: layout_bytes(layout)]
        loaded = self._load(unpack(buffer, layout))
        # The trainer packs the next bucket but one into this buffer once every engine returns: copies must be done.
        torch.cuda.current_stream(buffer.device).synchronize()
        return loaded

    def weights(self) -> dict[str, torch.Tensor]:
        """The HF engine's weights, on CPU (tests compare what the refits loaded).

        Raises:
            TypeError: the engine is not an HF one (a vLLM engine's weights live in vLLM alone).
        """
        if not isinstance(self.engine, HFGeneration):
            raise TypeError(f"a {type(self.engine).__name__} engine holds its weights itself; there is no HF copy")
        return {name: tensor.detach().cpu().clone() for name, tensor in self.engine.model.state_dict().items()}

    def _load(self, pairs: list[tuple[str, torch.Tensor]]) -> int:
        """Puts ``(name, tensor)`` pairs, already in the engine's dtype, into the engine."""
        self.engine.load_weights(pairs)
        return len(pairs)

    def generate(
        self,
        prompts: list[list[int]],
        strategy: GenerateStrategyConfig,
        num_samples: int,
        return_logprobs: bool,
        seed: int,
        teacher: str | None = None,
    ) -> BatchedDataDict:
        """Samples ``num_samples`` responses per prompt with seed ``seed + rank`` (``teacher``: a loaded teacher's)."""
        torch.manual_seed(seed + self.rank)
        engine = self.engine if teacher is None else self.teacher_engines[teacher]
        engine.prepare_for_generation()
        try:
            return engine.generate(prompts, strategy, num_samples, return_logprobs)
        finally:
            engine.finish_generation()

    def load_teacher(self, key: str, model_path: str, tokenizer: Any) -> None:
        """Loads a teacher as ``key`` into an HF engine of its own, beside the student's engine.

        Always HF (loaded like the student) so a vLLM engine keeps its memory for the student.
        """
        if key in self.teacher_engines:
            return
        model = self._load_frozen(model_path)
        self.teacher_engines[key] = HFGeneration(model, tokenizer, self.spec.generation.decode_loop)

    def free_teacher(self, key: str) -> None:
        """Drops the teacher ``key`` and gives its memory back (nothing if it is not loaded)."""
        if self.teacher_engines.pop(key, None) is None:
            return
        gc.collect()
        if torch.cuda.is_available():  # the teacher's blocks go back to the device, not to torch's cache
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Frees the engine (a vLLM engine's scratch files and memory)."""
        self.engine.close()


class RayGeneration(GenerationInterface):
    """``GenerationInterface`` over a :class:`WorkerGroup` of :class:`RolloutWorker` (see the module docstring).

    Args:
        refit_transport: ``object_store``, ``broadcast`` or ``cuda_ipc`` (resolved).
        timeout_s: bounds the setup of a refit's process group.
        offload_trainer: trainer workers sharing the engines' GPUs; they offload to host while the engines
            generate and reload when the rollout is collected. None leaves the trainer alone.
    """

    needs_refit = True
    samples_elsewhere = True

    def __init__(
        self,
        workers: WorkerGroup,
        pad_token_id: int,
        refit_bucket_bytes: int,
        refit_transport: str = "object_store",
        timeout_s: float = 600.0,
        offload_trainer: WorkerGroup | None = None,
    ) -> None:
        self.workers = workers
        self.pad_token_id = pad_token_id
        self.refit_bucket_bytes = refit_bucket_bytes
        self.offload_trainer = offload_trainer
        # The engines' dtype: every worker builds the same engine.
        self.engine_dtype: torch.dtype = workers.run_rank(0, "engine_dtype")
        self.transport = TRANSPORTS[refit_transport](workers, refit_bucket_bytes, self.engine_dtype, timeout_s)

    def prepare_for_generation(self) -> None:
        """Nothing to switch on: the workers sample in eval mode on every call."""

    def finish_generation(self) -> None:
        """Nothing to release: HF workers keep their weights for the next refit."""

    def generate(
        self,
        prompts: list[list[int]],
        strategy: GenerateStrategyConfig,
        num_samples: int = 1,
        return_logprobs: bool = True,
    ) -> BatchedDataDict:
        """The workers' samples, in prompt order (see ``GenerationInterface.generate``)."""
        return self.generate_async(prompts, strategy, num_samples, return_logprobs).result()

    def generate_async(
        self,
        prompts: list[list[int]],
        strategy: GenerateStrategyConfig,
        num_samples: int = 1,
        return_logprobs: bool = True,
        teacher: str | None = None,
        pad_token_id: int | None = None,
    ) -> Pending[BatchedDataDict]:
        """Hands each worker its share of the prompts and returns while they sample.

        The seed is drawn now, so a rollout depends on when it was asked for, not when it is collected.
        ``teacher``: sample from that teacher the workers loaded (:class:`TeacherOnRolloutWorkers`) instead of
        the student, its rows padded with ``pad_token_id``.
        """
        seed = int(torch.randint(_SEED_RANGE, (1,)))
        if self.offload_trainer is not None:
            self.offload_trainer.run_all("offload_to_host")
        count = min(self.workers.size, len(prompts))
        bounds = [len(prompts) * rank // count for rank in range(count + 1)]
        refs = [
            self.workers.actors[rank].generate.remote(
                prompts[bounds[rank] : bounds[rank + 1]], strategy, num_samples, return_logprobs, seed, teacher
            )
            for rank in range(count)
        ]
        pad = self.pad_token_id if pad_token_id is None else pad_token_id
        return self.workers.pending(
            refs, lambda parts: self._concat(parts, pad), ranks=list(range(count)), what="generate"
        )

    def _concat(self, parts: list[BatchedDataDict], pad_token_id: int) -> BatchedDataDict:
        if self.offload_trainer is not None:  # the engines are done with the GPUs
            self.offload_trainer.run_all("reload_to_device")
        return BatchedDataDict.concat(parts, pad_values={"input_ids": pad_token_id})

    def refit(self, policy: PolicyInterface) -> dict[str, float]:
        """Loads ``policy``'s weights into every worker; returns ``refit/bytes`` and ``refit/bytes_delivered``."""
        from opd.distributed.fsdp_policy import FSDPPolicy

        if isinstance(policy, FSDPPolicy):  # the trainer's ranks gather and send the buckets themselves
            return self.transport.send(policy.workers).metrics()
        # A student in the controller's process (no trainer workers): through the object store.
        weights = ((name, tensor.to(self.engine_dtype)) for name, tensor in policy.weights_for_refit())
        refs, sent = put_in_buckets(weights, self.refit_bucket_bytes)
        self.workers.run_all("load_buckets", refs)
        return RefitReport(sent, sent * self.workers.size).metrics()

    def close(self) -> None:
        """Closes the engines and stops the workers (a worker that died already is skipped)."""
        # A dead worker's engine went with its process; the others still close theirs.
        with contextlib.suppress(WorkerError):
            self.workers.run_all("close")
        self.workers.stop()


class TeacherOnRolloutWorkers(GenerationInterface):
    """A teacher's answers, sampled by the rollout workers with the teacher's weights (validation baselines).

    Workers load the teacher as ``key`` on the first :meth:`generate`, deal prompts as for the student, and free
    it on :meth:`close`.
    """

    def __init__(self, rollout: RayGeneration, key: str, model_path: str, tokenizer: Any) -> None:
        self.rollout = rollout
        self.key = key
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.loaded = False

    def prepare_for_generation(self) -> None:
        """Nothing to switch on: the workers load the teacher on the first call."""

    def finish_generation(self) -> None:
        """Nothing to release between calls: :meth:`close` frees the teacher."""

    def generate(
        self,
        prompts: list[list[int]],
        strategy: GenerateStrategyConfig,
        num_samples: int = 1,
        return_logprobs: bool = True,
    ) -> BatchedDataDict:
        """The teacher's samples, in prompt order (see ``GenerationInterface.generate``)."""
        if not self.loaded:
            self.rollout.workers.run_all("load_teacher", self.key, self.model_path, self.tokenizer)
            self.loaded = True
        pending = self.rollout.generate_async(
            prompts, strategy, num_samples, return_logprobs, self.key, self.tokenizer.pad_token_id
        )
        return pending.result()

    def close(self) -> None:
        """Frees the teacher in every worker (a worker that died already is skipped)."""
        if self.loaded:
            self.loaded = False
            with contextlib.suppress(WorkerError):
                self.rollout.workers.run_all("free_teacher", self.key)
