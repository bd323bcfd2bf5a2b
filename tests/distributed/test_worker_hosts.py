"""Warm worker hosts (``opd.distributed.worker_hosts``) on a real local Ray cluster.

A group built on warm hosts runs its workers in processes kept from the group before: the
same processes, but each worker built afresh, with the previous worker's process group
gone, each process with the rank it had. A group that failed is killed, and its hosts are never handed out again. The
equivalence of whole runs on warm hosts with one process is what the cluster tests check
(they run on warm hosts; ``OPD_TEST_FRESH_WORKERS=1`` runs them on fresh actors).
"""

from __future__ import annotations

import os
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from opd.distributed.worker_hosts import WarmHosts, keep_workers_warm
from opd.distributed.workers.ray_cluster import free_port
from opd.distributed.workers.worker_environment import runtime_env_for, worker_environment
from opd.distributed.workers.worker_group import Slot, WorkerGroup
from opd.utils.errors import WorkerError


class Counter:
    """Counts its calls; joins a gloo process group when asked (one per group of workers)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.calls = rank, world_size, 0

    def join(self, port: int) -> int:
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank, world_size=self.world_size
        )
        total = torch.tensor([self.rank + 1])
        dist.all_reduce(total)
        return int(total)

    def count(self) -> tuple[int, int]:
        self.calls += 1
        return os.getpid(), self.calls

    def fail(self) -> None:
        raise ValueError("this worker fails")


@pytest.fixture
def slots(ray_cluster):
    pool = placement_group([{"CPU": 0.5}, {"CPU": 0.5}])
    ray.get(pool.ready())
    yield [Slot(pool, index, 0.5, 0.0) for index in range(2)]
    remove_placement_group(pool)


def build(slots, hosts) -> WorkerGroup:
    return WorkerGroup("trainer", Counter, slots, lambda rank: (rank, 2), {"OMP_NUM_THREADS": "1"}, hosts=hosts)


def test_a_group_on_warm_hosts_reuses_the_processes_with_fresh_workers_and_process_groups(slots):
    hosts = keep_workers_warm()
    hosts.close()  # no idle host from an earlier test
    first = build(slots, hosts)
    assert first.run_all("join", free_port()) == [3, 3]
    assert [calls for _, calls in first.run_all("count")] == [1, 1]
    assert [calls for _, calls in first.run_all("count")] == [2, 2]
    pids = [pid for pid, _ in first.run_all("count")]
    first.stop()
    assert hosts.idle_count() == 2
    with pytest.raises(WorkerError, match="the trainer workers were stopped"):
        first.run_all("count")  # its hosts are no longer its own
    first.kill()  # nor are they its to kill

    second = build(slots, hosts)
    assert hosts.idle_count() == 0
    counted = second.run_all("count")
    # The same processes, each for the rank it served: torch keeps caches keyed by a device
    # mesh that compare equal across ranks (opd.distributed.worker_hosts.WarmHosts).
    assert [pid for pid, _ in counted] == pids
    assert [calls for _, calls in counted] == [1, 1]  # but new workers
    assert second.run_all("join", free_port()) == [3, 3]  # the first group's process group was left
    second.stop()
    second.stop()  # a second stop does nothing
    assert hosts.idle_count() == 2


def test_the_hosts_of_a_failed_group_are_never_handed_out_again(slots):
    hosts = keep_workers_warm()
    failing = build(slots, hosts)
    pids = {pid for pid, _ in failing.run_all("count")}
    with pytest.raises(WorkerError, match=r"trainer worker 0 of 2 \(node [\d.]+\) failed: ValueError: this worker"):
        failing.run_rank(0, "fail")
    idle = hosts.idle_count()
    failing.stop()  # killed already: nothing to give back
    assert hosts.idle_count() == idle
    fresh = build(slots, hosts)
    assert not pids & {pid for pid, _ in fresh.run_all("count")}
    fresh.stop()


def test_idle_hosts_beyond_the_limit_are_ended_the_longest_idle_first(ray_cluster):
    hosts = WarmHosts(ray.get_runtime_context().gcs_address, max_idle=1)
    first, second = hosts.take("rollout", 2, {})
    ray.get([first.__ray_ready__.remote(), second.__ray_ready__.remote()])
    hosts.give_back("rollout", [first, second], {})  # rank 0 given back first: idle the longest
    assert hosts.idle_count() == 1
    taken = hosts.take("rollout", 2, {})
    assert taken[1] is second and taken[0] is not first
    deadline = time.monotonic() + 60
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:  # ray.kill is asynchronous: a call sent just after may still be served
            ray.get(first.__ray_ready__.remote(), timeout=60)
            time.sleep(0.1)
    for host in taken:
        ray.kill(host)


class EnvironmentReader:
    """Reports the variables a worker process runs with."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank

    def read(self) -> dict[str, str | None]:
        return {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "OPD_TEST_ONLY_RAY")}


@pytest.mark.parametrize("warm", [False, True], ids=["fresh actors", "warm hosts"])
def test_workers_inherit_the_private_clusters_environment_and_get_only_the_rest_from_ray(slots, warm):
    """The tests' cluster is private (tests/conftest.py): its workers inherit one thread, no tokenizer pool."""
    inherited = worker_environment(threads=1)
    assert runtime_env_for(inherited) == {}  # an actor starts without Ray's environment set-up process
    assert runtime_env_for({**inherited, "OMP_NUM_THREADS": "3"}) == {"env_vars": {"OMP_NUM_THREADS": "3"}}
    wanted = {**inherited, "OPD_TEST_ONLY_RAY": "set through Ray"}
    assert "OPD_TEST_ONLY_RAY" not in os.environ
    hosts = keep_workers_warm() if warm else None
    group = WorkerGroup("reader", EnvironmentReader, slots, lambda rank: (rank, 2), wanted, hosts=hosts)
    try:
        assert group.run_all("read") == [wanted, wanted]
    finally:
        group.kill()
