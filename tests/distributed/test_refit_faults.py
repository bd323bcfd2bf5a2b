"""A rollout worker killed during a refit, on a real local Ray cluster (``opd train`` in this process).

A trainer worker and a rollout worker, every step on-policy (so every step refits the rollout
worker from the trainer), a checkpoint every 2 steps. The rollout worker's process is sent
SIGKILL inside the third refit (before step 3's rollout), while the run waits for the refit:

* the command stops within a bounded time with one error line naming the rollout worker, the
  step reached and the newest complete checkpoint (``step_2``);
* rerun, it resumes from ``step_2`` and ends with the per-step losses and bitwise the final
  weights of the same run left alone.

Both refit transports a CPU cluster has are tried: the object store (the CPU default), and a
gloo broadcast, where trainer rank 0 is inside a collective with the worker that dies. Both
leave the same weights in the engines, bitwise (``test_refit_transports.py``), so one
uninterrupted run (over the object store) is the reference of both.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import ray
from opd_test_helpers import REPO_ROOT, short_run_overrides

from opd.cli import main as opd_main
from opd.distributed.refit.transport import TRANSPORTS
from opd.distributed.workers.worker_group import WorkerGroup

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
STEPS = 4
KILLED_REFIT = 3
"""The refit the rollout worker dies in: the one before step 3's rollout, after checkpoint step_2."""
DEATH_DEADLINE_S = 60.0


def overrides(output_dir: Path, transport: str) -> list[str]:
    return [
        *short_run_overrides(output_dir.parent, output_dir.name),
        f"training.max_num_steps={STEPS}",
        "training.batch_size=2",
        "training.micro_batch_size=null",
        "training.save_freq=2",
        "checkpointing.keep_top_k=null",
        "distillation.lambda=1.0",
        "distillation.generate_strategy.max_length=8",
        "cluster.trainer.workers=1",
        "cluster.rollout.workers=1",
        f"cluster.rollout.refit_transport={transport}",
    ]


def train_records(output_dir: Path) -> dict[int, float]:
    lines = (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["train/loss"] for record in map(json.loads, lines) if "train/loss" in record}


def kill_the_rollout_worker_inside_refit(monkeypatch, transport: str, killed: dict) -> None:
    """SIGKILLs rollout worker 0 in refit ``KILLED_REFIT``, once the refit's first calls are out and awaited.

    The first wait of that refit (on either group) sends the kill, then waits as usual: the worker
    dies with the refit's calls in its queue or under way, the way a crash or the OOM killer takes it.
    """
    transport_class = TRANSPORTS[transport]
    original_send = transport_class.send
    refits = {"count": 0}

    def send(self, trainer):
        refits["count"] += 1
        if refits["count"] != KILLED_REFIT:
            return original_send(self, trainer)
        pid = ray.get(self.rollout.actors[0].__ray_call__.remote(lambda worker: os.getpid()))
        original_gathers = {group: group.gather for group in (trainer, self.rollout)}

        def gather(group: WorkerGroup, *args, **kwargs):
            if "pid" not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.update(pid=pid, at=time.monotonic())
            return original_gathers[group](*args, **kwargs)

        for group in original_gathers:
            monkeypatch.setattr(group, "gather", lambda *args, group=group, **kwargs: gather(group, *args, **kwargs))
        try:
            return original_send(self, trainer)
        finally:
            for group, original in original_gathers.items():
                monkeypatch.setattr(group, "gather", original)

    monkeypatch.setattr(transport_class, "send", send)


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory) -> Path:
    """The uninterrupted run."""
    output_dir = tmp_path_factory.mktemp("refit_faults") / "reference"
    # opd's console handler, installed by the run, must not outlive it: the tests read their runs' logs.
    opd_log = logging.getLogger("opd")
    saved = (list(opd_log.handlers), opd_log.level, opd_log.propagate)
    try:
        assert opd_main(["train", "--config", str(TINY), *overrides(output_dir, "object_store")]) == 0
    finally:
        opd_log.handlers[:], opd_log.level, opd_log.propagate = saved
    return output_dir


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_a_rollout_worker_killed_during_a_refit_stops_the_run_naming_it_and_the_rerun_resumes_exactly(
    reference, tmp_path, capsys, monkeypatch, transport
):
    def train(output_dir: Path) -> tuple[int, str]:
        status = opd_main(["train", "--config", str(TINY), *overrides(output_dir, transport)])
        return status, capsys.readouterr().err

    interrupted = tmp_path / "interrupted"
    killed: dict = {}
    kill_the_rollout_worker_inside_refit(monkeypatch, transport, killed)
    status, err = train(interrupted)
    stopped_after = time.monotonic() - killed["at"]
    monkeypatch.undo()
    assert status == 2 and "Traceback" not in err, err
    assert stopped_after < DEATH_DEADLINE_S
    lines = [line for line in err.splitlines() if line.startswith("opd: error:")]
    assert len(lines) == 1, err
    newest = interrupted / "checkpoints" / "step_2"
    assert "rollout worker 0 of 1" in lines[0] and "died" in lines[0], lines[0]
    assert f"after step 2 of {STEPS}; the newest complete checkpoint is {newest}" in lines[0], lines[0]
    assert lines[0].endswith("rerun the same command to resume")
    assert not list((interrupted / "checkpoints").glob(".tmp_*"))

    status, err = train(interrupted)
    assert status == 0, err
    assert f"resuming from {newest}" in err
    assert train_records(interrupted) == train_records(reference)
    final = {run: (run / "final_model" / "model.safetensors").read_bytes() for run in (reference, interrupted)}
    assert final[interrupted] == final[reference]
