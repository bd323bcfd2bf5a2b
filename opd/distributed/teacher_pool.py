"""The teacher on a Ray cluster as a pool of workers of its own (``cluster.teacher.placement: pool``).

A replica is one worker with the whole model, or ``shards_per_replica`` workers sharding it with FSDP2. Workers
send top-k or token log-probs, or for full-vocabulary losses final hidden states (``[B, L, D]``, teacher dtype),
never ``[B, L, V]`` logits; each trainer worker binds them to the output layer it loaded. The hidden states stay
in Ray's object store until the trainer rank that binds them fetches them: the controller passes references on.
What a worker scores with is a pool engine (:mod:`opd.distributed.pool_engines`).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, ClassVar

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
    StoredHiddenStates,
    TeacherHiddenStates,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TopKLogprobs,
    signal_to_device,
)
from opd.models.loading import resolve_dtype


def concat_blocks(signals: list[Any], counts: list[int]) -> TeacherSignal:
    """The blocks' answers joined back into one, dropping the filler rows."""

    def joined(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])

    if isinstance(signals[0], TopKLogprobs):
        rests = [signal.rest_logprobs for signal in signals]
        return TopKLogprobs(
            joined([signal.logprobs for signal in signals]),
            joined([signal.ids for signal in signals]),
            None if any(rest is None for rest in rests) else joined(rests),
        )
    if isinstance(signals[0], TeacherHiddenStates):
        return TeacherHiddenStates(joined([signal.hidden_states for signal in signals]))
    if isinstance(signals[0], StoredHiddenStates):  # references only: the blocks are joined where they are fetched
        return StoredHiddenStates(tuple(block for signal in signals for block in signal.blocks), tuple(counts))
    if isinstance(signals[0], tuple):
        parts = range(len(signals[0]))
        return tuple(joined([signal[part] for signal in signals]) for part in parts)  # type: ignore[return-value]
    return joined(signals)


class TeacherWorker:
    """One worker of a teacher pool (a Ray actor): a whole replica, or one FSDP2 shard of one.

    With ``shards_per_replica`` ``n > 1``, workers ``r·n … r·n + n − 1`` form replica ``r`` in a process group of
    their own (:meth:`rendezvous_address` on the first, then :meth:`start` on all). Each scores its own rows, but
    every forward gathers weights from all of them, so they must be asked together (:class:`TeacherPool` does).

    Args:
        backend, timeout_s: a replica's process group's backend and bound on every collective.
        pool: ``cluster.teacher``, whose ``engine`` builds the replica and answers; None: the HF engine.
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
        # Each worker reads only its own rows of the weights, never the whole teacher.
        dtype = resolve_dtype(self.loading.dtype, device)
        model = load_sharded(self.model_path, dtype, device, self.loading, lambda whole: shard_model(whole, mesh))
        self.teacher = ShardedTeacher(model)

    def score(self, data: BatchedDataDict, request: TeacherRequest, in_store: bool = False) -> TeacherSignal:
        """The teacher's answer for ``data``, on CPU (a sharded replica's workers must be asked together).

        ``in_store``: hidden states are put in Ray's object store and only their reference is returned
        (:class:`~opd.models.interfaces.StoredHiddenStates`), for the trainer rank that binds them to fetch.
        """
        if self.teacher is None:
            raise RuntimeError(f"teacher worker {self.rank} was not started (a sharded replica's workers need start)")
        signal = signal_to_device(self.engine.answer(self.teacher, data, request), torch.device("cpu"))
        if in_store and isinstance(signal, TeacherHiddenStates):
            import ray  # only inside a Ray actor

            return StoredHiddenStates((ray.put(signal),), (data.size,))
        return signal


class TeacherPool(TeacherInterface):
    """``TeacherInterface`` over a pool of :class:`TeacherWorker` replicas (see the module docstring).

    Every request is split into contiguous row blocks, one per worker used, so replicas and shards score at once;
    many requests may be in flight (each worker runs its requests in arrival order).

    Args:
        workers: the :class:`TeacherWorker` workers, replica by replica.
        binds_hidden_states: the trainer workers hold this teacher's output layer (full-vocabulary requests); the
            workers then leave the hidden states in Ray's object store and the trainer ranks fetch them, so they
            never pass through the controller (:class:`~opd.models.interfaces.StoredHiddenStates`).
        engine: what the workers score with; it says what they can send.
    """

    hidden_states_in_store: ClassVar[bool] = True
    """Hidden states for trainer workers stay in the object store (False: they come back through this process,
    as before; the controller-memory test measures that for contrast)."""

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
        # Requests from several threads must reach all of a sharded replica's workers in the same order.
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

        A sharded replica's worker without rows scores a dropped filler row, since its forward gathers its peers'.
        """
        reason = self.refusal(request)
        if reason is not None:
            raise ValueError(reason)
        shards = self.shards_per_replica
        replicas = min(self.workers.size // shards, -(-data.size // shards))
        count = replicas * shards
        blocks, counts = contiguous_blocks(data, count)
        in_store = self.hidden_states_in_store and self.binds_hidden_states and isinstance(request, FullVocabRequest)
        with self._submitting:
            refs = [
                self.workers.actors[rank].score.remote(block, request, in_store) for rank, block in enumerate(blocks)
            ]
        return self.workers.pending(
            refs, functools.partial(concat_blocks, counts=counts), ranks=list(range(count)), what="score"
        )

    def close(self) -> None:
        """Stops the workers."""
        self.workers.stop()
