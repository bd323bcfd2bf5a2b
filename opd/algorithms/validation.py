"""Validation: a model answers the validation prompts; accuracy, KL to the teacher, lengths.

Shared by distillation (student vs teacher) and SFT (no teacher: accuracy and lengths
only). Answers are checked with :mod:`opd.environments.math_verifier`.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from pydantic import Field
from torchdata.stateful_dataloader import StatefulDataLoader

from opd.algorithms.loss_functions import token_kl, topk_token_kl
from opd.data.batched_data_dict import BatchedDataDict
from opd.data.batches import attach_teacher_fields
from opd.data.sequences import build_token_mask, shift_token_mask
from opd.environments.math_verifier import grade_responses
from opd.models.generation.config import GenerateStrategyConfig
from opd.models.interfaces import (
    FullVocabRequest,
    GenerationInterface,
    PolicyInterface,
    SeveralTeachersSignal,
    TeacherInterface,
    TeacherRequest,
    TopKLogprobs,
    TopKRequest,
)
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
) -> dict[str, float]:
    """A model generates on the validation prompts; reports accuracy, KL and lengths.

    Validation draws its own random numbers (``fork_rng``), so how often and with which
    decoding it runs never changes the training run's sampling.

    Args:
        generation: engine that answers the prompts.
        policy: the student whose distribution is compared with the teacher's (needed
            with a teacher).
        teacher: the teacher for ``kl_*``; None skips the KL (SFT, teacher baseline).
        val_dataloader: validation examples.
        tokenizer: decodes responses for answer checking.
        generate_strategy: the decoding used for validation.
        teacher_topk: the k asked of a teacher that cannot send its full vocabulary as
            configured, when the loss is not itself top-k (see :func:`kl_request`).
        prefix: metric-name prefix (``val/`` or ``val/teacher_``).
        prompt_key: which prompt of each example the model answers: ``prompt_ids``, or
            ``teacher_prompt_ids`` for a teacher answering with its teacher-only context.
        loss_request: the signal the training loss asks the teacher for; its top-k is what
            validation falls back to (see :func:`kl_request`).

    Returns:
        ``{prefix}kl_forward`` / ``kl_reverse`` (token means over the generated
        responses; left out when the teacher answers none of :func:`kl_request`'s
        signals), ``mean_response_length``, ``truncation_rate``, and ``accuracy`` when the
        data has ground truth.
    """
    vocab_size = len(tokenizer)
    request = None if teacher is None else kl_request(teacher, loss_request, vocab_size, teacher_topk)
    totals = {"kl_forward": 0.0, "kl_reverse": 0.0, "tokens": 0.0, "length": 0.0, "truncated": 0.0}
    correct, graded, rows = 0, 0, 0
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        for examples in val_dataloader:
            generation.prepare_for_generation()
            try:
                batch = generation.generate(
                    [example[prompt_key] for example in examples], generate_strategy, 1, return_logprobs=False
                )
            finally:
                generation.finish_generation()
            if teacher is not None and request is not None:
                if policy is None:
                    raise ValueError("validate needs the student policy to compare with the teacher")
                attach_teacher_fields(batch, examples, 1)
                kl_forward, kl_reverse, tokens = _kl_to_teacher(batch, policy, teacher, request, vocab_size)
                totals["kl_forward"] += kl_forward
                totals["kl_reverse"] += kl_reverse
                totals["tokens"] += tokens
            totals["length"] += float(batch["response_lengths"].sum())
            totals["truncated"] += float(batch["truncated"].sum())
            rows += batch.size
            grades = grade_responses(
                batch["input_ids"],
                batch["prompt_lengths"],
                batch["input_lengths"],
                [example["ground_truth"] for example in examples],
                tokenizer,
            )
            correct += sum(grade is True for grade in grades)
            graded += sum(grade is not None for grade in grades)
    metrics = {
        f"{prefix}mean_response_length": totals["length"] / max(rows, 1),
        f"{prefix}truncation_rate": totals["truncated"] / max(rows, 1),
    }
    if request is not None:
        tokens = max(totals["tokens"], 1.0)
        metrics[f"{prefix}kl_forward"] = totals["kl_forward"] / tokens
        metrics[f"{prefix}kl_reverse"] = totals["kl_reverse"] / tokens
    if graded:
        metrics[f"{prefix}accuracy"] = correct / graded
    return metrics


def kl_request(
    teacher: TeacherInterface, loss_request: TeacherRequest | None, vocab_size: int, teacher_topk: int
) -> TeacherRequest | None:
    """The signal validation's KL asks ``teacher`` for: the most exact one it answers as configured.

    The teacher says itself what it answers (:meth:`TeacherInterface.refusal`), so a
    served teacher without its output layer, a teacher pool or a teacher with another
    tokenizer is never asked for its full vocabulary. In order:

    1. the full vocabulary: exact KLs;
    2. the loss's own top-k, at temperature 1: the k this teacher is known to serve (a
       vLLM server answers at most its ``--max-logprobs``);
    3. the top ``teacher_topk``.

    Top-k KLs are over the k + 1 classes of
    :func:`~opd.algorithms.loss_functions.topk_token_kl`. Returns None when the teacher
    answers none of these; validation then reports no KL.
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


def _kl_to_teacher(
    batch: BatchedDataDict, policy: PolicyInterface, teacher: TeacherInterface, request: TeacherRequest, vocab_size: int
) -> tuple[float, float, float]:
    """Forward and reverse KL summed over the batch's response tokens, and their count."""
    batch["token_mask"] = build_token_mask(
        batch["input_lengths"], batch["prompt_lengths"], batch["input_ids"].shape[1], True
    )
    answer = teacher.score(batch, request)
    if isinstance(answer, SeveralTeachersSignal):  # each row's teacher (routing), or the mixture
        answer = answer.combined()
    student_logits = policy.get_logits(batch)
    device = student_logits.device
    mask = shift_token_mask(batch["token_mask"]).bool().to(device)
    with torch.inference_mode():
        student_rows = student_logits[:, :-1][..., :vocab_size][mask]
        sums = []
        for direction in ("forward", "reverse"):
            if isinstance(answer, tuple):
                top_logprobs, top_ids = answer
                # A teacher that knows its full distribution sends the rest mass (exact); else None.
                rest = answer.rest_logprobs if isinstance(answer, TopKLogprobs) else None
                kl = topk_token_kl(
                    student_rows,
                    top_logprobs[:, :-1].to(device)[mask],
                    top_ids[:, :-1].to(device)[mask],
                    direction,
                    teacher_rest_logprobs=None if rest is None else rest[:, :-1].to(device)[mask],
                )
            else:
                assert isinstance(answer, torch.Tensor)  # full-vocabulary logits were asked for
                kl = token_kl(student_rows, answer[..., :vocab_size][:, :-1].to(device)[mask], direction)
            sums.append(float(kl.sum()))
    return sums[0], sums[1], float(mask.sum())
