"""The teacher on a Ray cluster: in the trainer workers (colocated) or as a pool of its own.

* :class:`ColocatedTeacher`: the frozen teacher lives, sharded, in every trainer worker
  (:class:`~opd.distributed.trainer_worker.TrainerWorker`). During training the workers
  score each micro-batch themselves, so the exact full-vocabulary loss works as in one
  process; this facade answers the driver's other questions (validation metrics) by
  running the same workers.
* :class:`TeacherPool`: ``cluster.teacher.workers`` replicas of their own
  (:class:`TeacherWorker`), each with the whole model, sharing the rows of each request.
  They send top-k or token log-probs; full-vocabulary logits would cost ``[B, L, V]``
  floats per micro-batch on the wire, so the full-vocabulary losses ask for a colocated
  teacher instead.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.distributed.batch_plan import contiguous_blocks
from opd.distributed.worker_group import WorkerGroup
from opd.models.config import ModelLoadingConfig
from opd.models.interfaces import (
    FullVocabRequest,
    Pending,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TopKLogprobs,
)
from opd.models.loading import load_causal_lm, resolve_device, resolve_dtype
from opd.models.teacher.local_teacher import LocalTeacher


def _concat(signals: list[Any], counts: list[int]) -> TeacherSignal:
    """The blocks' answers joined back into one, dropping the filler rows."""
    if isinstance(signals[0], TopKLogprobs):
        rests = [signal.rest_logprobs for signal in signals]
        return TopKLogprobs(
            torch.cat([signal.logprobs[:count] for signal, count in zip(signals, counts, strict=True)]),
            torch.cat([signal.ids[:count] for signal, count in zip(signals, counts, strict=True)]),
            None
            if any(rest is None for rest in rests)
            else torch.cat([rest[:count] for rest, count in zip(rests, counts, strict=True)]),
        )
    if isinstance(signals[0], tuple):
        return tuple(
            torch.cat([signal[part][:count] for signal, count in zip(signals, counts, strict=True)])
            for part in range(len(signals[0]))
        )  # type: ignore[return-value]
    return torch.cat([signal[:count] for signal, count in zip(signals, counts, strict=True)])


class ColocatedTeacher(TeacherInterface):
    """The teacher held by the trainer workers (see the module docstring).

    Args:
        workers: the trainer workers, built with a teacher.
    """

    def __init__(self, workers: WorkerGroup) -> None:
        self.workers = workers

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """None: the workers hold the model, so every signal can be computed."""
        return None

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """Every rank scores a block of the rows; hidden states come back as logits."""
        if isinstance(request, FullVocabRequest):
            request = FullVocabRequest(prefer_hidden_states=False)
        blocks, counts = contiguous_blocks(data, self.workers.size)
        return _concat(self.workers.run_all("teacher_score", request, per_rank=[(b,) for b in blocks]), counts)


class TeacherWorker:
    """One teacher replica (a Ray actor) with the whole frozen model.

    Args:
        rank: this replica's rank.
        model_path: the teacher's weights.
        loading: dtype and loading options.
        threads: torch threads of a CPU worker.
    """

    def __init__(self, rank: int, model_path: str, loading: ModelLoadingConfig, threads: int) -> None:
        torch.set_num_threads(threads)
        self.rank = rank
        device = resolve_device(loading.device)
        self.teacher = LocalTeacher(load_causal_lm(model_path, resolve_dtype(loading.dtype, device), device, loading))

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The teacher's answer for ``data``, on CPU."""
        signal = self.teacher.score(data, request)
        if isinstance(signal, TopKLogprobs):
            rest = signal.rest_logprobs
            return TopKLogprobs(signal.logprobs.cpu(), signal.ids.cpu(), rest.cpu() if rest is not None else None)
        assert isinstance(signal, torch.Tensor)  # token log-probs: full-vocabulary requests are refused
        return signal.cpu()


class TeacherPool(TeacherInterface):
    """``TeacherInterface`` over replicas of their own (see the module docstring).

    Args:
        workers: the :class:`TeacherWorker` replicas.
    """

    def __init__(self, workers: WorkerGroup) -> None:
        self.workers = workers

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """Full-vocabulary requests are refused: they would ship ``[B, L, V]`` floats per micro-batch."""
        if isinstance(request, FullVocabRequest):
            return (
                "a teacher pool (cluster.teacher.placement: pool) sends top-k or token log-probs, not the full "
                "vocabulary; use loss_fn.type topk or sampled_token, or cluster.teacher.placement: colocated"
            )
        return None

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The replicas score contiguous blocks of the rows; the answers are joined in row order."""
        return self.score_async(data, request).result()

    def score_async(self, data: BatchedDataDict, request: TeacherRequest) -> Pending[TeacherSignal]:
        """Hands the replicas their blocks and returns while they score."""
        reason = self.unsupported_reason(request)
        if reason is not None:
            raise ValueError(reason)
        count = min(self.workers.size, data.size)
        blocks, counts = contiguous_blocks(data, count)
        refs = [self.workers.actors[rank].score.remote(block, request) for rank, block in enumerate(blocks)]
        return self.workers.pending(
            refs, functools.partial(_concat, counts=counts), ranks=list(range(count)), what="score"
        )

    def close(self) -> None:
        """Stops the replicas."""
        self.workers.kill()
