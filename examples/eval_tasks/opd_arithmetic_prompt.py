"""The prompt of ``opd_arithmetic.yaml``: the demo's prompt template around the row's problem.

lm-eval loads this module by the task file's ``!function``; the template is read with opd's
own loader, so the harness asks exactly what opd's validation asks. Its path is relative to
the repository's root, as the task's data path and the configs' paths are.
"""

from opd.data.converters import load_prompt_template

_TEMPLATE = load_prompt_template("examples/prompts/math_think_answer.txt")


def doc_to_text(doc: dict) -> str:
    """The user message for one row (``problem``, ``ground_truth_answer``)."""
    return _TEMPLATE.format(prompt=doc["problem"])
