"""Damaged checkpoints: named with the damaged file, never loaded, never deleted or replaced.

A real tiny run (``opd train`` in this process) writes ``step_2`` and ``step_4``; each test
damages the newest one as a disk, a copy or a hand edit would, reruns the same command,
and checks: exit status 2, one ``error:`` line naming the checkpoint and the file, no
traceback, and every file of the run byte-identical afterwards. Following the message's
advice (moving the damaged checkpoint aside) resumes from ``step_2``.

A step saved again (after a resume) is never lost to a crash during the re-save: the
manager's rename and delete steps are made to fail, and the old or the new copy is left,
whole, where resume finds it.

A disk that fills while a checkpoint is written (the kernel refuses the write: a file size
limit in this process, or a writer failing with ENOSPC) stops the run with one error line
that names the checkpoint and the cause, removes the partial write, and leaves the
previous checkpoint byte for byte; the rerun with room resumes from it exactly.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import resource
import shutil
import signal
from pathlib import Path

import pytest
from opd_test_helpers import REPO_ROOT, short_run_overrides

from opd.cli import main
from opd.run import checkpoint
from opd.run.checkpoint import CheckpointingConfig, CheckpointManager, CheckpointWriteError

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
RUN_OVERRIDES = [
    "training.max_num_steps=4",
    "training.save_freq=2",
    "checkpointing.keep_top_k=null",
    "training.batch_size=2",
    "training.micro_batch_size=null",
    "distillation.generate_strategy.max_length=8",
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    opd_log = logging.getLogger("opd")
    saved = (list(opd_log.handlers), opd_log.level, opd_log.propagate)
    try:
        status = main(["train", "--config", str(TINY), *short_run_overrides(root, "run"), *RUN_OVERRIDES])
    finally:
        opd_log.handlers[:], opd_log.level, opd_log.propagate = saved
    assert status == 0
    return root / "run"


def snapshot(directory: Path) -> dict[str, str]:
    return {
        path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble(path: Path) -> None:
    """Same size, other bytes: only the checksum can tell."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES = {
    "truncated optimizer": ("optimizer.pt", truncate, "optimizer.pt has"),
    "truncated policy weights": ("policy/model.safetensors", truncate, "policy/model.safetensors has"),
    "garbled training state": ("training_state.pt", garble, "training_state.pt has changed since it was written"),
    "garbage save state": ("save_state.json", lambda path: path.write_text("{not json"), "save_state.json has"),
    "missing tokenizer": ("policy/tokenizer.json", lambda path: path.unlink(), "policy/tokenizer.json is missing"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_newest_checkpoint_stops_the_rerun_and_names_the_file(finished_run, tmp_path, cli, damage):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "final_model").rename(tmp_path / "final_model")  # as if the run had been killed before its end
    name, spoil, message = DAMAGES[damage]
    newest = run / "checkpoints" / "step_4"
    spoil(newest / name)
    before = snapshot(run)
    status, _, err = cli("train", "--config", str(TINY), *short_run_overrides(tmp_path, "run"), *RUN_OVERRIDES)
    assert status == 2
    lines = [line for line in err.splitlines() if line.startswith("opd: error:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert f"checkpoint {newest} is damaged: {message}" in lines[0]
    assert f"mv {newest} {newest.parent / 'damaged_step_4'}" in lines[0] and "(step_2)" in lines[0]
    assert snapshot(run) == before  # nothing loaded over, deleted or rewritten


def test_following_the_advice_resumes_from_the_previous_checkpoint(finished_run, tmp_path, cli):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "final_model").rename(tmp_path / "final_model")
    newest = run / "checkpoints" / "step_4"
    truncate(newest / "optimizer.pt")
    assert cli("train", "--config", str(TINY), *short_run_overrides(tmp_path, "run"), *RUN_OVERRIDES)[0] == 2
    newest.rename(newest.parent / "damaged_step_4")
    status, _, err = cli("train", "--config", str(TINY), *short_run_overrides(tmp_path, "run"), *RUN_OVERRIDES)
    assert status == 0, err
    assert "resuming from" in err and "step_2" in err

    # The rerun redid steps 3 and 4 from step_2: the first run's losses (resume is exact).
    def losses(directory: Path) -> dict[int, float]:
        records = [json.loads(line) for line in (directory / "logs" / "metrics.jsonl").read_text().splitlines()]
        return {record["step"]: record["train/loss"] for record in records if "train/loss" in record}

    assert losses(run) == losses(finished_run) and sorted(losses(run)) == [1, 2, 3, 4]
    assert (run / "checkpoints" / "damaged_step_4").is_dir()  # still there, for the user to inspect


def test_a_checkpoint_without_a_manifest_is_still_checked_when_read(finished_run, tmp_path, cli):
    """Written before manifests existed: a truncated file is named by the reader, not a traceback.

    The run is cut back to ``step_2`` so that resuming must read its training state (a
    complete run only needs the policy weights to write its final model).
    """
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "final_model").rename(tmp_path / "final_model")
    shutil.rmtree(run / "checkpoints" / "step_4")
    newest = run / "checkpoints" / "step_2"
    (newest / "manifest.json").unlink()
    truncate(newest / "training_state.pt")
    before = snapshot(run)
    status, _, err = cli("train", "--config", str(TINY), *short_run_overrides(tmp_path, "run"), *RUN_OVERRIDES)
    assert status == 2 and "Traceback" not in err
    assert f"checkpoint {newest} could not be read" in err
    assert snapshot(run) == before


class FileWritingPolicy:
    """Stands in for a policy: ``save_checkpoint`` writes one weights file holding ``weights``."""

    def __init__(self, weights: bytes) -> None:
        self.weights = weights

    def save_checkpoint(self, directory: Path, tokenizer=None) -> None:
        (directory / "policy").mkdir()
        (directory / "policy" / "model.safetensors").write_bytes(self.weights)


def save_step_3(manager: CheckpointManager, weights: bytes) -> Path:
    return manager.save(
        3, FileWritingPolicy(weights), None, {"step": 3, "weights": weights.decode()}, {"rng": 1}, "seed: 1\n"
    )


def test_a_crash_while_a_step_is_saved_again_leaves_its_old_checkpoint(tmp_path, monkeypatch):
    manager = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "checkpoints"), keep_top_k=None))
    step_3 = save_step_3(manager, b"old weights")
    real_replace = checkpoint.os.replace

    def killed_before_publishing(source, target):
        if Path(source).name.startswith(".tmp_step_"):
            raise OSError("killed")
        real_replace(source, target)

    monkeypatch.setattr(checkpoint.os, "replace", killed_before_publishing)
    with pytest.raises(OSError, match="killed"):
        save_step_3(manager, b"new weights")
    monkeypatch.undo()
    # The rerun's resume puts the old copy back, verifies it and loads it; the unpublished new one is removed.
    assert manager.remove_incomplete() == [tmp_path / "checkpoints" / ".tmp_step_3"]
    assert manager.latest_checkpoint() == step_3
    manager.verify(step_3)
    assert manager.load_save_state(step_3)["weights"] == "old weights"
    assert (step_3 / "policy" / "model.safetensors").read_bytes() == b"old weights"
    assert sorted(path.name for path in step_3.parent.iterdir()) == ["step_3"]


def test_a_crash_after_a_step_was_saved_again_leaves_the_new_checkpoint_and_no_old_copy(tmp_path, monkeypatch):
    manager = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "checkpoints"), keep_top_k=None))
    step_3 = save_step_3(manager, b"old weights")
    real_rmtree = checkpoint.shutil.rmtree

    def killed_while_deleting_the_old_copy(path, *args, **kwargs):
        if Path(path).name.startswith(".old_step_"):
            raise OSError("killed")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_while_deleting_the_old_copy)
    with pytest.raises(OSError, match="killed"):
        save_step_3(manager, b"new weights")
    monkeypatch.undo()
    assert (step_3.parent / ".old_step_3").is_dir()
    assert manager.list_checkpoints() == [(3, step_3)]  # the old copy is never taken for a checkpoint
    assert manager.remove_incomplete() == []
    assert sorted(path.name for path in step_3.parent.iterdir()) == ["step_3"]
    manager.verify(step_3)
    assert manager.load_save_state(step_3)["weights"] == "new weights"
    # A later re-save of the step goes through as usual.
    assert save_step_3(manager, b"newer weights") == step_3
    assert manager.load_save_state(step_3)["weights"] == "newer weights"
    assert sorted(path.name for path in step_3.parent.iterdir()) == ["step_3"]


# ------------------------------------------------------------------------ a disk that fills


@contextlib.contextmanager
def file_size_limit(limit: int):
    """This process may write no file past ``limit`` bytes: the kernel refuses the write with EFBIG.

    SIGXFSZ, whose default action would end the process, is ignored, as a daemon's is, so the
    writer sees the failed write. The soft limit goes back afterwards (the hard one is untouched).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)


def test_a_disk_that_fills_during_a_checkpoint_stops_the_run_and_keeps_the_previous_one(finished_run, tmp_path, cli):
    """The rerun of a run killed after step_2 cannot write step_4's weights; then, with room, it resumes exactly."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "final_model").rename(tmp_path / "final_model")
    shutil.rmtree(run / "checkpoints" / "step_4")
    previous = run / "checkpoints" / "step_2"
    before = snapshot(previous)
    weights_bytes = (previous / "policy" / "model.safetensors").stat().st_size
    argv = ["train", "--config", str(TINY), *short_run_overrides(tmp_path, "run"), *RUN_OVERRIDES]
    # Every small file (config, logs, captured output) fits; the student's weights do not.
    with file_size_limit(weights_bytes // 2):
        status, _, err = cli(*argv)
    assert status == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("opd: error:")]
    assert len(lines) == 1, err
    failed = run / "checkpoints" / "step_4"
    assert f"checkpoint {failed} could not be written: a file reached the largest size allowed" in lines[0]
    assert "File too large" in lines[0]  # the writer's own words
    assert f"the newest complete checkpoint, {previous}, is intact" in lines[0]
    assert "rerun the same command to resume" in lines[0]
    # The partial write is gone (its space freed), and the previous checkpoint is untouched and whole.
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == ["step_2"]
    assert snapshot(previous) == before
    CheckpointManager(CheckpointingConfig(checkpoint_dir=str(run / "checkpoints"))).verify(previous)
    assert not (run / "final_model").exists()

    status, _, err = cli(*argv)
    assert status == 0, err
    assert f"resuming from {previous}" in err
    final = (run / "final_model" / "model.safetensors").read_bytes()
    assert final == (finished_run / "final_model" / "model.safetensors").read_bytes()  # resume is exact


class SpaceRunningOutPolicy(FileWritingPolicy):
    """Writes its weights as far as a full disk lets it: the write fails with ENOSPC, as ``write(2)`` reports it."""

    def save_checkpoint(self, directory: Path, tokenizer=None) -> None:
        (directory / "policy").mkdir()
        with open(directory / "policy" / "model.safetensors", "wb") as handle:
            handle.write(self.weights[: len(self.weights) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(directory / "policy" / "model.safetensors"))


def test_a_full_disk_during_a_checkpoint_is_named_and_the_partial_write_removed(tmp_path):
    manager = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "checkpoints"), keep_top_k=None))
    step_3 = save_step_3(manager, b"old weights")
    with pytest.raises(CheckpointWriteError) as raised:
        manager.save(6, SpaceRunningOutPolicy(b"new weights"), None, {"step": 6}, {"rng": 1}, "seed: 1\n")
    message = str(raised.value)
    assert message.startswith(
        f"checkpoint {tmp_path / 'checkpoints' / 'step_6'} could not be written: the disk is full"
    )
    assert "No space left on device" in message and f"the newest complete checkpoint, {step_3}, is intact" in message
    assert sorted(path.name for path in step_3.parent.iterdir()) == ["step_3"]
    manager.verify(step_3)
    assert (step_3 / "policy" / "model.safetensors").read_bytes() == b"old weights"


def test_a_checkpoint_write_that_fails_for_another_reason_is_raised_as_it_was(tmp_path):
    """Only a lack of space is turned into a CheckpointWriteError; the partial write is removed either way."""

    class FailingPolicy(FileWritingPolicy):
        def save_checkpoint(self, directory: Path, tokenizer=None) -> None:
            super().save_checkpoint(directory, tokenizer)
            raise PermissionError(errno.EACCES, "Permission denied")

    manager = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "checkpoints")))
    with pytest.raises(PermissionError):
        manager.save(1, FailingPolicy(b"weights"), None, {"step": 1}, {"rng": 1}, "seed: 1\n")
    assert list((tmp_path / "checkpoints").iterdir()) == []
