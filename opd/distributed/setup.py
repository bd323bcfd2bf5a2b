"""Building the cluster's backends: the student, teacher and rollout worker groups behind their interfaces.

:func:`build_cluster_backends` is what :func:`opd.algorithms.distillation_setup.setup`
calls instead of loading models in its own process when the config has a ``cluster:``
section. It starts (or joins) Ray, places the pools, starts the workers and returns the
facades the driver talks to. Ray is imported only here and below, so the in-process
path never needs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray

from opd.distributed.config import ClusterConfig
from opd.distributed.fsdp_policy import FSDPPolicy
from opd.distributed.ray_cluster import build_pools, cpus_needed, free_port, start_ray
from opd.distributed.rollout import RayGeneration, RolloutSpec, RolloutWorker
from opd.distributed.teacher_pool import ColocatedTeacher, TeacherPool, TeacherWorker
from opd.distributed.trainer_worker import TrainerSpec, TrainerWorker
from opd.distributed.worker_group import WorkerGroup
from opd.models.config import ModelLoadingConfig, OptimizerConfig
from opd.models.generation.config import VllmGenerationConfig
from opd.models.interfaces import GenerationInterface, TeacherInterface

log = logging.getLogger("opd")

_MIB = 1024 * 1024


@dataclass(frozen=True)
class ClusterRequest:
    """What the run needs from the cluster (everything else comes from ``cluster:``).

    Attributes:
        student_path: the student's starting weights.
        teacher_path: an in-process teacher's weights; None for a served teacher.
        loading: dtype and loading options.
        optimizer: AdamW and schedule settings.
        total_steps: optimizer steps planned.
        micro_batch_size: rows per forward/backward pass on each trainer rank.
        micro_batch_tokens: a padded-token budget per micro-batch instead.
        sequence_packing: pack each micro-batch without padding.
        tokenizer: the run's tokenizer (the rollout workers decode with it).
        decode_loop: the rollout workers' decoding loop.
        stop_ids: ids that end a response (None: each model's own).
        vllm: the rollout workers' vLLM settings, or None for HF rollout workers.
        seed: the run's seed (vLLM engines are seeded from it).
    """

    student_path: str
    teacher_path: str | None
    loading: ModelLoadingConfig
    optimizer: OptimizerConfig
    total_steps: int
    micro_batch_size: int
    micro_batch_tokens: int | None
    sequence_packing: bool
    tokenizer: Any
    decode_loop: str
    stop_ids: tuple[int, ...] | None
    vllm: VllmGenerationConfig | None = None
    seed: int = 0


def build_cluster_backends(
    cluster: ClusterConfig, request: ClusterRequest, served_teacher: TeacherInterface | None
) -> tuple[FSDPPolicy, TeacherInterface, GenerationInterface]:
    """Starts the workers and returns the student, the teacher and the rollout engine.

    Args:
        cluster: the ``cluster:`` section.
        request: what the run needs.
        served_teacher: the client of a served teacher, or None to run the teacher model
            (``request.teacher_path``) colocated or in a pool.
    """
    colocated_teacher = served_teacher is None and cluster.teacher.placement == "colocated"
    teacher_workers = cluster.teacher.workers if served_teacher is None and not colocated_teacher else 0
    rollout_workers = cluster.rollout.workers
    started_ray = start_ray(cluster, cpus_needed(cluster, rollout_workers, teacher_workers))
    pools = build_pools(cluster, rollout_workers, teacher_workers)
    threads = {"OMP_NUM_THREADS": str(cluster.threads_per_worker), "TOKENIZERS_PARALLELISM": "false"}
    groups: list[WorkerGroup] = []

    def release() -> None:
        for group in groups:
            group.kill()
        pools.remove()
        if started_ray:
            ray.shutdown()

    try:
        master_port = free_port()
        trainer_spec = TrainerSpec(
            student_path=request.student_path,
            teacher_path=request.teacher_path if colocated_teacher else None,
            loading=request.loading,
            optimizer=request.optimizer,
            total_steps=request.total_steps,
            backend=cluster.resolved_backend(),
            timeout_s=cluster.worker_timeout_s,
            threads=cluster.threads_per_worker,
        )
        master_addr = ray.util.get_node_ip_address()
        trainer = WorkerGroup(
            "trainer",
            TrainerWorker,
            pools.trainer,
            lambda rank: (rank, cluster.trainer.workers, master_addr, master_port, trainer_spec),
            threads,
        )
        groups.append(trainer)
        teacher: TeacherInterface
        if served_teacher is not None:
            teacher = served_teacher
        elif colocated_teacher:
            teacher = ColocatedTeacher(trainer)
        else:
            assert request.teacher_path is not None
            teacher_path = request.teacher_path
            pool = WorkerGroup(
                "teacher",
                TeacherWorker,
                pools.teacher,
                lambda rank: (rank, teacher_path, request.loading, cluster.threads_per_worker),
                threads,
            )
            groups.append(pool)
            teacher = TeacherPool(pool)
        rollout_spec = RolloutSpec(
            request.student_path,
            request.loading,
            request.tokenizer,
            request.decode_loop,
            request.stop_ids,
            cluster.threads_per_worker,
            request.vllm,
            request.seed,
        )
        rollout = WorkerGroup("rollout", RolloutWorker, pools.rollout, lambda rank: (rank, rollout_spec), threads)
        groups.append(rollout)
        generation = RayGeneration(rollout, request.tokenizer.pad_token_id, int(cluster.rollout.refit_bucket_mb * _MIB))
    except BaseException:
        release()
        raise
    log.info(
        "cluster: %d trainer workers (%s), teacher %s, %d rollout workers, %s placement",
        cluster.trainer.workers,
        trainer_spec.backend,
        "served" if served_teacher is not None else cluster.teacher.placement,
        rollout_workers,
        cluster.placement,
    )
    policy = FSDPPolicy(
        trainer,
        request.micro_batch_size,
        request.micro_batch_tokens,
        request.sequence_packing,
        teacher_in_workers=colocated_teacher,
        on_close=release,
    )
    return policy, teacher, generation
