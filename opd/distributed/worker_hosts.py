"""Worker processes kept warm between the runs of one Python process, on one machine's CPUs.

A cluster run's workers are Ray actors. Starting one costs a process and the imports of
torch and transformers: on a machine with few CPUs, most of a short run's start. A
process that runs many short runs in a row (the test suite, a sweep in a notebook) can
keep those processes instead: :func:`keep_workers_warm` turns it on, and
every :class:`~opd.distributed.workers.worker_group.WorkerGroup` built by the cluster setup then
takes its actors from :class:`WarmHosts`.

A :class:`WorkerHost` is a Ray actor that holds one worker object at a time: it builds it
(the worker class's constructor, as a fresh actor would run it), forwards the calls to it,
and, when the run ends cleanly, drops it and leaves the default process group, so that the
next run's worker starts from the same state. A group that fails is killed as before and
its hosts are forgotten.

Warm hosts take no CPU slot of their own and sit in no placement group: the run's
placement groups still reserve its slots (so what a run may take is checked as before),
but the processes are not pinned to those bundles. That is sound on one machine's CPUs
alone, so warm hosts are never used for workers that take GPUs, and nothing turns them on
in an ordinary run (``opd train`` never does).
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import ray

from opd.distributed.workers.worker_environment import runtime_env_for

DEFAULT_MAX_IDLE = 8
"""Idle worker processes kept by default: a run of 2 trainer, 2 rollout and 2 teacher workers, and two more."""


class WorkerHost:
    """A Ray actor that builds one worker object at a time and forwards calls to it."""

    def __init__(self) -> None:
        self.worker: Any = None

    def build(self, worker_class: type, args: tuple[Any, ...]) -> None:
        """Constructs this host's worker (``worker_class(*args)``), as a fresh actor's constructor would."""
        if self.worker is not None:
            raise RuntimeError("this worker host still holds a worker (it was not released)")
        self.worker = worker_class(*args)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The worker's ``method`` called with the given arguments."""
        return getattr(self.worker, method)(*args, **kwargs)

    def apply(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        """``function(worker, ...)``: what Ray's ``actor.__ray_call__`` does on a worker's own actor."""
        return function(self.worker, *args, **kwargs)

    def release(self) -> None:
        """Drops the worker, its process group and its memory, ready for the next :meth:`build`."""
        import torch.distributed as dist

        self.worker = None
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


class _RemoteMethod:
    """``host.call.remote(method, ...)`` spelled as a Ray actor method's ``.remote(...)``."""

    def __init__(self, host: Any, method: str) -> None:
        self.host, self.method = host, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.host.call.remote(self.method, *args, **kwargs)


_ANSWERED_BY_THE_HOST = {"__ray_call__": "apply", "__ray_ready__": "__ray_ready__"}
"""Ray's own actor methods that a hosted worker answers through its host (the host's method of each)."""


class HostedActor:
    """A worker inside a :class:`WorkerHost`, called as its own Ray actor is (``actor.method.remote(...)``)."""

    def __init__(self, host: Any) -> None:
        self.host = host

    def __getattr__(self, method: str) -> Any:
        if method in _ANSWERED_BY_THE_HOST:
            return getattr(self.host, _ANSWERED_BY_THE_HOST[method])
        if method.startswith("__"):  # copy, pickle and the like must not reach the worker
            raise AttributeError(method)
        return _RemoteMethod(self.host, method)


class WarmHosts:
    """The idle worker hosts of one Ray cluster, each kept for one role, rank and environment.

    A host is only ever handed back to the rank of the role it served. Some of torch's
    caches outlive a process group: DTensor's sharding caches are keyed by device meshes,
    and two meshes of the same shape compare equal whatever rank built them, so a process
    that was rank 1 and came back as rank 0 would read its shards through rank 1's
    coordinates. A process that keeps its rank meets only what it computed itself.

    Args:
        address: the GCS address of the cluster the hosts belong to.
        max_idle: how many idle hosts are kept (each holds torch and transformers in
            memory); beyond it, those idle the longest are ended.
    """

    def __init__(self, address: str, max_idle: int = DEFAULT_MAX_IDLE) -> None:
        self.address = address
        self.max_idle = max_idle
        self._idle: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._remote_class: Any = ray.remote(WorkerHost)

    def take(self, role: str, count: int, env_vars: dict[str, str]) -> list[Any]:
        """The hosts of ranks ``0 .. count - 1`` of ``role``: each rank's idle host, else a new one."""
        return [
            self._idle.pop(_key(role, rank, env_vars), None)
            or self._remote_class.options(num_cpus=0, runtime_env=runtime_env_for(env_vars), max_restarts=0).remote()
            for rank in range(count)
        ]

    def give_back(self, role: str, hosts: Sequence[Any], env_vars: dict[str, str]) -> None:
        """Keeps released hosts (``hosts[r]`` served rank ``r`` of ``role``) for the next run."""
        for rank, host in enumerate(hosts):
            self._idle[_key(role, rank, env_vars)] = host
        while len(self._idle) > self.max_idle:
            _, oldest = self._idle.popitem(last=False)
            ray.kill(oldest, no_restart=True)

    def idle_count(self) -> int:
        """How many hosts wait for a run."""
        return len(self._idle)

    def close(self) -> None:
        """Ends every idle host."""
        for host in self._idle.values():
            ray.kill(host, no_restart=True)
        self._idle.clear()


def _key(role: str, rank: int, env_vars: dict[str, str]) -> tuple[Any, ...]:
    return role, rank, tuple(sorted(env_vars.items()))


_warm: WarmHosts | None = None


def keep_workers_warm(max_idle: int = DEFAULT_MAX_IDLE) -> WarmHosts:
    """Keeps the cluster runs' worker processes between runs, on the Ray cluster this process is connected to.

    Args:
        max_idle: how many idle worker processes are kept at most (:class:`WarmHosts`).

    Raises:
        RuntimeError: Ray is not initialised in this process.
    """
    global _warm
    if not ray.is_initialized():
        raise RuntimeError("keep_workers_warm needs a running Ray cluster (ray.init first)")
    address = ray.get_runtime_context().gcs_address
    if _warm is None or _warm.address != address:
        _warm = WarmHosts(address, max_idle)
    _warm.max_idle = max_idle
    return _warm


def warm_hosts() -> WarmHosts | None:
    """The warm hosts of the cluster this process is connected to, or None (the default: fresh actors)."""
    if _warm is None or not ray.is_initialized() or ray.get_runtime_context().gcs_address != _warm.address:
        return None
    return _warm
