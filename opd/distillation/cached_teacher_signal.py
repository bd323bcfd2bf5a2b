"""When a teacher-signal cache may stand in for the teacher, and the fixed-data steps that read it.

A cache (:mod:`opd.distillation.teacher_signal_cache`, written by ``opd generate``) answers for the teacher only where
the run's teacher would answer the same: one teacher in process that does not follow the student, scoring exactly the
training row's ids (no teacher-only context, no tokenizer of its own), the same model at the same dtype, asked for
the same signal as the one cached. ``opd generate`` refuses to write a cache no such run could read
(:func:`cache_setting_problem`); training checks all of it when it opens the cache, then each fixed-data batch: a batch
with a row the cache did not score (its token ids differ from those scored) goes to the teacher. Here too: a teacher's
answer cut into the rows a cache file stores (:func:`per_row_tensors`), and rows read back as that answer
(:func:`cached_signal`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from opd.data.dataloaders import PreparedExample
from opd.distillation.config import MasterConfig
from opd.distillation.teacher_loading import resolve_teacher_path
from opd.distillation.teacher_plan import Placement, plan_teacher
from opd.distillation.teacher_signal_cache import (
    CacheFileError,
    TeacherSignalCache,
    cache_directory,
    cache_manifest,
    describe_signal,
    manifest_differences,
)
from opd.models.interfaces import TeacherRequest, TeacherSignal, TokenLogprobsRequest, TopKLogprobs, TopKRequest
from opd.models.loading import resolve_device, resolve_dtype
from opd.utils.errors import DataError
from opd.utils.paths import absolute_model_path

log = logging.getLogger("opd")

CachedRequest = TopKRequest | TokenLogprobsRequest
"""The signals a cache can hold: small enough to store at every position."""


def request_to_json(request: CachedRequest) -> dict[str, Any]:
    """A request as a cache's manifest names its signal."""
    if isinstance(request, TopKRequest):
        return {"kind": "topk", "k": request.k, "temperature": request.temperature, "vocab_size": request.vocab_size}
    return {"kind": "token_logprobs", "vocab_size": request.vocab_size}


def per_row_tensors(
    request: CachedRequest, signal: TeacherSignal, lengths: list[int]
) -> list[tuple[torch.Tensor, ...]]:
    """A teacher's right-padded ``[B, L, ...]`` answer to ``request`` cut into each row's ``[length, ...]`` tensors
    on the CPU, as a cache file stores them."""
    if isinstance(request, TopKRequest):
        assert isinstance(signal, TopKLogprobs) and signal.rest_logprobs is not None  # a local teacher sends its rest
        parts: tuple[torch.Tensor, ...] = (signal.logprobs, signal.ids, signal.rest_logprobs)
    else:
        assert isinstance(signal, torch.Tensor)
        parts = (signal,)
    parts = tuple(part.cpu() for part in parts)
    return [tuple(part[row, :length] for part in parts) for row, length in enumerate(lengths)]


def cached_signal(
    cache: TeacherSignalCache, rows: list[list[int]], width: int, device: torch.device
) -> TeacherSignal | None:
    """The signal of right-padded rows (given as their token ids) as the teacher answers a batch of them, ``[B, width,
    ...]`` on ``device``; None if a row is not in the cache. Raises :class:`CacheFileError` for a damaged file."""
    read = cache.read_rows(rows)
    if read is None:
        return None
    padded = cache.kind.padded(read, width)
    if isinstance(padded, TopKLogprobs):
        assert padded.rest_logprobs is not None
        return TopKLogprobs(padded[0].to(device), padded[1].to(device), padded.rest_logprobs.to(device))
    return padded.to(device)


def cache_setting_problem(config: MasterConfig) -> str | None:
    """Why this config's teacher would not answer as a cached signal does, or None."""
    plan = plan_teacher(config)
    if plan.wrappers:
        return f"the teacher is wrapped in {', '.join(plan.wrappers)}: it does not score the training row alone"
    teacher = plan.members[0]
    if teacher.placement is Placement.SERVED or config.teacher.follows_student:
        return f"the teacher ({teacher.source}, {teacher.placement.value}) is not a fixed model in this process"
    if config.environment is not None:
        return "environment: prompts list the environment's tools and fixed rows are recorded episodes"
    return None


def wanted_manifest(config: MasterConfig, request: CachedRequest) -> dict[str, Any]:
    """The manifest of a cache this config's teacher would write for ``request``: its model (absolute) and dtype."""
    dtype = resolve_dtype(config.model.dtype, resolve_device(config.model.device))
    teacher = absolute_model_path(resolve_teacher_path(config))
    return cache_manifest(request_to_json(request), teacher, str(dtype).removeprefix("torch."))


def _row_ids(example: PreparedExample) -> list[int]:
    """The ids a fixed-data row trains on, which the teacher scores."""
    return example["prompt_ids"] + (example["response_ids"] or [])


class FixedDataSignals:
    """A cache as one run's fixed-data steps read it: a batch's whole signal, or None to score the batch live."""

    def __init__(self, cache: TeacherSignalCache, device: torch.device) -> None:
        self.cache = cache
        self.device = device
        self._told_missing = False

    def signal_for(self, examples: list[PreparedExample], width: int) -> TeacherSignal | None:
        """The cached signal of a fixed-data batch of ``examples`` padded to ``width``; None: score it live.

        The first batch with a row the cache did not score is logged, as is each file found damaged (its rows are
        not read again).
        """
        rows = [_row_ids(example) for example in examples]
        try:
            signal = cached_signal(self.cache, rows, width, self.device)
        except CacheFileError as error:
            log.warning("%s; its rows are scored by the teacher from now on", error)
            self.cache.forget(error.file)
            return None
        if signal is None and not self._told_missing:
            self._told_missing = True
            missing = sum(self.cache.locate(ids) is None for ids in rows)
            log.info(
                "a fixed-data batch holds %d of %d rows that the teacher-signal cache %s did not score (their token "
                "ids differ from those it scored: another tokenizer, chat template or data file?); such batches are "
                "scored by the teacher (logged once)",
                missing,
                len(rows),
                self.cache.directory,
            )
        return signal


def open_fixed_data_signals(
    config: MasterConfig, request: TeacherRequest | None, examples: list[PreparedExample]
) -> FixedDataSignals | None:
    """The cache of ``data.train_path`` if this run's fixed-data steps can use it, else None (with a log line saying
    why, where a cache exists). ``request`` is the loss's; ``examples`` the training rows, counted in the log."""
    if not config.distillation.teacher_signal_cache or config.distillation.lowest_lambda() >= 1.0:
        return None
    directory = cache_directory(config.data.train_path)
    if not directory.is_dir():
        return None

    def unused(reason: str) -> None:
        log.info("teacher-signal cache %s not used: %s; fixed-data steps are scored by the teacher", directory, reason)

    if not isinstance(request, (TopKRequest, TokenLogprobsRequest)):
        unused(f"the loss asks the teacher for {type(request).__name__}, not a cached kind of signal")
        return None
    problem = cache_setting_problem(config)
    if problem is not None:
        unused(problem)
        return None
    try:
        cache = TeacherSignalCache(directory)
    except DataError as error:
        log.warning("%s; fixed-data steps are scored by the teacher", error)
        return None
    differences = manifest_differences(cache.manifest, wanted_manifest(config, request))
    if differences:
        unused(f"it was written for other settings ({'; '.join(differences)})")
        return None
    for message in cache.unreadable:
        log.warning("%s; its rows are scored by the teacher", message)
    found = sum(cache.locate(_row_ids(example)) is not None for example in examples)
    if not found:
        unused(f"none of the {len(examples)} training rows has the token ids of a cached row")
        return None
    log.info(
        "teacher-signal cache %s: %s from %s; %d of %d training rows found: fixed-data batches of those rows read the "
        "teacher's signal instead of scoring it",
        directory,
        describe_signal(cache.manifest["signal"]),
        cache.manifest["teacher"],
        found,
        len(examples),
    )
    # Beside the student, where the loss reads it; a cluster's trainer workers move what they are sent.
    device = resolve_device(config.model.device) if config.cluster is None else torch.device("cpu")
    return FixedDataSignals(cache, device)
