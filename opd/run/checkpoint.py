"""Crash-safe checkpoints: ``step_N/`` directories written as ``.tmp_step_N`` and renamed once every file is on disk.

Layout (``.pt`` files are loaded with ``weights_only=True``)::

    checkpoint_dir/step_N/
      policy/             # HF model dir (safetensors + tokenizer); LoRA: merged weights + policy/adapter/ (peft)
      optimizer.pt        # optimizer + scheduler state; LoRA: also the adapter tensors resume starts from
      training_state.pt   # RNG and dataloader state
      teacher_state.pt    # only a teacher whose weights change (teacher.self_teacher: ema): its average
      save_state.json     # step, epoch, consumed samples, best metric
      config.yaml         # the resolved config
      manifest.json       # every other file's size and CRC-32, written last

An FSDP2 (``cluster:``) student writes instead of ``policy/`` and ``optimizer.pt``
(:mod:`opd.distributed.trainer_worker`): ``policy_shards/`` (weights + optimizer, torch.distributed.checkpoint),
``scheduler.pt``, ``model_config/`` (config.json, for ``opd export``) and ``tokenizer/``.

Resume verifies the newest checkpoint against its manifest first (:meth:`CheckpointManager.verify`); damage stops
the run without deleting anything, and the message says how to resume from the previous checkpoint: going back in
training time is the user's decision.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import re
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from safetensors import SafetensorError

from opd.utils.config import StrictConfig
from opd.utils.errors import OpdError, first_line
from opd.utils.paths import absolute_dir

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
_RETIRED_DIR = re.compile(r"^\.old_(step_\d+)$")
"""A re-saved step's previous ``step_N`` is renamed to ``.old_step_N`` until the new one is in its place."""
MANIFEST_FILE = "manifest.json"
TEACHER_STATE_FILE = "teacher_state.pt"
MANIFEST_FORMAT = "opd-checkpoint-manifest/1"
_READ_BLOCK = 8 * 2**20


class CheckpointDamagedError(OpdError):
    """A checkpoint's file is missing, truncated, changed or unreadable; nothing was loaded or removed."""


class CheckpointWriteError(OpdError):
    """A checkpoint could not be written for lack of space; its partial files were removed, older ones are intact."""


_NO_SPACE = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "a file reached the largest size allowed for one file (ulimit -f)",
}
"""The write failures that a rerun with more room resumes from, and what each means to a user."""
_NEARLY_FULL_BYTES = 2**20
"""Free space below which a failed write is put down to a full disk when its error names no errno (torch.save's)."""


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""A Hugging Face model directory holds its weights in one of these (one file, or an index of shards)."""


def check_model_directory(directory: Path, writer: str) -> None:
    """Checks that ``directory``, written by another process (maybe another node), holds a whole HF model here.

    Raises:
        OpdError: naming the directory, what is missing and who wrote it.
    """
    missing = [] if (directory / "config.json").is_file() else ["config.json"]
    index = next((directory / name for name in WEIGHT_FILES if (directory / name).is_file()), None)
    if index is None:
        missing.append(f"the weights ({' or '.join(WEIGHT_FILES)})")
    elif index.name.endswith(".index.json"):
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError) as error:
            raise OpdError(f"the model written to '{directory}' has an unreadable {index.name}: {error}") from None
        missing += [shard for shard in shards if not (directory / shard).is_file()]
    if missing:
        raise OpdError(
            f"the model written by {writer} to '{directory}' is incomplete where this process reads it: "
            f"{', '.join(missing)} missing. output_dir must be on a filesystem that the controller and the "
            "writing node share"
        )


class CheckpointingConfig(StrictConfig):
    """When and where checkpoints are written."""

    enabled: bool = True
    checkpoint_dir: str = Field("checkpoints", description="directory holding step_N/ checkpoints")
    keep_top_k: int | None = Field(3, ge=1, description="newest checkpoints kept (plus the best); null keeps all")
    metric_name: str | None = Field(
        "val/kl_reverse", description="validation metric that picks the best checkpoint; null disables"
    )
    higher_is_better: bool = Field(False, description="whether a larger metric_name is better")
    save_on_signal: bool = Field(True, description="write a checkpoint when SIGINT/SIGTERM stops the run")


class CheckpointManager:
    """Writes, lists, prunes and loads ``step_N`` checkpoints."""

    def __init__(self, config: CheckpointingConfig) -> None:
        self.config = config
        # Absolute: a distributed student's ranks write into it from their own working directories.
        self.root = absolute_dir(config.checkpoint_dir)
        self.protected_step: int | None = None
        """A step whose checkpoint pruning never deletes (the best one so far)."""

    def remove_incomplete(self) -> list[Path]:
        """Deletes temporary directories left by a write that was killed; returns them.

        A ``.old_step_N`` left by a re-save that was killed goes back to ``step_N`` if no ``step_N`` replaced it
        (it is the only copy of that step), and is deleted if one did.
        """
        if not self.root.is_dir():
            return []
        for retired in sorted(self.root.iterdir()):
            match = _RETIRED_DIR.match(retired.name)
            if match is None:
                continue
            final = self.root / match.group(1)
            if final.exists():
                log.warning("removing %s, superseded by %s (a re-save of that step was interrupted)", retired, final)
                shutil.rmtree(retired, ignore_errors=True)
            else:
                log.warning("restoring %s to %s (a re-save of that step was interrupted)", retired, final)
                os.replace(retired, final)
        leftovers = [child for child in self.root.iterdir() if child.name.startswith(".tmp_step_")]
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        return leftovers

    def list_checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as ``(step, path)``, oldest first (temporary dirs ignored)."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and child.is_dir() and (child / "save_state.json").is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        checkpoints = self.list_checkpoints()
        return checkpoints[-1][1] if checkpoints else None

    def save(
        self,
        step: int,
        policy: Any,
        tokenizer: Any,
        save_state: dict[str, Any],
        training_state: dict[str, Any],
        config_yaml: str,
        teacher_state: dict[str, Any] | None = None,
    ) -> Path:
        """Writes ``step_<step>`` atomically, prunes old checkpoints and returns the new directory.

        ``policy`` has ``save_checkpoint(dir, tokenizer=...)``; ``save_state`` is JSON, ``training_state`` and
        ``teacher_state`` (None or empty: no file) go through torch.save. A write that fails leaves no partial
        directory behind.

        Raises:
            CheckpointWriteError: the disk (or quota, or file size limit) had no room for the checkpoint.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step}"
        staging = staging_directory(final)
        staging.mkdir()
        try:
            policy.save_checkpoint(staging, tokenizer=tokenizer)
            torch.save(training_state, staging / "training_state.pt")
            if teacher_state:
                torch.save(teacher_state, staging / TEACHER_STATE_FILE)
            (staging / "config.yaml").write_text(config_yaml, encoding="utf-8")
            (staging / "save_state.json").write_text(json.dumps(save_state, indent=2), encoding="utf-8")
            # The manifest describes every file written above, so it is written last.
            write_manifest(staging)
            _fsync_tree(staging)
        except Exception as error:
            # A disk that fills mid-write used to end the run with the writer's traceback (safetensors' or
            # torch's, naming neither the checkpoint nor the cause) and leave the partial .tmp_step_N holding
            # the space the logs and the rerun need. It is removed here; older checkpoints were never touched.
            self._raise_if_out_of_space(error, staging, final)
            raise
        publish_directory(staging, final)  # re-saving a step (after a resume) keeps the old copy until then
        self._prune()
        return final

    def _raise_if_out_of_space(self, error: Exception, staging: Path, final: Path) -> None:
        """Removes ``staging`` and, when ``error`` is a lack of space, raises :class:`CheckpointWriteError` for it.

        The free space is read before the removal frees what the partial checkpoint took.
        """
        reason = _no_space_reason(error, staging)
        shutil.rmtree(staging, ignore_errors=True)
        if reason is None:
            return
        latest = self.latest_checkpoint()
        kept = f"the newest complete checkpoint, {latest}, is intact" if latest else "no earlier checkpoint exists"
        raise CheckpointWriteError(
            f"checkpoint {final} could not be written: {reason} ({type(error).__name__}: {first_line(error)}). "
            f"Its partial files were removed and {kept}; make room under {self.root} and rerun the same command "
            "to resume"
        ) from error

    def _prune(self) -> None:
        """Deletes all but the newest ``keep_top_k`` checkpoints and the protected (best) one."""
        if self.config.keep_top_k is None:
            return
        for step, path in self.list_checkpoints()[: -self.config.keep_top_k]:
            if step != self.protected_step:
                shutil.rmtree(path, ignore_errors=True)

    def verify(self, checkpoint: Path) -> None:
        """Checks every file of ``checkpoint`` against its manifest; a checkpoint without one is not checked.

        Raises:
            CheckpointDamagedError: naming the file, its damage, and how to resume from the previous checkpoint.
        """
        problem = manifest_problem(checkpoint)
        if problem is None:
            return
        older = [path for step, path in self.list_checkpoints() if path != checkpoint]
        if older:
            aside = checkpoint.parent / f"damaged_{checkpoint.name}"
            remedy = (
                f"to resume from the previous complete checkpoint ({older[-1].name}), move the damaged one "
                f"aside and rerun the same command: mv {checkpoint} {aside}"
            )
        else:
            remedy = "there is no older checkpoint; start the run again with another output_dir"
        raise CheckpointDamagedError(
            f"checkpoint {checkpoint} is damaged: {problem}. Nothing was loaded, changed or deleted; {remedy}"
        )

    @staticmethod
    def load_save_state(checkpoint: Path) -> dict[str, Any]:
        """Reads ``save_state.json`` of a checkpoint."""
        return json.loads((checkpoint / "save_state.json").read_text(encoding="utf-8"))

    @staticmethod
    def load_training_state(checkpoint: Path) -> dict[str, Any]:
        """Reads RNG and dataloader state (``weights_only=True``: no arbitrary unpickling)."""
        return torch.load(checkpoint / "training_state.pt", weights_only=True)

    @staticmethod
    def load_teacher_state(checkpoint: Path) -> dict[str, Any] | None:
        """Reads a teacher's state (``weights_only=True``), or None when the checkpoint kept none."""
        path = checkpoint / TEACHER_STATE_FILE
        return torch.load(path, weights_only=True) if path.is_file() else None


@contextlib.contextmanager
def reading_checkpoint(checkpoint: Path) -> Iterator[None]:
    """Turns a failure to read ``checkpoint`` into one :class:`CheckpointDamagedError` (damage no manifest sees)."""
    try:
        yield
    except (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError, SafetensorError) as error:
        aside = checkpoint.parent / f"damaged_{checkpoint.name}"
        raise CheckpointDamagedError(
            f"checkpoint {checkpoint} could not be read ({type(error).__name__}: {first_line(error)}); nothing "
            f"was changed or deleted; move it aside (mv {checkpoint} {aside}) to resume from the previous checkpoint"
        ) from None


def staging_directory(final: Path) -> Path:
    """``.tmp_<name>`` beside ``final``, where ``final`` is written first; emptied of an interrupted write's files."""
    staging = final.with_name(f".tmp_{final.name}")
    if staging.exists():
        shutil.rmtree(staging)
    return staging


def publish_directory(staging: Path, final: Path) -> None:
    """Renames ``staging`` to ``final``; an existing ``final`` waits as ``.old_<name>`` until then (crash-safe)."""
    retired = final.with_name(f".old_{final.name}")
    if final.exists():
        if retired.exists():  # from an earlier interrupted re-save that final had already replaced
            shutil.rmtree(retired)
        os.replace(final, retired)
    os.replace(staging, final)
    if retired.exists():
        shutil.rmtree(retired)


def _no_space_reason(error: BaseException, directory: Path) -> str | None:
    """What :data:`_NO_SPACE` says of ``error`` (or an error it was raised from), or None if it is no lack of space.

    Writers outside Python give no ``errno``: safetensors puts ``(os error N)`` in its message, and torch.save
    only says that a write failed, so then the free space under ``directory`` decides.
    """
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _NO_SPACE:
            return _NO_SPACE[cause.errno]
        text = str(cause)
        for number, reason in _NO_SPACE.items():
            if f"os error {number})" in text or f"[Errno {number}]" in text or os.strerror(number) in text:
                return reason
        cause = cause.__cause__ or cause.__context__
    if not isinstance(error, (OSError, RuntimeError)):  # not a failed write (a bug, a lost worker)
        return None
    try:
        nearly_full = shutil.disk_usage(directory).free < _NEARLY_FULL_BYTES
    except OSError:
        return None
    return _NO_SPACE[errno.ENOSPC] if nearly_full else None


def _crc32(path: Path) -> str:
    value = 0
    with open(path, "rb") as handle:
        while block := handle.read(_READ_BLOCK):
            value = zlib.crc32(block, value)
    return f"{value:08x}"


def write_manifest(directory: Path) -> None:
    """Writes ``manifest.json``: the size and CRC-32 of every other file under ``directory``."""
    files = {
        path.relative_to(directory).as_posix(): {"bytes": path.stat().st_size, "crc32": _crc32(path)}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE
    }
    manifest = {"format": MANIFEST_FORMAT, "files": files}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1), encoding="utf-8")


def _manifest_files(path: Path) -> dict[str, Any]:
    """The ``files`` table of a manifest (name → bytes and CRC-32); raises if it is not one of opd's."""
    manifest = json.loads(path.read_text(encoding="utf-8"))
    files = manifest["files"]
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
        raise ValueError(f"format {manifest.get('format')!r}")
    return files


def manifest_problem(directory: Path) -> str | None:
    """The first mismatch with ``directory``'s manifest, or None: all sizes first (cheap), then CRC-32s.

    Files added since are not reported.
    """
    path = directory / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        files = _manifest_files(path)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        return f"{MANIFEST_FILE} is unreadable ({error})"
    for name, expected in files.items():
        size = (directory / name).stat().st_size if (directory / name).is_file() else None
        if size != expected["bytes"]:
            return (
                f"{name} is missing" if size is None else f"{name} has {size} bytes, {expected['bytes']} were written"
            )
    for name, expected in files.items():
        if _crc32(directory / name) != expected["crc32"]:
            return f"{name} has changed since it was written (CRC-32 mismatch)"
    return None


def _fsync_tree(directory: Path) -> None:
    """Flushes every file under ``directory`` to disk before the rename publishes it."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
