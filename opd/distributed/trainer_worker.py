"""One rank of the FSDP2 student trainer: a Ray actor that holds a shard of the student.

The controller (:class:`~opd.distributed.fsdp_policy.FSDPPolicy`) sends each rank its micro-batches; FSDP2 sums
the gradients, and one all-reduce of the metrics before the optimizer step lets all ranks skip a non-finite step
together. A colocated teacher (sharded the same way, or whole per rank with ``cluster.teacher.sharded: false``)
scores each micro-batch where the student's hidden states are, so the full-vocabulary loss crosses no process
boundary. A teacher that runs apart sends final hidden states only; every rank binds them to that teacher's output
layer, loaded once. A LoRA student is wrapped with peft before sharding; only adapters are optimized and
checkpointed, and whatever leaves the trainer as a model is merged under the base model's names
(:mod:`opd.policy.lora`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import model_inputs
from opd.distributed.fsdp import HIDDEN_STATES_METHOD, init_process_group, rank_device, shard_model, whole_buckets
from opd.distributed.refit.sender import RefitSender
from opd.distributed.sharded_loading import load_sharded
from opd.distributed.workers.dispatch import Split, dispatch, every, first, nothing, summed
from opd.distributed.workers.shared_directory import marker_name
from opd.models.config import LoraConfig, ModelLoadingConfig, OptimizerConfig
from opd.models.interfaces import (
    AnsweredWhereTrained,
    FullVocabRequest,
    LossFunction,
    TeacherComparison,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    bind_teacher_head,
    signal_to_device,
)
from opd.models.lm_head import LMHeadInput, OutputLayer, output_layer_of
from opd.models.loading import load_causal_lm, load_output_layer, resolve_dtype
from opd.models.step_metrics import MetricValue, accumulate_metrics
from opd.policy.hf_policy import (
    ADAPTER_DIR,
    accumulate_gradients,
    apply_gradients,
    build_optimizer,
    build_scheduler,
    student_output,
)
from opd.policy.lora import (
    adapter_parameters,
    initialise_adapters,
    merged_tensors,
    plain_entries,
    wrap_with_lora,
)
from opd.teachers.context_teacher import ContextTeacher
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.several_teachers import MixedSignal, RoutedSignal
from opd.utils.devices import is_cpu, is_cuda
from opd.utils.memory import release_cached_memory

SHARDS_DIR = "policy_shards"
"""Where a checkpoint keeps the trainer's sharded model and optimizer (torch.distributed.checkpoint)."""
SCHEDULER_FILE = "scheduler.pt"
MODEL_CONFIG_DIR = "model_config"
"""The student's ``config.json`` in a sharded checkpoint."""
WHOLE_WEIGHTS_BUCKET_BYTES = 256 * 1024 * 1024
"""Bytes gathered per all-gather when the whole student goes to rank 0 (final model, export)."""


@dataclass(frozen=True)
class TrainerSpec:
    """What every trainer rank builds: the student, its optimizer, and (colocated) the teachers.

    Attributes:
        student_path: the student's starting weights (hub name, directory or ``tiny:``).
        teacher_path: a colocated teacher's weights; None when it runs elsewhere or ``teacher_paths`` is set.
        total_steps: optimizer steps planned (for decaying schedules).
        timeout_s: bound on every collective.
        threads: torch threads of a CPU rank.
        reduce_gradients_once_per_step: gradients reduced after a step's last micro-batch only (each rank
            accumulating whole ones until then), not after each (``cluster.trainer.reduce_gradients``).
        teacher_sharded: shard a colocated teacher with FSDP2; False keeps a whole copy per rank.
        shard_group_size: None shards over every rank; ``k`` shards within groups of ``k`` and replicates (HSDP).
        teacher_head_path: model whose output layer alone every rank loads (``loading.dtype``) to bind the hidden
            states a teacher running apart sends; None without one.
        seed: draws a LoRA student's starting adapter, as the in-process student does.
        teacher_paths: several colocated teachers' weights, in ``teachers.members`` order.
        teacher_assembly: the run's teacher builder, applied to the loaded colocated teachers (routing, mixture,
            context, tokenizer mapping). None: the one teacher, under each row's teacher-only context if any.
        teacher_head_paths: ``teacher_head_path`` per member of several teachers running apart (None: no hidden
            states).
        teacher_share_prompt_forward: per colocated teacher, in :meth:`colocated_teachers` order (empty: on);
            a sharded teacher never shares.
    """

    student_path: str
    teacher_path: str | None
    loading: ModelLoadingConfig
    optimizer: OptimizerConfig
    total_steps: int
    backend: str
    timeout_s: float
    threads: int
    reshard_after_forward: bool = True
    reduce_gradients_once_per_step: bool = True
    teacher_sharded: bool = True
    shard_group_size: int | None = None
    activation_checkpointing: bool = False
    teacher_head_path: str | None = None
    lora: LoraConfig | None = None
    seed: int = 0
    teacher_paths: tuple[str, ...] = ()
    teacher_assembly: Callable[[list[TeacherInterface]], TeacherInterface] | None = None
    teacher_head_paths: tuple[str | None, ...] = ()
    teacher_share_prompt_forward: tuple[bool, ...] = ()

    def colocated_teachers(self) -> tuple[str, ...]:
        """The weights of every colocated teacher, in order (none when the teachers run elsewhere)."""
        if self.teacher_paths:
            return self.teacher_paths
        return () if self.teacher_path is None else (self.teacher_path,)

    def heads(self) -> tuple[str | None, ...]:
        """Each teacher's output layer to load, by member position (one teacher: position 0)."""
        return self.teacher_head_paths or ((self.teacher_head_path,) if self.teacher_head_path is not None else ())


class ShardedTeacher(LocalTeacher):
    """A frozen teacher sharded with FSDP2: its forward gathers the weights, under ``no_grad``."""

    def __init__(self, model: Any) -> None:
        # One forward per micro-batch, so every rank gathers the weights in the same passes.
        super().__init__(model, share_prompt_forward=False)
        self.no_grad_mode = torch.no_grad

    def final_hidden_states(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return getattr(self.model, HIDDEN_STATES_METHOD)(**inputs)


def bind_members(signal: TeacherSignal, heads: Sequence[OutputLayer | None], holder: str) -> TeacherSignal:
    """A teacher's answer with every member's hidden states bound to that member's output layer.

    One teacher binds to ``heads[0]``; routed parts to their member's head; a mixture is mixed here once its
    members are bound (:meth:`MixedSignal.mix_bound`). ``holder`` names who lacks a missing layer in the error.
    """

    def head(member: int) -> OutputLayer | None:
        return heads[member] if member < len(heads) else None

    if isinstance(signal, RoutedSignal):
        parts = [
            dataclasses.replace(part, signal=bind_teacher_head(part.signal, head(part.teacher), holder))
            for part in signal.parts
        ]
        return dataclasses.replace(signal, parts=parts)
    if isinstance(signal, MixedSignal):
        members = [bind_teacher_head(answer, head(index), holder) for index, answer in enumerate(signal.members)]
        return signal.mix_bound(members)
    return bind_teacher_head(signal, head(0), holder)


class Lockstep:
    """Keeps the ranks' sharded colocated teachers in step: one forward each per micro-batch, in member order.

    A sharded forward gathers weights from every rank, so all ranks must run the same forwards in the same order.
    A member with no routed rows on this rank runs a dropped one-token forward in its turn.
    """

    def __init__(self, members: Sequence[LocalTeacher], device: torch.device) -> None:
        self.members, self.device = list(members), device
        self.done = 0  # members that ran in this micro-batch's turn

    def turn(self, member: int) -> None:
        """Member ``member`` is about to score: the members before it that did not run theirs stand-in forwards."""
        self._run_until(member)
        self.done = max(self.done, member + 1)

    def finish(self) -> None:
        """The micro-batch is scored: the members after the last that scored run their stand-in forwards."""
        self._run_until(len(self.members))
        self.done = 0

    def _run_until(self, end: int) -> None:
        stand_in = {"input_ids": torch.zeros((1, 1), dtype=torch.long, device=self.device)}
        with torch.no_grad():
            for member in self.members[self.done : end]:
                member.final_hidden_states(stand_in)
        self.done = max(self.done, end)


class InTurn(TeacherInterface):
    """A sharded colocated teacher that takes its turn (:class:`Lockstep`) before it scores."""

    def __init__(self, teacher: LocalTeacher, position: int, lockstep: Lockstep) -> None:
        self.teacher, self.position, self.lockstep = teacher, position, lockstep

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """As the wrapped in-process teacher's."""
        return LocalTeacher.unsupported_reason(request)

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The teacher's answer, after the stand-in forwards of the members before it."""
        self.lockstep.turn(self.position)
        return self.teacher.score(data, request)


def release_gathered_root(model: Any) -> None:
    """Frees the root group's gathered weights (embedding, final norm, head) of an FSDP2 model.

    FSDP2 keeps them for the backward; without one (frozen teacher, ``no_grad``) they would stay gathered until the
    next forward.
    """
    if isinstance(model, FSDPModule):
        model.reshard()


class TrainerWorker(RefitSender):
    """One FSDP2 rank (created by :class:`~opd.distributed.workers.worker_group.WorkerGroup` as a Ray actor).

    Built in two calls because rank 0 may be on another node: rank 0's :meth:`rendezvous_address` names where the
    process group meets, then :meth:`start` joins it and builds the models.
    """

    def __init__(self, rank: int, world_size: int, spec: TrainerSpec) -> None:
        torch.set_num_threads(spec.threads)
        self.rank, self.world_size, self.spec = rank, world_size, spec

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: this node's address and a free port, where the process group will meet."""
        import ray  # only inside a Ray actor

        from opd.distributed.workers.ray_cluster import free_port

        return ray.util.get_node_ip_address(), free_port()

    def start(self, master_addr: str, master_port: int) -> None:
        """Joins the process group at rank 0's address, then loads and shards the models."""
        spec = self.spec
        mesh = init_process_group(
            self.rank, self.world_size, master_addr, master_port, spec.backend, spec.timeout_s, spec.shard_group_size
        )
        self.build(mesh, rank_device(spec.backend))

    def build(self, mesh: DeviceMesh, device: torch.device) -> None:
        """Loads and shards the student (and colocated teachers) over ``mesh``; builds the optimizer.

        Separate from :meth:`start` so that ``opd plan``'s fake process group builds the very same trainer.
        """
        spec = self.spec
        self.device = device
        dtype = resolve_dtype(spec.loading.dtype, self.device)
        # fp32 master weights; a 16-bit model.dtype is the compute dtype (FSDP2 mixed precision).
        self.compute_dtype = dtype
        compute_dtype = dtype if dtype != torch.float32 else None
        self.peft_model: Any = None  # a LoRA student's PeftModel (it writes the adapter's files)

        def shard_student(model: Any) -> Any:
            if spec.lora is not None:  # the adapters are sharded with the layers they sit in
                self.peft_model = wrap_with_lora(model, spec.lora)
            return shard_model(model, mesh, compute_dtype, spec.reshard_after_forward, spec.activation_checkpointing)

        added = (lambda model: initialise_adapters(model, spec.seed)) if spec.lora is not None else None
        # Each rank reads only its shards of the weights: the whole model is never in one process.
        self.model = load_sharded(spec.student_path, torch.float32, self.device, spec.loading, shard_student, added)
        self.model.train()
        self.optimizer = build_optimizer(self.model, spec.optimizer)
        self.scheduler = build_scheduler(self.optimizer, spec.optimizer, spec.total_steps)
        # Each colocated teacher's model (frozen), and the teacher the ranks score with around them.
        sharing = spec.teacher_share_prompt_forward or (True,) * len(spec.colocated_teachers())
        self.teacher_members = [
            self._load_teacher(path, mesh, dtype, share)
            for path, share in zip(spec.colocated_teachers(), sharing, strict=True)
        ]
        self.teacher: TeacherInterface | None = None
        # Several sharded teachers run their forwards in step over the ranks (routing skips some).
        self.lockstep: Lockstep | None = None
        if spec.teacher_sharded and len(self.teacher_members) > 1:
            self.lockstep = Lockstep(self.teacher_members, self.device)
        if self.teacher_members:
            loaded: list[TeacherInterface] = list(self.teacher_members)
            if self.lockstep is not None:
                loaded = [InTurn(member, index, self.lockstep) for index, member in enumerate(self.teacher_members)]
            assembly = spec.teacher_assembly
            self.teacher = assembly(loaded) if assembly is not None else loaded[0]
        # The output layers of teachers that run apart, loaded once: their hidden states are bound to them here.
        self.teacher_heads: list[OutputLayer | None] = [
            None if path is None else load_output_layer(path, dtype, self.device, spec.loading.trust_remote_code)
            for path in spec.heads()
        ]
        release_cached_memory(self.device)

    def _load_teacher(self, path: str, mesh: DeviceMesh, dtype: torch.dtype, share_prompt: bool) -> LocalTeacher:
        """One frozen colocated teacher: sharded over ``mesh``, or whole (then ``share_prompt`` applies)."""
        spec = self.spec
        if spec.teacher_sharded:  # LocalTeacher freezes the model, sharded or whole
            model = load_sharded(path, dtype, self.device, spec.loading, lambda whole: shard_model(whole, mesh))
            return ShardedTeacher(model)
        # A whole copy scores as the in-process teacher does, with no collective at all.
        model = load_causal_lm(path, dtype, self.device, spec.loading)
        return LocalTeacher(model, share_prompt_forward=share_prompt)

    def colocated_teacher_bytes(self) -> int:
        """The whole (unsharded) size of the colocated teachers' weights: what a sharded one gathers per forward."""
        return sum(
            parameter.numel() * parameter.element_size()  # a DTensor's numel is its whole tensor's
            for member in self.teacher_members
            for parameter in member.model.parameters()
        )

    def _release_teachers(self) -> None:
        """Frees what the colocated teachers' forwards left gathered (see :func:`release_gathered_root`)."""
        for member in self.teacher_members:
            release_gathered_root(member.model)

    # ------------------------------------------------------------------ sharing the device

    def offload_to_host(self) -> int:
        """Moves the optimizer state and colocated teachers to host memory; returns the bytes moved.

        Frees the GPU for colocated rollout engines. The student's weights stay: the refit reads them.
        """
        host = torch.device("cpu")
        moved = self._move_optimizer_state(host) + self._move_teacher(host)
        release_cached_memory(self.device)
        return moved

    def reload_to_device(self) -> int:
        """Brings back what :meth:`offload_to_host` moved; returns the bytes moved."""
        return self._move_optimizer_state(self.device) + self._move_teacher(self.device)

    def state_devices(self) -> dict[str, list[str]]:
        """The devices the optimizer state and the teacher's weights are on now (for tests)."""
        optimizer = {
            str(value.device)
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        }
        teacher = {str(p.device) for member in self.teacher_members for p in member.model.parameters()}
        return {"optimizer": sorted(optimizer), "teacher": sorted(teacher)}

    def _move_optimizer_state(self, device: torch.device) -> int:
        moved = 0
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # The step counters are 0-dim host tensors by design; only the moments move.
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
                    state[key] = value.to(device, non_blocking=is_cpu(device))
                    moved += value.numel() * value.element_size()
        if is_cuda(device):
            torch.cuda.synchronize(device)
        return moved

    def _move_teacher(self, device: torch.device) -> int:
        moved = 0
        for member in self.teacher_members:
            moved += sum(p.numel() * p.element_size() for p in member.model.parameters() if p.device != device)
            torch.nn.Module.to(member.model, device)  # FSDP2 moves each shard; a whole copy moves whole
        return moved

    def pid(self) -> int:
        """This worker's process id (tests kill it to check fault handling)."""
        return os.getpid()

    # ------------------------------------------------------------------ training

    def _forward(self, micro_batch: BatchedDataDict, fused_lm_head: bool) -> torch.Tensor | LMHeadInput:
        """The student's logits, or its final hidden states and head (through the method FSDP2 hooks)."""
        return student_output(
            self.model, micro_batch, self.device, fused_lm_head, getattr(self.model, HIDDEN_STATES_METHOD)
        )

    @dispatch(Split.PER_RANK, gather=every)
    def train(
        self,
        loss_fn: LossFunction,
        global_valid_tokens: int,
        global_valid_seqs: int,
        micro_batches: list[BatchedDataDict],
        teacher_signals: list[TeacherSignal] | None,
    ) -> dict[str, float]:
        """Forward and backward over this rank's micro-batches, then one optimizer step on every rank.

        Args:
            global_valid_tokens: loss-carrying tokens of the whole global batch (``global_valid_seqs``: sequences).
            micro_batches: this rank's share; every rank gets as many (already packed if the run packs).
            teacher_signals: the answer per micro-batch (``AnsweredWhereTrained``: score here); None: no teacher.

        Returns:
            The global metrics (same on every rank) plus this rank's ``teacher_seconds`` and ``compute_seconds``.
        """
        start = time.perf_counter()
        teacher_seconds = 0.0
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)

        def teacher_answer(index: int, micro_batch: BatchedDataDict) -> TeacherSignal | None:
            nonlocal teacher_seconds
            if teacher_signals is None:
                return None
            teacher_start = time.perf_counter()
            answer = self._answer(teacher_signals[index], micro_batch)
            teacher_seconds += time.perf_counter() - teacher_start
            return answer

        totals = accumulate_gradients(
            micro_batches,
            self.device,
            self._forward,
            loss_fn,
            teacher_answer,
            global_valid_tokens,
            global_valid_seqs,
            self.model.set_requires_gradient_sync if self.spec.reduce_gradients_once_per_step else None,
        )
        if self.teacher_members:
            # Kept gathered over the micro-batches (one all-gather per step), freed for what comes next.
            self._release_teachers()
        parameters = [param for param in self.model.parameters() if param.requires_grad]
        metrics = apply_gradients(
            parameters, self.optimizer, self.scheduler, self.spec.optimizer.max_grad_norm, self._sum_over_ranks(totals)
        )
        metrics["teacher_seconds"] = teacher_seconds
        metrics["compute_seconds"] = time.perf_counter() - start
        return metrics

    def _sum_over_ranks(self, totals: dict[str, MetricValue]) -> dict[str, MetricValue]:
        """Each metric summed over the ranks, ``*_max`` ones maximised, left on the device (read with the norm).

        Ranks may hold different keys (routed teachers), so keys are gathered first; a missing key adds 0 or −inf.
        """
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(totals))
        every_key = sorted({key for keys in gathered for key in keys or []})
        reduced: dict[str, MetricValue] = {}
        for op, keys, missing in (
            (dist.ReduceOp.SUM, [key for key in every_key if not key.endswith("_max")], 0.0),
            (dist.ReduceOp.MAX, [key for key in every_key if key.endswith("_max")], -math.inf),
        ):
            if keys:
                # On the compute device: an NCCL process group has no CPU backend.
                values = torch.stack(
                    [
                        torch.as_tensor(totals.get(key, missing), dtype=torch.float64, device=self.device).reshape(())
                        for key in keys
                    ]
                )
                dist.all_reduce(values, op=op)
                reduced.update(zip(keys, values.unbind(), strict=True))
        return reduced

    def _answer(self, signal: TeacherSignal, micro_batch: BatchedDataDict) -> TeacherSignal:
        """The teacher's answer for ``micro_batch``: made here when the driver's teacher says so, else as sent
        (on this rank's device, bound by :func:`bind_members`)."""
        if isinstance(signal, AnsweredWhereTrained):
            return self._score_colocated(micro_batch, signal.request)
        return bind_members(signal_to_device(signal, self.device), self.teacher_heads, f"trainer rank {self.rank}")

    def _score_colocated(self, micro_batch: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The colocated teachers' answer for a micro-batch, as the run's teacher gives it in one process.

        Without ``TrainerSpec.teacher_assembly``, rows carrying ``teacher_prompt_ids`` are scored under a
        :class:`~opd.teachers.context_teacher.ContextTeacher`.
        """
        if self.teacher is None:
            raise RuntimeError("this trainer has no colocated teacher; the controller must send teacher signals")
        teacher = self.teacher
        if self.spec.teacher_assembly is None and "teacher_prompt_ids" in micro_batch:
            # Its padding is never attended (rows carry their lengths) and carries no loss: any id serves.
            teacher = ContextTeacher(teacher, pad_token_id=0)
        answer = teacher.score(micro_batch, request)
        if self.lockstep is not None:
            self.lockstep.finish()
        return answer

    # ------------------------------------------------------------------ inference

    @dispatch(gather=first)
    def teacher_student_classes(self) -> torch.Tensor | None:
        """What the assembled teacher's top-k ids name, when it has another tokenizer (None: student tokens)."""
        return None if self.teacher is None else self.teacher.student_classes

    @dispatch(Split.PER_RANK, gather=summed)
    def compare_with_teacher(
        self,
        comparison: TeacherComparison,
        micro_batches: list[BatchedDataDict],
        teacher_signals: list[TeacherSignal],
    ) -> dict[str, float]:
        """This rank's sums of ``comparison`` over its micro-batches (a collective: every rank calls it).

        ``comparison`` makes logits chunk by chunk from hidden states, so no ``[B, L, V]`` tensor is made or sent.
        """
        totals: dict[str, float] = {}
        with torch.no_grad():
            for index, micro_batch in enumerate(micro_batches):
                micro_batch = micro_batch.to(self.device)
                teacher_output = self._answer(teacher_signals[index], micro_batch)
                hidden = getattr(self.model, HIDDEN_STATES_METHOD)(**model_inputs(micro_batch, self.device))
                # Read after the forward: the root's weights (the head) are gathered only then.
                student = output_layer_of(self.model, "the student").over(hidden)
                accumulate_metrics(totals, comparison(student, teacher_output, micro_batch))
                del teacher_output, student, hidden
                release_gathered_root(self.model)
                self._release_teachers()
        return totals

    def teacher_score(self, request: TeacherRequest, data: BatchedDataDict) -> TeacherSignal:
        """The run's teacher, as assembled here, on this rank's rows: top-k or token log-probs, sent back.

        Raises ValueError for a full-vocabulary request: ``[B, L, V]`` floats are used in the worker, never sent.
        """
        if isinstance(request, FullVocabRequest):
            raise ValueError("the colocated teacher's full vocabulary is used in the worker, never sent")
        if self.teacher is None:
            raise RuntimeError("this trainer has no colocated teacher")
        with torch.no_grad():
            signal = self.teacher.score(data, request)
        self._release_teachers()
        return signal_to_device(signal, torch.device("cpu"))

    # ------------------------------------------------------------------ weights out

    def refit_entries(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What leaves the trainer as the student: a LoRA student's merged weights under the base model's names."""
        entries = super().refit_entries()
        return merged_tensors(self.model, entries) if self.peft_model is not None else entries

    def refit_shapes(self) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`refit_entries` by name, shape and dtype, without the merge's collectives."""
        shapes = super().refit_shapes()
        return plain_entries(self.model, shapes) if self.peft_model is not None else shapes

    @dispatch(gather=first)
    def whole_weights(self) -> dict[str, torch.Tensor]:
        """Rank 0: every weight (LoRA merged), whole, on CPU; the other ranks gather with it and return nothing."""
        return self._whole(self.refit_entries())

    def _whole(self, entries: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Rank 0: ``entries`` whole, on CPU (a collective; the other ranks return nothing)."""
        weights: dict[str, torch.Tensor] = {}
        for bucket in whole_buckets(entries, WHOLE_WEIGHTS_BUCKET_BYTES):
            if self.rank == 0:
                weights.update((name, tensor.cpu()) for name, tensor in bucket)
        return weights

    @dispatch(gather=nothing)
    def save_pretrained(self, directory: str) -> None:
        """Gathers the whole student; rank 0 writes it in ``model.dtype`` as a Hugging Face model directory.

        A LoRA student is written merged, plus its adapter in peft's format in ``directory/adapter/``.
        """
        weights = self.whole_weights()
        if self.rank == 0:  # in model.dtype, as an in-process run writes it
            weights = {name: tensor.to(self.compute_dtype) for name, tensor in weights.items()}
            self.model.config.dtype = self.compute_dtype
            self.model.save_pretrained(directory, state_dict=weights, safe_serialization=True)
            self.model.config.dtype = torch.float32
        if self.peft_model is not None:
            adapter = self._whole(adapter_parameters(self.model).items())
            if self.rank == 0:  # under the PeftModel's names, which peft's writer expects
                state = {f"base_model.model.{name}": tensor.to(self.compute_dtype) for name, tensor in adapter.items()}
                self.peft_model.save_pretrained(
                    str(Path(directory) / ADAPTER_DIR), state_dict=state, safe_serialization=True
                )
        dist.barrier()

    # The refit's methods (weight_buckets, broadcast_weights, ...) come from RefitSender.

    # ------------------------------------------------------------------ checkpoints

    @dispatch(gather=nothing)
    def save_shards(self, directory: str) -> None:
        """Writes this rank's shard of the model and optimizer (rank 0: also the schedule) to ``directory``.

        A LoRA student writes only its adapters and their optimizer state; resume reloads the base model.
        """
        model_state, optim_state = self._checkpoint_state()
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(Path(directory) / SHARDS_DIR))
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), Path(directory) / SCHEDULER_FILE)
            # For `opd export` to rebuild a model around the consolidated fp32 masters (in model.dtype).
            self.model.config.dtype = self.compute_dtype
            self.model.config.save_pretrained(str(Path(directory) / MODEL_CONFIG_DIR))
            self.model.config.dtype = torch.float32
        dist.barrier()

    @dispatch(gather=nothing)
    def load_shards(self, directory: str) -> None:
        """Restores model, optimizer and schedule from a checkpoint written with any number of ranks."""
        model_state, optim_state = self._checkpoint_state()
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(Path(directory) / SHARDS_DIR))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_state,  # filled in place by dcp.load
            optim_state_dict=optim_state,
            options=self._state_options(),
        )
        self.scheduler.load_state_dict(torch.load(Path(directory) / SCHEDULER_FILE, weights_only=True))

    def _checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's model and optimizer state as a checkpoint holds them (a LoRA student: its adapters only)."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        if self.peft_model is not None:  # a head tied to the frozen embedding would come along
            adapters = adapter_parameters(self.model)
            model_state = {name: value for name, value in model_state.items() if name in adapters}
        return model_state, optim_state

    def _state_options(self) -> StateDictOptions:
        """A checkpoint's model state: every weight, or (LoRA, non-strict) the adapters alone.

        ``dcp.load`` still fails on any adapter the checkpoint lacks.
        """
        lora = self.peft_model is not None
        return StateDictOptions(strict=not lora, ignore_frozen_params=lora)

    def node_name(self) -> str:
        """This worker's node, as errors name it: its host name and its address in the cluster."""
        import ray  # only inside a Ray actor

        return f"{socket.gethostname()}/{ray.util.get_node_ip_address()}"

    def write_marker(self, directory: str, token: str) -> tuple[str, str, str | None]:
        """Writes this rank's marker file into ``directory`` (see :mod:`opd.distributed.workers.shared_directory`).

        Returns ``(file name, node, error)``; error says why the write failed on this node (an ``OSError``), else
        None, and :func:`~opd.distributed.workers.shared_directory.check_shared_directory` adds it to the nodes it
        names.

        Raises:
            ValueError: ``directory`` is relative: the controller's mistake, not a filesystem the nodes do not share,
                so it fails the call instead of being reported as this node's.
        """
        if not Path(directory).is_absolute():  # it would name a place in this worker's own working directory
            raise ValueError(f"the controller must send an absolute checkpoint directory, got {directory!r}")
        node = self.node_name()
        name = marker_name(token, self.rank, node)
        try:
            path = Path(directory)
            path.mkdir(parents=True, exist_ok=True)
            (path / name).write_text(f"rank {self.rank} of {self.world_size} on {node}\n", encoding="utf-8")
        except OSError as error:
            return name, node, f"{type(error).__name__}: {error}"
        return name, node, None

    def remove_marker(self, directory: str, token: str) -> None:
        """Removes this rank's marker of ``token`` from ``directory``, if it is there."""
        (Path(directory) / marker_name(token, self.rank, self.node_name())).unlink(missing_ok=True)

    def shutdown(self) -> None:
        """Leaves the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()
