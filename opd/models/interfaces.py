"""The contracts between the distillation driver and its backends.

``distillation_train`` calls only what these classes declare: the student (:class:`PolicyInterface`), its sampler
(:class:`GenerationInterface`), the teacher (:class:`TeacherInterface`) and the loss (:class:`LossFunction`).
Backends subclass them, so a missing method fails when the backend is built, not mid-run.

The teacher answers the one typed *signal* the loss asks for:

* :class:`FullVocabRequest`: ``[B, L, V]`` logits, or final hidden states and head
  (:class:`~opd.models.lm_head.LMHeadInput`). A teacher in other processes sends hidden states alone
  (:class:`TeacherHiddenStates`), which the receiver binds to its copy of the head (:func:`bind_teacher_head`);
* :class:`TopKRequest`: ``([B, L, k] log-probs, [B, L, k] ids)`` as :class:`TopKLogprobs`, maybe with rest mass;
* :class:`TokenLogprobsRequest`: each token's log-prob given those before it, ``[B, L]``.

Logits and top-k at position ``t`` describe token ``t + 1``; token log-probs sit at the token's own position.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.models.decoding import GenerateStrategyConfig
from opd.models.lm_head import LMHeadInput, OutputLayer
from opd.models.step_metrics import MetricValue, read_metrics
from opd.utils.errors import OpdError
from opd.utils.timer import Timer

ResultT = TypeVar("ResultT")

CHECKPOINT_POLICY_DIR = "policy"
"""A checkpoint's student weights, as a Hugging Face model directory (in-process student)."""
CHECKPOINT_OPTIMIZER_FILE = "optimizer.pt"
"""A checkpoint's optimizer and schedule state (in-process student)."""

# --------------------------------------------------------------------------- teacher signals


@dataclass(frozen=True)
class FullVocabRequest:
    """The teacher's whole distribution at every position.

    Attributes:
        prefer_hidden_states: the (fused) loss takes hidden states and head; an in-process teacher then answers
            so, others with logits. A teacher in other processes always sends :class:`TeacherHiddenStates`.
    """

    prefer_hidden_states: bool = False


@dataclass(frozen=True)
class TopKRequest:
    """The teacher's ``k`` most likely tokens per position, with their log-probs.

    Attributes:
        k: tokens per position (capped at the vocabulary size).
        temperature: log-probs of ``softmax(logits / temperature)``.
        vocab_size: only the first ``vocab_size`` outputs are real tokens (None: all).
    """

    k: int
    temperature: float = 1.0
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"TopKRequest.k must be >= 1, got {self.k}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"TopKRequest.temperature must be a finite number > 0, got {self.temperature}")


class TopKLogprobs(tuple[torch.Tensor, torch.Tensor]):
    """A teacher's answer to a :class:`TopKRequest`: the 2-tuple ``(log-probs, ids)``, plus its rest mass.

    :attr:`rest_logprobs` is log(1 − Σ_k P), taken from the full distribution without subtracting
    (:mod:`opd.kernels.topk_rest`); a consumer that finds none computes it from the top-k log-probs.

    Attributes:
        logprobs: ``[B, L, k]`` float32 log-probs over the full vocabulary, sorted by probability.
        ids: ``[B, L, k]`` int64 token ids.
        rest_logprobs: ``[B, L]`` float32 log mass outside the k ids (−inf if they cover all), or None if unknown.
    """

    rest_logprobs: torch.Tensor | None

    def __new__(
        cls, logprobs: torch.Tensor, ids: torch.Tensor, rest_logprobs: torch.Tensor | None = None
    ) -> TopKLogprobs:
        answer = super().__new__(cls, (logprobs, ids))
        answer.rest_logprobs = rest_logprobs
        return answer

    def __reduce__(self) -> tuple[Any, ...]:
        # A tuple subclass would otherwise unpickle from the pair alone, losing the rest mass.
        return (TopKLogprobs, (self[0], self[1], self.rest_logprobs))

    @property
    def logprobs(self) -> torch.Tensor:
        """The ``[B, L, k]`` log-probs (element 0)."""
        return self[0]

    @property
    def ids(self) -> torch.Tensor:
        """The ``[B, L, k]`` token ids (element 1)."""
        return self[1]


@dataclass(frozen=True)
class TokenLogprobsRequest:
    """The teacher's log-prob of each token at temperature 1; only the first ``vocab_size`` outputs are real."""

    vocab_size: int | None = None


SingleTeacherRequest = FullVocabRequest | TopKRequest | TokenLogprobsRequest
"""What a loss asks one teacher for."""


@dataclass(frozen=True)
class PerTeacherRequest:
    """Several routed teachers, each asked for its own signal (``requests`` in ``teachers.members`` order).

    Only :class:`~opd.teachers.several_teachers.RoutedTeachers` answers it; other teachers refuse it.
    """

    requests: tuple[SingleTeacherRequest, ...]


TeacherRequest = SingleTeacherRequest | PerTeacherRequest
"""What a loss asks the teacher for."""


class SeveralTeachersSignal(ABC):
    """Several teachers' answer (``seconds``: scoring time by name); losses read its parts, others :meth:`combined`."""

    seconds: dict[str, float]

    @abstractmethod
    def combined(self) -> SingleTeacherSignal:
        """One answer of the kind asked for, row by row what the teachers said."""

    @abstractmethod
    def to(self, device: torch.device) -> SeveralTeachersSignal:
        """The same answer with every tensor on ``device`` (a cluster's trainer worker receives it)."""

    @abstractmethod
    def select_rows(self, rows: torch.Tensor, width: int) -> SeveralTeachersSignal:
        """The answer for ``rows`` (in order), cut to ``width`` positions (a micro-batch of a batch scored ahead)."""

    @abstractmethod
    def pack(self, lengths: list[int]) -> SeveralTeachersSignal:
        """The answer laid out as the packed row of right-padded rows of ``lengths`` (``training.sequence_packing``)."""


@dataclass(frozen=True)
class TeacherHiddenStates:
    """A teacher's full-vocabulary answer between processes: its final hidden states alone.

    The output layer does not travel: the loss side loaded it once and binds the states to it (:meth:`bind`).

    Attributes:
        hidden_states: ``[B, L, D]`` after the teacher's final norm (next-token positions), teacher or wire dtype.
    """

    hidden_states: torch.Tensor

    def bind(self, layer: OutputLayer) -> LMHeadInput:
        """The hidden states over the teacher's output ``layer``, on its device and in its dtype."""
        weight = layer.weight
        return layer.over(self.hidden_states.to(device=weight.device, dtype=weight.dtype))


@dataclass(frozen=True)
class StoredHiddenStates:
    """A teacher pool's final hidden states left in Ray's object store, fetched where they are bound.

    Each pool worker puts its block there and sends only the reference, so the controller passes references on
    and never holds the ``[B, L, D]`` states; the trainer rank that binds them fetches them
    (:func:`bind_teacher_head`). Row selections made on the way (a micro-batch's rows of a batch scored ahead,
    packing, routing) are kept as ``steps`` and applied after the fetch.

    Attributes:
        blocks: each worker's :class:`TeacherHiddenStates` (Ray object references), in row order.
        counts: the real rows of each block (a sharded replica's filler rows are dropped).
        steps: functions of the joined ``[B, L, D]`` states, applied in order after the fetch.
    """

    blocks: tuple[Any, ...]
    counts: tuple[int, ...]
    steps: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = ()

    def then(self, step: Callable[[torch.Tensor], torch.Tensor]) -> StoredHiddenStates:
        """These states with ``step`` applied after the fetch (a row selection, packing)."""
        return dataclasses.replace(self, steps=(*self.steps, step))

    def fetch(self) -> TeacherHiddenStates:
        """The states, fetched from the object store, joined and with the steps applied (on the CPU)."""
        import ray  # only where a teacher pool ran

        parts = ray.get(list(self.blocks))
        hidden = torch.cat([part.hidden_states[:count] for part, count in zip(parts, self.counts, strict=True)])
        for step in self.steps:
            hidden = step(hidden)
        return TeacherHiddenStates(hidden)

    def to(self, device: torch.device) -> StoredHiddenStates:
        """Unchanged: the states reach a device when they are fetched and bound."""
        return self


HIDDEN_STATE_SIGNALS = (TeacherHiddenStates, StoredHiddenStates)
"""A teacher's bare hidden states, here or in the object store: bound to its output layer where that is."""


def bind_teacher_head(signal: TeacherSignal, layer: OutputLayer | None, holder: str = "this process") -> TeacherSignal:
    """``signal`` with its hidden states bound to the teacher's output ``layer``; other signals as they are.

    Raises ValueError (naming ``holder``) when hidden states arrive but no layer was loaded. States left in the
    object store (:class:`StoredHiddenStates`) are fetched here.
    """
    if not isinstance(signal, HIDDEN_STATE_SIGNALS):
        return signal
    if layer is None:
        raise ValueError(
            f"the teacher sent its final hidden states, but {holder} holds no copy of the teacher's output layer "
            "to make its logits with"
        )
    if isinstance(signal, StoredHiddenStates):
        signal = signal.fetch()
    return signal.bind(layer)


@dataclass(frozen=True)
class AnsweredWhereTrained:
    """The answer of a teacher in the trainer's own workers: each worker scores its micro-batch there.

    Sent by :class:`~opd.distributed.colocated_teacher.TeacherInTrainerWorkers`, so a full-vocabulary answer
    never leaves the device.
    """

    request: TeacherRequest

    def to(self, device: torch.device) -> AnsweredWhereTrained:
        """Itself: nothing to move (the answer is made where the micro-batch is)."""
        return self


SingleTeacherSignal = (
    torch.Tensor
    | LMHeadInput
    | TeacherHiddenStates
    | StoredHiddenStates
    | tuple[torch.Tensor, torch.Tensor]
    | AnsweredWhereTrained
)
"""One teacher's answer (see :data:`TeacherSignal`)."""

TeacherSignal = SingleTeacherSignal | SeveralTeachersSignal
"""A teacher's answer: one teacher's (:data:`SingleTeacherSignal`) or several teachers'."""


def signal_to_device(signal: TeacherSignal, device: torch.device) -> TeacherSignal:
    """A teacher's answer with every tensor on ``device`` (the rest mass of a top-k answer kept)."""
    if isinstance(signal, SeveralTeachersSignal):
        return signal.to(device)
    if isinstance(signal, TopKLogprobs):
        rest = signal.rest_logprobs
        return TopKLogprobs(signal[0].to(device), signal[1].to(device), rest.to(device) if rest is not None else None)
    if isinstance(signal, tuple):
        return (signal[0].to(device), signal[1].to(device))
    if isinstance(signal, TeacherHiddenStates):
        return TeacherHiddenStates(signal.hidden_states.to(device))
    if isinstance(signal, LMHeadInput):
        bias = signal.bias.to(device) if signal.bias is not None else None
        return dataclasses.replace(
            signal, hidden_states=signal.hidden_states.to(device), weight=signal.weight.to(device), bias=bias
        )
    return signal.to(device)


TeacherSignalFn = Callable[[BatchedDataDict], TeacherSignal]
"""Scores one micro-batch: a plain function, or a :class:`MicroBatchScorer` that can also start many at once."""


# --------------------------------------------------------------------------- loss


class LossFunction(ABC):
    """Computes a micro-batch's share of the global-batch loss.

    It normalises by the valid tokens and sequences of the *whole global batch*, so the micro-batch losses sum
    to the loss of one big batch and gradient accumulation changes nothing but memory.

    Attributes:
        fused_lm_head: takes the student's hidden states and head (:class:`~opd.models.lm_head.LMHeadInput`)
            instead of ``[B, L, V]`` logits.
    """

    fused_lm_head: bool = False

    @property
    def teacher_request(self) -> TeacherRequest | None:
        """What the loss needs from the teacher; None for losses that need no teacher (SFT)."""
        return None

    @property
    def needs_task_reward(self) -> bool:
        """On-policy batches must carry ``task_reward [N]`` (the verifier's grade of each response)."""
        return False

    @property
    def needs_sampler_logprobs(self) -> bool:
        """On-policy batches must carry ``generation_logprobs`` (the sampler's log-probs)."""
        return False

    def finish_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics from their sums over micro-batches and ranks; a ratio of two sums is divided here."""
        return metrics

    def for_step(self, step: int) -> LossFunction:
        """This loss as optimizer step ``step`` (from 1) computes it: a copy where the step changes what it reports
        (``loss_fn.diagnostics_every``), else itself; never changed in place."""
        return self

    @abstractmethod
    def loss_and_metrics(
        self,
        student_output: Any,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_output: Any = None,
    ) -> tuple[torch.Tensor, dict[str, MetricValue]]:
        """The loss and its metrics, both already divided by the global normaliser; the metrics are not read.

        ``student_output`` is ``[B, L, V]`` logits, or an ``LMHeadInput`` when ``fused_lm_head`` is set;
        ``teacher_output`` answers ``teacher_request``. Metric values may be 0-dim device tensors: the trainers
        sum them over micro-batches and read them once per step (:mod:`opd.models.step_metrics`).
        """

    def __call__(
        self,
        student_output: Any,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_output: Any = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """:meth:`loss_and_metrics` with the metrics read as floats (one host sync)."""
        loss, metrics = self.loss_and_metrics(
            student_output, data, global_valid_tokens, global_valid_seqs, teacher_output
        )
        return loss, read_metrics(metrics)


class TeacherComparison(ABC):
    """Per-token sums comparing student and teacher (validation's KL), without gradient.

    Called per micro-batch where the student's hidden states are; only the summed numbers leave that process.
    """

    teacher_request: TeacherRequest

    @abstractmethod
    def __call__(self, student: LMHeadInput, teacher_output: TeacherSignal, data: BatchedDataDict) -> dict[str, float]:
        """Sums over ``data``'s loss tokens; ``student`` (``[B, L, D]``, head) and ``teacher_output`` share a device."""


# --------------------------------------------------------------------------- backends


class PolicyInterface(ABC):
    """The trainable student."""

    @abstractmethod
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        teacher_signal: TeacherSignalFn | None = None,
        timer: Timer | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``data`` (the global batch), micro-batch by micro-batch.

        Args:
            data: right-padded batch with ``input_ids``, ``input_lengths``, ``token_mask``.
            loss_fn: called on each micro-batch.
            teacher_signal: scores a micro-batch (a :class:`MicroBatchScorer`); None when no teacher is needed.
            timer: the step's phase clock; a trainer adds its own phases (logged as ``timing/<phase>``).

        Returns:
            The loss function's metrics summed over micro-batches, plus ``grad_norm``, ``lr``, ``skipped_nonfinite``.
        """

    @abstractmethod
    def compare_with_teacher(
        self, data: BatchedDataDict, comparison: TeacherComparison, teacher_signal: TeacherSignalFn
    ) -> dict[str, float]:
        """Sums of ``comparison`` over ``data``, computed without gradient where the student's hidden states are.

        The student's ``[B, L, V]`` logits never exist at once and never cross a process boundary.
        ``teacher_signal`` is as in :meth:`train`. Returns each sum over every micro-batch and rank.
        """

    @abstractmethod
    def weights_for_refit(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every parameter, as a separate generation engine loads them."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Optimizer and schedule state for a checkpoint (the weights are saved by :meth:`save_pretrained`)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned."""

    @abstractmethod
    def save_pretrained(self, directory: str, tokenizer: Any | None = None) -> None:
        """Writes the student (and the tokenizer, if given) as a Hugging Face model directory."""

    def save_checkpoint(self, directory: Path, tokenizer: Any | None = None) -> None:
        """Writes the student's part of a checkpoint: by default ``policy/`` and ``optimizer.pt``; shards if sharded."""
        self.save_pretrained(str(directory / CHECKPOINT_POLICY_DIR), tokenizer=tokenizer)
        torch.save(self.state_dict(), directory / CHECKPOINT_OPTIMIZER_FILE)

    def load_checkpoint(self, directory: Path) -> None:
        """Restores what :meth:`save_checkpoint` wrote, except weights already loaded with the model."""
        self.load_state_dict(torch.load(directory / CHECKPOINT_OPTIMIZER_FILE, weights_only=True))

    def close(self) -> None:  # noqa: B027 - a no-op unless the policy holds resources
        """Frees workers or processes the policy started; the in-process student holds none."""


class Pending(ABC, Generic[ResultT]):
    """A result that may still be computing elsewhere (a worker, a thread); :meth:`result` waits for it."""

    @abstractmethod
    def result(self) -> ResultT:
        """The result, once it is ready; raises what computing it raised."""


class Done(Pending[ResultT]):
    """A result computed already (the default ``*_async`` of a backend that cannot run in the background)."""

    def __init__(self, value: ResultT) -> None:
        self.value = value

    def result(self) -> ResultT:
        """The value given."""
        return self.value


class TimedPending(Pending[ResultT]):
    """Another pending result, collected inside ``waiting()`` (a phase timer: the wait counts as that phase)."""

    def __init__(self, pending: Pending[ResultT], waiting: Callable[[], AbstractContextManager[Any]]) -> None:
        self.pending, self.waiting = pending, waiting

    def result(self) -> ResultT:
        """The result, waited for inside ``waiting()``."""
        with self.waiting():
            return self.pending.result()


class MicroBatchScorer:
    """The teacher's answers for a trainer's micro-batches: a :data:`TeacherSignalFn` that can also start them.

    A trainer that has every micro-batch at hand submits them all first, so a teacher pool's replicas work on
    them together. ``submit`` starts one (``TeacherInterface.score_async``, or a :class:`Done`).
    """

    def __init__(self, submit: Callable[[BatchedDataDict], Pending[TeacherSignal]]) -> None:
        self._submit = submit

    def submit(self, micro_batch: BatchedDataDict) -> Pending[TeacherSignal]:
        """Starts scoring ``micro_batch`` and returns its pending answer."""
        return self._submit(micro_batch)

    def __call__(self, micro_batch: BatchedDataDict) -> TeacherSignal:
        """The answer for ``micro_batch``, waited for."""
        return self.submit(micro_batch).result()


class GenerationInterface(ABC):
    """Samples responses from the student.

    Attributes:
        needs_refit: the engine holds its own copy of the weights (vLLM), stale after each optimizer step.
        samples_elsewhere: samples in other processes, so a waiting thread leaves this process's cores free.
    """

    needs_refit: ClassVar[bool] = False
    samples_elsewhere: ClassVar[bool] = False

    @abstractmethod
    def prepare_for_generation(self) -> None:
        """Switches the engine on (eval mode, wake from sleep, ...)."""

    @abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        strategy: GenerateStrategyConfig,
        num_samples: int = 1,
        return_logprobs: bool = True,
    ) -> BatchedDataDict:
        """Samples ``num_samples`` responses per prompt (``return_logprobs=False``: no ``generation_logprobs``).

        Returns:
            ``len(prompts) * num_samples`` rows, a prompt's samples adjacent: right-padded ``input_ids [N, L]``
            (prompt + response), ``input_lengths``, ``prompt_lengths``, ``response_lengths``, ``truncated`` (no EOS),
            all ``[N]``, and ``generation_logprobs [N, L]`` (at each response token's position, 0 elsewhere).
        """

    @abstractmethod
    def finish_generation(self) -> None:
        """Releases what generation held (train mode, sleep, ...)."""

    def generate_async(
        self,
        prompts: list[list[int]],
        strategy: GenerateStrategyConfig,
        num_samples: int = 1,
        return_logprobs: bool = True,
    ) -> Pending[BatchedDataDict]:
        """Starts :meth:`generate` (switched on and off around it) and returns at once where the engine can.

        Calls are served in order, so a later :meth:`refit` does not change this rollout. The default samples first.
        """
        self.prepare_for_generation()
        try:
            return Done(self.generate(prompts, strategy, num_samples, return_logprobs))
        finally:
            self.finish_generation()

    def refit(self, policy: PolicyInterface) -> dict[str, float]:
        """Loads the policy's current weights and returns metrics for the step's log (empty by default)."""
        return {}

    def close(self) -> None:  # noqa: B027 - a no-op unless the engine holds resources
        """Frees the engine's own resources (processes, memory); the default holds none."""


class InProcessGenerationInterface(GenerationInterface):
    """An engine whose weights live in this process, so a refit can hand it tensors (:meth:`load_weights`)."""

    @property
    @abstractmethod
    def weights_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in (a trainer elsewhere casts to it before sending)."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies ``(name, tensor)`` pairs, under the student's parameter names, into the engine's weights: a part of
        the refit :meth:`begin_refit` opened, or a whole refit of its own. The caller may overwrite the tensors'
        memory once this returns (a refit's buffers carry the next bucket)."""

    def begin_refit(self) -> None:
        """Opens a refit whose weights arrive in parts (buckets): work that needs them all waits for
        :meth:`finish_refit`."""

    def finish_refit(self) -> None:
        """Closes the refit :meth:`begin_refit` opened (an engine's post-load processing, cache invalidation)."""


class TeacherInterface(ABC):
    """A model that scores the student's tokens: frozen, or following the student (:mod:`opd.teachers.self_teacher`).

    A following teacher updates in :meth:`follow_student` and checkpoints in :meth:`state_dict`; others no-op.
    """

    @classmethod
    @abstractmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """Why this kind of teacher cannot answer ``request``, or None (a class method: checked before building)."""

    def refusal(self, request: TeacherRequest) -> str | None:
        """This teacher's :meth:`unsupported_reason`; a :class:`PerTeacherRequest` is refused unless overridden."""
        if isinstance(request, PerTeacherRequest):
            return "one teacher answers one signal; a signal per teacher needs several teachers with routing"
        return self.unsupported_reason(request)

    @property
    def student_classes(self) -> torch.Tensor | None:
        """What this teacher's top-k ids name: None, student tokens; else ``[V_student]``, each student id's class.

        Set for a teacher with another tokenizer (:class:`~opd.data.token_alignment.PrefixClasses`); compare
        after pooling the student's logits by it (:func:`~opd.data.token_alignment.pool_logits_by_class`).
        """
        return None

    @abstractmethod
    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """Answers ``request`` for the right-padded (or packed) micro-batch ``data``.

        The signal's shapes are in the module docstring; token log-probs are 0 at position 0.
        """

    def score_async(self, data: BatchedDataDict, request: TeacherRequest) -> Pending[TeacherSignal]:
        """Starts :meth:`score` and returns at once where the teacher can (a pool, a server); the default waits."""
        return Done(self.score(data, request))

    def follow_student(  # noqa: B027 - a no-op unless the teacher follows the student
        self, student: PolicyInterface, version: int, timer: Timer | None = None
    ) -> None:
        """Called after the student's optimizer step ``version`` (1-based), before the next batch is scored.

        An EMA teacher averages the student's weights in (phase ``teacher_update``); others do nothing.
        """

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep of this teacher (an EMA teacher's average); empty by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restores :meth:`state_dict` from a checkpoint (None: the checkpoint kept none).

        Raises:
            OpdError: the checkpoint holds a teacher's state that this teacher does not keep.
        """
        if state:
            raise OpdError(
                "the checkpoint holds the state of a teacher that follows the student (teacher.self_teacher = ema), "
                "which this run's teacher does not keep; use the teacher settings it was written with"
            )

    def close(self) -> None:  # noqa: B027 - a no-op unless the teacher holds resources
        """Frees connections or processes; the default holds none."""
