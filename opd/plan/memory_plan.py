"""``opd plan``: what a cluster run will hold on each device (bytes), from its config alone.

:func:`plan_memory` dry-runs the trainer's step (:func:`opd.plan.dry_run.dry_run_rank`) at the configured shapes,
with and without activation checkpointing, which measures the peak and its standing part. Computed from the shapes
instead: the other teacher placements, the loss's chunk, and the rollout engine
(:meth:`~opd.rollout.engine_kind.EngineKind.planned_memory`). :func:`render_plan` prints a table,
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
from opd.rollout.engine_kind import GIB, EngineMemory, PlannedRollout, gib, kv_bytes_per_token
from opd.utils.errors import ConfigError

DEVICES = {"80 GB": 81_559 * 1024**2, "141 GB": 143_771 * 1024**2}
"""Device memory as ``nvidia-smi`` reports it: H100 80 GB (81,559 MiB) and H200 141 GB (143,771 MiB)."""
RUNTIME_RESERVE = int(1.5 * GIB)
"""Held outside PyTorch's tensors on every device: the CUDA context, NCCL's buffers, allocator slack."""
RESIDENT_STATES = {
    "kept": "trainer state kept on the device",
    "offloaded": "Adam moments, teacher offloaded",
}
"""What the trainer keeps on the device while the engine samples, by ``cluster.trainer.offload_during_generation``."""


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

    def peak_of(self, key: str) -> int:
        """The largest peak over the ranks dry-run under ``key`` (``"off"`` / ``"on"``)."""
        return max((rank.peak for rank in self.ranks.get(key, [])), default=0)

    def verdicts(self) -> dict[str, dict[str, bool]]:
        """Device → ``"off"`` / ``"on"`` → whether the trainer's peak plus the runtime reserve fits."""
        return {
            device: {key: self.peak_of(key) + RUNTIME_RESERVE <= size for key in self.ranks}
            for device, size in DEVICES.items()
        }

    def as_dict(self) -> dict[str, Any]:
        """Everything as plain JSON values (``opd plan --json``)."""
        data = asdict(self)
        data["ranks"] = {
            key: [{**asdict(rank), "standing": rank.standing, "transient": rank.transient} for rank in runs]
            for key, runs in self.ranks.items()
        }
        data["verdicts"] = self.verdicts()
        data["devices"] = DEVICES
        data["runtime_reserve"] = RUNTIME_RESERVE
        return data


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


def _add_engine_budgets(
    plan: MemoryPlan, config: MasterConfig, cluster: ClusterConfig, student_config: PretrainedConfig, shape: StepShape
) -> None:
    """What the rollout engine holds per device size, with the trainer's state kept or offloaded."""
    generation = config.generation
    first = next(iter(plan.ranks.values()))[0]
    # Offloading moves the Adam moments and the teacher to the host; the student's shard stays (the refit reads it).
    resident = {
        "kept": first.student_parameters + first.optimizer_state + first.teacher_parameters,
        "offloaded": first.student_parameters,
    }
    prompts_per_engine = math.ceil(config.training.batch_size / cluster.rollout.workers)
    rows = prompts_per_engine * config.distillation.num_samples_per_prompt
    plan.engine_arithmetic = generation.engine.memory_arithmetic
    for device, size in DEVICES.items():
        plan.engine[device] = {
            label: generation.engine.planned_memory(
                generation,
                PlannedRollout(
                    size,
                    trainer_bytes if cluster.colocated else 0,
                    student_config,
                    plan.student_parameters_total,
                    plan.vocab_size,
                    shape.prompt_tokens,
                    shape.response_tokens,
                    rows,
                ),
            )
            for label, trainer_bytes in resident.items()
        }


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
    teacher_dtype_bytes = 2 if config.model.dtype in ("bfloat16", "float16", "auto") else 4
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
    "buffers (kept from the first refit: 2 × cluster.rollout.refit_bucket_mb per trainer rank under cuda_ipc, on rank "
    "0 under broadcast), the checkpoint save, and what the caching allocator reserves beyond the allocated peak"
)
"""What the plan's peak leaves out, printed with its table."""


def render_plan(plan: MemoryPlan) -> str:
    """The plan as plain-text tables: GiB per device, one column per dry run."""
    columns = [(key, rank) for key, ranks in plan.ranks.items() for rank in ranks]
    header = "".join(f"  AC {key:>3} r{rank.rank:<2}" for key, rank in columns)
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
        f"trainer, GiB per device{'':14}" + header,
    ]

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
    if plan.teacher_replica is not None:
        replica = plan.teacher_replica
        lines += [
            "",
            f"teacher {plan.teacher_placement}, GiB per device of a replica scoring one micro-batch:",
            f"  weights {gib(replica.weights)}   answer sent {gib(replica.answer)}   "
            f"peak (measured by the dry run) {gib(replica.peak)}   "
            + "   ".join(
                f"{device}: {'fits' if replica.peak + RUNTIME_RESERVE <= size else 'DOES NOT FIT'}"
                for device, size in DEVICES.items()
            ),
        ]
    lines += [
        "",
        "teacher placements, weights per device (16 bits):",
        f"  colocated, sharded over {plan.shard_ranks}: {gib(plan.teacher_whole_bytes // plan.shard_ranks)} GiB   "
        f"colocated, whole: {gib(plan.teacher_whole_bytes)} GiB   "
        f"pool replica (whole, one device): {gib(plan.teacher_whole_bytes)} GiB",
        f"loss: fused chunks of {plan.loss_chunk_rows} positions × {plan.vocab_size:,} = "
        f"{plan.loss_chunk_bytes / 2**20:.0f} MiB of fp32 logits per chunk (in the peak above)",
        _gradients_line(plan),
        NOT_TRACED,
        "",
        "verdict (peak + 1.5 GiB runtime reserve):",
    ]
    for device, by_key in plan.verdicts().items():
        verdict = ", ".join(
            f"activation checkpointing {key}: {'fits' if fits else 'DOES NOT FIT'} "
            f"({gib(plan.peak_of(key) + RUNTIME_RESERVE)} GiB)"
            for key, fits in by_key.items()
        )
        lines.append(f"  {device:>6}: {verdict}")
    lines += [
        "",
        f"rollout engine ({plan.engine_arithmetic}, KV cache at {plan.kv_bytes_per_token:,} bytes per token):",
    ]
    for device, budgets in plan.engine.items():
        for label, budget in budgets.items():
            lines.append(f"  {device:>6}, {RESIDENT_STATES[label]:<33}: {budget.describe()}")
    return "\n".join(lines)
