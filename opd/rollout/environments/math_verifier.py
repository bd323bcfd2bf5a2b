"""Math answer extraction and checking, for validation accuracy and task rewards alike.

The math prompt asks for ``<answer> ... </answer>`` tags and a final ``\\boxed{...}``. Answers are compared with
Hugging Face's ``math-verify`` (symbolic equivalence: ``1/2`` equals ``0.5`` and ``\\frac{1}{2}``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}``, with nested braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for position in range(begin, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            if depth == 0:
                return text[begin:position]
            depth -= 1
    return None  # unbalanced: the response was cut off inside the box


def extract_answer(response: str) -> str | None:
    """The model's final answer: last ``\\boxed{}``, else last ``<answer>`` block, else None."""
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    tags = _ANSWER_TAG.findall(response)
    if tags:
        inner = tags[-1]
        return (_last_boxed(inner) or inner).strip()
    return None


def is_correct(response: str, ground_truth: str) -> bool:
    """Whether the response's extracted answer is mathematically equal to the ground truth."""
    answer = extract_answer(response)
    if not answer:  # none, or empty
        return False
    if answer == str(ground_truth).strip():
        return True
    # Imported lazily: math-verify pulls in sympy, which takes a second to import.
    from math_verify import parse, verify

    try:
        return bool(verify(parse(f"${ground_truth}$"), parse(f"${answer}$")))
    except Exception:  # math-verify raises on unparsable input; that answer is wrong
        return False


def grade_responses(
    input_ids: torch.Tensor,
    prompt_lengths: torch.Tensor,
    input_lengths: torch.Tensor,
    ground_truths: list[str | None],
    tokenizer: Any,
) -> list[bool | None]:
    """Decodes each ``[prompt | response | pad]`` row's response (special tokens skipped) and checks it.

    ``prompt_lengths`` and ``input_lengths`` (``[N]``) are where each response starts and ends; the grade is None
    where there is no ground truth.
    """
    grades: list[bool | None] = []
    for row, ground_truth in enumerate(ground_truths):
        if ground_truth is None:
            grades.append(None)
            continue
        start, end = int(prompt_lengths[row]), int(input_lengths[row])
        grades.append(is_correct(tokenizer.decode(input_ids[row, start:end], skip_special_tokens=True), ground_truth))
    return grades
