"""The ``cluster:`` section's checks that need no cluster: bounds per role, backends, colocated sharing.

* Each role's call bound is its own ``timeout_s`` when set, else ``cluster.worker_timeout_s``,
  and the key named in a timeout's message is the one that set it.
* ``backend: gloo`` with GPUs (it would train on the CPUs) and ``backend: nccl`` without
  them are refused, naming both keys.
* Colocated placement puts at most one worker of each role on a trainer bundle: more
  rollout workers (at config validation) or teacher-pool workers (at start, before Ray:
  the count depends on the teachers) than trainer workers are refused, naming the keys.
* A torch older than the floor (2.11: the oldest the trainer path has run on) is refused
  before a cluster starts, and the floor is the one ``pyproject.toml`` states.
"""

from __future__ import annotations

import re

import pytest
from opd_test_helpers import REPO_ROOT

from opd.distillation.config import MasterConfig
from opd.distributed.config import ClusterConfig
from opd.distributed.setup import TORCH_FLOOR, check_torch_version, cross_node_teacher_warning
from opd.distributed.workers.ray_cluster import check_colocated_sharing
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"


def cluster(*overrides: str) -> ClusterConfig:
    config = load_config(MasterConfig, TINY, ["cluster.trainer.workers=2", *overrides])
    assert config.cluster is not None
    return config.cluster


def test_each_role_is_bounded_by_its_own_timeout_or_the_clusters():
    default = cluster()
    assert {role: default.call_timeout(role) for role in ("trainer", "rollout", "teacher")} == {
        role: (600.0, "cluster.worker_timeout_s") for role in ("trainer", "rollout", "teacher")
    }
    assert default.start_timeout_s == 600.0
    tuned = cluster("cluster.worker_timeout_s=120", "cluster.rollout.timeout_s=1800", "cluster.teacher.timeout_s=30")
    assert tuned.call_timeout("trainer") == (120.0, "cluster.worker_timeout_s")
    assert tuned.call_timeout("rollout") == (1800.0, "cluster.rollout.timeout_s")
    assert tuned.call_timeout("teacher") == (30.0, "cluster.teacher.timeout_s")


@pytest.mark.parametrize("key", ["worker_timeout_s", "start_timeout_s", "trainer.timeout_s", "rollout.timeout_s"])
def test_a_bound_that_is_not_positive_is_refused(key):
    with pytest.raises(ConfigError, match=re.escape(f"cluster.{key} = 0: ") + ".*greater than 0"):
        cluster(f"cluster.{key}=0")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["cluster.backend=gloo", "cluster.gpus_per_worker=1"],
            r"cluster\.backend = gloo with cluster\.gpus_per_worker = 1 would train on the CPUs",
        ),
        (["cluster.backend=nccl"], r"cluster\.backend = nccl needs GPUs but cluster\.gpus_per_worker = 0"),
    ],
)
def test_a_backend_that_does_not_match_the_devices_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        cluster(*overrides)
    # What they should be: auto picks the backend from the devices.
    assert cluster("cluster.gpus_per_worker=1").resolved_backend() == "nccl"
    assert cluster().resolved_backend() == "gloo"


def test_more_colocated_rollout_workers_than_trainer_workers_are_refused_at_validation():
    with pytest.raises(
        ConfigError,
        match=r"cluster\.rollout\.workers = 3 with cluster\.placement = colocated: each of the "
        r"cluster\.trainer\.workers = 2 trainer bundles .*; set cluster\.rollout\.workers <= 2, raise "
        r"cluster\.trainer\.workers, or use cluster\.placement = split",
    ):
        cluster("cluster.rollout.workers=3")
    assert cluster("cluster.rollout.workers=2").rollout.workers == 2
    assert cluster("cluster.rollout.workers=3", "cluster.placement=split").rollout.workers == 3


def test_more_colocated_teacher_pool_workers_than_trainer_workers_are_refused_before_ray_starts():
    pool = cluster("cluster.teacher.placement=pool", "cluster.teacher.workers=1", "loss_fn.type=topk")
    check_colocated_sharing(pool, rollout_workers=1, teacher_workers=2)  # two teachers, one replica each: fits
    with pytest.raises(ConfigError, match=r"cluster\.teacher\.workers × 3 teacher pools = 3 with cluster\.placement"):
        check_colocated_sharing(pool, rollout_workers=1, teacher_workers=3)
    three = cluster("cluster.teacher.placement=pool", "cluster.teacher.workers=3", "loss_fn.type=topk")
    with pytest.raises(ConfigError, match=r"^cluster\.teacher\.workers = 3 with cluster\.placement = colocated"):
        check_colocated_sharing(three, rollout_workers=1, teacher_workers=3)
    split = cluster(
        "cluster.placement=split", "cluster.teacher.placement=pool", "cluster.teacher.workers=3", "loss_fn.type=topk"
    )
    check_colocated_sharing(split, rollout_workers=1, teacher_workers=3)  # pools of their own: no sharing


@pytest.mark.parametrize("version", ["2.10.1+cu128", "2.4.0", "1.13.1"])
def test_a_torch_older_than_the_floor_is_refused_before_the_cluster_starts(version):
    with pytest.raises(
        ConfigError,
        match=rf"needs torch >= 2\.11 \(FSDP2 and DTensor as opd uses them\), and this "
        rf"environment has torch {re.escape(version)}; install torch>=2\.11",
    ):
        check_torch_version(version)


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0+cpu", "2.13.0a0+gitabc123", "3.0.0"])
def test_the_floor_and_newer_torch_are_accepted(version):
    check_torch_version(version)


def test_the_floor_is_the_one_pyproject_states():
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    stated = re.search(r'"torch>=(\d+)\.(\d+)"', pyproject)
    assert stated is not None and (int(stated[1]), int(stated[2])) == TORCH_FLOOR


def test_a_teacher_sharded_across_nodes_is_warned_about_with_its_gather_volume():
    nodes = ["a/10.0.0.1"] * 4 + ["b/10.0.0.2"] * 4
    teacher_bytes = 64 * 2**30  # a 32B teacher in bf16
    warning = cross_node_teacher_warning(nodes, teacher_bytes)
    assert warning is not None
    # Each of 8 ranks receives 7/8 of the teacher per micro-batch.
    assert "sharded over 8 trainer ranks on 2 nodes" in warning and "gathers 56.0 GiB per rank" in warning
    assert "cluster.trainer.shard_group_size = 4" in warning
    assert cross_node_teacher_warning(["a/10.0.0.1"] * 8, teacher_bytes) is None

