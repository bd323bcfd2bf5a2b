"""The hooks of ``opd_math.yaml``: the specification's prompt, and grading as opd's validation grades.

lm-eval loads this module by the task file's ``!function``. The prompt is read with opd's
own template loader and the answer is graded with opd's own
:func:`opd.rollout.environments.math_verifier.is_correct` (the last ``\\boxed{}`` of the response,
else the last ``<answer>`` block, compared with the row's ``ground_truth_answer`` by
math-verify), so the harness scores a response exactly as opd's validation does. The
template's path is relative to the repository's root, as the task's data paths are.

With several samples per document (lm-eval's ``repeats``: ``validation.harness.repeats``,
``opd eval --repeats N``) the task reports, besides the first sample's grade
(``math_verify``), the practitioner's ``avg@n`` (the mean accuracy over the n samples;
pass@1's unbiased estimate is the same number) and ``pass@k`` for k = 2, 4, 8, ... and n
(the unbiased estimator of Chen et al., 2021: 1 - C(n-c, k) / C(n, k) for c correct).
"""

from __future__ import annotations

import math

from opd.data.converters import load_prompt_template
from opd.rollout.environments.math_verifier import is_correct

_TEMPLATE = load_prompt_template("examples/prompts/math_think_answer.txt")

# The specification's answer, after the prompt's opening "<think>": what a few-shot example
# answers when its row has no worked solution.
_ANSWER_TAGS = "</think> <answer> \\boxed{{{}}} </answer>"


def doc_to_text(doc: dict) -> str:
    """The user message for one row (``problem``, ``ground_truth_answer``)."""
    return _TEMPLATE.format(prompt=doc["problem"])


def fewshot_target(doc: dict) -> str:
    """A few-shot example's answer: the row's worked ``solution``, else the bare answer tags."""
    return doc.get("solution") or _ANSWER_TAGS.format(doc["ground_truth_answer"])


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sample_ks(n: int) -> list[int]:
    """The k of the pass@k reported for ``n`` samples: the powers of two from 2 below n, and n."""
    ks = [2**power for power in range(1, n.bit_length()) if 2**power < n]
    return [*ks, n] if n > 1 else []


def process_results(doc: dict, results: list) -> dict[str, float]:
    """The grades of one document's responses (one, or lm-eval's ``repeats`` of them).

    Args:
        doc: the row (``ground_truth_answer`` is the answer).
        results: lm-eval's filtered responses: ``[responses]``, the list of the document's
            samples (the task's filter keeps them all), or ``[response]`` for a single one.
    """
    responses = results[0] if isinstance(results[0], list) else list(results)
    grades = [is_correct(response, str(doc["ground_truth_answer"])) for response in responses]
    n, correct = len(grades), sum(grades)
    metrics = {"math_verify": float(grades[0])}
    if n > 1:
        metrics[f"avg@{n}"] = correct / n
        metrics.update({f"pass@{k}": pass_at_k(n, correct, k) for k in sample_ks(n)})
    return metrics
