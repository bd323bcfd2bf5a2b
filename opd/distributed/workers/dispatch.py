"""How a worker method's inputs are split over the ranks and its results gathered, declared on the method.

:func:`dispatch` marks each method the controller calls on every rank (like verl's ``@register``): ``split``
says whether ranks get the same arguments or also one ``shares`` tuple each (:class:`Split`); ``gather`` maps
the ranks' results, in rank order, to one. :meth:`~opd.distributed.workers.worker_group.WorkerGroup.call` reads
the declaration and refuses a method without one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from opd.models.step_metrics import accumulate_metrics

MethodT = TypeVar("MethodT", bound=Callable[..., Any])

_ATTRIBUTE = "__opd_dispatch__"


class Split(Enum):
    """How a call's arguments reach the ranks."""

    SAME = "same"
    PER_RANK = "per_rank"


def every(results: list[Any]) -> list[Any]:
    """Every rank's result, in rank order."""
    return results


def first(results: list[Any]) -> Any:
    """Rank 0's result."""
    return results[0]


def nothing(results: list[Any]) -> None:
    """No result (the call is made for what it does on the ranks)."""
    return None


def summed(results: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' metric sums added up (``*_max`` keys keep the largest), as micro-batches are."""
    totals: dict[str, float] = {}
    for result in results:
        accumulate_metrics(totals, result)
    return totals


@dataclass(frozen=True)
class Dispatch:
    """A method's declaration: how its inputs are split and its results gathered."""

    split: Split
    gather: Callable[[list[Any]], Any]

    def arguments(
        self, method: str, size: int, shares: Sequence[tuple[Any, ...]] | None
    ) -> list[tuple[Any, ...]] | None:
        """Each rank's own arguments; ValueError unless ``shares`` fits the declaration (one per rank, or none)."""
        if self.split is Split.SAME:
            if shares is not None:
                raise ValueError(f"{method} sends every rank the same arguments; it takes no shares")
            return None
        if shares is None or len(shares) != size:
            raise ValueError(
                f"{method} takes one share per rank ({size}), got {None if shares is None else len(shares)}"
            )
        return list(shares)


def dispatch(split: Split = Split.SAME, gather: Callable[[list[Any]], Any] = every) -> Callable[[MethodT], MethodT]:
    """Declares how the method's inputs are split over the ranks and its results gathered."""

    def declare(method: MethodT) -> MethodT:
        setattr(method, _ATTRIBUTE, Dispatch(split, gather))
        return method

    return declare


def declaration(worker_class: type, method: str) -> Dispatch:
    """The declaration of ``worker_class.method``; TypeError when it has none."""
    declared = getattr(getattr(worker_class, method, None), _ATTRIBUTE, None)
    if declared is None:
        raise TypeError(f"{worker_class.__name__}.{method} declares no dispatch (opd.distributed.workers.dispatch)")
    return declared
