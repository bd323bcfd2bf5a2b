"""Worker death and kill-and-resume on a real 2-worker cluster run (``opd train`` in a subprocess).

Two runs of the same config (2 FSDP2 trainer workers over gloo, one rollout worker,
sampled rollouts on some steps and fixed data on others, a checkpoint every step):

* the reference runs uninterrupted;
* the other loses a trainer worker (SIGKILL to that Ray actor) after its first
  checkpoint: the command must stop within a bounded time with one message naming the
  role, the rank and the newest complete checkpoint, and nothing half-saved. Rerun, it
  resumes, and is killed whole with SIGKILL after its third checkpoint; rerun again, it
  must end with bitwise the reference's weights;
* the reference's step-2 checkpoint, resumed on one trainer worker instead of two, must
  end within float32 rounding of the reference's weights (two steps of gradients summed
  in another order: ``opd_float_tolerance.adam_weight_tolerance``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from opd_float_tolerance import adam_weight_tolerance, assert_weights_within, entries
from opd_test_helpers import REPO_ROOT, TINY_TRAIN_DATA
from safetensors.torch import load_file

# Five `opd train` processes, each starting a private Ray cluster: minutes on 2 cores.
pytestmark = pytest.mark.slow

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
STEPS = 4
TINY_LEARNING_RATE = float(yaml.safe_load(TINY.read_text(encoding="utf-8"))["training"]["learning_rate"])
"""distillation_tiny.yaml's learning rate, which these runs keep."""
DEATH_DEADLINE_S = 60.0


def command(output_dir: Path, trainer_workers: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "opd",
        "train",
        "--config",
        str(TINY),
        f"output_dir={output_dir}",
        f"data.train_path={TINY_TRAIN_DATA}",
        "data.val_path=null",
        "validation.val_at_start=false",
        "validation.val_at_end=false",
        f"training.max_num_steps={STEPS}",
        "training.batch_size=4",
        "training.micro_batch_size=2",
        "training.save_freq=1",
        "checkpointing.keep_top_k=null",
        "distillation.lambda=0.6",
        "distillation.generate_strategy.max_length=12",
        f"cluster.trainer.workers={trainer_workers}",
        "cluster.rollout.workers=1",
    ]


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def start(output_dir: Path, trainer_workers: int = 2) -> subprocess.Popen:
    output_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        command(output_dir, trainer_workers),
        cwd=REPO_ROOT,
        env=environment(),
        stdout=open(output_dir.parent / f"{output_dir.name}.out", "a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, timeout: float = 300) -> int:
    return process.wait(timeout=timeout)


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"the run ended (status {process.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.2)


def log_of(output_dir: Path) -> str:
    return (output_dir.parent / f"{output_dir.name}.out").read_text()


def trainer_worker_pids(session_leader: int) -> list[int]:
    """Ray actor processes of the trainer started by this run (its private cluster's workers)."""
    listing = subprocess.run(["ps", "-eo", "pid,sid,args"], capture_output=True, text=True, check=True).stdout
    pids = []
    for line in listing.splitlines()[1:]:
        pid, sid, args = line.strip().split(None, 2)
        if int(sid) == session_leader and "TrainerWorker" in args:
            pids.append(int(pid))
    return pids


def final_weights(output_dir: Path):
    return load_file(str(output_dir / "final_model" / "model.safetensors"))


def assert_bitwise(actual, expected, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    differing = [name for name in expected if not (actual[name] == expected[name]).all()]
    assert not differing, f"{what}: {len(differing)} tensors differ, first {differing[0]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster_faults")
    results = {}
    # The reference runs beside the dying run and its reruns (each its own private Ray cluster):
    # a run leaves much of its cores idle (starting Ray and its workers, the workers' waits on
    # each other), and only the resharded run below needs the reference's checkpoints.
    reference = start(root / "reference")
    try:
        interrupted = root / "interrupted"
        dying = start(interrupted)
        wait_for(interrupted / "checkpoints" / "step_1", dying)
        workers = trainer_worker_pids(dying.pid)
        os.kill(workers[-1], signal.SIGKILL)
        killed_at = time.monotonic()
        results["dying_status"] = finish(dying, timeout=DEATH_DEADLINE_S + 60)
        results["dying_seconds"] = time.monotonic() - killed_at
        results["dying_workers"] = workers
        results["dying_log"] = log_of(interrupted)
        results["dying_checkpoints"] = {
            path.name: (path / "save_state.json").is_file() for path in (interrupted / "checkpoints").iterdir()
        }

        killed = start(interrupted)
        wait_for(interrupted / "checkpoints" / "step_3", killed)
        os.killpg(killed.pid, signal.SIGKILL)  # the command and everything it started
        results["killed_status"] = finish(killed)
        results["rerun_status"] = finish(start(interrupted))
        results["reference_status"] = finish(reference)
    finally:
        if reference.poll() is None:  # the runs above failed: the reference is not left running
            os.killpg(reference.pid, signal.SIGKILL)
            reference.wait()

    # The reference's step-2 checkpoint, resumed by one trainer worker instead of two.
    resharded = root / "resharded"
    shutil.copytree(root / "reference", resharded, ignore=shutil.ignore_patterns("step_3", "step_4", "final_model"))
    results["resharded_status"] = finish(start(resharded, trainer_workers=1))
    return root, results


def test_the_reference_cluster_run_completes(runs):
    root, results = runs
    assert results["reference_status"] == 0, log_of(root / "reference")
    assert (root / "reference" / "checkpoints" / f"step_{STEPS}" / "policy_shards").is_dir()


def test_a_dead_trainer_worker_stops_the_run_naming_role_rank_and_checkpoint(runs):
    root, results = runs
    assert len(results["dying_workers"]) == 2, results["dying_workers"]
    assert results["dying_status"] == 2, results["dying_log"]
    assert results["dying_seconds"] < DEATH_DEADLINE_S
    error_lines = [line for line in results["dying_log"].splitlines() if line.startswith("opd: error:")]
    assert len(error_lines) == 1, results["dying_log"]
    assert "trainer worker" in error_lines[0] and "died" in error_lines[0] and "after step" in error_lines[0]
    assert "the newest complete checkpoint is" in error_lines[0] and "checkpoints/step_" in error_lines[0]
    # Nothing half-saved: every step_N is complete; a write the death interrupted stays a
    # .tmp_step_N, which the rerun removes.
    for name, complete in results["dying_checkpoints"].items():
        assert name.startswith(("step_", ".tmp_step_")), name
        assert complete or name.startswith(".tmp_step_"), f"{name} is published but incomplete"
    assert not list((root / "interrupted" / "checkpoints").glob(".tmp_*"))  # the reruns removed them


def test_a_run_that_lost_a_worker_and_was_killed_resumes_to_bitwise_the_same_weights(runs):
    root, results = runs
    assert results["killed_status"] == -signal.SIGKILL
    assert results["rerun_status"] == 0, log_of(root / "interrupted")
    assert log_of(root / "interrupted").count("resuming from") == 2
    assert_bitwise(final_weights(root / "interrupted"), final_weights(root / "reference"), "interrupted twice")


def test_a_checkpoint_of_two_workers_resumes_on_one_worker_to_the_same_weights(runs):
    """torch.distributed.checkpoint reshards on load; only the order of the gradient sums changes."""
    root, results = runs
    assert results["resharded_status"] == 0, log_of(root / "resharded")
    assert "resuming from" in log_of(root / "resharded") and "cluster.trainer.workers (2 -> 1)" in log_of(
        root / "resharded"
    )
    resumed, reference = final_weights(root / "resharded"), final_weights(root / "reference")
    # Steps 3 and 4 of 2 micro-batches each, at most the tiny config's learning rate.
    tolerance = adam_weight_tolerance(TINY_LEARNING_RATE, STEPS - 2, 2, entries(reference))
    assert_weights_within(resumed, reference, tolerance, "resumed on 1 worker, the final weights")


def test_export_consolidates_a_sharded_checkpoint_into_the_final_model(runs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.run.checkpoint_export import export_checkpoint

    root, _ = runs
    exported = export_checkpoint(root / "reference" / "checkpoints" / f"step_{STEPS}", tmp_path / "exported")
    assert_bitwise(load_file(str(exported / "model.safetensors")), final_weights(root / "reference"), "export")
    AutoModelForCausalLM.from_pretrained(str(exported))
    AutoTokenizer.from_pretrained(str(exported))
