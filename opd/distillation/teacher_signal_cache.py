"""The teacher-signal cache: a teacher's scores of fixed data, written once by ``opd generate``, read by training.

It is a directory beside the generated file, ``<output>.teacher_signal/``:

* ``manifest.json``: which signal it holds (top-k with its k, temperature and vocabulary, or each token's
  log-prob), from which teacher at which dtype (:func:`cache_manifest`);
* ``batch_000000.safetensors``, ...: one file per recorded ``opd generate`` batch, holding each kept row's scored
  token ids and the signal at every one of its positions. A batch's file is complete on disk (written under a
  temporary name, synced, renamed) before the batch's rows are appended to the output.

A row is found by its token ids (a digest, then the ids themselves compared), never by its place in a file: a
training row whose tokens differ from those the cache scored (another tokenizer or chat template, an edited row) is
simply not found, and a file left over from an interrupted run can only answer for exactly the ids it scored.

Tensors of a batch file with R rows of T tokens in all (rows concatenated):
``token_ids`` int32 ``[T]``; top-k: ``topk_logprobs [T, k]`` (the teacher's dtype), ``topk_ids`` int32 ``[T, k]``,
``rest_logprobs [T]``; token log-probs: ``token_logprobs [T]``. The metadata lists each row's length and digest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from opd.models.interfaces import TokenLogprobsRequest, TopKLogprobs, TopKRequest
from opd.utils.errors import DataError

log = logging.getLogger("opd")

CACHE_SUFFIX = ".teacher_signal"
"""The cache directory is the data file's name with this appended."""

CACHE_FORMAT = 1
"""Version of the layout (the manifest and every batch file say which)."""

MANIFEST_NAME = "manifest.json"
_BATCH_FILE = re.compile(r"^batch_(\d+)\.safetensors(\.tmp)?$")


class SignalKind(ABC):
    """One kind of signal a cache holds: its name in the manifest, its per-position tensors (in the order a row's
    tensors list them), and how rows of it are read back as a teacher's right-padded answer."""

    name: str
    tensors: tuple[str, ...]

    @abstractmethod
    def describe(self, signal: dict[str, Any]) -> str:
        """The manifest's ``signal`` for log lines."""

    @abstractmethod
    def request(self, vocab_size: int, k: int, temperature: float) -> TopKRequest | TokenLogprobsRequest:
        """What the teacher is asked for this kind (``k`` and ``temperature``: top-k only)."""

    @abstractmethod
    def padded(self, rows: list[tuple[torch.Tensor, ...]], width: int) -> TopKLogprobs | torch.Tensor:
        """Rows' ``[length, ...]`` tensors as the teacher's right-padded ``[B, width, ...]`` answer.

        Positions past a row's end hold a finite placeholder, which a loss never reads (it takes the positions whose
        next token carries loss).
        """


class TopKSignal(SignalKind):
    """The k most likely tokens' log-probs and ids, with the rest mass (``loss_fn.type: topk``)."""

    name = "topk"
    tensors = ("topk_logprobs", "topk_ids", "rest_logprobs")

    def describe(self, signal: dict[str, Any]) -> str:
        return f"top-k {signal.get('k')} at temperature {signal.get('temperature')} {_vocabulary(signal)}"

    def request(self, vocab_size: int, k: int, temperature: float) -> TopKRequest:
        return TopKRequest(k, temperature, vocab_size)

    def padded(self, rows: list[tuple[torch.Tensor, ...]], width: int) -> TopKLogprobs:
        # The placeholder a served teacher leaves where it did not score: ids 0..k-1 at 1/(2k) each, rest 1/2.
        # Ids go back to int64, as a teacher sends them.
        k = rows[0][0].shape[-1]
        logprobs = torch.full((len(rows), width, k), math.log(0.5 / k), dtype=rows[0][0].dtype)
        ids = torch.arange(k, dtype=torch.long).expand(len(rows), width, k).clone()
        rest = torch.full((len(rows), width), math.log(0.5), dtype=rows[0][2].dtype)
        for index, (row_logprobs, row_ids, row_rest) in enumerate(rows):
            length = len(row_rest)
            logprobs[index, :length] = row_logprobs
            ids[index, :length] = row_ids.to(torch.long)
            rest[index, :length] = row_rest
        return TopKLogprobs(logprobs, ids, rest)


class TokenLogprobsSignal(SignalKind):
    """Each token's log-prob at temperature 1 (the sampled-token losses)."""

    name = "token_logprobs"
    tensors = ("token_logprobs",)

    def describe(self, signal: dict[str, Any]) -> str:
        return f"token log-probs {_vocabulary(signal)}"

    def request(self, vocab_size: int, k: int, temperature: float) -> TokenLogprobsRequest:
        return TokenLogprobsRequest(vocab_size)

    def padded(self, rows: list[tuple[torch.Tensor, ...]], width: int) -> torch.Tensor:
        values = torch.zeros((len(rows), width), dtype=rows[0][0].dtype)  # placeholder: log-prob 0
        for index, (row,) in enumerate(rows):
            values[index, : len(row)] = row
        return values


SIGNAL_KINDS: dict[str, SignalKind] = {kind.name: kind for kind in (TopKSignal(), TokenLogprobsSignal())}
"""Each kind of signal a cache can hold, by its name in the manifest (``generate.teacher_signal.kind``)."""


def _vocabulary(signal: dict[str, Any]) -> str:
    return f"over {signal.get('vocab_size')} tokens"


def cache_directory(data_file: str | Path) -> Path:
    """Where the cache of ``data_file`` lives (it may not exist)."""
    path = Path(data_file).expanduser()
    return path.with_name(path.name + CACHE_SUFFIX)


def batch_file(directory: Path, batch: int) -> Path:
    """The file of ``opd generate`` batch ``batch``."""
    return directory / f"batch_{batch:06d}.safetensors"


def token_digest(token_ids: Sequence[int]) -> str:
    """The key a row is found by: sha256 of its ids as little-endian int64."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()


# --------------------------------------------------------------------------- manifest


def describe_signal(signal: dict[str, Any]) -> str:
    """``top-k 64 at temperature 1.0 over 151665 tokens`` or ``token log-probs over ...``, for log lines."""
    return SIGNAL_KINDS[signal["kind"]].describe(signal)


def cache_manifest(signal: dict[str, Any], teacher: str, dtype: str) -> dict[str, Any]:
    """What a cache holds: the signal (``{"kind": "topk", "k", "temperature", "vocab_size"}`` or
    ``{"kind": "token_logprobs", "vocab_size"}``), and the teacher model and dtype that scored it."""
    return {"opd_teacher_signal_cache": CACHE_FORMAT, "signal": signal, "teacher": teacher, "dtype": dtype}


def read_manifest(directory: Path) -> dict[str, Any]:
    """The cache's manifest; DataError naming the file if it is missing or not one."""
    path = directory / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"teacher-signal cache manifest {path} could not be read: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("opd_teacher_signal_cache") != CACHE_FORMAT:
        raise DataError(f"{path} is not a teacher-signal cache manifest of format {CACHE_FORMAT}")
    if not isinstance(manifest.get("signal"), dict) or manifest["signal"].get("kind") not in SIGNAL_KINDS:
        raise DataError(f"{path}: unknown signal {manifest.get('signal')!r}")
    return manifest


def manifest_differences(cached: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """What differs between a cache's manifest and the one a run would write, as ``name: cached -> wanted``."""
    differences = []
    if cached["signal"] != wanted["signal"]:
        differences.append(f"signal: {describe_signal(cached['signal'])} -> {describe_signal(wanted['signal'])}")
    for name in ("teacher", "dtype"):
        if cached.get(name) != wanted.get(name):
            differences.append(f"{name}: {cached.get(name)!r} -> {wanted.get(name)!r}")
    return differences


# --------------------------------------------------------------------------- writing (opd generate)


def write_batch_file(
    directory: Path, batch: int, kind: SignalKind, token_ids: list[list[int]], rows: list[tuple[torch.Tensor, ...]]
) -> Path:
    """Writes batch ``batch``'s rows, their ids and their ``[length, ...]`` tensors (``kind.tensors``), and syncs
    the file and the directory."""
    names = kind.tensors
    tensors = {"token_ids": torch.tensor([token for ids in token_ids for token in ids], dtype=torch.int32)}
    for position, name in enumerate(names):
        # A batch whose answers were all rejected still gets its (empty) file.
        tensor = torch.cat([row[position] for row in rows]) if rows else torch.zeros(0)
        # Ids fit in int32 (no vocabulary comes near 2^31), which halves what they take on disk.
        tensors[name] = tensor.to(torch.int32) if name == "topk_ids" else tensor.contiguous()
    metadata = {
        "opd_teacher_signal_cache": str(CACHE_FORMAT),
        "kind": kind.name,
        "lengths": json.dumps([len(ids) for ids in token_ids]),
        "digests": json.dumps([token_digest(ids) for ids in token_ids]),
    }
    path = batch_file(directory, batch)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with temporary.open("wb") as handle:
            handle.write(safetensors_bytes(tensors, metadata))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        _sync_directory(directory)
    except OSError as error:
        raise DataError(f"could not write {path}: {error}") from None
    return path


def _sync_directory(directory: Path) -> None:
    """Makes a rename in ``directory`` durable (where the platform can open a directory)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def start_cache(directory: Path, manifest: dict[str, Any]) -> None:
    """A fresh cache: what an earlier, unrecorded run left is removed, then the manifest is written."""
    remove_cache_files(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    except OSError as error:
        raise DataError(f"could not write {directory / MANIFEST_NAME}: {error}") from None
    _sync_directory(directory)


def remove_cache_files(directory: Path, from_batch: int = 0) -> int:
    """Removes the batch files numbered ``from_batch`` on (and half-written ones; with 0, the manifest too).

    Only names this module writes are touched. Returns how many batch files went.
    """
    if not directory.is_dir():
        return 0
    removed = 0
    for path in directory.iterdir():
        match = _BATCH_FILE.match(path.name)
        if match is not None and (match.group(2) or int(match.group(1)) >= from_batch):
            path.unlink()
            removed += not match.group(2)
    if from_batch == 0:
        (directory / MANIFEST_NAME).unlink(missing_ok=True)
    return removed


def resume_cache(directory: Path, manifest: dict[str, Any], recorded_rows: list[int]) -> None:
    """Keeps the files of the recorded batches (``recorded_rows[i]`` rows each) and removes any later one.

    Raises:
        DataError: naming the file, when the manifest is not ``manifest`` or a recorded batch's file is missing,
            unreadable or holds another number of rows (delete the output, its progress file and the cache).
    """
    if not recorded_rows:
        start_cache(directory, manifest)
        return
    advice = "delete the output, its progress file and this directory to start over"
    cached = read_manifest(directory) if directory.is_dir() else None
    if cached is None or manifest_differences(cached, manifest):
        raise DataError(f"{directory / MANIFEST_NAME} does not describe the signal this run stores; {advice}")
    for batch, rows in enumerate(recorded_rows):
        path = batch_file(directory, batch)
        entries = read_index(path)
        if len(entries) != rows:
            raise DataError(f"{path} holds {len(entries)} rows but batch {batch} recorded {rows}; {advice}")
    removed = remove_cache_files(directory, len(recorded_rows))
    if removed:
        log.info("%s: dropping the signal of %d batches written after the last recorded batch", directory, removed)


# --------------------------------------------------------------------------- reading (training)


@dataclass(frozen=True)
class RowLocation:
    """Where one row's signal lies: its file and its first position and length among the file's positions."""

    file: Path
    offset: int
    length: int


def read_index(path: Path) -> list[tuple[str, RowLocation]]:
    """Each row of a batch file as ``(digest, location)``, from its header alone; DataError naming the file."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            total = handle.get_slice("token_ids").get_shape()[0]
    except (OSError, SafetensorError) as error:
        raise DataError(f"teacher-signal cache file {path} could not be read: {error}") from None
    try:
        lengths, digests = json.loads(metadata["lengths"]), json.loads(metadata["digests"])
        valid = metadata["opd_teacher_signal_cache"] == str(CACHE_FORMAT) and len(lengths) == len(digests)
    except (KeyError, json.JSONDecodeError, TypeError):
        valid = False
    if not valid or sum(lengths) != total:
        raise DataError(f"teacher-signal cache file {path} has no valid row index (not written by opd generate?)")
    offsets = np.cumsum([0, *lengths[:-1]]).tolist() if lengths else []
    return [
        (digest, RowLocation(path, offset, length))
        for digest, offset, length in zip(digests, offsets, lengths, strict=True)
    ]


class CacheFileError(DataError):
    """A batch file of the cache that cannot be read (its path in ``file``)."""

    def __init__(self, message: str, file: Path) -> None:
        super().__init__(message)
        self.file = file


class TeacherSignalCache:
    """A cache directory opened for reading: its manifest, and every readable row by the digest of its ids.

    Attributes:
        unreadable: one message per batch file that could not be indexed (its rows are not found).
    """

    def __init__(self, directory: Path) -> None:
        """Reads the manifest and each batch file's header; DataError (naming the file) for a bad manifest."""
        self.directory = directory
        self.manifest = read_manifest(directory)
        self.kind = SIGNAL_KINDS[self.manifest["signal"]["kind"]]
        self.index: dict[str, RowLocation] = {}
        self.unreadable: list[str] = []
        for path in sorted(directory.glob("batch_*.safetensors")):
            try:
                entries = read_index(path)
            except DataError as error:
                self.unreadable.append(str(error))
                continue
            for digest, location in entries:
                self.index.setdefault(digest, location)

    def locate(self, token_ids: Sequence[int]) -> RowLocation | None:
        """Where the signal of exactly these ids is, or None."""
        return self.index.get(token_digest(token_ids))

    def forget(self, file: Path) -> None:
        """Stops finding the rows of ``file`` (found damaged while reading)."""
        self.index = {digest: location for digest, location in self.index.items() if location.file != file}

    def read_rows(self, rows: list[list[int]]) -> list[tuple[torch.Tensor, ...]] | None:
        """Each row's ``[length, ...]`` tensors (those of the cache's kind), for rows given as their
        token ids; None if a row is not in the cache.

        Raises:
            CacheFileError: naming the file, when a file cannot be read or holds other ids than its index says.
        """
        locations = [self.locate(ids) for ids in rows]
        if any(location is None for location in locations):
            return None
        by_file: dict[Path, list[int]] = {}
        for row, location in enumerate(locations):
            assert location is not None
            by_file.setdefault(location.file, []).append(row)
        names = self.kind.tensors
        read: list[tuple[torch.Tensor, ...]] = [()] * len(rows)
        for path, members in by_file.items():
            try:
                with safe_open(str(path), framework="pt") as handle:
                    slices = {name: handle.get_slice(name) for name in ("token_ids", *names)}
                    for row in members:
                        location = locations[row]
                        assert location is not None
                        span = slice(location.offset, location.offset + location.length)
                        if slices["token_ids"][span].tolist() != rows[row]:
                            raise CacheFileError(
                                f"teacher-signal cache file {path} holds other ids than its index", path
                            )
                        read[row] = tuple(slices[name][span] for name in names)
            except (OSError, SafetensorError, ValueError, RuntimeError) as error:
                raise CacheFileError(f"teacher-signal cache file {path} could not be read: {error}", path) from None
        return read
