"""Which token ids end a response.

A chat model usually lists several: Qwen2.5-Instruct's ``generation_config.json`` names
``<|im_end|>`` and ``<|endoftext|>``, Llama 3 Instruct three ids. Generation stops at the
first of any of them, in every backend, and the response keeps that token (it is what the
student must learn to emit). A backend that stopped only at ``tokenizer.eos_token_id``
would let a response that ends with another listed id run on to ``max_length``, and the
tokens after it would be trained on.
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
    """The tokenizer's EOS plus every EOS id in the model's generation config, sorted.

    Args:
        tokenizer: supplies ``eos_token_id``.
        model: a ``PreTrainedModel`` (or anything with a ``generation_config``); None
            uses the tokenizer alone.
    """
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

    A token the teacher gives less than that at every probed position counts as one it
    never emits. The bound is scale-free: at Qwen's 152k vocabulary it is 6.6e-6, while a
    chat template places the turn-end token after every turn, so a teacher that knows the
    format predicts it there with a probability near 1.
    """
    return 1.0 / int(teacher.get_output_embeddings().weight.shape[0])


def highest_teacher_probability(
    teacher: Any, prompts: list[list[int]], token_ids: list[int], max_tokens: int = 256
) -> dict[int, float]:
    """The highest probability the teacher gives each of ``token_ids`` at any position of ``prompts``.

    Args:
        teacher: an in-process causal LM.
        prompts: token ids of a few rendered prompts (each cut to its first ``max_tokens``).
        token_ids: the tokens to look up.
        max_tokens: longest prompt prefix scored.
    """
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
    """Compares the student's and the teacher's stop tokens before training.

    A student that stops at a token the teacher never emits is taught, token after
    token, that stopping is wrong (the teacher's log-prob of its stop token is huge and
    negative): its responses grow to ``max_length``. This is the known failure of a base
    student distilled from an instruct teacher.

    Args:
        tokenizer: names the tokens in messages.
        student_stops: the ids that end the student's responses.
        teacher_stops: the teacher's own stop ids; None when unknown (a served teacher).
        teacher: the in-process teacher model, used to probe its probabilities; None skips the probe.
        probe_prompts: a few rendered training prompts to probe the teacher on.

    Returns:
        A warning to report when the two lists differ, else None.

    Raises:
        ModelCompatibilityError: if the student stops at a token to which the teacher
            gives less than :func:`never_emitted_threshold` at every probed position.
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
