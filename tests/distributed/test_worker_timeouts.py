"""Every wait on a worker is bounded: hung workers stop the run or the call, on a real local Ray cluster.

A worker that neither answers nor dies (a deadlock, a stuck device) gives Ray nothing
to report, so before the bounds each of these waited forever:

* a real distillation run (the driver, 1 FSDP2 trainer worker, 1 rollout worker) whose
  rollout worker hangs in its second ``generate``: the run stops within
  ``cluster.rollout.timeout_s``, naming the role, the rank, the node and the newest
  checkpoint (step 1's);
* a teacher-pool replica that hangs while scoring (the real ``TeacherPool`` facade over
  a real ``TeacherWorker`` with the tiny teacher);
* a call where one rank of two hangs (the other answered): the hung rank is named;
* an actor that can never be placed (no room left in its bundle, or a placement group
  the cluster cannot hold), and one whose constructor hangs: the start fails within its bound;
* a pool that the cluster cannot place fails within ``cluster.start_timeout_s``, and at
  once where Ray knows it never can.

The elapsed times asserted are generous bounds on "stops instead of hanging", not speeds.
The hanging worker classes are made by functions, so that Ray ships them by value: the
workers never import this module (nor what it imports).
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from opd_test_helpers import REPO_ROOT, TINY_TRAIN_DATA
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import opd.distributed.setup as cluster_setup
from opd.data.batched_data_dict import BatchedDataDict
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.distributed.config import ClusterConfig
from opd.distributed.rollout import RolloutWorker
from opd.distributed.teacher_pool import TeacherPool, TeacherWorker
from opd.distributed.workers.ray_cluster import build_pools
from opd.distributed.workers.worker_group import Bound, Slot, WorkerGroup
from opd.models.config import ModelLoadingConfig
from opd.models.interfaces import TopKRequest
from opd.utils.config import load_config
from opd.utils.errors import ConfigError, WorkerError

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
BOUND_S = 3.0
SLACK_S = 60.0  # on top of the bound: killing the actors, two shared cores under load
START = Bound(300.0, "cluster.start_timeout_s")  # a healthy worker's start (imports, a model) is not what is tested
NODE = r"node \d+\.\d+\.\d+\.\d+"


def plain_worker_class() -> type:
    """Rank ``hung_rank`` hangs in ``work``, or with ``in_constructor`` while being built; the others answer."""

    class Worker:
        def __init__(self, rank: int, hung_rank: int, in_constructor: bool = False) -> None:
            self.rank, self.hung_rank = rank, hung_rank
            if in_constructor and rank == hung_rank:
                threading.Event().wait()  # neither answers nor dies

        def work(self) -> int:
            if self.rank == self.hung_rank:
                threading.Event().wait()
            return self.rank

    return Worker


def hung_scoring_teacher_class() -> type:
    """The real teacher replica (the tiny teacher loaded), hanging while it scores."""

    class HungScoringTeacherWorker(TeacherWorker):
        def score(self, data, request, in_store=False):
            threading.Event().wait()
            return super().score(data, request, in_store)

    return HungScoringTeacherWorker


def second_generate_hangs_rollout_class() -> type:
    """The real rollout worker, except that its second ``generate`` hangs (after step 1's checkpoint)."""

    class SecondGenerateHangsRolloutWorker(RolloutWorker):
        def generate(self, *args, **kwargs):
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 2:
                threading.Event().wait()
            return super().generate(*args, **kwargs)

    return SecondGenerateHangsRolloutWorker


def cpu_pool(bundles: list[float]) -> object:
    group = placement_group([{"CPU": cpus} for cpus in bundles])
    ray.get(group.ready(), timeout=60)
    return group


def is_killed(actor: object, patience_s: float = 30.0) -> bool:
    """Whether ``actor`` is gone (``ray.kill`` takes effect asynchronously, so calls are retried a while)."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=patience_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.2)
    return False


def has(pattern: str, text: str) -> bool:
    return re.search(pattern, text) is not None


def test_a_hung_rank_stops_the_call_within_its_bound_naming_role_rank_and_node(ray_cluster):
    pool = cpu_pool([0.5, 0.5])
    workers = WorkerGroup(
        "rollout",
        plain_worker_class(),
        [Slot(pool, i, 0.5, 0.0) for i in range(2)],
        lambda rank: (rank, 1),
        call_bound=Bound(BOUND_S, "cluster.rollout.timeout_s"),
        start_bound=START,
    )
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        workers.run_all("work")
    assert time.monotonic() - start < BOUND_S + SLACK_S
    message = str(caught.value)
    assert (caught.value.role, caught.value.rank) == ("rollout", 1), message
    assert has(rf"^rollout worker 1 of 2 \({NODE}\) did not finish work within \d+\.\d s ", message), message
    assert "(cluster.rollout.timeout_s = 3)" in message and "the rollout workers were stopped" in message
    assert is_killed(workers.actors[0])  # the group was killed, the rank that answered too
    remove_placement_group(pool)


@pytest.mark.parametrize("case", ["hung constructor", "no room left in its bundle", "placement group never placed"])
def test_an_actor_that_never_starts_stops_the_start_within_its_bound(ray_cluster, case):
    worker_class = plain_worker_class()
    blocker = None
    never_placed = case == "placement group never placed"
    pool = placement_group([{"CPU": 1000.0}]) if never_placed else cpu_pool([0.5])  # 1000 CPUs: no node has them
    if case == "no room left in its bundle":  # the bundle is taken, as by a second colocated worker of one role
        in_bundle = PlacementGroupSchedulingStrategy(pool, 0)
        blocker = ray.remote(worker_class).options(num_cpus=0.5, scheduling_strategy=in_bundle).remote(0, -1)
        ray.get(blocker.__ray_ready__.remote(), timeout=300)
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        WorkerGroup(
            "teacher",
            worker_class,
            [Slot(pool, 0, 0.5, 0.0)],
            lambda rank: (rank, 0, case == "hung constructor"),
            start_bound=Bound(BOUND_S, "cluster.start_timeout_s"),
        )
    assert time.monotonic() - start < BOUND_S + SLACK_S
    message = str(caught.value)
    assert (caught.value.role, caught.value.rank) == ("teacher", 0), message
    assert has(r"^teacher worker 0 of 1 \(node .*\) did not start within \d+\.\d s ", message), message
    assert "(cluster.start_timeout_s = 3)" in message and "no room for 0.5 CPU in its bundle" in message, message
    if never_placed:
        assert "(node none: its placement group is not placed)" in message, message
    else:
        assert has(NODE, message), message
    if blocker is not None:
        ray.kill(blocker)
    remove_placement_group(pool)


def test_a_hung_teacher_pool_replica_stops_scoring_within_its_bound(ray_cluster):
    config = ClusterConfig(trainer={"workers": 1}, placement="split", teacher={"placement": "pool", "workers": 1})
    pools = build_pools(config, rollout_workers=0, teacher_workers=1)
    loading = ModelLoadingConfig(dtype="float32", device="cpu")
    workers = WorkerGroup(
        "teacher",
        hung_scoring_teacher_class(),
        pools.teacher,
        lambda rank: (rank, "tiny:teacher", loading, 1),
        call_bound=Bound(BOUND_S, "cluster.teacher.timeout_s"),
        start_bound=START,
    )
    ids = torch.randint(3, 200, (4, 6), generator=torch.Generator().manual_seed(0))
    data = BatchedDataDict({"input_ids": ids, "input_lengths": torch.full((4,), 6), "token_mask": torch.ones(4, 6)})
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        TeacherPool(workers).score(data, TopKRequest(k=4))
    assert time.monotonic() - start < BOUND_S + SLACK_S
    message = str(caught.value)
    assert (caught.value.role, caught.value.rank) == ("teacher", 0), message
    assert has(rf"^teacher worker 0 of 1 \({NODE}\) did not finish score within \d+\.\d s ", message), message
    assert "(cluster.teacher.timeout_s = 3)" in message, message
    pools.remove()


def test_a_pool_the_cluster_cannot_place_fails_within_the_start_bound(ray_cluster):
    # Joined cluster (an address): more nodes might come, so the start bound decides.
    joined = ClusterConfig(address="auto", trainer={"workers": 1}, gpus_per_worker=1, start_timeout_s=BOUND_S)
    start = time.monotonic()
    within = r"cannot place the trainer pool .* within \d+ s \(cluster\.start_timeout_s = 3\)"
    with pytest.raises(ConfigError, match=within):
        build_pools(joined, 1, 0)
    assert time.monotonic() - start < BOUND_S + SLACK_S
    # This machine's own cluster: Ray says at once that no node has a GPU, and nothing will join.
    private = ClusterConfig(trainer={"workers": 1}, gpus_per_worker=1)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"cannot place the trainer pool .* never \(it asks for more"):
        build_pools(private, 1, 0)
    assert time.monotonic() - start < SLACK_S


def test_a_hung_rollout_worker_stops_the_run_naming_role_rank_node_and_checkpoint(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setattr(cluster_setup, "RolloutWorker", second_generate_hangs_rollout_class())
    config = load_config(MasterConfig, TINY, [
        f"output_dir={tmp_path / 'run'}", f"data.train_path={TINY_TRAIN_DATA}", "data.val_path=null",
        "validation.val_at_start=false", "validation.val_at_end=false", "logger.console=false",
        "training.max_num_steps=3", "training.batch_size=2", "training.micro_batch_size=2", "training.save_freq=1",
        "distillation.lambda=1.0", "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.max_length=6",
        "cluster.trainer.workers=1", "cluster.rollout.workers=1", f"cluster.rollout.timeout_s={BOUND_S}",
    ])  # fmt: skip
    components = setup(config)
    try:
        with pytest.raises(WorkerError) as caught:
            distillation_train(components)
    finally:
        components.close()
    stopped = time.time()
    step_1 = Path(config.output_dir) / "checkpoints" / "step_1"
    # The hang began once step 1 was saved (then a refit, then the second generate).
    assert stopped - (step_1 / "save_state.json").stat().st_mtime < BOUND_S + SLACK_S
    message = str(caught.value)
    assert (caught.value.role, caught.value.rank) == ("rollout", 0), message
    assert has(rf"^rollout worker 0 of 1 \({NODE}\) did not finish generate within \d+\.\d s ", message), message
    assert "(cluster.rollout.timeout_s = 3)" in message and "after step 1 of 3" in message, message
    assert f"the newest complete checkpoint is {step_1}" in message, message
