"""The ``cluster:`` section: where the student trainer, the rollout engines and the teacher run.

Without a ``cluster:`` section a run stays in one process (the embedded default, no Ray).
With one, the same driver talks to Ray worker groups:

* **trainer** — ``trainer.workers`` FSDP2 ranks that hold the student, sharded
  data-parallel over the global batch (NCCL on GPUs, gloo on CPUs);
* **rollout** — ``rollout.workers`` engines that sample from the student and are refit
  from the trainer after each update;
* **teacher** — ``colocated``: a frozen, sharded copy in every trainer worker (the exact
  full-vocabulary loss stays available), or ``pool``: ``teacher.workers`` replicas of their
  own that answer top-k or token log-prob requests. A served teacher
  (``teacher.backend: remote`` at the top level) needs no workers.

``placement`` maps the roles to resource pools: ``colocated`` puts the rollout engines and
a teacher pool on the trainer's devices, where they take turns; ``split`` gives every role
devices of its own (seed 002's separate actor and rollout pools).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from opd.utils.config import StrictConfig


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


class RolloutPoolConfig(StrictConfig):
    """The engines that sample from the student."""

    workers: int = Field(1, ge=1, description="rollout engines; each prompt's samples stay on one engine")
    refit_bucket_mb: float = Field(
        256.0, gt=0, description="the trainer sends new weights to the engines in buckets of this many MiB"
    )


class TeacherPoolConfig(StrictConfig):
    """Where the in-process teacher model runs."""

    placement: Literal["colocated", "pool"] = Field(
        "colocated",
        description="colocated: a sharded frozen copy in each trainer worker (any loss, exact full vocabulary); "
        "pool: replicas of their own that send top-k or token log-probs",
    )
    workers: int = Field(1, ge=1, description="teacher replicas when placement is pool")
    sharded: bool = Field(
        True,
        description="colocated teacher: true shards it over the trainer workers with FSDP2 (each forward gathers "
        "its layers); false keeps a whole copy in every trainer worker (no communication, the whole teacher's "
        "memory on every device)",
    )


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
        description="a collective that waits this long fails (a dead or stuck worker stops the run, not hangs it)",
    )
    trainer: TrainerPoolConfig = Field(default_factory=TrainerPoolConfig)
    rollout: RolloutPoolConfig = Field(default_factory=RolloutPoolConfig)
    teacher: TeacherPoolConfig = Field(default_factory=TeacherPoolConfig)

    def resolved_backend(self) -> str:
        """The torch.distributed backend the trainer uses."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.gpus_per_worker else "gloo"
