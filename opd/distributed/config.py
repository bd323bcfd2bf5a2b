"""The ``cluster:`` section: where the student trainer, the rollout engines and the teacher run.

Without it a run stays in one process (no Ray). With it the same driver talks to Ray worker groups: FSDP2
**trainer** ranks, **rollout** engines refit after each update, and a **teacher** colocated in the trainer
workers or in a pool of its own (a served teacher, ``teacher.backend: remote``, needs no workers). Every wait on
a worker is bounded (``start_timeout_s``, then each role's ``timeout_s``), so a hung worker stops the run.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from opd.distributed.pool_engines import POOL_ENGINES, PoolEngine, PoolEngineName
from opd.models.interfaces import TeacherRequest
from opd.teachers.vllm_teacher import VllmScoringConfig
from opd.utils.config import StrictConfig, resolve_auto


class TrainerPoolConfig(StrictConfig):
    """The FSDP2 student trainer."""

    workers: int = Field(2, ge=1, description="data-parallel FSDP2 ranks (one GPU each on GPU nodes)")
    reshard_after_forward: bool = Field(
        True,
        description="true: each decoder layer's weights are gathered for the forward and again for the backward "
        "(least memory); false: gathered once and kept until the backward is done (one all-gather per layer "
        "instead of two, holding the whole student during each forward-backward)",
    )
    activation_checkpointing: bool = Field(
        False,
        description="true: each decoder layer of the student keeps only its input for the backward and recomputes "
        "its activations there (about one more forward of compute, activations of one layer at a time instead of "
        "all of them; `opd plan` shows both); false: keep every layer's activations",
    )
    shard_group_size: int | None = Field(
        None,
        ge=1,
        description="null: shard the student over all trainer workers (FSDP2); k: HSDP, shard within groups of k "
        "workers (e.g. the GPUs of one node) and replicate across the groups, so that the all-gathers of each "
        "forward stay inside a group and only the gradients cross groups (an all-reduce); workers must be a "
        "multiple of k",
    )

    @property
    def reduces_gradients_once_per_step(self) -> bool:
        """``reduce_gradients: once_per_step`` (what the trainer ranks' spec carries)."""
        return self.reduce_gradients == "once_per_step"

    @model_validator(mode="after")
    def _groups_divide_the_workers(self) -> TrainerPoolConfig:
        if self.shard_group_size is not None and self.workers % self.shard_group_size:
            raise ValueError(
                f"cluster.trainer.workers = {self.workers} is not a multiple of cluster.trainer.shard_group_size = "
                f"{self.shard_group_size}: HSDP replicates the student over equal groups of shard_group_size workers"
            )
        return self

    reduce_gradients: Literal["once_per_step", "every_micro_batch"] = Field(
        "once_per_step",
        description="once_per_step: the micro-batches of a step accumulate each rank's whole fp32 gradients and "
        "they are reduced once, after the last (one reduce-scatter per layer per step, and under HSDP one "
        "all-reduce across the groups instead of one per micro-batch), holding one unsharded gradient of the "
        "student per rank while they accumulate (`opd plan` counts it); every_micro_batch: reduce-scatter after "
        "each micro-batch (least memory, one reduction per micro-batch)",
    )
    offload_during_generation: bool = Field(
        False,
        description="colocated rollouts: move each trainer rank's optimizer state and colocated teacher to host "
        "memory while the rollout engines generate on its GPU, and back before the update (the sync scheduler "
        "only; nothing moves on CPU workers)",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="seconds a call to the trainer workers may run (a step with all its micro-batches and a colocated "
        "teacher's scoring, a checkpoint, a refit's gather) before they are taken for hung and the run stops; also "
        "bounds each collective; null = cluster.worker_timeout_s",
    )


class RolloutPoolConfig(StrictConfig):
    """The engines that sample from the student."""

    workers: int = Field(1, ge=1, description="rollout engines; each prompt's samples stay on one engine")
    refit_bucket_mb: float = Field(
        256.0,
        gt=0,
        description="the trainer sends new weights to the engines in buckets of this many MiB; broadcast and cuda_ipc "
        "keep two buffers of the largest bucket at each end from the first refit on (one fills while the other is "
        "sent)",
    )
    refit_transport: Literal["auto", "object_store", "broadcast", "cuda_ipc"] = Field(
        "auto",
        description="how new weights reach the engines, cast to the engines' dtype before the gather: "
        "object_store: trainer rank 0 puts each bucket in Ray's object store (the CPU path); broadcast: rank 0 "
        "broadcasts each bucket over a process group of its own with the rollout workers (NCCL on GPUs, gloo on "
        "CPUs); cuda_ipc: each engine maps the bucket gathered on its own GPU by the trainer rank beside it "
        "(colocated placement on GPUs only); auto: cuda_ipc colocated on GPUs, broadcast split on GPUs, "
        "object_store on CPUs",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="seconds a call to the rollout workers may run (one generation of the whole batch: raise it for "
        "long responses on slow engines, a refit) before they are taken for hung and the run stops; "
        "null = cluster.worker_timeout_s",
    )


_TEACHER_IN_POOL = {"colocated": False, "pool": True}
"""Whether each ``cluster.teacher.placement`` gives the teacher workers of its own."""
_ROLES_SHARE_DEVICES = {"colocated": True, "split": False}
"""Whether each ``cluster.placement`` puts the rollout and teacher workers on the trainer's devices."""


class TeacherPoolConfig(StrictConfig):
    """Where the in-process teacher model runs."""

    placement: Literal["colocated", "pool"] = Field(
        "colocated",
        description="colocated: a sharded frozen copy in each trainer worker (any loss, exact full vocabulary); "
        "pool: replicas of their own that send top-k or token log-probs, or for a full-vocabulary loss their final "
        "hidden states (each trainer worker then loads the teacher's output layer once)",
    )
    workers: int = Field(
        1, ge=1, description="teacher workers when placement is pool: workers / shards_per_replica replicas"
    )
    shards_per_replica: int = Field(
        1,
        ge=1,
        description="placement pool: 1 = every worker holds the whole teacher; n = each replica is n workers "
        "holding one teacher sharded with FSDP2 (forward only, each layer gathered for each forward), for a "
        "teacher larger than one device; the n workers score a share of the rows each; workers must be a "
        "multiple of n",
    )
    sharded: bool = Field(
        True,
        description="colocated teacher: true shards it over the trainer workers with FSDP2 (each forward gathers "
        "its layers); false keeps a whole copy in every trainer worker (no communication, the whole teacher's "
        "memory on every device)",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="placement pool: seconds a teacher replica may take to score its rows before it is taken for "
        "hung and the run stops; null = cluster.worker_timeout_s (a colocated teacher is bounded by "
        "cluster.trainer.timeout_s)",
    )

    engine: PoolEngineName = Field(
        "hf",
        description="placement pool: what each teacher worker scores with: hf (every signal, the full vocabulary "
        "as hidden states; a teacher larger than one device is sharded over shards_per_replica workers with FSDP2) "
        "or vllm (top-k and token log-probs only, from vLLM's prompt log-probs; a teacher larger than one device "
        "spreads over cluster.teacher.vllm.tensor_parallel_size devices of one worker; needs vLLM installed)",
    )
    vllm: VllmScoringConfig = Field(
        default_factory=VllmScoringConfig, description="engine vllm: the teacher workers' vLLM engine"
    )

    @property
    def in_pool(self) -> bool:
        """The teacher has workers of its own (``placement: pool``), not the trainer's."""
        return _TEACHER_IN_POOL[self.placement]

    @property
    def pool_engine(self) -> PoolEngine[TeacherPoolConfig]:
        """The engine ``engine`` names (:data:`~opd.distributed.pool_engines.POOL_ENGINES`)."""
        return POOL_ENGINES[self.engine]

    @property
    def devices_per_worker(self) -> int:
        """Devices one teacher worker spans: as its engine says in a pool, else none of its own (one)."""
        return self.pool_engine.devices_per_worker(self) if self.in_pool else 1

    def engine_problem(self, request: TeacherRequest | None, colocated: bool) -> str | None:
        """What the pool's engine says it cannot do with this request and placement (its own messages), or None."""
        problems = self.pool_engine.config_problems(self, request, colocated)
        return problems[0] if problems else None

    @model_validator(mode="after")
    def _shards_divide_the_workers(self) -> TeacherPoolConfig:
        if self.in_pool and self.workers % self.shards_per_replica:
            raise ValueError(
                f"cluster.teacher.workers = {self.workers} is not a multiple of cluster.teacher.shards_per_replica "
                f"= {self.shards_per_replica}: every replica is shards_per_replica workers"
            )
        return self


_BACKEND_FOR_DEVICES = {True: "nccl", False: "gloo"}
"""The trainer's torch.distributed backend, by whether its workers have GPUs."""

_BACKEND_WITHOUT_ITS_DEVICES = {
    "gloo": "cluster.backend = gloo with cluster.gpus_per_worker = {gpus} would train on the CPUs and leave the "
    "GPUs idle; set cluster.backend = auto (nccl on GPUs), or gpus_per_worker = 0",
    "nccl": "cluster.backend = nccl needs GPUs but cluster.gpus_per_worker = {gpus}; set cluster.backend = auto "
    "(gloo on CPUs), or gpus_per_worker = 1",
}
"""Why an explicit backend does not fit the workers' devices."""


class ClusterConfig(StrictConfig):
    """Ray placement of the trainer, rollout and teacher roles (see the module docstring)."""

    address: str | None = Field(
        None,
        description="null: start a private Ray cluster on this machine; 'auto' or ray://host:port: join a running "
        "one (ray start on each node first)",
    )
    placement: Literal["colocated", "split"] = Field(
        "colocated", description="colocated: roles share the trainer's devices; split: each role has its own"
    )
    gpus_per_worker: int = Field(0, ge=0, le=1, description="1 on GPU nodes (one GPU per worker), 0 for CPU workers")
    threads_per_worker: int = Field(1, ge=1, description="torch / OpenMP threads in each CPU worker")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend of the trainer: auto = nccl with GPUs, gloo without"
    )
    worker_timeout_s: float = Field(
        600.0,
        gt=0,
        description="seconds any call to a worker may run, and a trainer collective may wait, before the worker is "
        "taken for hung and the run stops (naming the role, rank and node) instead of hanging; "
        "cluster.trainer / rollout / teacher .timeout_s override it per role",
    )
    start_timeout_s: float = Field(
        600.0,
        gt=0,
        description="seconds to place each role's pool and start its workers (each loads its model) before the run "
        "stops naming what did not start: a cluster too small, an actor with no room, a load that hangs",
    )
    trainer: TrainerPoolConfig = Field(default_factory=TrainerPoolConfig)
    rollout: RolloutPoolConfig = Field(default_factory=RolloutPoolConfig)
    teacher: TeacherPoolConfig = Field(default_factory=TeacherPoolConfig)

    @property
    def colocated(self) -> bool:
        """The rollout and teacher workers share the trainer's devices (``placement: colocated``)."""
        return _ROLES_SHARE_DEVICES[self.placement]

    @model_validator(mode="after")
    def _sharded_replicas_on_devices_of_their_own(self) -> ClusterConfig:
        # Colocated teacher worker r shares trainer bundle r mod trainer.workers; NCCL needs each shard on its own GPU.
        shards = self.teacher.shards_per_replica
        if self.teacher.in_pool and self.colocated and self.gpus_per_worker and shards > self.trainer.workers:
            raise ValueError(
                f"cluster.teacher.shards_per_replica = {shards} with cluster.placement = colocated needs as many "
                f"trainer GPUs to share (cluster.trainer.workers = {self.trainer.workers}): each shard of a replica "
                "needs a GPU of its own; use cluster.placement = split or fewer shards"
            )
        return self

    @model_validator(mode="after")
    def _refit_transport_fits(self) -> ClusterConfig:
        if self.rollout.refit_transport == "cuda_ipc":
            if not self.gpus_per_worker:
                raise ValueError(
                    "cluster.rollout.refit_transport = cuda_ipc needs GPUs (cluster.gpus_per_worker = 1); "
                    "CPU workers refit through object_store or broadcast"
                )
            if not self.colocated:
                raise ValueError(
                    "cluster.rollout.refit_transport = cuda_ipc needs cluster.placement = colocated (each engine "
                    "maps memory on its own GPU, so a trainer rank must share it); split pools use broadcast"
                )
        return self

    def resolved_refit_transport(self) -> str:
        """How the rollout workers are refit (``auto`` resolved: see ``rollout.refit_transport``)."""
        for_devices = ("cuda_ipc" if self.colocated else "broadcast") if self.gpus_per_worker else "object_store"
        return resolve_auto(self.rollout.refit_transport, lambda: for_devices)

    @model_validator(mode="after")
    def _check_devices_and_sharing(self) -> ClusterConfig:
        """The backend must use the workers' devices, and colocated roles at most one worker per trainer bundle."""
        if self.backend not in ("auto", _BACKEND_FOR_DEVICES[bool(self.gpus_per_worker)]):
            raise ValueError(_BACKEND_WITHOUT_ITS_DEVICES[self.backend].format(gpus=self.gpus_per_worker))
        # A teacher pool's size depends on the teachers, unknown here: ray_cluster.check_colocated_sharing checks it.
        problem = colocated_sharing_problem("cluster.rollout.workers", self.rollout.workers, self.trainer.workers)
        if self.colocated and problem is not None:
            raise ValueError(problem)
        return self

    def call_timeout(self, role: Literal["trainer", "rollout", "teacher"]) -> tuple[float, str]:
        """How long a call to ``role``'s workers may run, and the key that says so."""
        own: float | None = getattr(self, role).timeout_s
        if own is not None:
            return own, f"cluster.{role}.timeout_s"
        return self.worker_timeout_s, "cluster.worker_timeout_s"

    def resolved_backend(self) -> str:
        """The torch.distributed backend the trainer uses."""
        return resolve_auto(self.backend, lambda: _BACKEND_FOR_DEVICES[bool(self.gpus_per_worker)])


def colocated_sharing_problem(key: str, count: int, trainer_workers: int) -> str | None:
    """Why ``count`` workers of a role cannot share the trainer's bundles (colocated placement), or None.

    A bundle takes one worker per other role; a second would wait forever for a GPU share already taken.
    """
    if count <= trainer_workers:
        return None
    return (
        f"{key} = {count} with cluster.placement = colocated: each of the cluster.trainer.workers = "
        f"{trainer_workers} trainer bundles holds at most one such worker beside its trainer rank; "
        f"set {key} <= {trainer_workers}, raise cluster.trainer.workers, or use cluster.placement = split"
    )
