"""Worker processes kept warm between the runs of one Python process, on one machine's CPUs.

Starting a Ray actor costs a process and the torch/transformers imports. For many short runs in a row (tests, a
sweep), :func:`keep_workers_warm` makes every :class:`~opd.distributed.workers.worker_group.WorkerGroup` take its
actors from :class:`WarmHosts`. A :class:`WorkerHost` holds one worker at a time; a clean end drops it and its
process group, a failed group is killed and its hosts forgotten. Hosts take no CPU slot and sit in no placement
group (the run's groups still reserve its slots), which is sound only on one machine's CPUs: never for GPU
workers, and ``opd train`` never turns them on.
"""

from __future__ import annotations

import functools
import gc
import types
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
        # ``host.call.remote(method, ...)``, spelled as a Ray actor method's ``.remote(...)``.
        return types.SimpleNamespace(remote=functools.partial(self.host.call.remote, method))


class WarmHosts:
    """The idle worker hosts of one Ray cluster (``address``: its GCS), each kept for one role, rank and environment.

    A host only ever serves the same rank again: DTensor's sharding caches outlive a process group and equal-shaped
    meshes compare equal, so a former rank 1 reused as rank 0 would read shards through rank 1's coordinates.
    Beyond ``max_idle`` idle hosts, those idle the longest are ended.
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

    Raises RuntimeError when Ray is not initialised in this process.
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
