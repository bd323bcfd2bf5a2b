"""A group of Ray actors of one role, called together, whose failures stop the run with one message.

:class:`WorkerGroup` starts ``count`` actors of a worker class, each on its own slot of a
resource pool, and calls a method on all of them (``run_all``) or on one (``run_rank``).
Results are collected as they arrive, so the first actor that dies, runs out of memory
or raises ends the wait at once, with a :class:`~opd.utils.errors.WorkerError` naming
the role and the rank, even while its peers are still blocked in a collective that the
dead rank will never join. The group is then killed, which frees those peers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from opd.models.interfaces import Pending
from opd.utils.errors import WorkerError

ResultT = TypeVar("ResultT")

log = logging.getLogger("opd")


@dataclass(frozen=True)
class Slot:
    """Where one actor runs: a bundle of a placement group and the resources it takes there."""

    placement_group: Any
    bundle_index: int
    num_cpus: float
    num_gpus: float


class WorkerGroup:
    """``count`` Ray actors of ``worker_class`` (see the module docstring).

    Args:
        role: named in error messages (``trainer``, ``rollout``, ``teacher``).
        worker_class: a plain class; each actor is ``worker_class(*init_args(rank))``.
        slots: one :class:`Slot` per rank.
        init_args: the constructor arguments of each rank.
        env_vars: environment of every actor (thread counts, ...).
    """

    def __init__(
        self,
        role: str,
        worker_class: type,
        slots: Sequence[Slot],
        init_args: Callable[[int], tuple[Any, ...]],
        env_vars: dict[str, str] | None = None,
    ) -> None:
        self.role = role
        remote_class: Any = ray.remote(worker_class)
        self.actors: list[Any] = [
            remote_class.options(
                num_cpus=slot.num_cpus,
                num_gpus=slot.num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(slot.placement_group, slot.bundle_index),
                runtime_env={"env_vars": env_vars or {}},
                max_restarts=0,
            ).remote(*init_args(rank))
            for rank, slot in enumerate(slots)
        ]
        # Constructors run asynchronously: wait for them, so that a worker that cannot
        # start (a bad model path, no memory) fails here, naming its rank.
        self.gather([actor.__ray_ready__.remote() for actor in self.actors])

    @property
    def size(self) -> int:
        return len(self.actors)

    def run_all(self, method: str, *args: Any, per_rank: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        """Calls ``method`` on every actor and returns the results in rank order.

        Args:
            method: the worker method.
            *args: arguments shared by every rank (put once in the object store).
            per_rank: each rank's own arguments, appended after the shared ones.
        """
        shared = [ray.put(arg) for arg in args]
        refs = [
            getattr(actor, method).remote(*shared, *(per_rank[rank] if per_rank is not None else ()))
            for rank, actor in enumerate(self.actors)
        ]
        return self.gather(refs)

    def run_rank(self, rank: int, method: str, *args: Any) -> Any:
        """Calls ``method`` on one actor."""
        return self.gather([getattr(self.actors[rank], method).remote(*args)], ranks=[rank])[0]

    def gather(self, refs: list[Any], ranks: Sequence[int] | None = None) -> list[Any]:
        """The results of ``refs`` (one per rank), failing on the first worker that fails.

        Raises:
            WorkerError: a worker died (killed, crashed, its node lost), ran out of
                memory, or raised; the group is killed first.
        """
        rank_of = {ref: rank for ref, rank in zip(refs, ranks if ranks is not None else range(len(refs)), strict=True)}
        results: dict[Any, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except Exception as error:
                    self.kill()
                    raise self._worker_error(error, rank_of[ref]) from None
        return [results[ref] for ref in refs]

    def pending(
        self, refs: list[Any], combine: Callable[[list[Any]], ResultT], ranks: Sequence[int] | None = None
    ) -> Pending[ResultT]:
        """``combine(gather(refs))`` as a :class:`~opd.models.interfaces.Pending`: the workers run meanwhile."""
        return _Gathered(self, refs, combine, ranks)

    def _worker_error(self, error: Exception, rank: int) -> WorkerError:
        where = f"{self.role} worker {rank} of {self.size}"
        if isinstance(error, ray.exceptions.OutOfMemoryError) or _is_oom(error):
            return WorkerError(f"{where} ran out of memory: {_first_line(error)}", self.role, rank)
        if isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError)):
            return WorkerError(f"{where} died ({type(error).__name__})", self.role, rank)
        if isinstance(error, ray.exceptions.RayTaskError):
            return WorkerError(f"{where} failed: {_first_line(error.cause)}", self.role, rank)
        return WorkerError(f"{where} failed: {_first_line(error)}", self.role, rank)

    def kill(self) -> None:
        """Ends every actor of the group at once (frees peers stuck in a collective)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


class _Gathered(Pending[ResultT]):
    """Results of calls already submitted to a group's workers, gathered (once) when asked for."""

    def __init__(
        self, group: WorkerGroup, refs: list[Any], combine: Callable[[list[Any]], ResultT], ranks: Sequence[int] | None
    ) -> None:
        self.group, self.refs, self.combine, self.ranks = group, refs, combine, ranks
        self.value: ResultT | None = None
        self.gathered = False

    def result(self) -> ResultT:
        """Waits for every worker's part and combines them (fails as :meth:`WorkerGroup.gather` does)."""
        if not self.gathered:
            self.value = self.combine(self.group.gather(self.refs, self.ranks))
            self.gathered = True
        return self.value  # type: ignore[return-value]


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
