"""A group of Ray actors of one role, called together, whose failures stop the run with one message.

Results are collected as they arrive, so the first actor that dies, runs out of memory or raises ends the wait
at once with a :class:`~opd.utils.errors.WorkerError` naming role, rank and node; the group is then killed, which
frees peers blocked in a collective. A rank's error that may only echo a peer's death waits a short grace, and
a death found is named instead. No wait is unbounded: a start bound and a call bound (:class:`Bound`) take
ranks still running for hung, and the error names the config key that sets the bound.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from opd.distributed.worker_hosts import HostedActor, WarmHosts
from opd.distributed.workers.dispatch import declaration
from opd.distributed.workers.worker_environment import runtime_env_for
from opd.models.interfaces import Pending
from opd.utils.errors import WorkerError

ResultT = TypeVar("ResultT")

log = logging.getLogger("opd")


@dataclass(frozen=True)
class Bound:
    """How long a wait on a group's workers may take, and the config key that says so (named when it runs out)."""

    seconds: float
    key: str = "cluster.worker_timeout_s"


DEFAULT_BOUND = Bound(600.0)
"""The bound of a group built without one (``cluster.worker_timeout_s``'s default)."""

PEER_DEATH_GRACE_S = 5.0
"""How long a rank's error waits for its peers' results, in case one of them died and caused it."""


@dataclass(frozen=True)
class Slot:
    """Where one actor runs: a bundle of a placement group and the resources it takes there."""

    placement_group: Any
    bundle_index: int
    num_cpus: float
    num_gpus: float


class WorkerGroup:
    """One Ray actor ``worker_class(*init_args(rank))`` per :class:`Slot` (see the module docstring).

    Args:
        role: named in error messages (``trainer``, ``rollout``, ``teacher``).
        call_bound: default bound of every call, unless the call names its own.
        start_bound: bound on placing and constructing the actors (``call_bound`` when None).
        hosts: warm processes to build the workers in (:mod:`~opd.distributed.worker_hosts`); ignored with GPUs.

    Raises:
        WorkerError: an actor failed in its constructor, or did not start within ``start_bound``.
    """

    def __init__(
        self,
        role: str,
        worker_class: type,
        slots: Sequence[Slot],
        init_args: Callable[[int], tuple[Any, ...]],
        env_vars: dict[str, str] | None = None,
        call_bound: Bound = DEFAULT_BOUND,
        start_bound: Bound | None = None,
        hosts: WarmHosts | None = None,
    ) -> None:
        self.role = role
        self.worker_class = worker_class
        self.slots = list(slots)
        self.call_bound = call_bound
        self._nodes: dict[int, str] = {}
        self._env_vars = env_vars or {}
        self._hosts = hosts if hosts is not None and not any(slot.num_gpus for slot in self.slots) else None
        self._stopped = False
        self._released = False  # its warm hosts were given back: they may serve another group now
        if self._hosts is not None:
            self._host_actors = self._hosts.take(role, len(self.slots), self._env_vars)
            self._actors: list[Any] = [HostedActor(host) for host in self._host_actors]
            started = [host.build.remote(worker_class, init_args(rank)) for rank, host in enumerate(self._host_actors)]
        else:
            remote_class: Any = ray.remote(worker_class)
            self._actors = [
                remote_class.options(
                    num_cpus=slot.num_cpus,
                    num_gpus=slot.num_gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(slot.placement_group, slot.bundle_index),
                    runtime_env=runtime_env_for(self._env_vars),
                    max_restarts=0,
                ).remote(*init_args(rank))
                for rank, slot in enumerate(self.slots)
            ]
            started = [actor.__ray_ready__.remote() for actor in self._actors]
        # Wait for the constructors so that a worker that cannot start fails here, naming its rank.
        self.gather(started, what=_START, bound=start_bound)
        # Noted now: once a node is lost, its bundles no longer say where they were.
        for rank in range(self.size):
            self.node(rank)

    @property
    def size(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> list[Any]:
        """The workers' actor handles, one per rank; WorkerError once stopped and its warm hosts given back."""
        if self._released:
            raise WorkerError(f"the {self.role} workers were stopped", self.role, 0)
        return self._actors

    def run_all(
        self,
        method: str,
        *args: Any,
        per_rank: Sequence[tuple[Any, ...]] | None = None,
        bound: Bound | None = None,
    ) -> list[Any]:
        """Calls ``method`` on every actor and returns the results in rank order.

        ``args`` are put once in the object store; ``per_rank`` arguments are appended after them.
        """
        shared = [ray.put(arg) for arg in args]
        refs = [
            getattr(actor, method).remote(*shared, *(per_rank[rank] if per_rank is not None else ()))
            for rank, actor in enumerate(self.actors)
        ]
        return self.gather(refs, what=method, bound=bound)

    def call(
        self, method: str, *args: Any, shares: Sequence[tuple[Any, ...]] | None = None, bound: Bound | None = None
    ) -> Any:
        """Calls ``method`` on every rank as its :func:`~opd.distributed.workers.dispatch.dispatch` declares.

        ``shares`` holds a per-rank method's own arguments, one tuple per rank; results are gathered as declared.
        """
        declared = declaration(self.worker_class, method)
        per_rank = declared.arguments(method, self.size, shares)
        return declared.gather(self.run_all(method, *args, per_rank=per_rank, bound=bound))

    def run_rank(self, rank: int, method: str, *args: Any, bound: Bound | None = None) -> Any:
        """Calls ``method`` on one actor (``bound`` as in :meth:`run_all`)."""
        return self.gather([getattr(self.actors[rank], method).remote(*args)], [rank], method, bound)[0]

    def gather(
        self, refs: list[Any], ranks: Sequence[int] | None = None, what: str | None = None, bound: Bound | None = None
    ) -> list[Any]:
        """The results of ``refs`` (one per rank), failing on the first worker that fails or on the bound.

        Raises:
            WorkerError: a worker died, ran out of memory or raised, or ranks were still running when ``bound``
                (counted from now) ran out; the group is killed first.
        """
        bound = bound or self.call_bound
        rank_of = {ref: rank for ref, rank in zip(refs, ranks if ranks is not None else range(len(refs)), strict=True)}
        results: dict[Any, Any] = {}
        pending = list(refs)
        start = time.monotonic()
        while pending:
            left = bound.seconds - (time.monotonic() - start)
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0.0))
            if not ready:
                waited = time.monotonic() - start
                # The node names are read before the kill, while the actors still have their places.
                error = self._timeout_error(sorted(rank_of[ref] for ref in pending), what, bound, waited)
                self.kill()
                raise error
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except Exception as error:
                    failure = self._worker_error(error, rank_of[ref])
                    if pending and not _is_death(error) and not _is_oom(error):
                        failure = self._dead_peer_error(pending, rank_of, error, rank_of[ref]) or failure
                    self.kill()
                    raise failure from None
        return [results[ref] for ref in refs]

    def _dead_peer_error(
        self, pending: list[Any], rank_of: dict[Any, int], raised: Exception, raised_rank: int
    ) -> WorkerError | None:
        """The death of a peer that ``raised`` (rank ``raised_rank``'s error) may only echo, or None.

        A killed rank's peers fail their collectives before Ray notices the death, so they get a short grace.
        """
        death = self.death_among(pending, [rank_of[ref] for ref in pending])
        if death is None:
            return None
        cause = raised.cause if isinstance(raised, ray.exceptions.RayTaskError) else raised
        echo = f"{self.role} worker {raised_rank} then failed: {_first_line(cause)}"
        return WorkerError(f"{death}; {echo}", self.role, death.rank)

    def death_among(self, refs: list[Any], ranks: Sequence[int] | None = None) -> WorkerError | None:
        """The death of the lowest rank among ``refs`` (one call per rank) whose worker died, or None.

        Waits up to :data:`PEER_DEATH_GRACE_S` for the calls to end: a killed worker's peers, in this group or
        another one sharing a collective with it, fail before Ray notices the death.
        """
        rank_of = dict(zip(refs, ranks if ranks is not None else range(len(refs)), strict=True))
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=PEER_DEATH_GRACE_S)
        for ref in sorted(ready, key=rank_of.__getitem__):
            try:
                ray.get(ref)
            except Exception as error:
                if _is_death(error):
                    return self._worker_error(error, rank_of[ref])
        return None

    def pending(
        self,
        refs: list[Any],
        combine: Callable[[list[Any]], ResultT],
        ranks: Sequence[int] | None = None,
        what: str | None = None,
        bound: Bound | None = None,
    ) -> Pending[ResultT]:
        """``combine(gather(refs))`` as a :class:`~opd.models.interfaces.Pending`; the bound counts from collection."""
        return _Gathered(lambda: combine(self.gather(refs, ranks, what, bound)))

    def node(self, rank: int) -> str:
        """The IP address of the node that holds ``rank``'s bundle, or why there is none."""
        if rank not in self._nodes:
            slot = self.slots[rank]
            try:
                node_id = placement_group_table(slot.placement_group)["bundles_to_node_id"].get(slot.bundle_index)
                addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
            except Exception as error:  # the error being reported matters more than its node
                return f"unknown ({type(error).__name__})"
            if not node_id:  # the placement group is still waiting for room
                return "none: its placement group is not placed"
            self._nodes[rank] = addresses.get(node_id, f"id {node_id[:12]}")
        return self._nodes[rank]

    def _timeout_error(self, ranks: list[int], what: str | None, bound: Bound, waited: float) -> WorkerError:
        plural = len(ranks) > 1
        workers = f"{self.role} worker{'s' if plural else ''} {', '.join(map(str, ranks))} of {self.size}"
        where = list(dict.fromkeys(self.node(rank) for rank in ranks))  # each node once, in rank order
        nodes = f"node{'s' if len(where) > 1 else ''} {', '.join(where)}"
        limit = f"within {waited:.1f} s ({bound.key} = {bound.seconds:g})"
        if what == _START:
            slot = self.slots[ranks[0]]
            wanted = f"{slot.num_cpus:g} CPU" + (f" and {slot.num_gpus:g} GPU" if slot.num_gpus else "")
            problem = (
                f"did not start {limit}: still loading, hung in the constructor, or no room for "
                f"{wanted} in {'their bundles' if plural else 'its bundle'}"
            )
        else:
            problem = f"did not finish {what or 'the call'} {limit}; if it can take longer, raise {bound.key}"
        return WorkerError(f"{workers} ({nodes}) {problem}; the {self.role} workers were stopped", self.role, ranks[0])

    def _worker_error(self, error: Exception, rank: int) -> WorkerError:
        where = f"{self.role} worker {rank} of {self.size} (node {self.node(rank)})"
        if isinstance(error, ray.exceptions.OutOfMemoryError) or _is_oom(error):
            return WorkerError(f"{where} ran out of memory: {_first_line(error)}", self.role, rank)
        if _is_death(error):
            return WorkerError(f"{where} died ({type(error).__name__})", self.role, rank)
        if isinstance(error, ray.exceptions.RayTaskError):
            return WorkerError(f"{where} failed: {_first_line(error.cause)}", self.role, rank)
        return WorkerError(f"{where} failed: {_first_line(error)}", self.role, rank)

    def kill(self) -> None:
        """Ends every actor of the group at once (frees peers stuck in a collective); given-back hosts are spared."""
        if self._released:
            return
        self._stopped = True
        for actor in self._host_actors if self._hosts is not None else self._actors:
            ray.kill(actor, no_restart=True)

    def stop(self) -> None:
        """Ends the group after a run: kills its actors, or releases its warm hosts; no-op once killed."""
        if self._stopped:
            return
        if self._hosts is None:
            self.kill()
            return
        self._stopped = True
        try:
            ray.get([host.release.remote() for host in self._host_actors], timeout=self.call_bound.seconds)
        except Exception:  # a host that cannot be cleaned is not reused
            self.kill()
            return
        self._released = True
        self._hosts.give_back(self.role, self._host_actors, self._env_vars)


class _Gathered(Pending[ResultT]):
    """Results of calls already submitted to a group's workers, gathered (once) when asked for."""

    def __init__(self, gather: Callable[[], ResultT]) -> None:
        self.gather = functools.cache(gather)  # a failed gather is not cached: it raises again

    def result(self) -> ResultT:
        """Waits for every worker's part and combines them (fails as :meth:`WorkerGroup.gather` does)."""
        return self.gather()


_START = "__start__"
"""``what`` of the wait for the actors' constructors."""


def _is_death(error: Exception) -> bool:
    """Whether ``error`` says the actor itself is gone (killed, crashed, its node lost)."""
    return isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError))


def _is_oom(error: Exception) -> bool:
    """A device out of memory (``torch.OutOfMemoryError``) or the host (``MemoryError``)."""
    cause = getattr(error, "cause", None)
    return (
        isinstance(cause, MemoryError)
        or "OutOfMemoryError" in type(cause).__name__
        or "out of memory" in str(cause).lower()
    )


def _first_line(error: Any) -> str:
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if isinstance(error, ray.exceptions.RayTaskError) else (lines[0] if lines else text)
