"""Starting (or joining) Ray, and the resource pools that place each role's workers.

Without ``cluster.address`` a private, quiet Ray cluster starts (own temp directory, no dashboard or usage stats).
Pools are placement groups of one bundle per worker slot. ``colocated`` has one pool, the trainer's, whose
bundles each take at most one worker of every other role; ``split`` gives each role its own pool.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from opd.distributed.config import ClusterConfig, colocated_sharing_problem
from opd.distributed.workers.worker_environment import init_local_ray, worker_environment
from opd.distributed.workers.worker_group import Slot
from opd.utils.errors import ConfigError

log = logging.getLogger("opd")

# Set before ray.init unless already in the environment. prestart=0: opd uses only actors, so Ray's idle task
# workers (one per CPU slot) would only slow start-up.
RAY_ENVIRONMENT = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_prestart_worker_first_driver": "0",
}
_PLACEMENT_POLL_S = 1.0
"""How often a pool that is not placed yet is asked whether it ever can be."""


def start_ray(config: ClusterConfig, cpus_needed: int) -> bool:
    """Starts a private local Ray cluster, or joins ``config.address``; a no-op if Ray runs already.

    Returns whether this call started or joined Ray (so the run shuts it down). ConfigError: address unreachable.
    """
    for key, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return False
    if config.address is not None:
        try:
            ray.init(address=config.address, log_to_driver=True)
        except ConnectionError as error:
            raise ConfigError(f"cluster.address = {config.address}: cannot join the Ray cluster ({error})") from None
        log.info("joined the Ray cluster at %s: %s", config.address, ray.cluster_resources())
        return True
    # A short path: Ray's sockets live under it and Unix socket paths are limited to ~107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="opd_ray_", dir="/tmp")
    init_local_ray(
        worker_environment(config.threads_per_worker),
        num_cpus=max(cpus_needed, os.cpu_count() or 1),
        include_dashboard=False,
        _temp_dir=temp_dir,
        log_to_driver=True,
        configure_logging=False,
    )
    log.info("started a private Ray cluster (temporary files in %s)", temp_dir)
    return True


@dataclass
class ResourcePools:
    """The slots of each role's workers, and the placement groups that hold them."""

    trainer: list[Slot]
    rollout: list[Slot]
    teacher: list[Slot]
    groups: list[object]

    def remove(self) -> None:
        """Frees the placement groups (after the workers are gone)."""
        for group in self.groups:
            remove_placement_group(group)


def _pool(count: int, cpus: int, gpus: int, name: str, config: ClusterConfig) -> object:
    """A placement group of ``count`` bundles, ready within ``cluster.start_timeout_s``, else ConfigError.

    On a private cluster an infeasible pool fails at once: no node will join.
    """
    bundle: dict[str, float] = {"CPU": float(cpus)}
    if gpus:
        bundle["GPU"] = float(gpus)
    group = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
    ready = group.ready()
    start = time.monotonic()
    while True:
        left = config.start_timeout_s - (time.monotonic() - start)
        done, _ = ray.wait([ready], timeout=max(0.0, min(left, _PLACEMENT_POLL_S)))
        if done:
            return group
        infeasible = config.address is None and _scheduling_state(group) == "INFEASIBLE"
        if infeasible or left <= 0:
            remove_placement_group(group)
            why = (
                "never (it asks for more than this machine has)"
                if infeasible
                else (f"within {time.monotonic() - start:.0f} s (cluster.start_timeout_s = {config.start_timeout_s:g})")
            )
            raise ConfigError(
                f"the Ray cluster cannot place the {name} pool ({count} × {bundle}) {why}; "
                f"it has {ray.cluster_resources()}: lower cluster.*.workers or cluster.gpus_per_worker, or add nodes"
            )


def _scheduling_state(group: object) -> str:
    """Ray's word for where a placement group's scheduling stands (``INFEASIBLE`` when no node can hold it)."""
    stats = placement_group_table(group).get("stats") or {}
    return str(stats.get("scheduling_state", ""))


def check_colocated_sharing(config: ClusterConfig, rollout_workers: int, teacher_workers: int) -> None:
    """Raises ConfigError for colocated roles with more workers than the trainer has bundles."""
    if not config.colocated:
        return
    pools = teacher_workers // max(config.teacher.workers, 1)
    teacher_key = "cluster.teacher.workers" if pools <= 1 else f"cluster.teacher.workers × {pools} teacher pools"
    for key, count in (("cluster.rollout.workers", rollout_workers), (teacher_key, teacher_workers)):
        problem = colocated_sharing_problem(key, count, config.trainer.workers)
        if problem is not None:
            raise ConfigError(problem)


def build_pools(
    config: ClusterConfig,
    rollout_workers: int,
    teacher_workers: int,
    rollout_devices: int = 1,
    teacher_devices: int = 1,
) -> ResourcePools:
    """The slots of ``config.trainer.workers`` trainer ranks, and of the rollout and teacher workers.

    ``rollout_devices`` and ``teacher_devices`` are GPUs per worker (tensor-parallel vLLM; split placement only).
    """
    check_colocated_sharing(config, rollout_workers, teacher_workers)
    cpus, gpus = config.threads_per_worker, config.gpus_per_worker
    trainer_count = config.trainer.workers
    if config.colocated:
        group = _pool(trainer_count, cpus, gpus, "trainer", config)
        # Roles sharing a bundle split its GPU; on CPU they take turns on its cores.
        sharing = 1 + int(rollout_workers > 0) + int(teacher_workers > 0)
        share = gpus / sharing
        return ResourcePools(
            trainer=[Slot(group, rank, cpus, share) for rank in range(trainer_count)],
            rollout=[Slot(group, rank, 0, share) for rank in range(rollout_workers)],
            teacher=[Slot(group, rank, 0, share) for rank in range(teacher_workers)],
            groups=[group],
        )
    groups = [_pool(trainer_count, cpus, gpus, "trainer", config)]
    trainer = [Slot(groups[0], rank, cpus, gpus) for rank in range(trainer_count)]
    rollout: list[Slot] = []
    teacher: list[Slot] = []
    if rollout_workers:
        engine_gpus = gpus * rollout_devices
        groups.append(_pool(rollout_workers, cpus, engine_gpus, "rollout", config))
        rollout = [Slot(groups[-1], rank, cpus, engine_gpus) for rank in range(rollout_workers)]
    if teacher_workers:
        teacher_gpus = gpus * teacher_devices
        groups.append(_pool(teacher_workers, cpus, teacher_gpus, "teacher", config))
        teacher = [Slot(groups[-1], rank, cpus, teacher_gpus) for rank in range(teacher_workers)]
    return ResourcePools(trainer=trainer, rollout=rollout, teacher=teacher, groups=groups)


def cpus_needed(config: ClusterConfig, rollout_workers: int, teacher_workers: int) -> int:
    """CPUs the pools reserve (a private cluster declares at least this many)."""
    workers = config.trainer.workers
    if not config.colocated:
        workers += rollout_workers + teacher_workers
    return workers * config.threads_per_worker


def free_port() -> int:
    """A TCP port free on this machine now (rank 0 of the trainer listens on it)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
