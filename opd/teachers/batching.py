"""Dynamic batching for the teacher server: concurrent requests share one forward pass.

:class:`ScoringBatcher` loops: it takes every waiting :class:`ScoringJob` up to a token budget, runs one padded decoder
pass over all their sequences, then each job's ``finish``. Requests arriving during a pass are coalesced into the
next, so nothing waits on a timer. The model runs on one thread (a model is not re-entrant), off the event loop, so
the server keeps accepting, refusing and answering health checks while it computes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from opd.teachers.scoring import PromptScorer

log = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 60.0
"""Tokens per second are reported over the last minute."""


@dataclass
class ScoringJob:
    """One request's share of a batch.

    ``finish`` turns its hidden rows (one ``[n_i, D]`` per sequence, from ``first_positions``) into its answer, on the
    model thread.
    """

    sequences: list[list[int]]
    first_positions: list[int]
    finish: Callable[[list[torch.Tensor]], Any]
    future: asyncio.Future[Any] | None = field(default=None, repr=False)


@dataclass
class BatcherStats:
    """Counters for ``/metrics``."""

    jobs: int = 0
    sequences: int = 0
    tokens: int = 0
    forward_passes: int = 0
    busy_seconds: float = 0.0
    recent: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)

    def record(self, jobs: int, sequences: int, tokens: int, passes: int, seconds: float) -> None:
        self.jobs += jobs
        self.sequences += sequences
        self.tokens += tokens
        self.forward_passes += passes
        self.busy_seconds += seconds
        now = time.monotonic()
        self.recent.append((now, tokens))
        while self.recent and self.recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self.recent.popleft()

    def tokens_per_second(self) -> float:
        """Tokens scored per second over the last :data:`THROUGHPUT_WINDOW_S` seconds."""
        now = time.monotonic()
        recent = [tokens for stamp, tokens in self.recent if stamp >= now - THROUGHPUT_WINDOW_S]
        return sum(recent) / THROUGHPUT_WINDOW_S


class ScoringBatcher:
    """Coalesces jobs into passes of at most ``max_batch_tokens`` padded tokens (sequences × longest).

    A single sequence longer than the budget still runs, alone.
    """

    def __init__(self, scorer: PromptScorer, max_batch_tokens: int) -> None:
        self.scorer = scorer
        self.max_batch_tokens = max_batch_tokens
        self.stats = BatcherStats()
        self._waiting: collections.deque[ScoringJob] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opd-teacher-model")
        self._stopping = False

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for a forward pass (not counting the one running)."""
        return len(self._waiting)

    def start(self) -> None:
        """Starts the batching loop on the running event loop."""
        self._wakeup = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Finishes the jobs already submitted, then stops the loop and the model thread."""
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._loop_task is not None:
            await self._loop_task
        self._model_thread.shutdown(wait=True)

    async def submit(self, job: ScoringJob) -> Any:
        """Queues ``job`` and waits for its answer (re-raising what its scoring raised)."""
        if self._wakeup is None or self._stopping:
            raise RuntimeError("the scoring batcher is not running")
        job.future = asyncio.get_running_loop().create_future()
        self._waiting.append(job)
        self._wakeup.set()
        return await job.future

    async def run_alone(self, work: Callable[[], Any]) -> Any:
        """Runs ``work`` on the model thread between two passes (for what cannot share one: generation)."""
        if self._stopping:
            raise RuntimeError("the scoring batcher is not running")
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, work)

    def _take_batch(self) -> list[ScoringJob]:
        """The waiting jobs that fit in one pass's token budget, oldest first (at least one)."""
        batch = [self._waiting.popleft()]
        longest = max(len(sequence) for sequence in batch[0].sequences)
        count = len(batch[0].sequences)
        while self._waiting:
            job = self._waiting[0]
            job_longest = max(longest, *(len(sequence) for sequence in job.sequences))
            if job_longest * (count + len(job.sequences)) > self.max_batch_tokens:
                break
            batch.append(self._waiting.popleft())
            longest, count = job_longest, count + len(job.sequences)
        return batch

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._waiting:
                if self._stopping:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._take_batch()
            try:
                answers = await loop.run_in_executor(self._model_thread, self._compute, batch)
            except Exception as error:  # the shared forward pass failed: every job in it fails
                log.exception("a batched forward pass failed")
                answers = [error] * len(batch)
            for job, answer in zip(batch, answers):
                assert job.future is not None
                if job.future.done():  # the client went away
                    continue
                if isinstance(answer, BaseException):
                    job.future.set_exception(answer)
                else:
                    job.future.set_result(answer)

    def _compute(self, batch: list[ScoringJob]) -> list[Any]:
        """On the model thread: the decoder passes for all the jobs' sequences, then each job's answer."""
        began = time.perf_counter()
        sequences = [sequence for job in batch for sequence in job.sequences]
        firsts = [first for job in batch for first in job.first_positions]
        rows, passes = self._hidden_rows(sequences, firsts)
        answers: list[Any] = []
        begin = 0
        for job in batch:
            mine = rows[begin : begin + len(job.sequences)]
            begin += len(job.sequences)
            try:
                answers.append(job.finish(mine))
            except Exception as error:  # this request's own post-processing: only it fails
                answers.append(error)
        tokens = sum(len(sequence) for sequence in sequences)
        self.stats.record(len(batch), len(sequences), tokens, passes, time.perf_counter() - began)
        return answers

    def _hidden_rows(self, sequences: list[list[int]], firsts: list[int]) -> tuple[list[torch.Tensor], int]:
        """Hidden rows of every sequence, in passes of at most ``max_batch_tokens`` padded tokens."""
        rows: list[torch.Tensor] = []
        passes = 0
        begin = 0
        while begin < len(sequences):
            end, longest = begin + 1, len(sequences[begin])
            while (
                end < len(sequences) and max(longest, len(sequences[end])) * (end + 1 - begin) <= self.max_batch_tokens
            ):
                longest = max(longest, len(sequences[end]))
                end += 1
            rows.extend(self.scorer.hidden_rows(sequences[begin:end], firsts[begin:end]))
            passes += 1
            begin = end
        return rows, passes
