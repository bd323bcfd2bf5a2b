"""A teacher pool whose replica is one teacher sharded over 2 workers equals one process, on a real Ray cluster.

* ``cluster.teacher.shards_per_replica=2`` with 4 workers: the two workers of each of
  two replicas meet in a gloo process group of their own and hold one FSDP2-sharded
  teacher between them (each holds part of every weight). For batches of 5 rows (over
  both replicas) and of 1 row (one replica, whose second worker scores a filler row,
  because its forward gathers its peer's weights), the pool's top-k log-probs (with the
  rest mass) and token log-probs equal an in-process
  :class:`~opd.teachers.local_teacher.LocalTeacher`'s within fp32 rounding.
* Three steps of top-k distillation (λ = 0.5) with 2 trainer workers and a pool of one
  such replica give the per-step losses of one process, and the pool had every
  micro-batch of a step in flight at once (the trainer submits them all before it
  collects any answer). The trainer runs HSDP with groups of one
  (``cluster.trainer.shard_group_size=1``: a 2 × 1 mesh, each worker a whole replica of
  the student), so the run also carries that setting from the config to the workers and
  refits the rollout worker from a 2-D mesh.
* A pool whose workers do not make whole replicas is refused with the keys named.

One Ray cluster serves the module; every worker runs one thread (two shared cores).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import ray
import torch
from opd_float_tolerance import METRIC_ZERO, metric_tolerance, tiny_student_entries
from opd_test_helpers import REPO_ROOT, short_run_overrides

from opd.data.batched_data_dict import BatchedDataDict
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.models.config import ModelLoadingConfig, OptimizerConfig
from opd.models.interfaces import (
    Pending,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TokenLogprobsRequest,
    TopKLogprobs,
    TopKRequest,
)
from opd.models.loading import load_causal_lm
from opd.rollout.engines import GenerationConfig
from opd.run.plotting import read_metrics
from opd.teachers.local_teacher import LocalTeacher
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
LOADING = ModelLoadingConfig(dtype="float32", device="cpu")
SHARDED_POOL = ["cluster.teacher.placement=pool", "cluster.teacher.workers=2", "cluster.teacher.shards_per_replica=2"]
STEPS = 3
MICRO_BATCHES_PER_STEP = 4  # 8 rows, 2 trainer ranks, micro-batches of 2
ABSOLUTE_TOLERANCE = 1e-5  # the shards' gathered weights are the same numbers; only reduction order differs


def config(tmp_path: Path, name: str, *overrides: str) -> MasterConfig:
    return load_config(MasterConfig, TINY, [
        *short_run_overrides(tmp_path, name), f"training.max_num_steps={STEPS}", "training.batch_size=8",
        "training.micro_batch_size=2", "training.save_freq=0", "distillation.lambda=0.5",
        "distillation.num_samples_per_prompt=1", "distillation.generate_strategy.decoding_method=greedy",
        "distillation.generate_strategy.max_length=10", "loss_fn.type=topk", "loss_fn.k=4", *overrides,
    ])


def scored_batch(size: int) -> BatchedDataDict:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.tensor([9, 4, 7, 9, 2][:size])
    ids = torch.randint(3, 200, (size, 9), generator=generator)
    mask = torch.arange(9)[None, :] < lengths[:, None]
    return BatchedDataDict({"input_ids": ids * mask, "input_lengths": lengths, "token_mask": mask.long()})


# The training test runs before the replica fixture exists: the fixture's placement group holds
# every CPU the module's Ray cluster has until the module ends.


class InFlightCounter(TeacherInterface):
    """Passes every request to ``teacher`` and counts the requests started but not yet collected."""

    def __init__(self, teacher: TeacherInterface) -> None:
        self.teacher = teacher
        self.in_flight = 0
        self.most_in_flight = 0

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        return None

    def refusal(self, request: TeacherRequest) -> str | None:
        return self.teacher.refusal(request)

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        return self.score_async(data, request).result()

    def score_async(self, data: BatchedDataDict, request: TeacherRequest) -> Pending[TeacherSignal]:
        pending = self.teacher.score_async(data, request)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        counter = self

        class Collected(Pending[TeacherSignal]):
            def result(self) -> TeacherSignal:
                answer = pending.result()
                counter.in_flight -= 1
                return answer

        return Collected()

    def close(self) -> None:
        self.teacher.close()


def run(config_: MasterConfig) -> tuple[list[dict], int, tuple[int, ...] | None]:
    """The run's step records; on a cluster also the most teacher requests in flight and the trainer's mesh shape."""
    components = setup(config_)
    counter, mesh_shape = None, None
    if config_.cluster is not None:
        counter = components.teacher_policy = InFlightCounter(components.teacher_policy)
        trainer = components.student_policy.workers  # type: ignore[attr-defined]
        mesh_shape = ray.get(trainer.actors[0].__ray_call__.remote(
            lambda worker: tuple(next(worker.model.parameters()).device_mesh.shape)))
    try:
        distillation_train(components)
    finally:
        components.close()
    records = [record for record in read_metrics(Path(config_.output_dir) / "logs") if "train/loss" in record]
    return records, counter.most_in_flight if counter is not None else 0, mesh_shape


def test_training_with_a_sharded_teacher_pool_matches_one_process(ray_cluster, tmp_path):
    in_process, _, _ = run(config(tmp_path, "in_process"))
    on_cluster, most_in_flight, mesh_shape = run(
        config(tmp_path, "cluster", "cluster.trainer.workers=2", "cluster.trainer.shard_group_size=1",
               "cluster.rollout.workers=1", *SHARDED_POOL)
    )
    assert mesh_shape == (2, 1)  # HSDP: 2 replicas of 1 shard
    assert len(on_cluster) == len(in_process) == STEPS
    assert 0 < sum(record["train/on_policy"] for record in on_cluster) < STEPS  # both branches ran
    for mine, reference in zip(on_cluster, in_process, strict=True):
        tolerance = metric_tolerance(mine["step"], tiny_student_entries())
        for key in ("train/loss", "train/kl_forward", "train/grad_norm"):
            assert math.isclose(mine[key], reference[key], rel_tol=tolerance, abs_tol=METRIC_ZERO), (
                f"step {mine['step']} {key}: sharded pool {mine[key]!r}, one process {reference[key]!r}"
            )
        assert mine["timing/teacher"] > 0
        # The trainer's own phases reach the log through the step's timer.
        assert mine["timing/trainer_compute"] > 0 and mine["timing/dispatch"] > 0
        assert not any(key.endswith("_seconds") for key in mine)
    # Every micro-batch of a step was with the pool before the first answer was collected.
    assert most_in_flight == MICRO_BATCHES_PER_STEP


@pytest.fixture(scope="module")
def sharded_pool(ray_cluster, tmp_path_factory):
    """Two replicas of the tiny teacher, each sharded over two workers, started as a run starts them."""
    from opd.distributed.setup import ClusterRequest, _start_teacher_pool
    from opd.distributed.teacher_pool import TeacherPool
    from opd.distributed.workers.ray_cluster import build_pools

    # Colocated teacher workers share the trainer's bundles, one each: four bundles for four workers.
    cluster = config(
        tmp_path_factory.mktemp("pool"), "pool", *SHARDED_POOL, "cluster.teacher.workers=4", "cluster.trainer.workers=4",
        "cluster.start_timeout_s=60",
    ).cluster
    assert cluster is not None
    pools = build_pools(cluster, 0, cluster.teacher.workers)
    request = ClusterRequest("tiny:student", {"teacher": "tiny:teacher"}, LOADING, OptimizerConfig(), 1, 1, None,
                             False, None, GenerationConfig())
    workers = _start_teacher_pool(cluster, request, "teacher", "tiny:teacher", pools.teacher)
    yield TeacherPool(workers, cluster.teacher.shards_per_replica)
    workers.kill()
    pools.remove()


def test_each_worker_of_a_replica_holds_part_of_every_weight(sharded_pool):
    whole = load_causal_lm("tiny:teacher", torch.float32, torch.device("cpu"), LOADING)

    def local_rows(worker):
        return {name: param.to_local().shape[0] for name, param in worker.teacher.model.named_parameters()}

    held = ray.get([actor.__ray_call__.remote(local_rows) for actor in sharded_pool.workers.actors])
    for replica in (held[:2], held[2:]):
        for name, param in whole.named_parameters():
            assert sum(rows[name] for rows in replica) == param.shape[0], name
            assert all(rows[name] < param.shape[0] for rows in replica), f"{name} is whole on a worker"


@pytest.mark.parametrize("size", [5, 1], ids=["five_rows", "one_row"])
@pytest.mark.parametrize("request_", [TopKRequest(k=5), TokenLogprobsRequest()], ids=["topk", "token_logprobs"])
def test_a_sharded_replica_sends_the_in_process_signal(sharded_pool, request_, size):
    batch = scored_batch(size)
    expected = LocalTeacher(load_causal_lm("tiny:teacher", torch.float32, torch.device("cpu"), LOADING)).score(
        batch, request_
    )
    actual = sharded_pool.score(batch, request_)
    for row, length in enumerate(batch["input_lengths"].tolist()):
        if isinstance(expected, TopKLogprobs):
            assert isinstance(actual, TopKLogprobs) and actual.rest_logprobs is not None
            assert torch.equal(actual.ids[row, :length], expected.ids[row, :length])
            pairs = ((actual.logprobs, expected.logprobs), (actual.rest_logprobs, expected.rest_logprobs))
            for mine, reference in pairs:
                torch.testing.assert_close(mine[row, :length], reference[row, :length], rtol=0, atol=ABSOLUTE_TOLERANCE)
        else:
            torch.testing.assert_close(actual[row, :length], expected[row, :length], rtol=0, atol=ABSOLUTE_TOLERANCE)
    assert len(actual[0] if isinstance(actual, tuple) else actual) == size  # the filler row was dropped


@pytest.mark.parametrize(("overrides", "message"), [
    (["cluster.teacher.workers=3"], "cluster.teacher.workers = 3 is not a multiple of cluster.teacher.shards_per"),
    (["cluster.gpus_per_worker=1", "cluster.trainer.workers=1"],
     "cluster.teacher.shards_per_replica = 2 with cluster.placement = colocated needs as many trainer GPUs"),
])
def test_a_pool_that_does_not_make_whole_replicas_is_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, "refused", *SHARDED_POOL, *overrides)
