"""How a worker group reports its workers' failures, on a real local Ray cluster.

A rank that runs out of memory (device or host) or raises must end the wait at once with one
:class:`~opd.utils.errors.WorkerError` naming the role, the rank and its node (and, for memory,
saying so), while its peer is still busy; the group is killed afterwards. A rank whose error
only echoes a peer's death (its collective lost the peer) yields to that death, which is named. The end-to-end
path (a SIGKILLed trainer worker in a real run) is in ``test_cluster_faults.py``.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import ray
import torch
from ray.util.placement_group import placement_group

from opd.distributed.workers.worker_group import Slot, WorkerGroup
from opd.utils.errors import WorkerError


class Worker:
    """Rank 1 fails as told; rank 0 works slowly (a peer still busy when rank 1 fails)."""

    def __init__(self, rank: int, failure: str) -> None:
        self.rank, self.failure = rank, failure

    def work(self) -> int:
        if self.rank == 0:
            if self.failure == "peer_dies":  # dies just after rank 1's collective failed because of it
                time.sleep(0.5)
                os._exit(1)
            time.sleep(30)
            return 0
        if self.failure == "peer_dies":
            raise RuntimeError("gloo: Connection reset by peer")
        if self.failure == "cuda_oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.3 GiB total)")
        if self.failure == "host_oom":
            raise MemoryError("cannot allocate 8589934592 bytes")
        raise ValueError("bad micro-batch shape")


def group(failure: str) -> WorkerGroup:
    pool = placement_group([{"CPU": 0.5}, {"CPU": 0.5}])
    ray.get(pool.ready())
    slots = [Slot(pool, index, 0.5, 0.0) for index in range(2)]
    return WorkerGroup("trainer", Worker, slots, lambda rank: (rank, failure))


@pytest.mark.parametrize(
    ("failure", "message"),
    [
        ("cuda_oom", r"trainer worker 1 of 2 \(node [\d.]+\) ran out of memory: .*CUDA out of memory"),
        ("host_oom", r"trainer worker 1 of 2 \(node [\d.]+\) ran out of memory: .*MemoryError"),
        ("error", r"trainer worker 1 of 2 \(node [\d.]+\) failed: ValueError: bad micro-batch shape"),
        # A rank that dies (SIGKILL) is tested end to end in test_cluster_faults.py.
    ],
)
def test_a_failing_rank_ends_the_wait_at_once_with_its_role_and_rank(ray_cluster, failure, message):
    workers = group(failure)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=message) as caught:
        workers.run_all("work")
    assert time.monotonic() - start < 20, "the busy peer (30 s) must not be waited for"
    assert (caught.value.role, caught.value.rank) == ("trainer", 1)


def test_a_peers_death_is_named_rather_than_the_collective_error_it_caused(ray_cluster):
    with pytest.raises(WorkerError) as caught:
        group("peer_dies").run_all("work")
    message = str(caught.value)
    assert re.match(r"trainer worker 0 of 2 \(node [\d.]+\) died \(\w+\); ", message), message
    assert message.endswith("trainer worker 1 then failed: RuntimeError: gloo: Connection reset by peer"), message
    assert (caught.value.role, caught.value.rank) == ("trainer", 0)
