"""The hooks of ``opd_capitals.yaml``: the row's question, graded by the real-model example's own grader.

lm-eval loads this module by the task file's ``!function``; the grader is
:func:`make_capitals_task.is_correct` (a response is right when it names one of the row's
accepted capitals as a whole word), imported from the example's folder so that the harness
grades exactly as the example does.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The example's folder beside this one; or under the working directory, the repository's root
# (where the task's data path points), for a copy of this file elsewhere.
for folder in (Path(__file__).resolve().parents[1] / "real_model", Path.cwd() / "examples" / "real_model"):
    if (folder / "make_capitals_task.py").is_file():
        sys.path.insert(0, str(folder))
        break

from make_capitals_task import is_correct  # noqa: E402


def doc_to_text(doc: dict) -> str:
    """The user message of the row (its question)."""
    return doc["messages"][0]["content"]


def doc_to_target(doc: dict) -> str:
    """The reference answer ("The capital of France is Paris.")."""
    return doc["messages"][-1]["content"]


def process_results(doc: dict, results: list) -> dict[str, float]:
    """``names_capital``: 1.0 when the (first) response names an accepted capital."""
    return {"names_capital": float(is_correct(results[0], doc["answers"]))}
