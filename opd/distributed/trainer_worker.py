"""One rank of the FSDP2 student trainer: a Ray actor that holds a shard of the student.

The controller (:class:`~opd.distributed.fsdp_policy.FSDPPolicy`) plans each rank's
micro-batches and sends them; every rank runs forward and backward on its own, FSDP2
sums the gradients over the ranks, and the ranks agree on the global metrics with one
all-reduce before the optimizer step, so they all skip a non-finite step together.

A colocated teacher is a frozen copy sharded the same way (no gradients, no optimizer),
or with ``cluster.teacher.sharded: false`` a whole copy in every rank: it scores each
micro-batch right where the student's hidden states are, so the exact full-vocabulary
loss needs nothing to cross a process boundary.

A teacher that runs apart (a pool, a served teacher) sends its full-vocabulary answer as
final hidden states alone (:class:`~opd.models.interfaces.TeacherHiddenStates`): every
rank loads that teacher's output layer once (``TrainerSpec.teacher_head_path``) and binds
the hidden states it receives to it, so the fused loss makes the teacher's logits chunk by
chunk, as with a colocated teacher.

A LoRA student (``model.lora``) is wrapped with peft before it is sharded: the frozen
base weights are sharded like any others, only the adapters are in the optimizer, and
checkpoints hold the adapters and their optimizer state. Whatever leaves the trainer as
a model (the refit, ``final_model/``) is the merged plain model under the base model's
names, as the in-process LoRA student gives it (:mod:`opd.models.policy.lora`).
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Iterable, Iterator
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
from opd.distributed.dispatch import Split, dispatch, every, first, nothing, summed
from opd.distributed.fsdp import HIDDEN_STATES_METHOD, init_process_group, rank_device, shard_model, whole_buckets
from opd.distributed.refit_sender import RefitSender
from opd.distributed.sharded_loading import load_sharded
from opd.distributed.shared_directory import marker_name
from opd.models.config import LoraConfig, ModelLoadingConfig, OptimizerConfig
from opd.models.interfaces import (
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
from opd.models.policy.hf_policy import ADAPTER_DIR
from opd.models.policy.lora import (
    adapter_parameters,
    initialise_adapters,
    merged_tensors,
    plain_entries,
    wrap_with_lora,
)
from opd.models.policy.optimization import (
    accumulate_gradients,
    accumulate_metrics,
    apply_gradients,
    build_optimizer,
    build_scheduler,
    student_output,
)
from opd.models.teacher.context_teacher import ContextTeacher
from opd.models.teacher.local_teacher import LocalTeacher
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
    """What every trainer rank builds: the student, its optimizer, and (colocated) the teacher.

    Attributes:
        student_path: the student's starting weights (hub name, directory or ``tiny:``).
        teacher_path: a colocated teacher's weights; None when the teacher runs elsewhere.
        loading: dtype and loading options of both models.
        optimizer: AdamW and schedule settings.
        total_steps: optimizer steps planned (for decaying schedules).
        backend: ``gloo`` or ``nccl``.
        timeout_s: bound on every collective.
        threads: torch threads of a CPU rank.
        reshard_after_forward: free the student's gathered layers after each forward
            (``cluster.trainer.reshard_after_forward``).
        teacher_sharded: shard a colocated teacher with FSDP2; False keeps a whole copy
            in every rank (``cluster.teacher.sharded``).
        shard_group_size: None shards over every rank (FSDP2); ``k`` shards within groups
            of ``k`` ranks and replicates across them (HSDP, ``cluster.trainer.shard_group_size``).
        activation_checkpointing: recompute each student layer's activations in the
            backward (``cluster.trainer.activation_checkpointing``).
        teacher_head_path: the model whose output layer (only that layer) every rank loads,
            in ``loading.dtype``, to bind the hidden states that a teacher running apart (a
            pool, a served teacher) sends for a full-vocabulary loss; None without one.
        lora: train low-rank adapters on the frozen student (``model.lora``); None
            trains every weight.
        seed: the run's seed, which draws a LoRA student's starting adapter (as the
            in-process student draws it).
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
    teacher_sharded: bool = True
    shard_group_size: int | None = None
    activation_checkpointing: bool = False
    teacher_head_path: str | None = None
    lora: LoraConfig | None = None
    seed: int = 0


class ShardedTeacher(LocalTeacher):
    """A frozen teacher sharded with FSDP2: its forward gathers the weights, under ``no_grad``."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.no_grad_mode = torch.no_grad

    def final_hidden_states(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return getattr(self.model, HIDDEN_STATES_METHOD)(**inputs)


def release_gathered_root(model: Any) -> None:
    """Frees the root group's gathered weights (embedding, final norm, head) of an FSDP2 model.

    FSDP2 keeps them after a forward for the backward that follows; a frozen teacher, or
    a student scored under ``no_grad``, has none, so they would stay gathered (for a 32B
    teacher, its 3.1 GB of bf16 embedding and head on every rank) until the next forward.
    """
    if isinstance(model, FSDPModule):
        model.reshard()


class TrainerWorker(RefitSender):
    """One FSDP2 rank (created by :class:`~opd.distributed.worker_group.WorkerGroup` as a Ray actor).

    Built in two calls, because rank 0 may be on another node than the controller: the
    constructor only records its place, rank 0's :meth:`rendezvous_address` names where the
    process group meets, and :meth:`start` joins it and builds the models.

    Args:
        rank: this rank.
        world_size: trainer ranks in all.
        spec: what to build.
    """

    def __init__(self, rank: int, world_size: int, spec: TrainerSpec) -> None:
        torch.set_num_threads(spec.threads)
        self.rank, self.world_size, self.spec = rank, world_size, spec

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: this node's address and a free port, where the process group will meet."""
        import ray  # only inside a Ray actor

        from opd.distributed.ray_cluster import free_port

        return ray.util.get_node_ip_address(), free_port()

    def start(self, master_addr: str, master_port: int) -> None:
        """Joins the process group at rank 0's address, then loads and shards the models."""
        spec = self.spec
        mesh = init_process_group(
            self.rank, self.world_size, master_addr, master_port, spec.backend, spec.timeout_s, spec.shard_group_size
        )
        self.build(mesh, rank_device(spec.backend))

    def build(self, mesh: DeviceMesh, device: torch.device) -> None:
        """Loads and shards the student (and a colocated teacher) over ``mesh``; builds the optimizer.

        Separate from :meth:`start` so that a process group made elsewhere (a fake one,
        for ``opd plan``'s dry run) builds the very same trainer.
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

        # Each rank reads only its shards of the weights: the whole model is never in one process.
        self.model = load_sharded(
            spec.student_path,
            torch.float32,
            self.device,
            spec.loading,
            shard_student,
            (lambda model: initialise_adapters(model, spec.seed)) if spec.lora is not None else None,
        )
        self.model.train()
        self.optimizer = build_optimizer(self.model, spec.optimizer)
        self.scheduler = build_scheduler(self.optimizer, spec.optimizer, spec.total_steps)
        self.teacher: LocalTeacher | None = None
        if spec.teacher_path is not None:
            if spec.teacher_sharded:
                teacher_model = load_sharded(
                    spec.teacher_path, dtype, self.device, spec.loading, lambda model: shard_model(model, mesh)
                )
                teacher_model.requires_grad_(False)
                self.teacher = ShardedTeacher(teacher_model)
            else:  # a whole copy scores as the in-process teacher does, with no collective at all
                teacher_model = load_causal_lm(spec.teacher_path, dtype, self.device, spec.loading)
                teacher_model.requires_grad_(False)
                self.teacher = LocalTeacher(teacher_model)
        # The output layer of a teacher that runs apart, loaded once: its hidden states are bound to it here.
        self.teacher_head: OutputLayer | None = None
        if spec.teacher_head_path is not None:
            self.teacher_head = load_output_layer(
                spec.teacher_head_path, dtype, self.device, spec.loading.trust_remote_code
            )
        release_cached_memory(self.device)

    # ------------------------------------------------------------------ sharing the device

    def offload_to_host(self) -> int:
        """Moves the optimizer state and a colocated teacher to host memory; returns the bytes moved.

        Called while colocated rollout engines generate on this rank's GPU (NeMo-RL's
        offload): Adam's two moments are twice the student's fp32 weights, and a teacher
        is often larger than the student, so this is most of what the engine needs.
        The student's own weights stay: the refit reads them.
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
        teacher = set() if self.teacher is None else {str(p.device) for p in self.teacher.model.parameters()}
        return {"optimizer": sorted(optimizer), "teacher": sorted(teacher)}

    def _move_optimizer_state(self, device: torch.device) -> int:
        moved = 0
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # The step counters are 0-dim host tensors by design; only the moments move.
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
                    state[key] = value.to(device, non_blocking=device.type == "cpu")
                    moved += value.numel() * value.element_size()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return moved

    def _move_teacher(self, device: torch.device) -> int:
        if self.teacher is None:
            return 0
        moved = sum(p.numel() * p.element_size() for p in self.teacher.model.parameters() if p.device != device)
        torch.nn.Module.to(self.teacher.model, device)  # FSDP2 moves each shard; a whole copy moves whole
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
            loss_fn: called per micro-batch.
            global_valid_tokens: loss-carrying tokens of the whole global batch.
            global_valid_seqs: sequences of the whole global batch.
            micro_batches: this rank's share, as many micro-batches as every other rank
                (already packed when the run packs sequences).
            teacher_signals: the teacher's answer for each micro-batch when the teacher
                runs elsewhere; None to score with the colocated teacher (or no teacher).

        Returns:
            The global metrics (the same on every rank), plus this rank's own timings:
            ``teacher_seconds`` (in its colocated teacher) and ``compute_seconds`` (the
            whole call).
        """
        start = time.perf_counter()
        request = loss_fn.teacher_request
        teacher_seconds = 0.0
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)

        def teacher_answer(index: int, micro_batch: BatchedDataDict) -> TeacherSignal | None:
            nonlocal teacher_seconds
            if teacher_signals is not None:
                return self._received(teacher_signals[index])
            if request is None:
                return None
            teacher_start = time.perf_counter()
            answer = self._score_colocated(micro_batch, request)
            teacher_seconds += time.perf_counter() - teacher_start
            return answer

        totals = accumulate_gradients(
            micro_batches, self.device, self._forward, loss_fn, teacher_answer, global_valid_tokens, global_valid_seqs
        )
        if isinstance(self.teacher, ShardedTeacher) and teacher_signals is None:
            # Kept gathered over the micro-batches (one all-gather per step), freed for what comes next.
            release_gathered_root(self.teacher.model)
        totals = self._sum_over_ranks(totals)
        parameters = [param for param in self.model.parameters() if param.requires_grad]
        totals = apply_gradients(parameters, self.optimizer, self.scheduler, self.spec.optimizer.max_grad_norm, totals)
        totals["teacher_seconds"] = teacher_seconds
        totals["compute_seconds"] = time.perf_counter() - start
        return totals

    def _sum_over_ranks(self, totals: dict[str, float]) -> dict[str, float]:
        """Each metric summed over the ranks, ``*_max`` ones maximised.

        Ranks may hold different keys (several routed teachers: a rank whose rows all
        went to one teacher has no metrics of the other), so the keys are gathered first
        and a rank without a key adds nothing to it (0 to a sum, −inf to a maximum).
        """
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(totals))
        every_key = sorted({key for keys in gathered for key in keys or []})
        reduced: dict[str, float] = {}
        for op, keys, missing in (
            (dist.ReduceOp.SUM, [key for key in every_key if not key.endswith("_max")], 0.0),
            (dist.ReduceOp.MAX, [key for key in every_key if key.endswith("_max")], -math.inf),
        ):
            if keys:
                # On the compute device: an NCCL process group has no CPU backend.
                values = torch.tensor(
                    [totals.get(key, missing) for key in keys], dtype=torch.float64, device=self.device
                )
                dist.all_reduce(values, op=op)
                reduced.update(zip(keys, values.tolist(), strict=True))
        return reduced

    def _received(self, signal: TeacherSignal) -> TeacherSignal:
        """A teacher's answer sent by the controller, on this rank's device (hidden states bound to the head)."""
        return bind_teacher_head(signal_to_device(signal, self.device), self.teacher_head, f"trainer rank {self.rank}")

    def _score_colocated(self, micro_batch: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The colocated teacher's answer for a micro-batch, under each row's teacher-only context if it has one.

        Context distillation (``distillation.teacher_context``): the rows carry
        ``teacher_prompt_ids``, and the teacher scores each completion after its own prompt
        (:class:`~opd.models.teacher.context_teacher.ContextTeacher`), as in one process.
        """
        teacher: TeacherInterface = self._colocated_teacher()
        if "teacher_prompt_ids" in micro_batch:
            # Its padding is never attended (rows carry their lengths) and carries no loss: any id serves.
            teacher = ContextTeacher(teacher, pad_token_id=0)
        return teacher.score(micro_batch, request)

    def _colocated_teacher(self) -> LocalTeacher:
        if self.teacher is None:
            raise RuntimeError("this trainer has no colocated teacher; the controller must send teacher signals")
        return self.teacher

    # ------------------------------------------------------------------ inference

    @dispatch(Split.PER_RANK, gather=summed)
    def compare_with_teacher(
        self,
        comparison: TeacherComparison,
        micro_batches: list[BatchedDataDict],
        teacher_signals: list[TeacherSignal] | None,
    ) -> dict[str, float]:
        """This rank's sums of ``comparison`` over its micro-batches (every rank must call it).

        The student runs to its final hidden states without gradient; ``comparison`` makes
        the logits from them chunk by chunk. The teacher's answers come from the controller,
        or (None) from the colocated teacher, which answers a full-vocabulary request with
        its own hidden states and head: no ``[B, L, V]`` tensor is made or sent.
        """
        totals: dict[str, float] = {}
        with torch.no_grad():
            for index, micro_batch in enumerate(micro_batches):
                micro_batch = micro_batch.to(self.device)
                if teacher_signals is not None:
                    teacher_output = self._received(teacher_signals[index])
                else:
                    teacher_output = self._score_colocated(micro_batch, comparison.teacher_request)
                hidden = getattr(self.model, HIDDEN_STATES_METHOD)(**model_inputs(micro_batch, self.device))
                # Read after the forward: the root's weights (the head) are gathered only then.
                student = output_layer_of(self.model, "the student").over(hidden)
                accumulate_metrics(totals, comparison(student, teacher_output, micro_batch))
                del teacher_output, student, hidden
                release_gathered_root(self.model)
                if self.teacher is not None:
                    release_gathered_root(self.teacher.model)
        return totals

    def teacher_score(self, request: TeacherRequest, data: BatchedDataDict) -> TeacherSignal:
        """The colocated teacher's top-k or token log-probs for this rank's rows.

        A full-vocabulary answer is refused: it stays in the worker (``train`` and
        ``compare_with_teacher`` use it there), since ``[B, L, V]`` floats must not be sent.
        """
        if isinstance(request, FullVocabRequest):
            raise ValueError("the colocated teacher's full vocabulary is used in the worker, never sent")
        with torch.no_grad():
            signal = self._colocated_teacher().score(data, request)
        release_gathered_root(self._colocated_teacher().model)
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
        """Rank 0: every weight, whole, on CPU (the others gather with it and return nothing).

        A LoRA student's are merged, under the base model's names (what the refit sends).
        """
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

        A LoRA student is written as the in-process one writes it: merged into a plain
        model in ``directory``, and its adapter alone in peft's format in ``directory/adapter/``.
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
        """Writes this rank's shard of the model and optimizer (and, rank 0, the schedule) to ``directory``.

        A LoRA student writes its adapters only (and their optimizer state): the frozen
        base weights are the run's starting model, loaded again on resume.
        """
        model_state, optim_state = self._checkpoint_state()
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(Path(directory) / SHARDS_DIR))
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), Path(directory) / SCHEDULER_FILE)
            # What `opd export` needs to rebuild a model around the consolidated weights
            # (the fp32 masters, written in model.dtype).
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
        """A checkpoint's model state: every weight, or (LoRA) the adapters alone.

        A LoRA student's state dict lacks the frozen weights, which a strict load would
        call missing; ``dcp.load`` still fails on any adapter the checkpoint lacks.
        """
        lora = self.peft_model is not None
        return StateDictOptions(strict=not lora, ignore_frozen_params=lora)

    def node_name(self) -> str:
        """This worker's node, as errors name it: its host name and its address in the cluster."""
        import ray  # only inside a Ray actor

        return f"{socket.gethostname()}/{ray.util.get_node_ip_address()}"

    def write_marker(self, directory: str, token: str) -> tuple[str, str, str | None]:
        """Writes this rank's marker file into ``directory`` (see :mod:`opd.distributed.shared_directory`).

        Returns:
            ``(file name, node, error)``: the error is why the write failed (the
            directory cannot be made on this node), else None.
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
