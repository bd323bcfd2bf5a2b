"""Shared pytest setup: the test-helper import path, a clean ``opd`` logger per test, the cluster tests' Ray.

The suite runs with ``--import-mode=importlib``, which does not put test directories on
``sys.path``; shared test helpers therefore live in one uniquely named module here.
"""

import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from opd.utils.compile_cache import kernel_cache_dir_for

# One set of CPU kernels for every x86-64 machine: PyTorch picks AVX-512 kernels where the
# CPU has them, and their float32 reductions round differently from the AVX2 ones (1e-5
# relative in an ill-conditioned gradient). The float32 values pinned in tests/reference
# were recorded with the AVX2 kernels, which every x86-64 CPU of the last decade runs, so
# the suite asks for those (before torch picks its kernels; an explicit setting wins).
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
# Inductor's kernel cache must not mix kernels compiled at a forced level with the user's
# default-level ones (a default-level run that loaded them aborted: opd/utils/compile_cache.py).
# Set here as well as in opd's compile path, since a test may compile before opd does.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", kernel_cache_dir_for(os.environ["ATEN_CPU_CAPABILITY"]))

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


@pytest.fixture(autouse=True)
def _restore_opd_logger():
    """Gives every test the ``opd`` logger as it found it.

    Tests that call ``opd.cli.main`` in-process install opd's console handler and turn
    propagation off; without this, a later test that reads log records through ``caplog``
    would see none, depending on the order the tests ran in.
    """
    opd_log = logging.getLogger("opd")
    saved = (list(opd_log.handlers), opd_log.level, opd_log.propagate)
    yield
    opd_log.handlers[:], opd_log.level, opd_log.propagate = saved


@pytest.fixture(autouse=True, scope="session")
def _arithmetic_task_exists():
    """The demo's arithmetic task (``examples/data/arithmetic/``, generated, not committed) is on disk.

    Several test modules read it; without this, whether it existed depended on a demo test
    having run earlier in the same process. The generator is deterministic and writes each
    file atomically, so parallel test workers may both run it.
    """
    task_dir = Path(_TESTS_DIR).parent / "examples" / "data" / "arithmetic"
    if not all((task_dir / f"{split}.jsonl").is_file() for split in ("train", "val", "test")):
        generator = task_dir.parent / "make_arithmetic_task.py"
        subprocess.run([sys.executable, str(generator)], check=True, capture_output=True)


# ------------------------------------------------------------------------------ the cluster tests' Ray cluster

RAY_TEST_CPUS = 4
"""CPU slots of the tests' Ray cluster: a trainer, a rollout worker and two teacher pools (or 4 trainer ranks)."""
_RAY_FREE_WAIT_S = 10.0
"""How long a module's end waits for Ray to free the CPU slots of the workers it killed."""
_shared_ray: dict[str, object] = {}
"""The cluster ``ray_cluster`` started: its GCS address, while it runs."""


def _shared_ray_running() -> bool:
    """Whether the cluster ``ray_cluster`` started is the Ray this process is connected to."""
    ray = sys.modules.get("ray")  # never imported here: most test processes never need Ray
    if ray is None or not ray.is_initialized() or "address" not in _shared_ray:
        return False
    return ray.get_runtime_context().gcs_address == _shared_ray["address"]


def _stop_shared_ray() -> None:
    if _shared_ray_running():
        sys.modules["ray"].shutdown()
    _shared_ray.clear()


def _slots_freed(ray) -> bool:
    """Whether every CPU slot is free again, once the placement groups a module left behind are removed.

    A worker left alive outside a placement group keeps its slot: then the cluster is not
    shared further.
    """
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    for group_id, entry in placement_group_table().items():
        if entry.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
    deadline = time.monotonic() + _RAY_FREE_WAIT_S
    while ray.available_resources().get("CPU", 0.0) < RAY_TEST_CPUS:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local Ray cluster of ``RAY_TEST_CPUS`` CPU slots for the module (runs join it, not start their own).

    Started once and kept for the next test file that asks for one (in the same pytest
    process), through the files between that do not: a cluster's start and stop, and its
    warm workers' imports, cost seconds of both cores, and the cluster tests are two dozen
    files. A file ends with every slot free, or the cluster is stopped (the next file gets
    a fresh one). A run that a test starts in this process while the cluster is up joins
    it (``opd.distributed.workers.ray_cluster.start_ray``); the runs' worker processes are kept
    warm between runs (``OPD_TEST_FRESH_WORKERS=1``: a fresh actor per worker, as a run
    outside the tests has), and they inherit their environment from the cluster
    (``opd.distributed.workers.worker_environment``).
    """
    import ray

    from opd.distributed.workers.ray_cluster import RAY_ENVIRONMENT
    from opd.distributed.workers.worker_environment import init_local_ray, worker_environment

    if not _shared_ray_running():
        if ray.is_initialized():  # another test's Ray, left running: not a cluster of RAY_TEST_CPUS slots
            ray.shutdown()
        for key, value in RAY_ENVIRONMENT.items():
            os.environ.setdefault(key, value)
        # The workers of the tests' runs (one thread each) inherit their environment.
        init_local_ray(
            worker_environment(threads=1),
            num_cpus=RAY_TEST_CPUS,
            include_dashboard=False,
            _temp_dir=tempfile.mkdtemp(prefix="opd_ray_test_", dir="/tmp"),
            configure_logging=False,
            log_to_driver=False,
        )
        _shared_ray["address"] = ray.get_runtime_context().gcs_address
    if os.environ.get("OPD_TEST_FRESH_WORKERS") != "1":
        # The runs' worker processes are kept between runs (opd.distributed.worker_hosts):
        # each costs seconds of imports to start.
        from opd.distributed.worker_hosts import keep_workers_warm

        keep_workers_warm()
    yield
    if not _shared_ray_running() or not _slots_freed(ray):
        _stop_shared_ray()


@pytest.fixture(scope="module")
def without_shared_ray():
    """Stops the shared cluster (``ray_cluster``, kept up between files) for a module that starts a Ray of its own."""
    _stop_shared_ray()


def pytest_sessionfinish(session, exitstatus):
    _stop_shared_ray()


# Test files that take minutes, slowest first (measured with --durations on 2 cores).
# The parallel run (pytest-xdist, --dist loadfile) hands files to workers in collection
# order: a worker takes the next file when at most 2 of its tests are left, so starting
# the long files first keeps one of them from running alone at the end. Each tier has its
# own order: a file's place is that of its tests the run selected (`slow` or not), and
# in `--all` the slow tier's files lead.
_SLOWEST_FILES = [
    "reference/test_reference_runs.py",
    "distributed/test_cluster_equivalence.py",
    "functional/test_run_lifecycle.py",
    "distributed/test_async_cluster.py",
    "distributed/test_cluster_teachers.py",
    "distributed/test_sharded_teacher_pool.py",
    "distributed/test_exact_signal_transport.py",
    "distributed/test_layer_extrapolation.py",
    "unit/test_hsdp.py",
    "unit/models/test_teacher_server.py",
    "unit/algorithms/test_sft.py",
    "distributed/test_worker_errors.py",
    "unit/models/test_remote_teacher.py",
    "functional/test_feature_pairs.py",
    # Not the vLLM stage's files (scripts/test_vllm.sh): ordered longest first, its two workers ran two
    # multi-process vLLM engines at once, and the stage took 183 s instead of 159-178 s (2026-11-30).
]
_SLOWEST_SLOW_FILES = [
    # Two workers (CI's 2 cores). A worker is handed its next file as soon as at most 2 of its
    # tests are left, so a file of one or two tests takes the next file along at once. By CI's
    # 2-core durations of 2026-11-30 (08:48 UTC run): the fault runs 125 s, SmolLM2 86 s,
    # kill-and-rerun 78 s, the cluster pairs and spec case 70 s, the trainer-worker teachers 52 s,
    # compiling 51 s, Gemma 3 compiled 36 s, the dry run 31 s, baselines 18 s.
    "distributed/test_cluster_faults.py",  # five `opd train` processes
    "functional/test_real_model_smollm2.py",  # SmolLM2 exported and pruned, five 3-step runs with a real 135M teacher
    "distributed/test_async_cluster.py",  # three `opd train` processes
    "functional/test_feature_pairs.py",  # every accepted cluster pair and the spec case, each also in one process
    "distributed/test_trainer_worker_teachers.py",
    "unit/utils/test_compile_cache.py",
    "unit/models/test_model_families.py",  # its slow test compiles a Gemma 3 decode step
    "distributed/test_dry_run_accuracy.py",
    "distributed/test_cluster_baselines.py",
]
"""The files of the tests marked `slow` (CI's second run, `--all`), in the order that balances two workers."""
# The demo's reference test: a second when it reads a finished demo, else the longest of all.
_SLOWEST_SLOW_FILES.insert(
    len(_SLOWEST_SLOW_FILES) if os.environ.get("OPD_DEMO_OUTPUT") else 0, "reference/test_reference_runs.py"
)


# The quick tier (`bash scripts/test.sh --quick`, marker `quick`): what a developer runs
# before every commit, in at most 3 minutes on 2 cores. Every loss and divergence against
# its float64 reference and the recorded loss values, config and data errors (the bad-input
# table, the command line), one tiny end-to-end run (tests/functional/distillation.sh) and
# one step of every shipped config.
# A directory stands for every file under it.
_QUICK_PATHS = [
    "unit/algorithms/test_loss_functions.py",
    "unit/algorithms/test_divergences.py",
    "unit/algorithms/test_fused_lm_head.py",
    "unit/algorithms/test_topk_rest_mass.py",
    "unit/algorithms/test_topk_empty_slots.py",
    "unit/algorithms/test_token_clip.py",
    "unit/algorithms/test_hybrid_loss.py",
    "unit/algorithms/test_off_policy.py",
    "unit/algorithms/test_several_teachers.py",
    "unit/algorithms/test_loss_config.py",
    "unit/algorithms/test_loss_fn_config.py",
    "unit/algorithms/test_validation_kl_request.py",
    "unit/algorithms/test_early_stop.py",
    "reference/test_reference_losses.py",
    "unit/utils/test_config.py",
    "unit/test_cli.py",
    "unit/data",
    "robustness/test_bad_inputs.py",
    "functional/test_distillation_sh.py",
    "functional/test_shipped_configs.py",
    "unit/test_check_demo_result.py",
    "unit/test_code_hygiene.py",
]


# Rerun by CI's second run beside the slow tier, at the machine's own CPU kernel level
# (marker `kernel_rerun`): the recorded losses and tiny runs, and the multi-turn cluster runs
# against one process. The other cluster comparisons are rerun there by the slow tier's
# feature pairs; scripts/test_kernel_levels.sh reruns any of them at any level.
_KERNEL_RERUN_PATHS = ["reference", "distributed/test_cluster_multi_turn.py"]
_SLOW_AND_KERNEL_RERUN = "slow or kernel_rerun"


def _under(name: str, paths: list[str]) -> bool:
    return any(name == path or name.startswith(path + "/") for path in paths)


def _relative_path(item) -> str | None:
    try:
        return Path(item.path).resolve().relative_to(_TESTS_DIR).as_posix()
    except ValueError:
        return None


def pytest_ignore_collect(collection_path, config):
    """With ``-m slow`` (CI's second run: ``slow or kernel_rerun``), leaves out the test files that mark no test
    `slow` (and are no kernel-level rerun).

    Collecting a file imports it and what it imports (torch, transformers, Ray, TRL...):
    the whole suite's collection costs each pytest worker most of 20 CPU-seconds, to
    select a dozen tests from three files in a hundred. A file that marks a test slow
    names ``mark.slow`` (a decorator, ``pytestmark`` or a parameter's ``marks=``).
    """
    markexpr = config.getoption("markexpr", default="")
    if markexpr not in ("slow", _SLOW_AND_KERNEL_RERUN) or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    if markexpr == _SLOW_AND_KERNEL_RERUN:
        path = Path(collection_path).resolve()
        if path.is_relative_to(_TESTS_DIR) and _under(path.relative_to(_TESTS_DIR).as_posix(), _KERNEL_RERUN_PATHS):
            return None
    return "mark.slow" not in collection_path.read_text(encoding="utf-8")


def pytest_collection_modifyitems(config, items):
    """Marks the quick tier and the kernel-level reruns."""
    for item in items:
        name = _relative_path(item)
        if name is not None and _under(name, _QUICK_PATHS):
            item.add_marker(pytest.mark.quick)
        if name is not None and _under(name, _KERNEL_RERUN_PATHS):
            item.add_marker(pytest.mark.kernel_rerun)


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_slowest_first(config, items):
    """Moves the slowest test files to the front (the order inside each file is kept).

    Runs after ``-m`` has deselected (``trylast``), so that a file is placed by the tests
    that run: by `_SLOWEST_SLOW_FILES` when its `slow` tests run, else by `_SLOWEST_FILES`.
    """
    slow_rank = {name: position for position, name in enumerate(_SLOWEST_SLOW_FILES)}
    rank = {name: len(slow_rank) + position for position, name in enumerate(_SLOWEST_FILES)}
    last = len(slow_rank) + len(rank)
    position: dict[str | None, int] = {}
    for item in items:
        name = _relative_path(item)
        here = slow_rank.get(name, last) if item.get_closest_marker("slow") else rank.get(name, last)
        position[name] = min(position.get(name, last), here)
    items.sort(key=lambda item: position[_relative_path(item)])
