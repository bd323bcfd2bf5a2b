"""When each step's batch is sampled and scored: ``training.scheduler`` (sync, one-step-off, two-step-off).

The driver asks :meth:`RolloutSchedule.next_batch` for the batch of the step it is about
to train, and gets it with its rollout, its teacher signal (when scored ahead) and the
time it waited. The schedule decides what runs while the student trains (as verl's
asynchronous on-policy distillation recipe does). With policy version ``v`` = the number of
optimizer steps taken so far, step ``t`` (1-based) updates ``v = t − 1`` to ``t``:

* ``sync`` (depth 0): step t's rollout is sampled at the start of step t, with the
  weights being trained (version t − 1); nothing overlaps.
* ``one_step_off`` (depth 1): during update t the rollout workers sample batch t + 1 with
  the weights from before update t (version t − 1), so batch t + 1 trains on version t
  one step stale. The weight sync to the rollout workers happens while the teacher scores
  batch t. Warm-up: the first batch is sampled in step 1 with the initial weights.
* ``two_step_off`` (depth 2): during update t the rollout workers sample batch t + 2 (with
  version t − 1) and the teacher scores batch t + 1, so the teacher's time also hides
  behind the update; samples are two steps stale. Warm-up: the first two batches are
  sampled in step 1 with the initial weights. For a full-vocabulary loss the batch scored
  ahead carries the teacher's final hidden states (with its head in one process, alone
  from a teacher in other processes: the trainer workers bind them to the head they hold).

Every batch records ``sampled_version``, the version its rollout was sampled with; the
step's ``staleness`` is ``v − sampled_version``. Rollouts and teacher scores run in the
background where the backend can (:meth:`GenerationInterface.generate_async`,
:meth:`TeacherInterface.score_async`: Ray workers, a served teacher); in one process the
same schedule runs its phases one after another and draws the same samples.

The λ coin of a step is flipped when its batch is started (one or two steps early under
an asynchronous schedule); a fixed-data step needs no rollout.

Checkpoints keep what is in flight (:meth:`RolloutSchedule.state_dict`): the batches
started but not yet trained, with their rollouts and teacher signals, so a resumed run
trains exactly the samples the uninterrupted run would have, none lost or repeated. A
batch's hidden states are not saved (``[B, L, D]`` per batch would outweigh the
checkpoint): the frozen teacher scores that batch again after the resume.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.batches import attach_teacher_fields, build_fixed_data_batch
from opd.data.dataloaders import PreparedExample
from opd.data.sequences import build_token_mask, pack_rows
from opd.distillation.config import DEPTHS, MasterConfig
from opd.models.interfaces import (
    FullVocabRequest,
    GenerationInterface,
    LossFunction,
    Pending,
    PerTeacherRequest,
    PolicyInterface,
    SeveralTeachersSignal,
    SingleTeacherSignal,
    TeacherHiddenStates,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TopKLogprobs,
)
from opd.models.lm_head import LMHeadInput
from opd.rollout.environments.config import build_environment
from opd.rollout.environments.math_verifier import grade_responses
from opd.rollout.environments.turn_template import TurnTemplate
from opd.rollout.multi_turn import MultiTurnRollout, multi_turn_rollout
from opd.teachers.several_teachers import MixedSignal, RoutedPart, RoutedSignal
from opd.utils.errors import ConfigError

NextExamples = Callable[[], list[PreparedExample]]
"""Draws the next batch of prompts from the training data (across epochs)."""


@dataclass
class ScheduledBatch:
    """One step's training input, as the schedule hands it to the driver.

    Attributes:
        batch: the rollout (or fixed-data) batch with ``token_mask`` (and ``task_reward``,
            ``staleness``, ``sample_index`` where they apply).
        examples: the prompts it was made from.
        on_policy: whether the λ coin chose the student's own samples.
        sampled_version: the policy version the rollout was sampled with (None for fixed data).
        staleness: optimizer steps between sampling and this update (None for fixed data).
        teacher_signal: the whole batch's teacher signal when it was scored ahead, else
            None (the trainer then scores each micro-batch itself).
        seconds: the time the controller spent on this step's inputs, by phase.
        refit_metrics: what the step's weight syncs moved (``refit/bytes``,
            ``refit/bytes_delivered``, summed over the step's syncs); empty without one.
        rollout_metrics: a multi-turn rollout's episode metrics (``env/...``); empty otherwise.
    """

    batch: BatchedDataDict
    examples: list[PreparedExample]
    on_policy: bool
    sampled_version: int | None
    staleness: int | None
    teacher_signal: TeacherSignal | None
    seconds: dict[str, float]
    refit_metrics: dict[str, float] = field(default_factory=dict)
    rollout_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Slot:
    """A batch started but not yet trained."""

    examples: list[PreparedExample]
    on_policy: bool
    sampled_version: int | None
    rollout: Pending[Any] | None = None  # running or done; None once collected
    finish: Callable[[Any], BatchedDataDict] | None = None  # makes the collected rollout a training batch
    batch: BatchedDataDict | None = None  # the collected training batch
    teacher: Pending[TeacherSignal] | None = None
    teacher_signal: TeacherSignal | None = None
    teacher_started: bool = False
    rollout_metrics: dict[str, float] = field(default_factory=dict)  # a multi-turn rollout's episode metrics


class RolloutSchedule:
    """Starts rollouts and teacher scores ahead of the update, as ``training.scheduler`` says.

    Args:
        scheduler: ``sync``, ``one_step_off`` or ``two_step_off``.
        generation: samples from the student (a :class:`GenerationInterface`).
        teacher: scores batches ahead when the schedule asks (top-k and token signals).
        policy: the student, the source of every weight sync.
        loss_fn: says what the teacher must send and whether the sampler's log-probs are read.
        tokenizer: pads fixed-data batches and grades answers for a task reward.
        config: the run config (λ, sampling, masking).
        lambda_coin: the λ coin (checkpointed by the training loop).
        sampler_logprobs: ask the engine for the sampler's log-probs even when the loss
            does not read them (the off-policy correction and its metrics do).
    """

    def __init__(
        self,
        scheduler: str,
        generation: GenerationInterface,
        teacher: TeacherInterface,
        policy: PolicyInterface,
        loss_fn: LossFunction,
        tokenizer: Any,
        config: MasterConfig,
        lambda_coin: Any,
        sampler_logprobs: bool = False,
    ) -> None:
        self.depth = DEPTHS[scheduler]
        self.generation, self.teacher, self.policy = generation, teacher, policy
        self.loss_fn, self.tokenizer, self.config, self.lambda_coin = loss_fn, tokenizer, config, lambda_coin
        self.return_logprobs = loss_fn.needs_sampler_logprobs or sampler_logprobs
        request = loss_fn.teacher_request
        # Top-k and token signals are small enough to score a whole batch ahead; the full
        # vocabulary is scored by the trainer, micro-batch by micro-batch, as in sync,
        # unless the schedule must score the next batch during the update (two_step_off).
        # Several routed teachers of which one asks for the full vocabulary score at the step.
        full_vocab = isinstance(request, FullVocabRequest)
        self.scores_ahead = (
            self.depth > 0
            and request is not None
            and not _routes_full_vocab(request)
            and (self.depth == 2 or not full_vocab)
        )
        # A whole batch's full vocabulary is scored ahead as final hidden states, never as logits.
        self.ahead_request = FullVocabRequest(prefer_hidden_states=True) if full_vocab else request
        self.queue: deque[_Slot] = deque()
        self.rollout_version: int | None = None
        """The policy version the engine's weights are (None: not known, refit before sampling)."""
        self.refit_metrics: dict[str, float] = {}
        """What the weight syncs timed for the step being prepared moved (handed to its :class:`ScheduledBatch`)."""
        self.environment = build_environment(config.environment) if config.environment is not None else None
        """Multi-turn rollouts' environment (``environment:``), or None for one turn per rollout."""
        self._episodes: ThreadPoolExecutor | None = None
        """Runs multi-turn rollouts in the background (asynchronous schedules, engines in other processes)."""
        self._episodes_in_flight: list[Future[Any]] = []

    @property
    def asynchronous(self) -> bool:
        """Whether rollouts are sampled ahead of the update."""
        return self.depth > 0

    @property
    def ahead(self) -> int:
        """Batches drawn from the data but not yet trained."""
        return len(self.queue)

    # ------------------------------------------------------------------ the step

    def next_batch(self, next_examples: NextExamples, version: int) -> ScheduledBatch:
        """The batch to train at policy version ``version``, after starting the rollouts due now.

        Args:
            next_examples: draws the next batch of prompts from the data.
            version: optimizer steps taken so far.
        """
        seconds: dict[str, float] = {}
        if not self.queue:  # sync, or the first step of an asynchronous run
            self.queue.append(self._start(next_examples(), version, seconds, version + 1 + len(self.queue)))
        current = self.queue[0]
        self._collect(current, seconds)
        if self.depth == 2:
            if len(self.queue) < 2:  # warm-up: the second batch, with the initial weights too
                self.queue.append(self._start(next_examples(), version, seconds, version + 1 + len(self.queue)))
            self._collect(self.queue[1], seconds)  # its teacher now scores while the student trains
        while len(self.queue) < self.depth + 1:  # sampled with the weights of now, trained later
            self.queue.append(self._start(next_examples(), version, seconds, version + 1 + len(self.queue)))
        teacher_signal = None
        if current.teacher is not None:
            start = time.perf_counter()
            teacher_signal = current.teacher.result()
            seconds["wait_prev_teacher"] = seconds.get("wait_prev_teacher", 0.0) + time.perf_counter() - start
            current.teacher = None
        elif current.teacher_signal is not None:  # restored from a checkpoint
            teacher_signal = current.teacher_signal
        self.queue.popleft()
        assert current.batch is not None  # collected above
        return self._scheduled(current, version, teacher_signal, seconds)

    def sync_weights(self, version: int, seconds: dict[str, float] | None = None) -> None:
        """Loads the policy's weights (version ``version``) into the engine, if it holds others."""
        if not self.generation.needs_refit or self.rollout_version == version:
            return
        start = time.perf_counter()
        # A multi-turn rollout still running samples each turn with the weights it started
        # with: the engine is refit only once its episodes are done.
        for episodes in self._episodes_in_flight:
            episodes.result()
        self._episodes_in_flight.clear()
        moved = self.generation.refit(self.policy)
        self.rollout_version = version
        if seconds is not None:
            key = "sync_rollout_weights" if self.asynchronous else "refit"
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start
            for name, value in moved.items():
                self.refit_metrics[name] = self.refit_metrics.get(name, 0.0) + value

    def refresh_for_validation(self, version: int) -> None:
        """Before validation samples: rollouts in flight finish (and are kept), then the engine gets ``version``."""
        self._drain()
        self.sync_weights(version)

    def _start(self, examples: list[PreparedExample], version: int, seconds: dict[str, float], step: int) -> _Slot:
        """Flips the λ coin of optimizer step ``step`` (the batch's place in the queue says which) and starts
        its rollout (synced to ``version`` first) or builds its fixed data."""
        on_policy = self.lambda_coin.random() < self.config.distillation.lambda_at(step)
        if not on_policy:
            slot = _Slot(examples, False, None)
            slot.batch = build_fixed_data_batch(
                examples, self.tokenizer.pad_token_id, self.config.distillation.mask_prompt_tokens
            )
            self._start_teacher(slot)
            return slot
        self.sync_weights(version, seconds)
        distillation = self.config.distillation
        if self.environment is not None:
            return self._start_multi_turn(examples, version, seconds)
        start = time.perf_counter()
        rollout = self.generation.generate_async(
            [example["prompt_ids"] for example in examples],
            distillation.generate_strategy,
            distillation.num_samples_per_prompt,
            return_logprobs=self.return_logprobs,
        )
        if not self.asynchronous:
            # In sync the rollout is the step's generation phase: it is collected at once.
            slot = _Slot(examples, True, version, batch=self._finish_rollout(rollout.result(), examples))
            seconds["generation"] = seconds.get("generation", 0.0) + time.perf_counter() - start
            return slot
        return _Slot(examples, True, version, rollout=rollout, finish=lambda raw: self._finish_rollout(raw, examples))

    def _start_multi_turn(self, examples: list[PreparedExample], version: int, seconds: dict[str, float]) -> _Slot:
        """Starts a multi-turn rollout (:mod:`opd.rollout.multi_turn`); its batch is built when it is collected.

        Every turn is a ``generate`` call, so any engine serves it. Under an asynchronous
        schedule with an engine in other processes (rollout workers), the whole episode
        loop runs on a background thread while the student trains, as a single-turn
        rollout does on the workers; the engine is not refit until it ends
        (:meth:`sync_weights`). Otherwise it runs to its end now.
        """
        assert self.environment is not None and self.config.environment is not None
        missing = [index for index, example in enumerate(examples) if "prompt_messages" not in example]
        if missing:
            raise ValueError("multi-turn rollouts need each example's prompt_messages (prepare_examples with tools)")
        slot = _Slot(examples, True, version, finish=lambda raw: self._finish_multi_turn(raw, slot))
        if self.asynchronous and self.generation.samples_elsewhere:
            if self._episodes is None:
                self._episodes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opd-episodes")
            future = self._episodes.submit(self._run_episodes, examples)
            self._episodes_in_flight.append(future)
            slot.rollout = _FromThread(future)
            return slot
        start = time.perf_counter()
        rollout = self._run_episodes(examples)
        slot.rollout = None
        slot.batch = self._finish_multi_turn(rollout, slot)
        rollout_seconds = time.perf_counter() - start
        environment_seconds = slot.rollout_metrics.get("timing/environment", 0.0)
        seconds["environment"] = seconds.get("environment", 0.0) + environment_seconds
        seconds["generation"] = seconds.get("generation", 0.0) + rollout_seconds - environment_seconds
        slot.rollout_metrics.pop("timing/environment", None)
        self._start_teacher(slot)
        return slot

    def _run_episodes(self, examples: list[PreparedExample]) -> MultiTurnRollout:
        """The episodes of ``examples``, turn by turn, with the engine switched on around them."""
        environment, config = self.environment, self.config
        assert environment is not None and config.environment is not None
        distillation = config.distillation
        self.generation.prepare_for_generation()
        try:
            return multi_turn_rollout(
                self.generation,
                environment,
                TurnTemplate(self.tokenizer, environment.tool_schemas()),
                [{"ground_truth": example["ground_truth"]} for example in examples],
                [example["prompt_messages"] for example in examples],
                distillation.generate_strategy,
                config.environment.max_turns,
                self.tokenizer.pad_token_id,
                distillation.num_samples_per_prompt,
                self.return_logprobs,
                max_episode_tokens=config.environment.max_episode_tokens,
            )
        finally:
            self.generation.finish_generation()

    def _finish_multi_turn(self, rollout: MultiTurnRollout, slot: _Slot) -> BatchedDataDict:
        """A multi-turn rollout made a training batch (its own mask kept); its episode metrics go on the slot."""
        slot.rollout_metrics = rollout.metrics()
        batch = rollout.batch
        attach_teacher_fields(batch, slot.examples, self.config.distillation.num_samples_per_prompt)
        if self.loss_fn.needs_task_reward:
            batch["task_reward"] = torch.nan_to_num(rollout.rewards(), nan=0.0)
        return batch

    def _collect(self, slot: _Slot, seconds: dict[str, float]) -> None:
        """Waits for a slot's rollout (timed as ``wait_prev_gen``) and starts its teacher."""
        if slot.rollout is not None:
            start = time.perf_counter()
            raw = slot.rollout.result()
            seconds["wait_prev_gen"] = seconds.get("wait_prev_gen", 0.0) + time.perf_counter() - start
            assert slot.finish is not None  # every started rollout has one
            slot.batch = slot.finish(raw)
            slot.rollout = None
            environment_seconds = slot.rollout_metrics.pop("timing/environment", None)
            if environment_seconds is not None:  # spent in the background thread, beside the update
                seconds["environment"] = seconds.get("environment", 0.0) + environment_seconds
        self._start_teacher(slot)

    def _start_teacher(self, slot: _Slot) -> None:
        if self.scores_ahead and not slot.teacher_started and slot.batch is not None:
            request = self.ahead_request
            assert request is not None  # scores_ahead implies a request
            slot.teacher = self.teacher.score_async(slot.batch, request)
            slot.teacher_started = True

    def _finish_rollout(self, batch: BatchedDataDict, examples: list[PreparedExample]) -> BatchedDataDict:
        """A rollout made a training batch: its loss mask, the teacher's prompts, a task reward."""
        distillation = self.config.distillation
        batch["token_mask"] = build_token_mask(
            batch["input_lengths"],
            batch["prompt_lengths"],
            batch["input_ids"].shape[1],
            distillation.mask_prompt_tokens,
        )
        attach_teacher_fields(batch, examples, distillation.num_samples_per_prompt)
        if self.loss_fn.needs_task_reward:
            batch["task_reward"] = task_rewards(batch, examples, distillation.num_samples_per_prompt, self.tokenizer)
        return batch

    def _scheduled(
        self, slot: _Slot, version: int, teacher_signal: TeacherSignal | None, seconds: dict[str, float]
    ) -> ScheduledBatch:
        batch = slot.batch
        assert batch is not None
        staleness = version - slot.sampled_version if slot.sampled_version is not None else None
        if staleness is not None and self.asynchronous:
            batch["staleness"] = torch.full((batch.size,), staleness, dtype=torch.long)
        if teacher_signal is not None:
            batch["sample_index"] = torch.arange(batch.size)  # micro-batches find their rows of the signal
        refit_metrics, self.refit_metrics = self.refit_metrics, {}
        return ScheduledBatch(
            batch,
            slot.examples,
            slot.on_policy,
            slot.sampled_version,
            staleness,
            teacher_signal,
            seconds,
            refit_metrics,
            slot.rollout_metrics,
        )

    def _drain(self) -> None:
        """Collects every rollout and teacher score in flight (results are kept for their steps)."""
        for slot in self.queue:
            self._collect(slot, {})
            if slot.teacher is not None:
                slot.teacher_signal = slot.teacher.result()
                slot.teacher = None

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The batches in flight, collected, as plain tensors and lists (``torch.load(weights_only=True)``)."""
        self._drain()
        return {
            "depth": self.depth,
            "slots": [
                {
                    "examples": slot.examples,
                    "on_policy": slot.on_policy,
                    "sampled_version": slot.sampled_version,
                    "batch": dict(slot.batch) if slot.batch is not None else None,
                    "rollout_metrics": slot.rollout_metrics,
                    **_teacher_state(slot),
                }
                for slot in self.queue
            ],
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restores the batches in flight of a checkpoint; the engine is refit before its next rollout.

        Raises:
            ConfigError: the checkpoint was written under another ``training.scheduler``
                with batches in flight.
        """
        self.queue.clear()
        self.rollout_version = None
        if state is None or not state["slots"]:
            return
        if state["depth"] != self.depth:
            names = {depth: name for name, depth in DEPTHS.items()}
            raise ConfigError(
                f"the checkpoint was written with training.scheduler = {names[state['depth']]} and has batches "
                f"in flight; resume it with that scheduler (this run has {names[self.depth]})"
            )
        for saved in state["slots"]:
            slot = _Slot(saved["examples"], saved["on_policy"], saved["sampled_version"])
            slot.batch = BatchedDataDict(saved["batch"]) if saved["batch"] is not None else None
            slot.teacher_signal = _signal_from_state(saved["teacher_signal"])
            slot.teacher_started = saved["teacher_started"]
            slot.rollout_metrics = saved.get("rollout_metrics", {})
            self.queue.append(slot)


class _FromThread(Pending[Any]):
    """A result computed on a background thread (a multi-turn rollout running beside the update)."""

    def __init__(self, future: Future[Any]) -> None:
        self.future = future

    def result(self) -> Any:
        """Waits for the thread's result; raises what it raised."""
        return self.future.result()


def _teacher_state(slot: _Slot) -> dict[str, Any]:
    """A slot's teacher signal for a checkpoint; hidden states are left out, and the batch scored again on resume.

    A mixture of members that sent hidden states alone (mixed where their heads are) is left out too.
    """
    signal = slot.teacher_signal
    unmixed = isinstance(signal, MixedSignal) and signal.mixed is None
    if _holds_hidden_states(signal) or unmixed:
        return {"teacher_signal": None, "teacher_started": False}
    return {"teacher_signal": _signal_to_state(slot.teacher_signal), "teacher_started": slot.teacher_started}


def _holds_hidden_states(signal: TeacherSignal | None) -> bool:
    """Whether ``signal``, or any teacher's part of it (routing, a mixture), is hidden states."""
    if isinstance(signal, RoutedSignal):
        return any(_holds_hidden_states(part.signal) for part in signal.parts)
    if isinstance(signal, MixedSignal):
        return any(_holds_hidden_states(member) for member in (signal.mixed, *signal.members))
    return isinstance(signal, (LMHeadInput, TeacherHiddenStates))


def _routes_full_vocab(request: TeacherRequest) -> bool:
    """Whether ``request`` routes rows to several teachers of which one asks for the full vocabulary."""
    return isinstance(request, PerTeacherRequest) and any(
        isinstance(part, FullVocabRequest) for part in request.requests
    )


def _signal_to_state(signal: TeacherSignal | None) -> dict[str, Any] | None:
    """A top-k or token signal as plain tensors (checkpoints are loaded with ``weights_only``).

    Several teachers' answers keep their parts (routing: each member's rows and answer;
    mixture: the mixture, each member's answer and the weights).
    """
    if signal is None:
        return None
    if isinstance(signal, RoutedSignal):
        parts = [
            {"teacher": part.teacher, "rows": part.rows, "signal": _signal_to_state(part.signal)}
            for part in signal.parts
        ]
        return {"kind": "routed", "parts": parts, "batch_size": signal.batch_size}
    if isinstance(signal, MixedSignal):
        return {
            "kind": "mixed",
            "mixed": _signal_to_state(signal.mixed),
            "members": [_signal_to_state(member) for member in signal.members],
            "weights": signal.weights,
        }
    if isinstance(signal, TopKLogprobs):
        return {"kind": "topk", "logprobs": signal.logprobs, "ids": signal.ids, "rest": signal.rest_logprobs}
    if isinstance(signal, tuple):
        return {"kind": "tuple", "parts": list(signal)}
    assert isinstance(signal, torch.Tensor)  # token log-probs (hidden states are not saved: _teacher_state)
    return {"kind": "tensor", "value": signal}


def _signal_from_state(state: dict[str, Any] | None) -> TeacherSignal | None:
    if state is None:
        return None
    if state["kind"] == "routed":
        parts = [RoutedPart(part["teacher"], part["rows"], _single(part["signal"])) for part in state["parts"]]
        return RoutedSignal(parts, state["batch_size"])
    if state["kind"] == "mixed":
        members = [_single(member) for member in state["members"]]
        return MixedSignal(_single(state["mixed"]), members, state["weights"])
    if state["kind"] == "topk":
        return TopKLogprobs(state["logprobs"], state["ids"], state["rest"])
    if state["kind"] == "tuple":
        return tuple(state["parts"])
    return state["value"]


def _single(state: dict[str, Any]) -> SingleTeacherSignal:
    """One member's answer from its state."""
    signal = _signal_from_state(state)
    assert signal is not None and not isinstance(signal, SeveralTeachersSignal)
    return signal


def signal_rows(signal: TeacherSignal, micro_batch: BatchedDataDict) -> TeacherSignal:
    """The rows of a whole batch's teacher signal that a micro-batch holds, cut to its width.

    The micro-batch carries ``sample_index`` (its rows' places in the batch) and may be
    trimmed to its own longest row, so the signal is cut to the same number of positions.
    Several teachers' answers select their own rows (:meth:`SeveralTeachersSignal.select_rows`).
    A packed micro-batch (``training.sequence_packing``: one row with ``sequence_lengths``)
    gets its sequences' rows packed as its tokens are: each row cut to its sequence's
    length and the rows concatenated, so every position keeps the teacher's answer for
    it (what the teacher answers when it scores the packed row itself).
    """
    if "sequence_lengths" in micro_batch:
        rows = micro_batch["sample_index"][0].cpu()
        lengths = [int(length) for length in micro_batch["sequence_lengths"][0]]
        if isinstance(signal, SeveralTeachersSignal):
            return signal.select_rows(rows, max(lengths)).pack(lengths)
        if isinstance(signal, TeacherHiddenStates):
            return TeacherHiddenStates(pack_rows(signal.hidden_states, lengths, rows.tolist()))
        if isinstance(signal, LMHeadInput):
            return signal.with_rows(pack_rows(signal.hidden_states, lengths, rows.tolist()))
        return _map_tensors(signal, lambda part: pack_rows(part, lengths, rows.tolist()))
    rows = micro_batch["sample_index"].cpu()
    width = micro_batch["input_ids"].shape[1]
    if isinstance(signal, TeacherHiddenStates):
        return signal.rows(rows, width)
    if isinstance(signal, LMHeadInput):
        return signal.with_rows(signal.hidden_states[rows.to(signal.hidden_states.device), :width])
    if isinstance(signal, SeveralTeachersSignal):
        return signal.select_rows(rows, width)
    return _map_tensors(signal, lambda part: part[rows.to(part.device), :width])


def _map_tensors(signal: TeacherSignal, per_row: Callable[[torch.Tensor], torch.Tensor]) -> TeacherSignal:
    """One teacher's top-k or token signal with ``per_row`` applied to each of its ``[B, L, ...]`` tensors."""
    if isinstance(signal, TopKLogprobs):
        rest = per_row(signal.rest_logprobs) if signal.rest_logprobs is not None else None
        return TopKLogprobs(per_row(signal.logprobs), per_row(signal.ids), rest)
    if isinstance(signal, tuple):
        return tuple(per_row(part) for part in signal)  # type: ignore[return-value]
    assert isinstance(signal, torch.Tensor)  # full-vocabulary signals are scored by the trainer
    return per_row(signal)


def task_rewards(
    batch: BatchedDataDict, examples: list[PreparedExample], num_samples: int, tokenizer: Any
) -> torch.Tensor:
    """``[N]`` task reward of each sampled response: 1.0 if the math verifier accepts it, else 0."""
    ground_truths = [examples[row // num_samples]["ground_truth"] for row in range(batch.size)]  # samples adjacent
    grades = grade_responses(
        batch["input_ids"], batch["prompt_lengths"], batch["input_lengths"], ground_truths, tokenizer
    )
    return torch.tensor([float(grade is True) for grade in grades], dtype=torch.float32)
