"""The student as N FSDP2 trainer workers, behind the same ``PolicyInterface`` as the in-process student.

The driver calls :meth:`FSDPPolicy.train` with the global batch, as it would the
in-process :class:`~opd.policy.hf_policy.HFPolicy`. The controller side here:

1. counts the loss-carrying tokens and sequences of the *whole* batch (each rank's loss
   is normalised by them, and FSDP2 sums the gradients, so N ranks compute the gradient
   of one process);
2. deals the rows to the ranks balanced by tokens and cuts each rank's share into
   micro-batches, padded with idle ones to the same count on every rank
   (:mod:`opd.distributed.batch_plan`);
3. when the teacher runs elsewhere (a teacher pool or a served teacher), asks it for
   every micro-batch's signal at once, collects the answers and sends them along; a
   colocated teacher scores in the workers instead;
4. runs the step on every rank and returns the global metrics.

Validation's KL (:meth:`FSDPPolicy.compare_with_teacher`) is dealt the same way: each
rank sums the KL over its rows from its own hidden states, with the colocated teacher
scoring in place, and only the sums come back; no ``[B, L, V]`` tensor is sent.

Checkpoints are sharded (``torch.distributed.checkpoint``, one file per rank plus
metadata) and can be loaded by any number of ranks; ``save_pretrained`` gathers the
whole model once, for ``final_model/`` and for ``opd export``.
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
from opd.policy.optimization import plan_micro_batches
from opd.run.checkpoint import check_model_directory
from opd.utils.paths import absolute_dir
from opd.utils.timer import Timer


def _score_all(plans: list[list[BatchedDataDict]], teacher_signal: TeacherSignalFn) -> list[list[TeacherSignal]]:
    """The teacher's answer for every micro-batch of every rank.

    A :class:`~opd.models.interfaces.MicroBatchScorer` gets every micro-batch before any
    answer is collected, so a teacher in other processes has them all at once: the
    replicas of a teacher pool score them together and back to back, instead of waiting
    for the controller between micro-batches. A plain function is called micro-batch by
    micro-batch.
    """
    if not isinstance(teacher_signal, MicroBatchScorer):
        return [[teacher_signal(micro_batch) for micro_batch in plan] for plan in plans]
    pending = [[teacher_signal.submit(micro_batch) for micro_batch in plan] for plan in plans]
    return [[answer.result() for answer in answers] for answers in pending]


class FSDPPolicy(PolicyInterface):
    """``PolicyInterface`` over a :class:`WorkerGroup` of :class:`~opd.distributed.trainer_worker.TrainerWorker`.

    Args:
        workers: the trainer ranks.
        micro_batch_size: rows per forward/backward pass on each rank.
        micro_batch_tokens: a padded-token budget per micro-batch instead (length-sorted).
        sequence_packing: each micro-batch is packed into one row without padding.
        on_close: called after the workers are gone (frees the cluster's resources).
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
        """One optimizer step over the global batch on every rank (see the module docstring).

        Adds to ``timer`` the phases timed here: ``teacher`` (the slowest rank's time in
        its colocated teacher), ``trainer_compute`` (the slowest rank's time in the step)
        and ``dispatch`` (the controller's time planning the micro-batches).

        Returns:
            The global metrics, as :meth:`HFPolicy.train` returns them.
        """
        start = time.perf_counter()
        global_valid_tokens = int(shift_token_mask(data["token_mask"]).sum())
        plans = self.plan(data)
        dispatch_seconds = time.perf_counter() - start
        signals: list[Any] = [None] * len(plans)
        if teacher_signal is not None:  # timed by the driver as teacher time (a colocated teacher's: below)
            signals = _score_all(plans, teacher_signal)
        results = self.workers.call(
            "train",
            loss_fn,
            global_valid_tokens,
            data.size,
            shares=[(plan, signal) for plan, signal in zip(plans, signals, strict=True)],
        )
        metrics = dict(results[0])
        teacher_seconds = max(result["teacher_seconds"] for result in results)
        compute_seconds = max(result["compute_seconds"] for result in results)
        if timer is not None:
            # The slowest rank's colocated teacher time (zero when it scored elsewhere).
            timer.add("teacher", teacher_seconds)
            timer.add("trainer_compute", compute_seconds)
            timer.add("dispatch", dispatch_seconds)
        metrics.pop("teacher_seconds")
        metrics.pop("compute_seconds")
        return metrics

    def compare_with_teacher(
        self, data: BatchedDataDict, comparison: TeacherComparison, teacher_signal: TeacherSignalFn
    ) -> dict[str, float]:
        """Sums of ``comparison`` over ``data``: each rank sums over its rows where its hidden states are.

        Rows are dealt as for :meth:`train` (idle micro-batches add nothing). The teacher
        is asked for each micro-batch and its (top-k, token or hidden-state) answer sent
        along; a colocated teacher answers that the workers score it themselves
        (:class:`~opd.models.interfaces.AnsweredWhereTrained`), so with a full-vocabulary
        request the ranks make both models' logits chunk by chunk from hidden states in
        place. Only each rank's sums come back.
        """
        plans = self.plan(data, packed=False)
        signals = [[teacher_signal(micro_batch) for micro_batch in plan] for plan in plans]
        return self.workers.call(
            "compare_with_teacher",
            comparison,
            shares=[(plan, signal) for plan, signal in zip(plans, signals, strict=True)],
        )

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

        The directory reaches the ranks absolute (each resolves nothing against its own
        working directory); start-up checked that every node shares it
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
            OpdError: the directory, as the controller sees it, lacks the config or the
                weights after rank 0 wrote them (rank 0's node does not share it).
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
