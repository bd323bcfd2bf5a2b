"""The contracts between the distillation driver and its backends.

``distillation_train`` calls only what these classes declare, as NeMo-RL's ``grpo_train``
does: the trainable student (:class:`PolicyInterface`), the engine that samples from it
(:class:`GenerationInterface`), the teacher (:class:`TeacherInterface`) and the
loss (:class:`LossFunction`). Every backend subclasses its interface, so a missing method
fails when the backend is built, not halfway through a run, and a new backend (a Ray
worker group, a served teacher that sends hidden states, several teachers) plugs in
without the driver changing.

The teacher is asked for one typed *signal*, the one the loss needs:

* :class:`FullVocabRequest`: the whole distribution at every position, as ``[B, L, V]``
  logits or, for the fused loss, final hidden states and the output head
  (:class:`~opd.models.lm_head.LMHeadInput`). A teacher in other processes (a pool, a
  server) sends its final hidden states alone (:class:`TeacherHiddenStates`): the
  receiver holds the teacher's output layer once and binds them to it
  (:func:`bind_teacher_head`), so neither ``[B, L, V]`` logits nor the ``[V, D]`` head
  ever travel with a micro-batch;
* :class:`TopKRequest`: the top-k log-probs and their ids, ``([B, L, k], [B, L, k])``, as a
  :class:`TopKLogprobs` that may also carry the teacher's own rest mass ``[B, L]``;
* :class:`TokenLogprobsRequest`: the log-prob of each token given those before it, ``[B, L]``.

Positions follow the next-token convention everywhere (logits and top-k at position ``t``
describe token ``t + 1``), except token log-probs, which sit at the token's own position.
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
        prefer_hidden_states: the loss can take final hidden states and the head instead of
            logits (the fused loss makes the logits chunk by chunk); a teacher that holds
            its model answers so, any other teacher answers with logits. A teacher in
            other processes answers with :class:`TeacherHiddenStates` either way (every
            full-vocabulary loss takes the head it is bound to).
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
    """A teacher's answer to a :class:`TopKRequest`: the pair ``(log-probs, ids)``, plus its rest mass.

    A 2-tuple, so ``values, ids = answer`` works as for a plain pair; the attribute
    :attr:`rest_logprobs` adds what only the teacher can compute well: log(1 − Σ_k P) at
    each position, taken from its full distribution without subtracting (see
    :mod:`opd.kernels.topk_rest`). A consumer that finds no rest (a plain pair, or None
    here) computes it from the top-k log-probs instead, which is as exact as their own
    rounding allows.

    Attributes:
        logprobs: ``[B, L, k]`` float32 log-probs, normalised over the full vocabulary,
            sorted by probability.
        ids: ``[B, L, k]`` int64 token ids.
        rest_logprobs: ``[B, L]`` float32 log of the mass outside the k ids (−inf where they
            cover the vocabulary), or None when the teacher does not know it.
    """

    rest_logprobs: torch.Tensor | None

    def __new__(
        cls, logprobs: torch.Tensor, ids: torch.Tensor, rest_logprobs: torch.Tensor | None = None
    ) -> TopKLogprobs:
        answer = super().__new__(cls, (logprobs, ids))
        answer.rest_logprobs = rest_logprobs
        return answer

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (a teacher pool sends these between processes): a tuple
        # subclass would otherwise be rebuilt from the pair alone.
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
    """The teacher's log-prob of each token of the sequence, at temperature 1.

    Attributes:
        vocab_size: only the first ``vocab_size`` outputs are real tokens (None: all).
    """

    vocab_size: int | None = None


SingleTeacherRequest = FullVocabRequest | TopKRequest | TokenLogprobsRequest
"""What a loss asks one teacher for."""


@dataclass(frozen=True)
class PerTeacherRequest:
    """Several routed teachers, each asked for its own signal (``teachers.members[i].loss_fn``).

    Only :class:`~opd.teachers.several_teachers.RoutedTeachers` answers it; every
    other teacher refuses it (:meth:`TeacherInterface.refusal`).

    Attributes:
        requests: one request per member, in ``teachers.members`` order.
    """

    requests: tuple[SingleTeacherRequest, ...]


TeacherRequest = SingleTeacherRequest | PerTeacherRequest
"""What a loss asks the teacher for."""


class SeveralTeachersSignal(ABC):
    """The answer of several teachers (:mod:`opd.teachers.several_teachers`).

    Losses built for several teachers read its parts; any other consumer (validation)
    takes :meth:`combined`.

    Attributes:
        seconds: each teacher's scoring time, by name.
    """

    seconds: dict[str, float]

    @abstractmethod
    def combined(self) -> SingleTeacherSignal:
        """One answer of the kind asked for, row by row what the teachers said."""

    @abstractmethod
    def to(self, device: torch.device) -> SeveralTeachersSignal:
        """The same answer with every tensor on ``device`` (a cluster's trainer worker receives it)."""

    @abstractmethod
    def select_rows(self, rows: torch.Tensor, width: int) -> SeveralTeachersSignal:
        """The answer for rows ``rows`` (in that order) of the batch it answers, cut to ``width`` positions.

        A batch scored ahead by an asynchronous schedule is answered whole; each
        micro-batch takes its rows (:func:`~opd.distillation.schedule.signal_rows`).
        """

    @abstractmethod
    def pack(self, lengths: list[int]) -> SeveralTeachersSignal:
        """The answer for right-padded rows laid out like their packed row (``training.sequence_packing``).

        ``lengths`` are the rows' sequence lengths, in row order (the packed row's segments).
        """


@dataclass(frozen=True)
class TeacherHiddenStates:
    """A teacher's full-vocabulary answer as it travels between processes: its final hidden states alone.

    The exact signal of every teacher that runs apart from the loss (a teacher pool, a
    served teacher on a cluster, a batch scored ahead on a cluster). Its output layer
    does not travel with it: the side that computes the loss loaded that layer once and
    binds the hidden states to it (:meth:`bind`), and the fused loss then makes the
    teacher's logits chunk by chunk, as for an in-process teacher.

    Attributes:
        hidden_states: ``[B, L, D]`` hidden states after the teacher's final norm (the
            positions follow the next-token convention, like logits), in the teacher's
            dtype or the wire's.
    """

    hidden_states: torch.Tensor

    def bind(self, layer: OutputLayer) -> LMHeadInput:
        """The hidden states over the teacher's output ``layer``, on its device and in its dtype."""
        weight = layer.weight
        return layer.over(self.hidden_states.to(device=weight.device, dtype=weight.dtype))

    def rows(self, rows: torch.Tensor, width: int) -> TeacherHiddenStates:
        """The hidden states of ``rows``, cut to the first ``width`` positions."""
        return TeacherHiddenStates(self.hidden_states[rows, :width])


def bind_teacher_head(signal: TeacherSignal, layer: OutputLayer | None, holder: str = "this process") -> TeacherSignal:
    """``signal`` with its hidden states bound to the teacher's output layer; other signals as they are.

    Args:
        signal: a teacher's answer, as received.
        layer: the teacher's output layer where the loss runs, or None when none was loaded.
        holder: who should hold the layer, for the error.

    Raises:
        ValueError: hidden states arrived where no output layer was loaded.
    """
    if not isinstance(signal, TeacherHiddenStates):
        return signal
    if layer is None:
        raise ValueError(
            f"the teacher sent its final hidden states, but {holder} holds no copy of the teacher's output layer "
            "to make its logits with"
        )
    return signal.bind(layer)


@dataclass(frozen=True)
class AnsweredWhereTrained:
    """The answer of a teacher that lives in the trainer's own workers: computed there, per micro-batch.

    A colocated cluster teacher (:class:`~opd.distributed.colocated_teacher.TeacherInTrainerWorkers`)
    answers the driver with this: each trainer worker then scores the micro-batch with the
    teacher it holds, where the student's hidden states are, so that a full-vocabulary
    answer never leaves the device.
    """

    request: TeacherRequest

    def to(self, device: torch.device) -> AnsweredWhereTrained:
        """Itself: nothing to move (the answer is made where the micro-batch is)."""
        return self


SingleTeacherSignal = (
    torch.Tensor | LMHeadInput | TeacherHiddenStates | tuple[torch.Tensor, torch.Tensor] | AnsweredWhereTrained
)
"""One teacher's answer (see :data:`TeacherSignal`)."""

TeacherSignal = SingleTeacherSignal | SeveralTeachersSignal
"""A teacher's answer: logits or token log-probs, hidden states and head (or hidden states
alone, :class:`TeacherHiddenStates`, from a teacher in other processes), or top-k (log-probs, ids)
(a :class:`TopKLogprobs` when the teacher sends its rest mass too); several teachers answer
with a :class:`SeveralTeachersSignal`; a teacher in the trainer's workers with
:class:`AnsweredWhereTrained`."""


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
"""Scores one micro-batch (the driver binds the teacher, the request and its timer): a plain
function, or a :class:`MicroBatchScorer` that can also start many at once."""


# --------------------------------------------------------------------------- loss


class LossFunction(ABC):
    """Computes a micro-batch's share of the global-batch loss.

    A loss function is called once per micro-batch. It receives the counts of valid tokens
    and sequences in the *whole global batch*, so that it can normalise by them: the sum
    of the micro-batch losses is then exactly the loss of one big batch, and gradient
    accumulation changes nothing but memory.

    Attributes:
        fused_lm_head: the loss takes the student's final hidden states and head
            (:class:`~opd.models.lm_head.LMHeadInput`) instead of ``[B, L, V]`` logits.
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
        """The step's metrics from their sum over micro-batches (and ranks); as they are by default.

        A loss whose metric is a ratio of two sums (several teachers: a teacher's mean KL
        over its own tokens) reports both sums per micro-batch and divides them here.
        """
        return metrics

    @abstractmethod
    def __call__(
        self,
        student_output: Any,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_output: Any = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns the loss (already divided by the global normaliser) and metrics.

        ``student_output`` is the student's ``[B, L, V]`` logits, or an
        :class:`~opd.models.lm_head.LMHeadInput` when ``fused_lm_head`` is set.
        ``teacher_output`` is the teacher's answer to ``teacher_request``. Metrics are
        global-normalised contributions too, so the trainer sums them over micro-batches.
        """


class TeacherComparison(ABC):
    """Per-token sums that compare the student with the teacher (validation's KL), without gradient.

    A policy calls it once per micro-batch, where the student's final hidden states are
    (:meth:`PolicyInterface.compare_with_teacher`); the sums of all micro-batches are
    added up, so only a few numbers leave the process that holds the logits.

    Attributes:
        teacher_request: what the comparison needs from the teacher.
    """

    teacher_request: TeacherRequest

    @abstractmethod
    def __call__(self, student: LMHeadInput, teacher_output: TeacherSignal, data: BatchedDataDict) -> dict[str, float]:
        """Sums over ``data``'s loss tokens.

        ``student`` holds the ``[B, L, D]`` final hidden states and the output layer (its
        logit transform included); ``teacher_output`` is the teacher's answer to
        :attr:`teacher_request` for ``data``; both on the same device.
        """


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
            teacher_signal: scores a micro-batch with the teacher (the driver passes a
                :class:`MicroBatchScorer`, which a trainer may also use to start many
                micro-batches at once); None when the loss needs no teacher.
            timer: the step's phase clock. A trainer that times phases of its own (a
                distributed trainer's colocated teacher, its dispatch, its ranks' compute)
                adds them here; the driver logs every phase as ``timing/<phase>``.

        Returns:
            Global-batch metrics: the loss function's, summed over micro-batches, plus
            ``grad_norm``, ``lr`` and ``skipped_nonfinite``.
        """

    @abstractmethod
    def compare_with_teacher(
        self, data: BatchedDataDict, comparison: TeacherComparison, teacher_signal: TeacherSignalFn
    ) -> dict[str, float]:
        """Sums of ``comparison`` over ``data``, computed where the student's hidden states are (validation).

        The student runs forward without gradient, micro-batch by micro-batch, up to its
        final hidden states; ``comparison`` gets them with the output layer and the
        teacher's answer to ``comparison.teacher_request`` for the same micro-batch, and
        returns sums. Only the sums come back: the student's ``[B, L, V]`` logits never
        exist at once, and never cross a process boundary.

        Args:
            data: right-padded batch with ``input_ids``, ``input_lengths``, ``token_mask``.
            comparison: the per-micro-batch sums (validation's KL to the teacher).
            teacher_signal: scores a micro-batch with the teacher; a trainer whose workers
                hold the teacher (colocated) scores there instead, as in :meth:`train`.

        Returns:
            Each of the comparison's sums, over every micro-batch (and rank).
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
        """Writes the student's part of a checkpoint into ``directory``.

        By default the weights as a Hugging Face model directory (``policy/``) and the
        optimizer and schedule (``optimizer.pt``); a sharded trainer writes its shards.
        """
        self.save_pretrained(str(directory / CHECKPOINT_POLICY_DIR), tokenizer=tokenizer)
        torch.save(self.state_dict(), directory / CHECKPOINT_OPTIMIZER_FILE)

    def load_checkpoint(self, directory: Path) -> None:
        """Restores what :meth:`save_checkpoint` wrote, except weights that were loaded with the model.

        The default restores the optimizer and schedule (``weights_only=True``); the
        in-process student was loaded from ``policy/`` already.
        """
        self.load_state_dict(torch.load(directory / CHECKPOINT_OPTIMIZER_FILE, weights_only=True))

    def close(self) -> None:  # noqa: B027 - a no-op unless the policy holds resources
        """Frees workers or processes the policy started; the in-process student holds none."""


class Pending(ABC, Generic[ResultT]):
    """A result that may still be computing elsewhere (a worker, a thread); :meth:`result` waits for it.

    Asynchronous schedules (:mod:`opd.distillation.schedule`) start a rollout or a
    teacher's scoring with ``generate_async`` / ``score_async`` and collect it later.
    """

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
    """Another pending result, collected inside ``waiting()`` (a phase timer: the wait counts as that phase).

    Args:
        pending: the result being computed.
        waiting: makes the context that the wait runs in.
    """

    def __init__(self, pending: Pending[ResultT], waiting: Callable[[], AbstractContextManager[Any]]) -> None:
        self.pending, self.waiting = pending, waiting

    def result(self) -> ResultT:
        """The result, waited for inside ``waiting()``."""
        with self.waiting():
            return self.pending.result()


class MicroBatchScorer:
    """The teacher's answers for a trainer's micro-batches: a :data:`TeacherSignalFn` that can also start them.

    The driver builds one per step (binding the teacher, the loss's request and its
    timer) and hands it to :meth:`PolicyInterface.train`. Called, it answers one
    micro-batch. :meth:`submit` starts one and returns while the teacher scores: a
    trainer that has every micro-batch at hand before it computes (the distributed one)
    submits them all first and collects the answers afterwards, so a teacher in other
    processes (the replicas of a pool) works on all of them together.

    Args:
        submit: starts scoring a micro-batch (``TeacherInterface.score_async``, or an
            answer already at hand as a :class:`Done`).
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
        needs_refit: the engine holds its own copy of the weights (vLLM), which goes
            stale after each optimizer step; False when it samples with the trained model.
        samples_elsewhere: the engine samples in other processes (rollout workers), so a
            caller's thread that waits on it leaves this process's cores to the trainer.
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
        """Samples ``num_samples`` responses per prompt.

        ``return_logprobs=False`` tells the engine that nobody needs the sampler's
        log-probs (the batch then has no ``generation_logprobs``), so it may skip them.

        Returns:
            A batch of ``len(prompts) * num_samples`` rows (samples of one prompt are
            adjacent) with right-padded ``input_ids [N, L]`` (prompt + response),
            ``input_lengths [N]``, ``prompt_lengths [N]``, ``response_lengths [N]``,
            ``generation_logprobs [N, L]`` (the sampler's log-prob of each response
            token at that token's position, 0 elsewhere) and ``truncated [N]`` (no EOS).
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
        """Starts :meth:`generate` (switched on and off around it) and returns at once, where the engine can.

        Engines in other processes (rollout workers) sample while the caller goes on;
        this default samples before returning. Calls are served in the order they are
        made, so a :meth:`refit` made after this call does not change this rollout.
        """
        self.prepare_for_generation()
        try:
            return Done(self.generate(prompts, strategy, num_samples, return_logprobs))
        finally:
            self.finish_generation()

    def refit(self, policy: PolicyInterface) -> dict[str, float]:
        """Loads the policy's current weights; engines that sample with the policy itself need nothing.

        Returns:
            Metrics of the refit for the step's log (an engine in other processes reports
            ``refit/bytes`` and ``refit/bytes_delivered``); empty by default.
        """
        return {}

    def close(self) -> None:  # noqa: B027 - a no-op unless the engine holds resources
        """Frees the engine's own resources (processes, memory); the default holds none."""


class InProcessGenerationInterface(GenerationInterface):
    """An engine whose weights live in this process, so a refit can hand it tensors.

    The rollout workers hold one each and load what the trainer sends through
    :meth:`load_weights`; a pool of rollout workers (which refits its workers itself) is a
    plain :class:`GenerationInterface`.
    """

    @property
    @abstractmethod
    def weights_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in (a trainer elsewhere casts to it before sending)."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies ``(name, tensor)`` pairs, under the student's parameter names, into the engine's weights."""


class TeacherInterface(ABC):
    """A model that scores the student's tokens: frozen, or following the student (self-distillation).

    A teacher whose weights change during the run (an EMA of the student's,
    :mod:`opd.teachers.self_teacher`) takes each update in :meth:`follow_student`,
    which the driver calls after every optimizer step, and keeps what a resumed run needs
    in :meth:`state_dict`; for every other teacher both are no-ops.
    """

    @classmethod
    @abstractmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """Why this kind of teacher cannot answer ``request``, or None when it can.

        A class method, so that a config can be checked before any teacher is built.
        """

    def refusal(self, request: TeacherRequest) -> str | None:
        """This teacher's :meth:`unsupported_reason` for ``request`` (a wrapper asks what it wraps).

        One teacher answers one signal: a :class:`PerTeacherRequest` is refused unless a
        subclass that holds several teachers says otherwise.
        """
        if isinstance(request, PerTeacherRequest):
            return "one teacher answers one signal; a signal per teacher needs several teachers with routing"
        return self.unsupported_reason(request)

    @property
    def student_classes(self) -> torch.Tensor | None:
        """What the ids of this teacher's top-k answers name: None, student tokens; else classes of them.

        A teacher with another tokenizer names classes of student tokens
        (:class:`~opd.data.token_alignment.PrefixClasses`): ``[V_student]``, the class
        (root id) of each student id. Whoever compares the student with such an answer
        pools the student's logits by it first (:func:`~opd.data.token_alignment.pool_logits_by_class`).
        """
        return None

    @abstractmethod
    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """Answers ``request`` for the right-padded (or packed) micro-batch ``data``.

        Returns:
            ``[B, L, V]`` logits or an :class:`~opd.models.lm_head.LMHeadInput` for a
            :class:`FullVocabRequest` (a teacher in other processes: :class:`TeacherHiddenStates`);
            ``([B, L, k] float32 log-probs, [B, L, k] int64 ids)`` sorted by probability
            for a :class:`TopKRequest` (a :class:`TopKLogprobs`, with the rest mass where
            the teacher knows it); ``[B, L]`` log-probs (0 at position 0) for a
            :class:`TokenLogprobsRequest`.
        """

    def score_async(self, data: BatchedDataDict, request: TeacherRequest) -> Pending[TeacherSignal]:
        """Starts :meth:`score` and returns at once, where the teacher can (a pool, a server).

        The default scores before returning.
        """
        return Done(self.score(data, request))

    def follow_student(  # noqa: B027 - a no-op unless the teacher follows the student
        self, student: PolicyInterface, version: int, timer: Timer | None = None
    ) -> None:
        """After the student's optimizer step ``version`` (1-based): a teacher that follows the student updates.

        Called once per step, right after the student's update and before anything scores
        the next batch. An EMA teacher averages the student's weights in (timed as the
        phase ``teacher_update`` on ``timer``); a frozen teacher, and one that scores with
        the student's module itself, do nothing.
        """

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep of this teacher (an EMA teacher's average); empty by default.

        A teacher whose weights are loaded at start (frozen, served, the live student) has none.
        """
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
