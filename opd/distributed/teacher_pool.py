"""The teacher on a Ray cluster as a pool of workers of its own (``cluster.teacher.placement: pool``).

:class:`TeacherPool`: ``cluster.teacher.workers`` workers (:class:`TeacherWorker`),
sharing the rows of each request. A replica is one worker with the whole model, or
(``cluster.teacher.shards_per_replica: n``) ``n`` workers that hold one teacher sharded
with FSDP2 over a process group of their own, for a teacher larger than one device. They
send top-k or token log-probs, or for the full-vocabulary losses their final hidden
states (:class:`~opd.models.interfaces.TeacherHiddenStates`, ``[B, L, D]`` in the
teacher's dtype): never ``[B, L, V]`` logits, and never the output layer, which each
trainer worker loaded once and binds them to. What a worker scores with
(``cluster.teacher.engine``) is a pool engine
(:data:`~opd.distributed.pool_engines.POOL_ENGINES`): it builds the replica, says what it
can send and answers. A teacher colocated in the trainer workers is
:class:`~opd.distributed.colocated_teacher.TeacherInTrainerWorkers`.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.distributed.batch_plan import contiguous_blocks
from opd.distributed.config import TeacherPoolConfig
from opd.distributed.fsdp import init_process_group, rank_device, shard_model
from opd.distributed.pool_engines import HF_POOL_ENGINE, PoolEngine
from opd.distributed.sharded_loading import load_sharded
from opd.distributed.trainer_worker import ShardedTeacher
from opd.distributed.workers.worker_group import WorkerGroup
from opd.models.config import ModelLoadingConfig
from opd.models.interfaces import (
    FullVocabRequest,
    Pending,
    TeacherHiddenStates,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TopKLogprobs,
)
from opd.models.loading import resolve_dtype


def concat_blocks(signals: list[Any], counts: list[int]) -> TeacherSignal:
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
    if isinstance(signals[0], TeacherHiddenStates):
        return TeacherHiddenStates(
            torch.cat([signal.hidden_states[:count] for signal, count in zip(signals, counts, strict=True)])
        )
    if isinstance(signals[0], tuple):
        return tuple(
            torch.cat([signal[part][:count] for signal, count in zip(signals, counts, strict=True)])
            for part in range(len(signals[0]))
        )  # type: ignore[return-value]
    return torch.cat([signal[:count] for signal, count in zip(signals, counts, strict=True)])


def _on_host(signal: TeacherSignal) -> TeacherSignal:
    """A worker's answer with its tensors in host memory (what Ray sends back)."""
    if isinstance(signal, TopKLogprobs):
        rest = signal.rest_logprobs
        return TopKLogprobs(signal.logprobs.cpu(), signal.ids.cpu(), rest.cpu() if rest is not None else None)
    if isinstance(signal, TeacherHiddenStates):
        return TeacherHiddenStates(signal.hidden_states.cpu())
    assert isinstance(signal, torch.Tensor)  # token log-probs
    return signal.cpu()


class TeacherWorker:
    """One worker of a teacher pool (a Ray actor): a whole replica, or one FSDP2 shard of one.

    With ``shards_per_replica`` 1 the constructor loads the whole frozen teacher and the
    worker answers on its own. With ``n > 1``, workers ``r·n … r·n + n − 1`` form replica
    ``r``: a process group of their own (built in two calls, like the trainer's:
    :meth:`rendezvous_address` on the replica's first worker, then :meth:`start` on all),
    over which the teacher is sharded with FSDP2, forward only. Each worker of a replica
    scores rows of its own, and every forward gathers each layer's weights from the
    replica's workers, so all of them must be asked together (:class:`TeacherPool` does).

    Args:
        rank: this worker's rank in the pool.
        model_path: the teacher's weights.
        loading: dtype and loading options.
        threads: torch threads of a CPU worker.
        shards_per_replica: workers that hold one replica between them.
        backend: torch.distributed backend of a replica's process group (``gloo`` or ``nccl``).
        timeout_s: bound on every collective of a replica (``cluster.worker_timeout_s``).
        pool: ``cluster.teacher``, whose ``engine`` builds the replica and answers
            (:data:`~opd.distributed.pool_engines.POOL_ENGINES`); None: the HF engine.
        seed: the engine's seed.
        share_prompt_forward: an unsharded HF teacher runs each distinct prompt of a
            micro-batch once (``teacher.share_prompt_forward``).
    """

    def __init__(
        self,
        rank: int,
        model_path: str,
        loading: ModelLoadingConfig,
        threads: int,
        shards_per_replica: int = 1,
        backend: str = "gloo",
        timeout_s: float = 600.0,
        pool: TeacherPoolConfig | None = None,
        seed: int = 0,
        share_prompt_forward: bool = True,
    ) -> None:
        torch.set_num_threads(threads)
        self.rank = rank
        self.replica, self.shard = divmod(rank, shards_per_replica)
        self.shards_per_replica = shards_per_replica
        self.model_path, self.loading, self.backend, self.timeout_s = model_path, loading, backend, timeout_s
        self.engine: PoolEngine[TeacherPoolConfig] = pool.pool_engine if pool is not None else HF_POOL_ENGINE
        self.teacher: TeacherInterface | None = None
        if shards_per_replica == 1:  # a sharded replica is built by its workers together (start)
            self.teacher = self.engine.build_replica(
                pool or TeacherPoolConfig(), model_path, loading, seed, share_prompt_forward
            )

    def rendezvous_address(self) -> tuple[str, int]:
        """A replica's first worker: this node's address and a free port, where the replica's group meets."""
        import ray  # only inside a Ray actor

        from opd.distributed.workers.ray_cluster import free_port

        return ray.util.get_node_ip_address(), free_port()

    def start(self, master_addr: str, master_port: int) -> None:
        """A sharded replica's worker: joins the replica's process group, then loads and shards the teacher."""
        mesh = init_process_group(
            self.shard, self.shards_per_replica, master_addr, master_port, self.backend, self.timeout_s
        )
        device = rank_device(self.backend)
        # Each worker reads only its own rows of the weights: neither the host nor the
        # device ever holds the whole teacher.
        dtype = resolve_dtype(self.loading.dtype, device)
        model = load_sharded(self.model_path, dtype, device, self.loading, lambda whole: shard_model(whole, mesh))
        model.requires_grad_(False)
        self.teacher = ShardedTeacher(model)

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The teacher's answer for ``data``, on CPU (a sharded replica's workers must be asked together)."""
        if self.teacher is None:
            raise RuntimeError(f"teacher worker {self.rank} was not started (a sharded replica's workers need start)")
        return _on_host(self.engine.answer(self.teacher, data, request))


class TeacherPool(TeacherInterface):
    """``TeacherInterface`` over a pool of :class:`TeacherWorker` replicas (see the module docstring).

    Every request is split into contiguous blocks of rows, one per worker of the
    replicas it uses, so all replicas (and all shards of a sharded replica) score at
    the same time; :meth:`score_async` returns while they do, so a caller can have many
    requests in flight at once (each worker runs its requests in the order they came).

    A full-vocabulary request is answered with the teacher's final hidden states
    (:class:`~opd.models.interfaces.TeacherHiddenStates`), when the trainer that receives
    them holds the teacher's output layer (``binds_hidden_states``).

    Args:
        workers: the :class:`TeacherWorker` workers, replica by replica.
        shards_per_replica: workers that hold one replica between them.
        binds_hidden_states: the trainer workers loaded this teacher's output layer, so
            full-vocabulary requests can be answered with hidden states.
        engine: what the workers score with (``cluster.teacher.pool_engine``): it says what they can send.
    """

    def __init__(
        self,
        workers: WorkerGroup,
        shards_per_replica: int = 1,
        binds_hidden_states: bool = False,
        engine: PoolEngine[TeacherPoolConfig] = HF_POOL_ENGINE,
    ) -> None:
        if workers.size % shards_per_replica:
            raise ValueError(f"{workers.size} teacher workers do not make replicas of {shards_per_replica}")
        self.workers = workers
        self.shards_per_replica = shards_per_replica
        self.binds_hidden_states = binds_hidden_states
        self.engine = engine
        # A sharded replica's workers run their forwards together: requests from several
        # threads must reach all of a replica's workers in the same order.
        self._submitting = threading.Lock()

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """None: the workers hold the model, so every signal can be computed (the full vocabulary as hidden states)."""
        return None

    def refusal(self, request: TeacherRequest) -> str | None:
        """What the workers' engine cannot send; full-vocabulary requests also need the teacher's output layer in
        the trainer workers (``binds_hidden_states``)."""
        reason = self.engine.unsupported_reason(request)
        if reason is not None:
            return reason
        if isinstance(request, FullVocabRequest) and not self.binds_hidden_states:
            return (
                "this teacher pool's hidden states would reach trainer workers that hold no copy of its output "
                "layer (they load it only for a full-vocabulary loss)"
            )
        return super().refusal(request)

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The workers score contiguous blocks of the rows; the answers are joined in row order."""
        return self.score_async(data, request).result()

    def score_async(self, data: BatchedDataDict, request: TeacherRequest) -> Pending[TeacherSignal]:
        """Hands the workers their blocks and returns while they score.

        As many replicas as have rows to score take part, each with all of its workers
        (a worker of a sharded replica without a row of its own scores a filler row,
        dropped from the answer, because its forward gathers its peers' weights).
        """
        reason = self.refusal(request)
        if reason is not None:
            raise ValueError(reason)
        shards = self.shards_per_replica
        replicas = min(self.workers.size // shards, -(-data.size // shards))
        count = replicas * shards
        blocks, counts = contiguous_blocks(data, count)
        with self._submitting:
            refs = [self.workers.actors[rank].score.remote(block, request) for rank, block in enumerate(blocks)]
        return self.workers.pending(
            refs, functools.partial(concat_blocks, counts=counts), ranks=list(range(count)), what="score"
        )

    def close(self) -> None:
        """Stops the workers."""
        self.workers.stop()
