"""``opd plan``: what a cluster run will hold on each device (bytes), from its config alone.

:func:`plan_memory` dry-runs the trainer's step (:func:`opd.plan.dry_run.dry_run_rank`) at the configured shapes,
with and without activation checkpointing, which measures the peak and its standing part. The dry run counts
allocated bytes; the verdicts count what the caching allocator reserves, the allocated peak × a stated factor
(:data:`RESERVED_FACTOR`). Computed from the shapes instead: the other teacher placements, the loss's chunk, the
rollout engine and its worker's process (:meth:`~opd.rollout.engine_kind.EngineKind.planned_memory`,
:meth:`~opd.rollout.engine_kind.EngineKind.worker_memory`), and, where the engines share the trainer's devices,
the busier moment of such a device (:meth:`MemoryPlan.colocated_checks`). From a sample of the training data:
the share of a step's tokens that is padding (:mod:`opd.plan.padding`). :func:`render_plan` prints a table,
:meth:`MemoryPlan.as_dict` JSON.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from opd.distillation.config import MasterConfig, resolve_micro_batching
from opd.distributed.config import ClusterConfig
from opd.distributed.trainer_worker import TrainerSpec
from opd.models.interfaces import FullVocabRequest, LossFunction
from opd.models.lm_head import default_chunk_rows
from opd.models.model_shapes import model_config, tokenizer_size
from opd.plan.dry_run import RankMemory, ReplicaMemory, StepShape, dry_run_rank, dry_run_teacher_replica
from opd.plan.layer_extrapolation import BASE_DEPTH
from opd.plan.padding import PaddingShare, UnknownPadding, estimate_padding
from opd.rollout.engine_kind import (
    GIB,
    RUNTIME_RESERVE,
    EngineMemory,
    HeldMemory,
    PlannedRollout,
    RolloutWorkerMemory,
    gib,
    kv_bytes_per_token,
)
from opd.utils.errors import ConfigError

DEVICES = {"80 GB": 81_559 * 1024**2, "141 GB": 143_771 * 1024**2}
"""Device memory as ``nvidia-smi`` reports it: H100 80 GB (81,559 MiB) and H200 141 GB (143,771 MiB)."""
RESERVED_FACTOR = 1.15
"""The trainer's reserved peak over its allocated peak (``torch.cuda.max_memory_reserved()`` over
``max_memory_allocated()``): an assumption, not a measurement of opd's step.

The dry run counts the bytes of live tensors. PyTorch's caching allocator reserves more: blocks rounded up and
split, segments that fragment as activations of many sizes come and go, and FSDP2's all-gather and reduce-scatter
buffers, allocated on streams of their own, whose freed blocks the compute stream does not reuse. Reports of
FSDP2 training commonly put the reserved peak some 5 to 25% above the allocated one; 1.15 is a middle value.
``scripts/gpu_check.py``'s ``qwen*_step`` checks print both peaks of opd's step on a GPU; ``opd plan
--reserved-factor`` replaces the figure with a measured one.
"""
RESIDENT_STATES = {
    "kept": "trainer state kept on the device",
    "offloaded": "Adam moments, teacher offloaded",
}
"""What the trainer keeps on the device while the engine samples, by ``cluster.trainer.offload_during_generation``."""
EMPTIES_CACHE_BEFORE_SAMPLING = {"kept": False, "offloaded": True}
"""Whether the trainer hands its cached blocks back to the device before a colocated engine samples, by resident
state: offloading ends with ``torch.cuda.empty_cache()`` (``TrainerWorker.offload_to_host``); otherwise nothing
empties the trainer's cache between its step and the rollout, so it still reserves its step's peak."""
_OFFLOAD_REMEDY = "set cluster.trainer.offload_during_generation: true"


def _trainer_peak_remedy(checkpointing: bool) -> str:
    """The settings that lower the trainer's peak, given whether it already checkpoints its activations."""
    settings = "a smaller training.micro_batch_size"
    if not checkpointing:
        settings = "cluster.trainer.activation_checkpointing: true, or " + settings
    return f"lower the trainer's peak ({settings})"


@dataclass
class MemoryPlan:
    """What ``opd plan`` found (see the module docstring); bytes per device."""

    world_size: int
    student: str
    teacher: str | None
    teacher_placement: str
    micro_batch_size: int
    prompt_tokens: int
    response_tokens: int
    vocab_size: int
    activation_checkpointing: bool
    student_parameters_total: int
    teacher_parameters_total: int
    ranks: dict[str, list[RankMemory]]
    """``"off"`` / ``"on"`` (activation checkpointing) → the ranks dry-run."""
    ranks_equal: bool
    teacher_whole_bytes: int
    loss_chunk_rows: int
    loss_chunk_bytes: int
    kv_bytes_per_token: int
    engine: dict[str, dict[str, EngineMemory]] = field(default_factory=dict)
    """Device → ``"kept"`` / ``"offloaded"`` (``cluster.trainer.offload_during_generation``) → the engine's memory."""
    engine_arithmetic: str = ""
    """How ``generation.backend``'s engine counts its memory (the table's heading)."""
    engine_untraced: str = ""
    """What the engine holds that its budget leaves out (printed under it)."""
    dry_run_steps: int = 1
    teacher_in_trainer: str = ""
    """What of the teacher a trainer rank holds: a colocated copy, a pooled or served teacher's output layer, none."""
    shard_ranks: int = 0
    """Ranks each parameter is sharded over: the trainer workers, or an HSDP group."""
    lora: bool = False
    """The student trains LoRA adapters (its base weights are frozen: no gradients or Adam moments for them)."""
    teacher_replica: ReplicaMemory | None = None
    """A teacher pool: what the first device of one replica holds while it scores a micro-batch."""
    teacher_shards_per_replica: int = 1
    reduce_gradients_once_per_step: bool = False
    """``cluster.trainer.reduce_gradients: once_per_step`` (whole gradients held while micro-batches accumulate)."""
    micro_batches: int = 1
    """Micro-batches per rank per step in the dry run."""
    reserved_factor: float = RESERVED_FACTOR
    """The caching allocator's reserved peak over the allocated peak (``opd plan --reserved-factor``)."""
    colocated: bool = False
    """The rollout engines share the trainer's devices (``cluster.placement: colocated``)."""
    trainer_resident: dict[str, int] = field(default_factory=dict)
    """``"kept"`` / ``"offloaded"`` → the allocated bytes a trainer rank keeps on its device while the engines
    sample."""
    rollout_worker: RolloutWorkerMemory | None = None
    """What a rollout worker's process holds on its device beside its engine."""
    padding: PaddingShare | UnknownPadding | None = None
    """The share of a step's tokens that is padding, from a sample of the training data (:mod:`opd.plan.padding`)."""

    def peak_of(self, key: str) -> int:
        """The largest peak over the ranks dry-run under ``key`` (``"off"`` / ``"on"``)."""
        return max((rank.peak for rank in self.ranks.get(key, [])), default=0)

    def reserved(self, allocated: int) -> int:
        """What the caching allocator reserves for an ``allocated`` peak (× :attr:`reserved_factor`)."""
        return math.ceil(allocated * self.reserved_factor)

    def reserved_peak_of(self, key: str) -> int:
        """The reserved peak of the dry runs under ``key`` (``"off"`` / ``"on"``)."""
        return self.reserved(self.peak_of(key))

    def configured_key(self) -> str:
        """The dry runs of the configured activation checkpointing, or of the larger peak where those did not run."""
        configured = "on" if self.activation_checkpointing else "off"
        return configured if configured in self.ranks else max(self.ranks, key=self.peak_of)

    def verdicts(self) -> dict[str, dict[str, bool]]:
        """Device → ``"off"`` / ``"on"`` → whether the trainer's reserved peak plus the runtime reserve fits."""
        return {
            device: {key: self.reserved_peak_of(key) + RUNTIME_RESERVE <= size for key in self.ranks}
            for device, size in DEVICES.items()
        }

    def colocated_checks(self) -> dict[str, dict[str, ColocatedCheck]]:
        """Device → ``"kept"`` / ``"offloaded"`` → the busier moment of a device an engine shares with a trainer rank.

        Empty when the engines have devices of their own (``cluster.placement: split``).
        """
        if not self.colocated or self.rollout_worker is None:
            return {}
        return {
            device: {
                label: max(self._shared_device_moments(label, budget, DEVICES[device]), key=lambda check: check.total)
                for label, budget in budgets.items()
            }
            for device, budgets in self.engine.items()
        }

    def _shared_device_moments(
        self, label: str, budget: EngineMemory, device_bytes: int
    ) -> tuple[ColocatedCheck, ColocatedCheck]:
        """The device while the engine samples, and at the refit (right after the step, the trainer's cache full).

        The trainer's cache keeps its step's reserved peak until something empties it (see
        :data:`EMPTIES_CACHE_BEFORE_SAMPLING`); the rollout worker's process and the trainer's each need their runtime.
        """
        assert self.rollout_worker is not None
        key = self.configured_key()
        remedy = _trainer_peak_remedy(checkpointing=key == "on")
        at_peak = HeldMemory(self.reserved_peak_of(key), "trainer (reserved peak)", remedy)
        if EMPTIES_CACHE_BEFORE_SAMPLING[label]:
            sampling_trainer = HeldMemory(self.trainer_resident[label], "trainer (resident, cache emptied)")
        else:
            sampling_trainer = HeldMemory(at_peak.size, at_peak.what, _OFFLOAD_REMEDY)
        beside = (
            HeldMemory(self.rollout_worker.total, "rollout worker"),
            HeldMemory(RUNTIME_RESERVE, "runtime reserve"),
        )
        return (
            ColocatedCheck("while sampling", (sampling_trainer, budget.while_sampling, *beside), device_bytes),
            ColocatedCheck("at the refit", (at_peak, budget.at_refit, *beside), device_bytes),
        )

    def as_dict(self) -> dict[str, Any]:
        """Everything as plain JSON values (``opd plan --json``)."""
        data = asdict(self)
        data["ranks"] = {
            key: [{**asdict(rank), "standing": rank.standing, "transient": rank.transient} for rank in runs]
            for key, runs in self.ranks.items()
        }
        data["verdicts"] = self.verdicts()
        data["reserved_peaks"] = {key: self.reserved_peak_of(key) for key in self.ranks}
        data["colocated_checks"] = {
            device: {label: check.as_dict() for label, check in checks.items()}
            for device, checks in self.colocated_checks().items()
        }
        data["padding"] = self.padding.as_dict() if self.padding is not None else None
        data["devices"] = DEVICES
        data["runtime_reserve"] = RUNTIME_RESERVE
        return data


@dataclass(frozen=True)
class ColocatedCheck:
    """One moment of a device a rollout engine shares with a trainer rank: what each part holds, against the device."""

    moment: str
    parts: tuple[HeldMemory, ...]
    device_bytes: int

    @property
    def total(self) -> int:
        """Every part's bytes."""
        return sum(part.size for part in self.parts)

    @property
    def fits(self) -> bool:
        """The parts fit the device."""
        return self.total <= self.device_bytes

    def describe(self) -> str:
        """The sum against the device, and where it does not fit, the settings that make its parts smaller."""
        terms = " + ".join(f"{part.what} {gib(part.size)}" for part in self.parts)
        line = f"{self.moment}: {terms} = {gib(self.total)} of {gib(self.device_bytes)} GiB: "
        if self.fits:
            return line + "fits"
        return line + "DOES NOT FIT (" + "; ".join(part.remedy for part in self.parts if part.remedy) + ")"

    def as_dict(self) -> dict[str, Any]:
        """The check as plain JSON values (``opd plan --json``)."""
        return {**asdict(self), "total": self.total, "fits": self.fits}


def _parameter_shapes(config: PretrainedConfig) -> list[torch.Size]:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [parameter.shape for parameter in model.parameters()]


def _plannable_cluster(config: MasterConfig) -> ClusterConfig:
    """The config's ``cluster:`` section, if the dry run can plan it (see :func:`plan_memory`'s errors)."""
    cluster = config.cluster
    if cluster is None:
        raise ConfigError(
            "opd plan plans a cluster run: the config has no cluster: section (e.g. cluster.trainer.workers=8)"
        )
    if config.teachers is not None:
        raise ConfigError(
            "opd plan plans one teacher (model.teacher_model_path or teacher:); several teachers (teachers:) are not "
            "planned yet: plan each member's run alone"
        )
    return cluster


def _gpu_element_bytes(dtype: str) -> int:
    """Bytes of one weight loaded on a GPU in ``model.dtype`` (``auto`` is bfloat16 there)."""
    return 2 if dtype in ("bfloat16", "float16", "auto") else 4


def _add_engine_budgets(
    plan: MemoryPlan, config: MasterConfig, cluster: ClusterConfig, student_config: PretrainedConfig, shape: StepShape
) -> None:
    """What the rollout engine and its worker hold per device size, with the trainer's state kept or offloaded."""
    generation = config.generation
    first = next(iter(plan.ranks.values()))[0]
    # Offloading moves the Adam moments and the teacher to the host; the student's shard stays (the refit reads it).
    plan.trainer_resident = {
        "kept": first.student_parameters + first.optimizer_state + first.teacher_parameters,
        "offloaded": first.student_parameters,
    }
    plan.colocated = cluster.colocated
    prompts_per_engine = math.ceil(config.training.batch_size / cluster.rollout.workers)
    rows = prompts_per_engine * config.distillation.num_samples_per_prompt
    plan.engine_arithmetic = generation.engine.memory_arithmetic
    plan.engine_untraced = generation.engine.untraced_memory

    def rollout(device_bytes: int, trainer_bytes: int) -> PlannedRollout:
        """One engine's rollout on a device of ``device_bytes``, beside ``trainer_bytes`` where it shares one."""
        return PlannedRollout(
            device_bytes,
            trainer_bytes if cluster.colocated else 0,
            student_config,
            plan.student_parameters_total,
            plan.vocab_size,
            shape.prompt_tokens,
            shape.response_tokens,
            rows,
            _gpu_element_bytes(config.model.dtype),
        )

    for device, size in DEVICES.items():
        plan.engine[device] = {
            label: generation.engine.planned_memory(generation, rollout(size, trainer_bytes))
            for label, trainer_bytes in plan.trainer_resident.items()
        }
    # The worker's process holds the same on any device.
    plan.rollout_worker = generation.engine.worker_memory(generation, rollout(next(iter(DEVICES.values())), 0))


@dataclass(frozen=True)
class _TeacherPlacement:
    """Where the plan puts the teacher, and what of it each trainer rank holds."""

    label: str
    in_trainer: str
    """What of the teacher each trainer rank holds (the table's row)."""
    colocated_path: str | None
    """The teacher the trainer ranks hold (sharded or whole); None when it runs apart."""
    head_path: str | None
    """A teacher apart that answers a full-vocabulary loss: the trainer ranks hold its output layer."""
    sharded_in_trainer: bool
    pool_shards: int | None
    """A teacher pool the dry run measures: the devices of one replica; None otherwise."""

    @classmethod
    def of(
        cls, config: MasterConfig, cluster: ClusterConfig, teacher_path: str | None, loss_fn: Any
    ) -> _TeacherPlacement:
        full_vocab = isinstance(loss_fn.teacher_request, FullVocabRequest)
        if not config.teacher.served and not cluster.teacher.in_pool:
            label = "colocated, sharded" if cluster.teacher.sharded else "colocated, whole"
            return cls(label, label, teacher_path, None, cluster.teacher.sharded, None)
        head = teacher_path if full_vocab else None
        if full_vocab and teacher_path is None:
            raise ConfigError(
                "opd plan: a full-vocabulary loss binds the served teacher's hidden states to its output layer, read "
                "from model.teacher_model_path; set it"
            )
        in_trainer = "its output layer" if head else "none"
        if config.teacher.served:
            return cls("served", in_trainer, None, head, False, None)
        pool = cluster.teacher.pool_engine.planned_placement(cluster.teacher)
        return cls(pool.label, in_trainer, None, head, False, pool.dry_run_shards)


def _trainer_spec(
    config: MasterConfig, cluster: ClusterConfig, placement: _TeacherPlacement, checkpointing: bool
) -> TrainerSpec:
    """The trainer ranks as the run builds them, with the Adam implementation CUDA gets from ``auto`` (fused)."""
    optimizer = config.training
    if optimizer.adam_implementation == "auto":
        optimizer = optimizer.model_copy(update={"adam_implementation": "fused"})
    return TrainerSpec(
        student_path=config.model.student_model_path,
        teacher_path=placement.colocated_path,
        loading=config.model,
        optimizer=optimizer,
        total_steps=config.training.max_num_steps or 1,
        backend="nccl",
        timeout_s=cluster.worker_timeout_s,
        threads=1,
        reshard_after_forward=cluster.trainer.reshard_after_forward,
        reduce_gradients_once_per_step=cluster.trainer.reduces_gradients_once_per_step,
        teacher_sharded=cluster.teacher.sharded,
        shard_group_size=cluster.trainer.shard_group_size,
        activation_checkpointing=checkpointing,
        teacher_head_path=placement.head_path,
        lora=config.model.active_lora(),
        seed=config.training.seed,
    )


def _step_shape(config: MasterConfig, world: int) -> StepShape:
    """The micro-batches one rank trains on in a step, as the config sizes them."""
    if config.data.max_prompt_length is None:
        raise ConfigError("opd plan sizes each row as data.max_prompt_length + the response's max_length: set it")
    micro_batch_size, accumulation = resolve_micro_batching(config)
    # At most two: the second runs beside the first's gradients, as every later one does (more add no memory).
    per_rank = math.ceil(accumulation / world)
    return StepShape(
        micro_batch_size,
        config.data.max_prompt_length,
        config.distillation.generate_strategy.max_length,
        micro_batches=min(per_rank, 2),
    )


def _eager_loss(config: MasterConfig, vocab: int) -> LossFunction:
    """The run's loss, with eager kernels: the dry run measures those (an upper bound of the compiled ones)."""
    loss_settings = config.loss_fn
    if hasattr(loss_settings, "compile_kernels"):
        loss_settings = loss_settings.model_copy(update={"compile_kernels": False})
    return loss_settings.build(vocab, "cpu")


def plan_memory(
    config: MasterConfig, checkpointing_variants: tuple[bool, ...] = (False, True), *, every_layer: bool = False
) -> MemoryPlan:
    """Dry-runs the configured cluster's trainer (once per rank shown and checkpointing variant) and plans the rest.

    ``every_layer`` traces every decoder layer instead of extrapolating (:mod:`opd.plan.layer_extrapolation`).

    Raises:
        ConfigError: no ``cluster:`` section, several teachers, no ``data.max_prompt_length``, or a model without a
            config.
    """
    cluster = _plannable_cluster(config)
    from opd.distillation.teacher_loading import resolve_teacher_path

    world = cluster.trainer.workers
    # HSDP shards within groups of shard_group_size ranks.
    shard_ranks = cluster.trainer.shard_group_size or world
    student_path = config.model.student_model_path
    # A served top-k or token-log-prob teacher needs no path.
    teacher_path = resolve_teacher_path(config) if config.model.teacher_model_path is not None else None
    student_config = model_config(student_path)
    teacher_config = model_config(teacher_path) if teacher_path is not None else None
    vocab = tokenizer_size(config.model.tokenizer_path or student_path)
    shape = _step_shape(config, world)
    loss_fn = _eager_loss(config, vocab)
    placement = _TeacherPlacement.of(config, cluster, teacher_path, loss_fn)
    student_shapes = _parameter_shapes(student_config)
    teacher_shapes = _parameter_shapes(teacher_config) if teacher_config is not None else []
    sharded_shapes = student_shapes + (teacher_shapes if placement.sharded_in_trainer else [])
    # The last rank holds fewer rows when some parameter's rows do not divide by the ranks.
    uneven = any(len(shape) and shape[0] % shard_ranks for shape in sharded_shapes)
    ranks_to_run = [0, world - 1] if uneven and world > 1 else [0]
    hidden_size = teacher_config.hidden_size if teacher_config is not None else None
    runs = {
        "on" if checkpointing else "off": [
            dry_run_rank(spec, world, rank, shape, loss_fn, vocab, hidden_size, every_layer=every_layer)
            for rank in ranks_to_run
        ]
        for checkpointing in checkpointing_variants
        for spec in [_trainer_spec(config, cluster, placement, checkpointing)]
    }
    # model.parameters() yields a tied head once, so these count distinct weights.
    student_parameters = sum(math.prod(shape) for shape in student_shapes)
    teacher_parameters = sum(math.prod(shape) for shape in teacher_shapes)
    teacher_dtype_bytes = _gpu_element_bytes(config.model.dtype)
    chunk_rows = getattr(loss_fn, "chunk_size", None) or default_chunk_rows(vocab)
    plan = MemoryPlan(
        world_size=world,
        student=student_path,
        teacher=teacher_path,
        teacher_placement=placement.label,
        teacher_in_trainer=placement.in_trainer,
        micro_batch_size=shape.micro_batch_size,
        prompt_tokens=shape.prompt_tokens,
        response_tokens=shape.response_tokens,
        vocab_size=vocab,
        activation_checkpointing=cluster.trainer.activation_checkpointing,
        student_parameters_total=student_parameters,
        teacher_parameters_total=teacher_parameters,
        ranks=runs,
        ranks_equal=not uneven,
        teacher_whole_bytes=teacher_parameters * teacher_dtype_bytes,
        loss_chunk_rows=chunk_rows,
        loss_chunk_bytes=chunk_rows * vocab * 4,
        kv_bytes_per_token=kv_bytes_per_token(student_config),
        shard_ranks=shard_ranks,
        lora=config.model.active_lora() is not None,
        reduce_gradients_once_per_step=cluster.trainer.reduces_gradients_once_per_step,
        micro_batches=shape.micro_batches,
        padding=estimate_padding(config, world),
    )
    if placement.pool_shards is not None:
        assert teacher_path is not None and loss_fn.teacher_request is not None
        dtype = torch.bfloat16 if teacher_dtype_bytes == 2 else torch.float32
        plan.teacher_replica = dry_run_teacher_replica(
            teacher_path, dtype, placement.pool_shards, shape, loss_fn.teacher_request, every_layer=every_layer
        )
        plan.teacher_shards_per_replica = placement.pool_shards
    _add_engine_budgets(plan, config, cluster, student_config, shape)
    return plan


# ---------------------------------------------------------------------------- the table


def _layers_line(plan: MemoryPlan) -> str:
    """Which models the dry runs traced whole, and which at a few layers and extrapolated."""
    depths: dict[str, int] = {}
    for rank in (rank for ranks in plan.ranks.values() for rank in ranks):
        depths.update(rank.extrapolated_layers)
    if plan.teacher_replica is not None:
        depths.update(plan.teacher_replica.extrapolated_layers)
    if not depths:
        return "layers: every layer traced"
    models = ", ".join(f"{path} to {depth}" for path, depth in depths.items())
    return (
        f"layers: traced at {BASE_DEPTH} and {BASE_DEPTH + 1} and extrapolated ({models}); "
        "--every-layer traces every layer"
    )


def _gradients_line(plan: MemoryPlan) -> str:
    """How the step reduces gradients, and what that holds (``cluster.trainer.reduce_gradients``)."""
    if plan.micro_batches < 2:
        return "gradients: one micro-batch per rank, reduce-scattered after its backward"
    if plan.reduce_gradients_once_per_step:
        return (
            f"gradients: reduced once per step; while the {plan.micro_batches} micro-batches accumulate, each rank "
            "holds the student's whole fp32 gradients (in the peak above; reduce_gradients: every_micro_batch "
            "holds shards only)"
        )
    return f"gradients: reduce-scattered after each of the {plan.micro_batches} micro-batches"


NOT_TRACED = (
    "not traced (leave room for them): validation's generation and scoring, the teacher baselines, the refit's "
    "buffers (kept from the first refit: 2 × cluster.rollout.refit_bucket_mb per trainer rank under cuda_ipc; on "
    "trainer rank 0 and on each rollout worker under broadcast), the checkpoint save, and fragmentation beyond the "
    "reserved factor"
)
"""What the plan's peak leaves out, printed with its table."""


def _trainer_table(plan: MemoryPlan) -> list[str]:
    """The trainer's bytes per device, GiB, one column per dry run: its standing parts, the peak and its reserve."""
    columns = [(key, rank) for key, ranks in plan.ranks.items() for rank in ranks]
    header = "".join(f"  AC {key:>3} r{rank.rank:<2}" for key, rank in columns)
    lines = [f"trainer, GiB per device{'':14}" + header]

    def row(label: str, values: list[int]) -> None:
        lines.append(f"{label:<38}" + "".join(f"  {value / GIB:13.2f}" for value in values))

    if plan.lora:
        lines.append(
            "student: LoRA adapters on frozen base weights (gradients and Adam moments for the adapters alone)"
        )
    row("student parameters (fp32 shard)", [rank.student_parameters for _, rank in columns])
    row("student gradients (fp32 shard)", [rank.student_gradients for _, rank in columns])
    row("optimizer state (Adam, fp32 shard)", [rank.optimizer_state for _, rank in columns])
    row(f"teacher ({plan.teacher_in_trainer})", [rank.teacher_parameters for _, rank in columns])
    row("activations, gathered layers, loss", [rank.transient for _, rank in columns])
    row("peak (measured by the dry run)", [rank.peak for _, rank in columns])
    for kind in ("Activation", "Temp", "All Gather", "Unsharded Param", "Reduce Scatter"):
        if any(rank.peak_breakdown.get(kind) for _, rank in columns):
            row(f"  at the peak: {kind.lower()}", [rank.peak_breakdown.get(kind, 0) for _, rank in columns])
    row(f"reserved (allocated peak × {plan.reserved_factor:g})", [plan.reserved(rank.peak) for _, rank in columns])
    return lines


def _replica_lines(plan: MemoryPlan, replica: ReplicaMemory) -> list[str]:
    """A teacher pool replica's first device while it scores a micro-batch, and whether it fits each device."""
    reserved = plan.reserved(replica.peak)
    return [
        "",
        f"teacher {plan.teacher_placement}, GiB per device of a replica scoring one micro-batch:",
        f"  weights {gib(replica.weights)}   answer sent {gib(replica.answer)}   "
        f"peak (measured by the dry run) {gib(replica.peak)}   reserved (× {plan.reserved_factor:g}) {gib(reserved)}   "
        + "   ".join(
            f"{device}: {'fits' if reserved + RUNTIME_RESERVE <= size else 'DOES NOT FIT'}"
            for device, size in DEVICES.items()
        ),
    ]


def _verdict_lines(plan: MemoryPlan) -> list[str]:
    """Whether each dry run's reserved peak, with the runtime reserve, fits each device."""
    lines = [
        f"verdict (reserved peak + {gib(RUNTIME_RESERVE)} GiB runtime reserve; reserved = allocated peak × "
        f"{plan.reserved_factor:g}, an assumption until measured on a GPU: --reserved-factor sets it):"
    ]
    for device, by_key in plan.verdicts().items():
        verdict = ", ".join(
            f"activation checkpointing {key}: {'fits' if fits else 'DOES NOT FIT'} "
            f"({gib(plan.reserved_peak_of(key) + RUNTIME_RESERVE)} GiB)"
            for key, fits in by_key.items()
        )
        lines.append(f"  {device:>6}: {verdict}")
    return lines


def _engine_lines(plan: MemoryPlan) -> list[str]:
    """The rollout engine's budget per device and resident state, and its worker's process."""
    lines = [f"rollout engine ({plan.engine_arithmetic}, KV cache at {plan.kv_bytes_per_token:,} bytes per token):"]
    for device, budgets in plan.engine.items():
        described = {RESIDENT_STATES[label]: budget.describe() for label, budget in budgets.items()}
        if len(set(described.values())) == 1:  # the engine's budget does not depend on what the trainer keeps
            described = {"trainer state kept or offloaded": next(iter(described.values()))}
        lines += [f"  {device:>6}, {state:<33}: {description}" for state, description in described.items()]
    if plan.rollout_worker is not None:
        lines.append(f"  rollout worker, per device: {plan.rollout_worker.describe()}")
    if plan.engine_untraced:
        lines.append(f"  not counted: {plan.engine_untraced}")
    return lines


def _colocated_lines(plan: MemoryPlan) -> list[str]:
    """The busier moment of each device an engine shares with a trainer rank, or why there is none."""
    if not plan.colocated:
        return ["colocated check: does not apply (cluster.placement: split gives each engine devices of its own)"]
    lines = [
        f"colocated: the engine beside the trainer, the busier of sampling and the refit (activation checkpointing "
        f"{plan.configured_key()}; the trainer's cache keeps its step's reserved peak until offloading empties it):"
    ]
    for device, checks in plan.colocated_checks().items():
        for label, check in checks.items():
            lines.append(f"  {device:>6}, {RESIDENT_STATES[label]:<33}: {check.describe()}")
    return lines


def render_plan(plan: MemoryPlan) -> str:
    """The plan as plain-text tables: GiB per device, one column per dry run."""
    lines = [
        f"opd plan: {plan.world_size} trainer ranks; student {plan.student} "
        f"({plan.student_parameters_total / 1e9:.2f} B parameters), teacher {plan.teacher} "
        f"({plan.teacher_parameters_total / 1e9:.2f} B, {plan.teacher_placement}); micro-batch "
        f"{plan.micro_batch_size} × ({plan.prompt_tokens} prompt + {plan.response_tokens} response) tokens; "
        f"vocabulary {plan.vocab_size:,}",
        "ranks: "
        + (
            f"all {plan.world_size} hold equal shards (every parameter's rows divide by {plan.world_size}); "
            "rank 0 shown"
            if plan.ranks_equal
            else f"uneven shards: rank 0 and rank {plan.world_size - 1} shown"
        ),
        _layers_line(plan),
        "",
        *_trainer_table(plan),
    ]
    if plan.teacher_replica is not None:
        lines += _replica_lines(plan, plan.teacher_replica)
    lines += [
        "",
        "teacher placements, weights per device (16 bits):",
        f"  colocated, sharded over {plan.shard_ranks}: {gib(plan.teacher_whole_bytes // plan.shard_ranks)} GiB   "
        f"colocated, whole: {gib(plan.teacher_whole_bytes)} GiB   "
        f"pool replica (whole, one device): {gib(plan.teacher_whole_bytes)} GiB",
        f"loss: fused chunks of {plan.loss_chunk_rows} positions × {plan.vocab_size:,} = "
        f"{plan.loss_chunk_bytes / 2**20:.0f} MiB of fp32 logits per chunk (in the peak above)",
        _gradients_line(plan),
        *([plan.padding.describe()] if plan.padding is not None else []),
        NOT_TRACED,
        "",
        *_verdict_lines(plan),
        "",
        *_engine_lines(plan),
        "",
        *_colocated_lines(plan),
    ]
    return "\n".join(lines)
