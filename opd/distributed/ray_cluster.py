"""Starting (or joining) Ray, and the resource pools that place each role's workers.

A run without ``cluster.address`` starts a private Ray cluster on this machine, with its
own temporary directory (nothing written to the home directory), no dashboard and no
usage statistics. With an address it joins the cluster that ``ray start`` built.

Pools are Ray placement groups of one bundle per worker slot (one GPU, or
``threads_per_worker`` CPUs). ``colocated`` placement has one pool, the trainer's: the
rollout engines and teacher replicas take a share of the trainer's bundles, as verl's
colocated worker groups do. ``split`` placement gives each role a pool of its own.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from opd.distributed.config import ClusterConfig
from opd.distributed.worker_group import Slot
from opd.utils.errors import ConfigError

log = logging.getLogger("opd")

# Ray's own settings for a private, quiet cluster (set before ray.init reads them).
RAY_ENVIRONMENT = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
PLACEMENT_TIMEOUT_S = 120.0


def start_ray(config: ClusterConfig, cpus_needed: int) -> bool:
    """Starts a private local Ray cluster, or joins ``config.address``; a no-op if Ray runs already.

    Returns:
        Whether this call started or joined Ray (and the run should shut it down at the end).

    Raises:
        ConfigError: the address cannot be reached.
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
    ray.init(
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


def _pool(count: int, cpus: int, gpus: int, name: str) -> object:
    """A placement group of ``count`` bundles, ready (or a clear error when the cluster is too small)."""
    bundle: dict[str, float] = {"CPU": float(cpus)}
    if gpus:
        bundle["GPU"] = float(gpus)
    group = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ConfigError(
            f"the Ray cluster cannot place the {name} pool ({count} × {bundle}) within {PLACEMENT_TIMEOUT_S:.0f} s; "
            f"it has {ray.cluster_resources()}: lower cluster.*.workers or add nodes"
        ) from None
    return group


def build_pools(config: ClusterConfig, rollout_workers: int, teacher_workers: int) -> ResourcePools:
    """The slots of ``config.trainer.workers`` trainer ranks, and of the rollout and teacher workers.

    Args:
        config: the cluster section.
        rollout_workers: rollout engines to place (0 when the trainer's model samples).
        teacher_workers: teacher replicas to place (0 for a colocated or served teacher).
    """
    cpus, gpus = config.threads_per_worker, config.gpus_per_worker
    trainer_count = config.trainer.workers
    if config.placement == "colocated":
        group = _pool(trainer_count, cpus, gpus, "trainer")
        # Roles sharing a bundle split its GPU; on CPU they take turns on its cores.
        sharing = 1 + int(rollout_workers > 0) + int(teacher_workers > 0)
        share = gpus / sharing
        return ResourcePools(
            trainer=[Slot(group, rank, cpus, share) for rank in range(trainer_count)],
            rollout=[Slot(group, rank % trainer_count, 0, share) for rank in range(rollout_workers)],
            teacher=[Slot(group, rank % trainer_count, 0, share) for rank in range(teacher_workers)],
            groups=[group],
        )
    groups = [_pool(trainer_count, cpus, gpus, "trainer")]
    trainer = [Slot(groups[0], rank, cpus, gpus) for rank in range(trainer_count)]
    rollout: list[Slot] = []
    teacher: list[Slot] = []
    if rollout_workers:
        groups.append(_pool(rollout_workers, cpus, gpus, "rollout"))
        rollout = [Slot(groups[-1], rank, cpus, gpus) for rank in range(rollout_workers)]
    if teacher_workers:
        groups.append(_pool(teacher_workers, cpus, gpus, "teacher"))
        teacher = [Slot(groups[-1], rank, cpus, gpus) for rank in range(teacher_workers)]
    return ResourcePools(trainer=trainer, rollout=rollout, teacher=teacher, groups=groups)


def cpus_needed(config: ClusterConfig, rollout_workers: int, teacher_workers: int) -> int:
    """CPUs the pools reserve (a private cluster declares at least this many)."""
    workers = config.trainer.workers
    if config.placement == "split":
        workers += rollout_workers + teacher_workers
    return workers * config.threads_per_worker


def free_port() -> int:
    """A TCP port free on this machine now (rank 0 of the trainer listens on it)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
