"""Building the cluster's backends: the student, teacher and rollout worker groups behind their interfaces.

:func:`opd.distillation.setup.setup` calls :func:`build_cluster_backends` for a ``cluster:`` config. Ray is
imported only here and below, so the in-process path never needs it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import ray
import torch

from opd.distributed.colocated_teacher import TeacherInTrainerWorkers
from opd.distributed.config import ClusterConfig
from opd.distributed.fsdp_policy import FSDPPolicy
from opd.distributed.rollout import RayGeneration, RolloutSpec, RolloutWorker
from opd.distributed.teacher_pool import TeacherPool, TeacherWorker
from opd.distributed.trainer_worker import TrainerSpec, TrainerWorker
from opd.distributed.worker_hosts import warm_hosts
from opd.distributed.workers.ray_cluster import build_pools, check_colocated_sharing, cpus_needed, start_ray
from opd.distributed.workers.shared_directory import check_shared_directory
from opd.distributed.workers.worker_environment import worker_environment
from opd.distributed.workers.worker_group import Bound, Slot, WorkerGroup
from opd.models.config import LoraConfig, ModelLoadingConfig, OptimizerConfig
from opd.models.interfaces import GenerationInterface, TeacherInterface
from opd.rollout.engines import GenerationConfig
from opd.utils.errors import ConfigError
from opd.utils.paths import absolute_dir, absolute_model_path

log = logging.getLogger("opd")

_MIB = 1024 * 1024

TORCH_FLOOR = (2, 11)
"""The oldest torch (major, minor) the cluster runs on (FSDP2 and DTensor APIs), as in ``pyproject.toml``."""


def check_torch_version(version: str = torch.__version__) -> None:
    """Raises ConfigError for a torch older than :data:`TORCH_FLOOR`, which would fail deep in a worker."""
    found = re.match(r"(\d+)\.(\d+)", str(version))
    if found is not None and (int(found[1]), int(found[2])) >= TORCH_FLOOR:
        return
    floor = ".".join(map(str, TORCH_FLOOR))
    raise ConfigError(
        f"a cluster: run needs torch >= {floor} (FSDP2 and DTensor as opd uses them), and this environment has "
        f"torch {version}; install torch>={floor} (pip install 'torch>={floor}', with your CUDA index on GPU nodes)"
    )


@dataclass(frozen=True)
class ClusterRequest:
    """What the run needs from the cluster (everything else comes from ``cluster:``).

    Paths are made absolute here, in the controller (:mod:`opd.utils.paths`), never in a worker.

    Attributes:
        teacher_paths: teachers the cluster runs, by role (``teacher`` or ``teacher <name>``): all colocated in
            the trainer workers, or each in its own pool; empty when every teacher is served.
        micro_batch_tokens: a padded-token budget per micro-batch instead of ``micro_batch_size`` rows.
        checkpoint_dir: where trainer ranks write shards, checked at start to be one filesystem on every node.
        teacher_head_path, teacher_head_paths, teacher_assembly: as in
            :class:`~opd.distributed.trainer_worker.TrainerSpec`.
        share_prompt_forward: per teacher, in ``teacher_paths`` order (empty: on for every one).
    """

    student_path: str
    teacher_paths: dict[str, str]
    loading: ModelLoadingConfig
    optimizer: OptimizerConfig
    total_steps: int
    micro_batch_size: int
    micro_batch_tokens: int | None
    sequence_packing: bool
    tokenizer: Any
    generation: GenerationConfig
    seed: int = 0
    checkpoint_dir: str | None = None
    teacher_head_path: str | None = None
    lora: LoraConfig | None = None
    teacher_assembly: Callable[[list[TeacherInterface]], TeacherInterface] | None = None
    teacher_head_paths: tuple[str | None, ...] = ()
    share_prompt_forward: tuple[bool, ...] = ()

    def sharing(self, role: str) -> bool:
        """Whether the teacher of ``role`` shares its prompts' forward passes (default on)."""
        roles = list(self.teacher_paths)
        return self.share_prompt_forward[roles.index(role)] if self.share_prompt_forward else True

    def __post_init__(self) -> None:
        # Frozen: the absolute forms are set once, as the fields' own values.
        object.__setattr__(self, "student_path", absolute_model_path(self.student_path))
        teachers = {role: absolute_model_path(path) for role, path in self.teacher_paths.items()}
        object.__setattr__(self, "teacher_paths", teachers)
        if self.checkpoint_dir is not None:
            object.__setattr__(self, "checkpoint_dir", str(absolute_dir(self.checkpoint_dir)))
        if self.teacher_head_path is not None:
            object.__setattr__(self, "teacher_head_path", absolute_model_path(self.teacher_head_path))
        heads = tuple(None if path is None else absolute_model_path(path) for path in self.teacher_head_paths)
        object.__setattr__(self, "teacher_head_paths", heads)

    def heads(self) -> tuple[str | None, ...]:
        """Each teacher's output layer for the trainer ranks to load, by member position (one teacher: 0)."""
        return self.teacher_head_paths or ((self.teacher_head_path,) if self.teacher_head_path is not None else ())


def build_cluster_backends(
    cluster: ClusterConfig, request: ClusterRequest
) -> tuple[FSDPPolicy, list[TeacherInterface], GenerationInterface]:
    """Starts (or joins) Ray and the workers; returns the student, the cluster's teachers and the rollout engine.

    Colocated teachers come back as one :class:`~opd.distributed.colocated_teacher.TeacherInTrainerWorkers`;
    pooled teachers as one :class:`TeacherPool` per ``request.teacher_paths`` entry, in order.

    Raises:
        ConfigError: a torch older than :data:`TORCH_FLOOR`, or colocated roles with more workers than
            the trainer has bundles (both before Ray starts); a pool the cluster cannot place.
        WorkerError: a worker failed or did not start within ``cluster.start_timeout_s``.
    """
    check_torch_version()
    paths = list(request.teacher_paths.values())
    colocated_teacher = bool(paths) and not cluster.teacher.in_pool
    per_pool = cluster.teacher.workers
    teacher_workers = 0 if colocated_teacher else per_pool * len(paths)
    check_colocated_sharing(cluster, cluster.rollout.workers, teacher_workers)
    started_ray = start_ray(cluster, cpus_needed(cluster, cluster.rollout.workers, teacher_workers))
    try:
        engine_devices = request.generation.engine.devices(request.generation)
        pools = build_pools(
            cluster, cluster.rollout.workers, teacher_workers, engine_devices, cluster.teacher.devices_per_worker
        )
    except BaseException:  # a pool that cannot be placed: leave no private cluster behind
        if started_ray:
            ray.shutdown()
        raise
    groups: list[WorkerGroup] = []

    def release() -> None:
        for group in groups:
            group.stop()
        pools.remove()
        if started_ray:
            ray.shutdown()

    try:
        trainer = _start_trainer(cluster, request, pools.trainer, colocated_teacher)
        groups.append(trainer)
        if request.checkpoint_dir is not None:  # before any step: a run that could not resume stops now
            check_shared_directory(trainer, Path(request.checkpoint_dir))
        teachers = _start_teachers(cluster, request, trainer, colocated_teacher, pools.teacher, groups)
        rollout = _start_rollout(cluster, request, pools.rollout)
        groups.append(rollout)
    except BaseException:
        release()
        raise
    _log_cluster(cluster, len(paths), colocated_teacher)
    policy = FSDPPolicy(
        trainer,
        request.micro_batch_size,
        request.micro_batch_tokens,
        request.sequence_packing,
        on_close=release,
    )
    generation = RayGeneration(
        rollout,
        request.tokenizer.pad_token_id,
        int(cluster.rollout.refit_bucket_mb * _MIB),
        refit_transport=cluster.resolved_refit_transport(),
        timeout_s=cluster.worker_timeout_s,
        offload_trainer=trainer if cluster.trainer.offload_during_generation else None,
    )
    return policy, teachers, generation


def _start_teachers(
    cluster: ClusterConfig,
    request: ClusterRequest,
    trainer: WorkerGroup,
    colocated: bool,
    slots: list[Slot],
    groups: list[WorkerGroup],
) -> list[TeacherInterface]:
    """The teachers the cluster runs (see :func:`build_cluster_backends`); each pool started is added to ``groups``."""
    if colocated:  # the workers hold them all and assemble the run's teacher; the driver asks this
        return [TeacherInTrainerWorkers(trainer, trainer.call("teacher_student_classes"))]
    per_pool = cluster.teacher.workers
    # The trainer workers hold each pooled teacher's output layer when the loss takes the full vocabulary.
    binds = any(path is not None for path in request.heads())
    shards, engine = cluster.teacher.shards_per_replica, cluster.teacher.pool_engine
    teachers: list[TeacherInterface] = []
    for index, (role, path) in enumerate(request.teacher_paths.items()):
        teacher_pool = _start_teacher_pool(
            cluster, request, role, path, slots[index * per_pool : (index + 1) * per_pool]
        )
        groups.append(teacher_pool)
        teachers.append(TeacherPool(teacher_pool, shards, binds, engine))
    return teachers


def _log_cluster(cluster: ClusterConfig, teachers: int, colocated_teacher: bool) -> None:
    """One line on what the cluster started: its workers by role, and where the teachers run."""
    per_pool, shards = cluster.teacher.workers, cluster.teacher.shards_per_replica
    log.info(
        "cluster: %d trainer workers (%s), %s, %d rollout workers, %s placement",
        cluster.trainer.workers,
        cluster.resolved_backend(),
        f"{teachers} teacher(s) colocated"
        if colocated_teacher
        else f"{teachers} teacher pool(s) of {per_pool} ({shards} per replica)"
        if teachers
        else "teacher served",
        cluster.rollout.workers,
        cluster.placement,
    )


def _bounds(cluster: ClusterConfig, role: Literal["trainer", "rollout", "teacher"]) -> dict[str, Bound]:
    """A role's group's bounds: on each call (its own ``timeout_s`` or the cluster's), and on its start."""
    return {
        "call_bound": Bound(*cluster.call_timeout(role)),
        "start_bound": Bound(cluster.start_timeout_s, "cluster.start_timeout_s"),
    }


def _start_trainer(
    cluster: ClusterConfig, request: ClusterRequest, slots: list[Slot], colocated_teacher: bool
) -> WorkerGroup:
    """The FSDP2 trainer ranks (with the teachers, when they are colocated), in their process group."""
    paths = tuple(request.teacher_paths.values()) if colocated_teacher else ()
    spec = TrainerSpec(
        student_path=request.student_path,
        teacher_path=paths[0] if len(paths) == 1 else None,
        loading=request.loading,
        optimizer=request.optimizer,
        total_steps=request.total_steps,
        backend=cluster.resolved_backend(),
        # A collective may wait for a peer still loading at start; the controller's call bounds stop a hung step.
        timeout_s=max(cluster.call_timeout("trainer")[0], cluster.start_timeout_s),
        threads=cluster.threads_per_worker,
        reshard_after_forward=cluster.trainer.reshard_after_forward,
        reduce_gradients_once_per_step=cluster.trainer.reduces_gradients_once_per_step,
        teacher_sharded=cluster.teacher.sharded,
        shard_group_size=cluster.trainer.shard_group_size,
        activation_checkpointing=cluster.trainer.activation_checkpointing,
        lora=request.lora,
        seed=request.seed,
        teacher_paths=paths if len(paths) > 1 else (),
        teacher_assembly=request.teacher_assembly if colocated_teacher else None,
        teacher_head_paths=() if colocated_teacher else request.heads(),
        teacher_share_prompt_forward=request.share_prompt_forward if colocated_teacher else (),
    )
    world_size = cluster.trainer.workers
    bounds = _bounds(cluster, "trainer")
    trainer = WorkerGroup(
        "trainer",
        TrainerWorker,
        slots,
        lambda rank: (rank, world_size, spec),
        worker_environment(cluster.threads_per_worker),
        hosts=warm_hosts(),
        **bounds,
    )
    # The process group meets on rank 0's node, which need not be the controller's.
    master_addr, master_port = trainer.run_rank(0, "rendezvous_address", bound=bounds["start_bound"])
    trainer.run_all("start", master_addr, master_port, bound=bounds["start_bound"])  # loads the models
    if colocated_teacher and cluster.teacher.sharded and cluster.trainer.shard_group_size is None and world_size > 1:
        warning = cross_node_teacher_warning(
            trainer.run_all("node_name", bound=bounds["start_bound"]),
            trainer.run_rank(0, "colocated_teacher_bytes", bound=bounds["start_bound"]),
        )
        if warning is not None:
            log.warning(warning)
    return trainer


def cross_node_teacher_warning(nodes: list[str], teacher_bytes: int) -> str | None:
    """Why a colocated teacher sharded over trainer ranks on several nodes is slow, or None on one node.

    ``nodes``: each rank's node (:meth:`TrainerWorker.node_name`). Every micro-batch's teacher forward gathers the
    teacher's layers from every rank, so each rank receives ``(ranks − 1) / ranks`` of its weights, most of it
    from other nodes.
    """
    hosts = sorted(set(nodes))
    if len(hosts) < 2:
        return None
    ranks = len(nodes)
    per_node = max(nodes.count(host) for host in hosts)
    gathered = teacher_bytes * (ranks - 1) / ranks / 2**30
    return (
        f"the colocated teacher is sharded over {ranks} trainer ranks on {len(hosts)} nodes: every micro-batch's "
        f"teacher forward gathers {gathered:.1f} GiB per rank, across nodes; set cluster.trainer.shard_group_size = "
        f"{per_node} (the ranks of one node) to shard it within each node instead, or cluster.teacher.placement = "
        "pool"
    )


def _start_teacher_pool(
    cluster: ClusterConfig, request: ClusterRequest, role: str, teacher_path: str, slots: list[Slot]
) -> WorkerGroup:
    """The workers of one teacher (``cluster.teacher.placement: pool``); ``role`` names them in errors.

    With ``shards_per_replica`` above 1, each replica's workers shard the teacher in their own process group.
    """
    shards = cluster.teacher.shards_per_replica
    backend, timeout_s = cluster.resolved_backend(), cluster.worker_timeout_s
    pool = WorkerGroup(
        role,
        TeacherWorker,
        slots,
        lambda rank: (
            rank,
            teacher_path,
            request.loading,
            cluster.threads_per_worker,
            shards,
            backend,
            timeout_s,
            cluster.teacher,
            request.seed,
            request.sharing(role),
        ),
        worker_environment(cluster.threads_per_worker),
        hosts=warm_hosts(),
        **_bounds(cluster, "teacher"),
    )
    if shards > 1:
        first_ranks = range(0, pool.size, shards)
        addresses = pool.gather([pool.actors[rank].rendezvous_address.remote() for rank in first_ranks], first_ranks)
        pool.gather([actor.start.remote(*addresses[rank // shards]) for rank, actor in enumerate(pool.actors)])
    return pool


def _start_rollout(cluster: ClusterConfig, request: ClusterRequest, slots: list[Slot]) -> WorkerGroup:
    """The rollout workers (HF or vLLM engines over a copy of the student)."""
    spec = RolloutSpec(
        request.student_path,
        request.loading,
        request.tokenizer,
        request.generation,
        cluster.threads_per_worker,
        request.seed,
    )
    return WorkerGroup(
        "rollout",
        RolloutWorker,
        slots,
        lambda rank: (rank, spec),
        worker_environment(cluster.threads_per_worker),
        hosts=warm_hosts(),
        **_bounds(cluster, "rollout"),
    )
