"""Validation: a model answers the validation prompts; accuracy, KL to the teacher, lengths.

Shared by distillation (student vs teacher) and SFT (no teacher: accuracy and lengths
only). Answers are checked with :mod:`opd.environments.math_verifier`.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torchdata.stateful_dataloader import StatefulDataLoader

from opd.algorithms.loss_functions import shift_token_mask, token_kl, topk_token_kl
from opd.data.sequences import attention_mask_from_lengths, build_token_mask
from opd.environments.math_verifier import is_correct
from opd.models.generation.config import GenerateStrategyConfig
from opd.models.interfaces import GenerationInterface, TeacherInterface
from opd.utils.config import StrictConfig


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
    student_generation: GenerationInterface,
    student_model: torch.nn.Module,
    teacher_policy: TeacherInterface | None,
    val_dataloader: StatefulDataLoader,
    tokenizer: Any,
    master_config: Any,
    prefix: str = "val/",
    prompt_key: str = "prompt_ids",
) -> dict[str, float]:
    """A model generates on the validation prompts; reports accuracy, KL and lengths.

    Validation draws its own random numbers (``fork_rng``), so how often and with which
    decoding it runs never changes the training run's sampling.

    Args:
        student_generation: engine that answers the prompts.
        student_model: the model whose distribution is compared with the teacher's.
        teacher_policy: the teacher for ``kl_*``; None skips the KL (teacher baseline).
        val_dataloader: validation examples.
        tokenizer: decodes responses for answer checking.
        master_config: a run config; supplies ``validation.generate_strategy``.
        prefix: metric-name prefix (``val/`` or ``val/teacher_``).
        prompt_key: which prompt of each example the model answers: ``prompt_ids``, or
            ``teacher_prompt_ids`` for a teacher answering with its teacher-only context.

    Returns:
        ``{prefix}kl_forward`` / ``kl_reverse`` (token means over the generated
        responses), ``mean_response_length``, ``truncation_rate``, and ``accuracy`` when
        the data has ground truth.
    """
    strategy = master_config.validation.generate_strategy
    vocab_size = len(tokenizer)
    totals = {"kl_forward": 0.0, "kl_reverse": 0.0, "tokens": 0.0, "length": 0.0, "truncated": 0.0}
    correct, graded, rows = 0, 0, 0
    student_device = next(student_model.parameters()).device
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        for examples in val_dataloader:
            student_generation.prepare_for_generation()
            try:
                batch = student_generation.generate(
                    [example[prompt_key] for example in examples], strategy, 1, return_logprobs=False
                )
            finally:
                student_generation.finish_generation()
            if "teacher_prompt_ids" in examples[0]:  # context distillation: the teacher's own prompts
                batch["teacher_prompt_ids"] = [example["teacher_prompt_ids"] for example in examples]
            if teacher_policy is not None:
                batch["token_mask"] = build_token_mask(
                    batch["input_lengths"], batch["prompt_lengths"], batch["input_ids"].shape[1], True
                )
                # A served teacher sends its top k: the KLs are then taken over the k + 1
                # classes of topk_token_kl (a lower bound of the full-vocabulary KL).
                full_vocabulary = getattr(teacher_policy, "full_vocabulary", True)
                if full_vocabulary:
                    teacher_logits = teacher_policy.get_logits(batch)[..., :vocab_size]
                else:
                    top_logprobs, top_ids = teacher_policy.get_topk_logprobs(
                        batch, master_config.loss_fn.teacher_topk, 1.0, vocab_size
                    )
                with torch.inference_mode():
                    input_ids = batch["input_ids"].to(student_device)
                    attention = attention_mask_from_lengths(batch["input_lengths"].to(student_device), input_ids.shape[1])
                    student_logits = student_model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
                    mask = shift_token_mask(batch["token_mask"]).bool().to(student_device)
                    student_rows = student_logits[:, :-1][..., :vocab_size][mask]
                    for direction in ("forward", "reverse"):
                        if full_vocabulary:
                            kl = token_kl(student_rows, teacher_logits[:, :-1].to(student_device)[mask], direction)
                        else:
                            kl = topk_token_kl(student_rows, top_logprobs[:, :-1].to(student_device)[mask],
                                               top_ids[:, :-1].to(student_device)[mask], direction)
                        totals[f"kl_{direction}"] += float(kl.sum())
                    totals["tokens"] += float(mask.sum())
            totals["length"] += float(batch["response_lengths"].sum())
            totals["truncated"] += float(batch["truncated"].sum())
            rows += batch.size
            for row, example in enumerate(examples):
                if example["ground_truth"] is None:
                    continue
                start, end = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
                response = tokenizer.decode(batch["input_ids"][row, start:end], skip_special_tokens=True)
                correct += is_correct(response, example["ground_truth"])
                graded += 1
    metrics = {
        f"{prefix}mean_response_length": totals["length"] / max(rows, 1),
        f"{prefix}truncation_rate": totals["truncated"] / max(rows, 1),
    }
    if teacher_policy is not None:
        tokens = max(totals["tokens"], 1.0)
        metrics[f"{prefix}kl_forward"] = totals["kl_forward"] / tokens
        metrics[f"{prefix}kl_reverse"] = totals["kl_reverse"] / tokens
    if graded:
        metrics[f"{prefix}accuracy"] = correct / graded
    return metrics
