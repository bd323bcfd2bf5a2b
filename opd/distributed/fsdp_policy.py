"""The student as N FSDP2 trainer workers, behind the same ``PolicyInterface`` as the in-process student.

:meth:`FSDPPolicy.train` counts the *whole* batch's loss tokens and sequences (each rank normalises by them and
FSDP2 sums gradients, so N ranks compute one process's gradient), deals rows to ranks balanced by tokens in equal
numbers of micro-batches (:mod:`opd.distributed.batch_plan`), asks a teacher running elsewhere for every
micro-batch at once, and runs the step on every rank. Validation's sums are dealt the same way; no
``[B, L, V]`` tensor is sent. Checkpoints are sharded (``torch.distributed.checkpoint``) and load on any number
of ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import pack_padding_free, shift_token_mask
from opd.distributed.batch_plan import balance_by_tokens, equalize_micro_batches
from opd.distributed.workers.worker_group import WorkerGroup
from opd.models.interfaces import (
    LossFunction,
    MicroBatchScorer,
    PolicyInterface,
    TeacherComparison,
    TeacherSignal,
    TeacherSignalFn,
)
from opd.policy.hf_policy import plan_micro_batches
from opd.run.checkpoint import check_model_directory
from opd.utils.paths import absolute_dir
from opd.utils.timer import Timer


def _score_all(plans: list[list[BatchedDataDict]], teacher_signal: TeacherSignalFn) -> list[list[TeacherSignal]]:
    """The teacher's answer for every micro-batch of every rank.

    A :class:`~opd.models.interfaces.MicroBatchScorer` gets every micro-batch before any answer is collected, so
    a pool's replicas score back to back; a plain function is called micro-batch by micro-batch.
    """
    if not isinstance(teacher_signal, MicroBatchScorer):
        return [[teacher_signal(micro_batch) for micro_batch in plan] for plan in plans]
    pending = [[teacher_signal.submit(micro_batch) for micro_batch in plan] for plan in plans]
    return [[answer.result() for answer in answers] for answers in pending]


class FSDPPolicy(PolicyInterface):
    """``PolicyInterface`` over a :class:`WorkerGroup` of :class:`~opd.distributed.trainer_worker.TrainerWorker`.

    ``micro_batch_tokens`` is a padded-token budget per micro-batch instead of ``micro_batch_size`` rows;
    ``on_close`` runs after the workers are gone (frees the cluster's resources).
    """

    def __init__(
        self,
        workers: WorkerGroup,
        micro_batch_size: int,
        micro_batch_tokens: int | None,
        sequence_packing: bool,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.workers = workers
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.sequence_packing = sequence_packing
        self.on_close = on_close

    def plan(self, data: BatchedDataDict, packed: bool | None = None) -> list[list[BatchedDataDict]]:
        """Each rank's micro-batches for ``data`` (the same number on every rank).

        ``packed`` overrides the run's ``sequence_packing`` (validation's sums read right-padded rows).
        """
        rows = balance_by_tokens(data["input_lengths"].tolist(), self.workers.size)
        plans = [
            plan_micro_batches(data.select_indices(indices), self.micro_batch_size, self.micro_batch_tokens)
            if indices
            else []
            for indices in rows
        ]
        plans = equalize_micro_batches(plans)
        if self.sequence_packing if packed is None else packed:
            plans = [[pack_padding_free(micro_batch) for micro_batch in plan] for plan in plans]
        return plans

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        teacher_signal: TeacherSignalFn | None = None,
        timer: Timer | None = None,
    ) -> dict[str, float]:
        """One optimizer step over the global batch on every rank; returns the global metrics.

        Adds to ``timer`` the slowest rank's ``teacher`` and ``trainer_compute`` times and the planning ``dispatch``.
        """
        start = time.perf_counter()
        global_valid_tokens = int(shift_token_mask(data["token_mask"]).sum())
        plans = self.plan(data)
        dispatch_seconds = time.perf_counter() - start
        signals: list[Any] = [None] * len(plans)
        if teacher_signal is not None:  # timed by the driver as teacher time (a colocated teacher's: below)
            signals = _score_all(plans, teacher_signal)
        shares = list(zip(plans, signals, strict=True))
        results = self.workers.call("train", loss_fn, global_valid_tokens, data.size, shares=shares)
        if timer is not None:
            # The slowest rank's colocated teacher time (zero when it scored elsewhere).
            timer.add("teacher", max(result["teacher_seconds"] for result in results))
            timer.add("trainer_compute", max(result["compute_seconds"] for result in results))
            timer.add("dispatch", dispatch_seconds)
        metrics = dict(results[0])
        del metrics["teacher_seconds"], metrics["compute_seconds"]  # rank 0's own times
        return metrics

    def compare_with_teacher(
        self, data: BatchedDataDict, comparison: TeacherComparison, teacher_signal: TeacherSignalFn
    ) -> dict[str, float]:
        """Sums of ``comparison`` over ``data``: each rank sums over its rows where its hidden states are.

        Rows are dealt as for :meth:`train`; only each rank's sums come back.
        """
        plans = self.plan(data, packed=False)
        signals = [[teacher_signal(micro_batch) for micro_batch in plan] for plan in plans]
        return self.workers.call("compare_with_teacher", comparison, shares=list(zip(plans, signals, strict=True)))

    def weights_for_refit(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight, whole, gathered from the ranks (rank 0 sends them)."""
        yield from self.workers.call("whole_weights").items()

    def state_dict(self) -> dict[str, Any]:
        """Not used: the optimizer state stays sharded in the workers (see :meth:`save_checkpoint`)."""
        raise NotImplementedError("an FSDP2 student saves its optimizer state sharded: use save_checkpoint")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Not used: see :meth:`load_checkpoint`."""
        raise NotImplementedError("an FSDP2 student loads its optimizer state sharded: use load_checkpoint")

    def save_checkpoint(self, directory: Path, tokenizer: Any | None = None) -> None:
        """Every rank writes its shard of weights and optimizer; the tokenizer and model config go beside them.

        The directory is sent absolute; start-up checked that every node shares it
        (:mod:`opd.distributed.workers.shared_directory`).
        """
        directory = absolute_dir(directory)
        self.workers.call("save_shards", str(directory))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory / "tokenizer"))

    def load_checkpoint(self, directory: Path) -> None:
        """Restores weights, optimizer and schedule from a checkpoint written with any number of ranks."""
        self.workers.call("load_shards", str(absolute_dir(directory)))

    def save_pretrained(self, directory: str, tokenizer: Any | None = None) -> None:
        """Gathers the whole student and writes it as a Hugging Face model directory (rank 0 writes).

        Raises:
            OpdError: the controller does not see the config or weights rank 0 wrote (an unshared directory).
        """
        path = absolute_dir(directory)
        self.workers.call("save_pretrained", str(path))
        check_model_directory(path, "trainer rank 0")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))

    def close(self) -> None:
        """Stops the workers and frees the cluster's resources."""
        self.workers.stop()
        if self.on_close is not None:
            self.on_close()
