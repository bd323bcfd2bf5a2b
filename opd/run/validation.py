"""Validation: a model answers the validation prompts; accuracy, KL to the teacher, lengths.

SFT has no teacher, so no KL. Answers are graded by :mod:`opd.rollout.environments.math_verifier`; with an
``environment:``, the model plays whole episodes (:class:`~opd.rollout.multi_turn.Episodes`, as in training) graded
by the final reward.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field
from torchdata.stateful_dataloader import StatefulDataLoader

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.batches import attach_teacher_fields
from opd.data.dataloaders import PreparedExample
from opd.data.sequences import build_token_mask, shift_token_mask
from opd.losses.divergences import token_kl, topk_token_kl
from opd.models.decoding import GenerateStrategyConfig
from opd.models.interfaces import (
    FullVocabRequest,
    GenerationInterface,
    PolicyInterface,
    SeveralTeachersSignal,
    SingleTeacherSignal,
    TeacherComparison,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TopKLogprobs,
    TopKRequest,
)
from opd.models.lm_head import LMHeadInput, default_chunk_rows
from opd.rollout.environments.math_verifier import grade_responses
from opd.rollout.multi_turn import EpisodeRecord, Episodes, episode_metrics
from opd.run.harness import HarnessConfig
from opd.teachers.several_teachers import waits_for_heads
from opd.utils.config import StrictConfig

log = logging.getLogger(__name__)


class ValidationConfig(StrictConfig):
    """When validation runs and how the model decodes for it."""

    val_at_start: bool = True
    val_at_end: bool = True
    batch_size: int = Field(16, ge=1, description="prompts per validation generation batch")
    generate_strategy: GenerateStrategyConfig = Field(
        default_factory=lambda: GenerateStrategyConfig(decoding_method="greedy"),
        description="the model's decoding for validation (greedy by default)",
    )
    harness_tasks: list[str] = Field(
        default_factory=list,
        description="at the end of the run, evaluate the final model on these tasks of an external harness "
        "(validation.harness; pip install 'opd[eval]'); empty = none",
    )
    harness: HarnessConfig = Field(
        default_factory=HarnessConfig, description="the external harness of harness_tasks and opd eval --harness"
    )


@dataclass(frozen=True)
class TeacherEngine:
    """A teacher that answers the validation prompts for the baselines (``validation.teacher_baseline``).

    Attributes:
        generation: in process, its server or a cluster's rollout workers; the baselines close it afterwards.
        name: among several teachers (metrics ``val/teacher_<name>_*``); None for the one (``val/teacher_*``).
        tokenizer: decodes and grades its answers (a cross-tokenizer teacher's own).
        prompt_key: ``teacher_prompt_ids`` where its prompt differs from the student's.
        route: with routing, it answers only examples whose ``teacher_index`` is ``route``; None: all.
    """

    generation: GenerationInterface
    name: str | None
    tokenizer: Any
    prompt_key: Literal["prompt_ids", "teacher_prompt_ids"] = "prompt_ids"
    route: int | None = None

    def answers(self, example: PreparedExample) -> bool:
        """Whether this teacher answers ``example`` (routing: the examples routed to it)."""
        return self.route is None or example.get("teacher_index") == self.route


def validate(
    generation: GenerationInterface,
    policy: PolicyInterface | None,
    teacher: TeacherInterface | None,
    val_dataloader: StatefulDataLoader,
    tokenizer: Any,
    generate_strategy: GenerateStrategyConfig,
    teacher_topk: int = 64,
    prefix: str = "val/",
    prompt_key: Literal["prompt_ids", "teacher_prompt_ids"] = "prompt_ids",
    loss_request: TeacherRequest | None = None,
    keep: Callable[[PreparedExample], bool] | None = None,
    episodes: Episodes | None = None,
) -> dict[str, float]:
    """``generation`` answers the validation prompts; returns ``{prefix}``-named accuracy, KL and length metrics.

    Validation forks the RNG, so it never changes the training run's sampling. ``teacher`` None skips the KL;
    ``teacher_topk`` and ``loss_request`` feed :func:`kl_request`; ``keep`` filters examples (a routed teacher's).
    The KL (token means; absent when the teacher answers no request) needs ``policy``; ``accuracy`` needs ground truth.
    With ``episodes`` the model plays one episode per prompt: the KL covers its own turns only, ``accuracy`` is the
    mean final reward, and :func:`~opd.rollout.multi_turn.episode_metrics` are added under ``prefix``.
    """
    comparison, teacher_signal = _teacher_comparison(teacher, policy, loss_request, len(tokenizer), teacher_topk)
    totals = {"kl_forward": 0.0, "kl_reverse": 0.0, "tokens": 0.0, "length": 0.0, "truncated": 0.0}
    correct, graded, rows = 0.0, 0, 0
    records: list[EpisodeRecord] = []
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        for all_examples in val_dataloader:
            examples = all_examples if keep is None else [example for example in all_examples if keep(example)]
            if not examples:
                continue
            batch, episode_records = _answer(generation, tokenizer, examples, generate_strategy, prompt_key, episodes)
            records += episode_records
            if comparison is not None and teacher_signal is not None and policy is not None:
                sums = _kl_sums(batch, examples, policy, comparison, teacher_signal)
                for key in ("kl_forward", "kl_reverse", "tokens"):
                    totals[key] += sums[key]
            totals["length"] += float(batch["response_lengths"].sum())
            totals["truncated"] += float(batch["truncated"].sum())
            rows += batch.size
            batch_correct, batch_graded = _grade(batch, examples, episode_records if episodes else None, tokenizer)
            correct += batch_correct
            graded += batch_graded
    metrics = _means(totals, rows, comparison is not None, correct, graded, prefix)
    if episodes is not None:  # the episode metrics, under ``prefix`` instead of ``env/``
        for key, value in episode_metrics(records).items():
            if key.startswith("env/"):
                metrics[prefix + key.removeprefix("env/")] = value
    return metrics


def _means(
    totals: dict[str, float], rows: int, has_kl: bool, correct: float, graded: int, prefix: str
) -> dict[str, float]:
    """The metrics of :func:`validate` from its sums: per-row lengths, per-token KL, the share graded correct."""
    metrics = {
        f"{prefix}mean_response_length": totals["length"] / max(rows, 1),
        f"{prefix}truncation_rate": totals["truncated"] / max(rows, 1),
    }
    if has_kl:
        tokens = max(totals["tokens"], 1.0)
        metrics[f"{prefix}kl_forward"] = totals["kl_forward"] / tokens
        metrics[f"{prefix}kl_reverse"] = totals["kl_reverse"] / tokens
    if graded:
        metrics[f"{prefix}accuracy"] = correct / graded
    return metrics


def _teacher_comparison(
    teacher: TeacherInterface | None,
    policy: PolicyInterface | None,
    loss_request: TeacherRequest | None,
    vocab_size: int,
    teacher_topk: int,
) -> tuple[ValidationKL | None, Callable[[BatchedDataDict], TeacherSignal] | None]:
    """How validation compares the student with the teacher, and how it asks the teacher (None, None: no KL)."""
    if teacher is None:
        return None, None
    request = kl_request(teacher, loss_request, vocab_size, teacher_topk)
    if request is None:
        return None, None
    if policy is None:
        raise ValueError("validate needs the student policy to compare with the teacher")
    comparison = ValidationKL(request, vocab_size, student_classes=teacher.student_classes)
    return comparison, functools.partial(_one_answer, teacher, comparison.teacher_request)


def _answer(
    generation: GenerationInterface,
    tokenizer: Any,
    examples: list[PreparedExample],
    generate_strategy: GenerateStrategyConfig,
    prompt_key: Literal["prompt_ids", "teacher_prompt_ids"],
    episodes: Episodes | None,
) -> tuple[BatchedDataDict, list[EpisodeRecord]]:
    """The model's answers to one validation batch: one turn each, or (``episodes``) an episode each."""
    generation.prepare_for_generation()
    try:
        if episodes is None:
            prompts = [example[prompt_key] for example in examples]
            return generation.generate(prompts, generate_strategy, 1, return_logprobs=False), []
        # The student's prompt is rendered from its messages, as in training.
        rollout = episodes.rollout(
            generation,
            tokenizer,
            examples,
            generate_strategy,
            return_logprobs=False,
            prompt_key=None if prompt_key == "prompt_ids" else prompt_key,
        )
        return rollout.batch, rollout.episodes
    finally:
        generation.finish_generation()


def _kl_sums(
    batch: BatchedDataDict,
    examples: list[PreparedExample],
    policy: PolicyInterface,
    comparison: ValidationKL,
    teacher_signal: Callable[[BatchedDataDict], TeacherSignal],
) -> dict[str, float]:
    """The student's and the teacher's KL sums over one batch's response tokens (the student's own, in episodes)."""
    attach_teacher_fields(batch, examples, 1)
    if "token_mask" not in batch:  # an episode's mask already leaves out its observations
        batch["token_mask"] = build_token_mask(
            batch["input_lengths"], batch["prompt_lengths"], batch["input_ids"].shape[1], True
        )
    return policy.compare_with_teacher(batch, comparison, teacher_signal)


def _grade(
    batch: BatchedDataDict, examples: list[PreparedExample], records: list[EpisodeRecord] | None, tokenizer: Any
) -> tuple[float, int]:
    """``(correct, graded)`` over one batch: the episodes' final rewards, else each answer against its ground truth."""
    if records is not None:
        rewards = [record.reward for record in records if record.reward is not None]
        return float(sum(rewards)), len(rewards)
    grades = grade_responses(
        batch["input_ids"],
        batch["prompt_lengths"],
        batch["input_lengths"],
        [example["ground_truth"] for example in examples],
        tokenizer,
    )
    return float(sum(grade is True for grade in grades)), sum(grade is not None for grade in grades)


def kl_request(
    teacher: TeacherInterface, loss_request: TeacherRequest | None, vocab_size: int, teacher_topk: int
) -> TeacherRequest | None:
    """The most exact signal ``teacher`` answers (:meth:`TeacherInterface.refusal`) for validation's KL, or None.

    Tried in order: the full vocabulary; the loss's own top-k at temperature 1 (a k the teacher is known to serve,
    e.g. within a vLLM server's ``--max-logprobs``); the top ``teacher_topk``.
    """
    candidates: list[TeacherRequest] = [FullVocabRequest()]
    if isinstance(loss_request, TopKRequest):
        candidates.append(TopKRequest(loss_request.k, 1.0, vocab_size))
    candidates.append(TopKRequest(teacher_topk, 1.0, vocab_size))
    for request in candidates:
        if teacher.refusal(request) is None:
            return request
    log.warning("validation reports no KL: the teacher answers neither its full vocabulary nor a top-k")
    return None


class ValidationKL(TeacherComparison):
    """Forward and reverse token KL to the teacher (temperature 1), summed over the response tokens, with their count.

    Runs where the student's hidden states are (:meth:`~opd.models.interfaces.PolicyInterface.compare_with_teacher`);
    logits are made ``chunk_rows`` positions at a time, so no ``[tokens × vocab]`` tensor exists and only three sums
    leave. Only the first ``vocab_size`` outputs of either head are tokens.
    """

    def __init__(
        self,
        teacher_request: TeacherRequest,
        vocab_size: int,
        chunk_rows: int | None = None,
        student_classes: torch.Tensor | None = None,
    ) -> None:
        if isinstance(teacher_request, FullVocabRequest):
            teacher_request = FullVocabRequest(prefer_hidden_states=True)
        self.teacher_request = teacher_request
        self.vocab_size = vocab_size
        self.chunk_rows = chunk_rows or default_chunk_rows(vocab_size)
        self.student_classes = student_classes

    def __call__(self, student: LMHeadInput, teacher_output: TeacherSignal, data: BatchedDataDict) -> dict[str, float]:
        """``{"kl_forward", "kl_reverse", "tokens"}`` over ``data``'s response tokens."""
        if isinstance(teacher_output, SeveralTeachersSignal):  # each row's teacher (routing), or the mixture
            teacher_output = teacher_output.combined()
        device = student.hidden_states.device
        # Logits at position t predict token t + 1 (shifted once, here).
        mask = shift_token_mask(data["token_mask"]).bool().to(device)
        student_rows = _head_over(student, student.hidden_states[:, :-1][mask], self.vocab_size)
        teacher_rows = _teacher_rows(teacher_output, mask, self.vocab_size)
        sums = {"kl_forward": 0.0, "kl_reverse": 0.0, "tokens": float(mask.sum())}
        with torch.no_grad():
            for begin in range(0, student_rows.hidden_states.shape[0], self.chunk_rows):
                rows = slice(begin, begin + self.chunk_rows)
                student_logits = student_rows.logits(rows)
                if isinstance(teacher_rows, tuple):
                    logprobs, ids, rest = teacher_rows
                    kl_in = functools.partial(
                        topk_token_kl,
                        student_logits,
                        logprobs[rows],
                        ids[rows],
                        teacher_rest_logprobs=None if rest is None else rest[rows],
                        student_classes=self.student_classes,
                    )
                else:  # the teacher's logits made once for both directions
                    teacher_logits = (
                        teacher_rows.logits(rows) if isinstance(teacher_rows, LMHeadInput) else teacher_rows[rows]
                    )
                    kl_in = functools.partial(token_kl, student_logits, teacher_logits)
                    del teacher_logits  # the partial holds it
                for direction in ("forward", "reverse"):
                    sums[f"kl_{direction}"] += float(kl_in(direction).sum(dtype=torch.float64))
                # Else this chunk's [chunk × V] logits would live on while the next chunk's are made.
                del student_logits, kl_in
        return sums


def _head_over(head: LMHeadInput, hidden_rows: torch.Tensor, vocab_size: int) -> LMHeadInput:
    """``head`` over the selected positions' hidden states, cut to the first ``vocab_size`` outputs."""
    vocab = vocab_size if head.vocab_size is None else min(head.vocab_size, vocab_size)
    return dataclasses.replace(head, hidden_states=hidden_rows, vocab_size=vocab)


def _teacher_rows(
    answer: SingleTeacherSignal, mask: torch.Tensor, vocab_size: int
) -> LMHeadInput | torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The teacher's answer at the masked positions: a head, ``[N, V]`` logits, or top-k (logprobs, ids, rest|None)."""
    device = mask.device
    if isinstance(answer, LMHeadInput):
        return _head_over(answer, answer.hidden_states[:, :-1].to(device)[mask], vocab_size)
    if isinstance(answer, tuple):
        top_logprobs, top_ids = answer
        # A teacher that knows its full distribution sends the rest mass (exact); else None.
        rest = answer.rest_logprobs if isinstance(answer, TopKLogprobs) else None
        return (
            top_logprobs[:, :-1].to(device)[mask],
            top_ids[:, :-1].to(device)[mask],
            None if rest is None else rest[:, :-1].to(device)[mask],
        )
    if not isinstance(answer, torch.Tensor) or answer.dim() != 3:
        raise TypeError(f"validation's KL needs the teacher's logits, hidden states or top-k, got {type(answer)}")
    return answer[:, :-1].to(device)[mask][..., :vocab_size]


def _one_answer(teacher: TeacherInterface, request: TeacherRequest, data: BatchedDataDict) -> TeacherSignal:
    """The teacher's answer for a micro-batch, several teachers' combined into one.

    Hidden states that still need their members' output layers stay apart; :class:`ValidationKL` combines them.
    """
    # As a training step asks: a teacher in the trainer's workers answers where the rows go.
    answer = teacher.score_async(data, request).result()
    if isinstance(answer, SeveralTeachersSignal) and not waits_for_heads(answer):
        return answer.combined()
    return answer
