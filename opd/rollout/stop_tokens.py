"""Which token ids end a response.

A chat model often lists several (Qwen2.5-Instruct: ``<|im_end|>`` and ``<|endoftext|>``). Every backend stops at
the first of any of them and keeps it in the response, as the student must learn to emit it; stopping only at
``tokenizer.eos_token_id`` would train on tokens after another listed id.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from opd.utils.errors import ModelCompatibilityError


def _as_ids(value: Any) -> list[int]:
    """``generation_config.eos_token_id`` is an int, a list of ints or None."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(token_id) for token_id in value]


def stop_token_ids(tokenizer: Any, model: Any | None = None) -> tuple[int, ...]:
    """The tokenizer's EOS plus every EOS id in ``model.generation_config`` (if any), sorted."""
    ids = set(_as_ids(tokenizer.eos_token_id))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        ids.update(_as_ids(generation_config.eos_token_id))
    return tuple(sorted(ids))


def ends_with_stop(token_ids: list[int], stop_ids: Iterable[int]) -> bool:
    """Whether a response's last token is one of ``stop_ids`` (False for an empty response)."""
    return bool(token_ids) and token_ids[-1] in set(stop_ids)


def is_stop(tokens: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """Elementwise: whether each token id is one of ``stop_ids`` (a 1-D tensor on the same device)."""
    return torch.isin(tokens, stop_ids)


def describe_tokens(tokenizer: Any, token_ids: Iterable[int]) -> str:
    """``'<|im_end|>' (151645), '<|endoftext|>' (151643)``: ids with their text, for messages."""
    return ", ".join(f"{tokenizer.convert_ids_to_tokens(token_id)!r} ({token_id})" for token_id in token_ids)


def never_emitted_threshold(teacher: Any) -> float:
    """The probability of a uniform guess over the teacher's vocabulary, ``1 / V``.

    A token the teacher gives less at every probed position counts as never emitted; a teacher that knows the chat
    format predicts its turn-end token with a probability near 1.
    """
    return 1.0 / int(teacher.get_output_embeddings().weight.shape[0])


def highest_teacher_probability(
    teacher: Any, prompts: list[list[int]], token_ids: list[int], max_tokens: int = 256
) -> dict[int, float]:
    """An in-process teacher's highest probability of each of ``token_ids`` in ``prompts`` (cut to ``max_tokens``)."""
    best = dict.fromkeys(token_ids, 0.0)
    device = next(teacher.parameters()).device
    lookup = torch.tensor(token_ids, dtype=torch.long, device=device)
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt[:max_tokens]], dtype=torch.long, device=device)
            probabilities = torch.softmax(teacher(input_ids=ids).logits[0].float(), dim=-1)[:, lookup]
            for column, token_id in enumerate(token_ids):
                best[token_id] = max(best[token_id], float(probabilities[:, column].max()))
    return best


def check_stop_tokens(
    tokenizer: Any,
    student_stops: tuple[int, ...],
    teacher_stops: tuple[int, ...] | None,
    teacher: Any | None,
    probe_prompts: list[list[int]],
) -> str | None:
    """Compares the student's and the teacher's stop tokens before training; a warning when they differ, else None.

    A student that stops at a token the teacher never emits is taught that stopping is wrong, and its responses
    grow to ``max_length`` (the known failure of a base student distilled from an instruct teacher).
    ``teacher_stops`` is None when unknown (a served teacher); ``teacher`` None skips the probe.

    Raises:
        ModelCompatibilityError: the student stops at a token the teacher gives less than
            :func:`never_emitted_threshold` at every position of ``probe_prompts``.
    """
    if teacher_stops is None or set(student_stops) == set(teacher_stops):
        return None
    student_only = [token_id for token_id in student_stops if token_id not in teacher_stops]
    if teacher is not None and student_only and probe_prompts:
        highest = highest_teacher_probability(teacher, probe_prompts, student_only)
        threshold = never_emitted_threshold(teacher)
        never = [token_id for token_id, probability in highest.items() if probability < threshold]
        if never:
            raise ModelCompatibilityError(
                f"the student stops at {describe_tokens(tokenizer, never)}, which the teacher never emits "
                f"(highest probability {max(highest[token_id] for token_id in never):.1e} over "
                f"{len(probe_prompts)} training prompts, below a uniform guess's {threshold:.1e}): "
                "distillation would teach the student never to stop. "
                "Use a student and teacher with the same chat format (e.g. both instruct models), or set "
                "generation.stop_token_ids to the ids the teacher ends its answers with"
            )
    return (
        f"the student's stop tokens [{describe_tokens(tokenizer, student_stops)}] differ from the teacher's "
        f"[{describe_tokens(tokenizer, teacher_stops)}]; responses end at the student's"
    )
