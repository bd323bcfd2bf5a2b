"""Writes the real-model example's task: capital cities, with disjoint train / validation / test countries.

A short factual question with a shipped answer list (``capitals.tsv``: 127 countries,
each with the spellings accepted as its capital). SmolLM2-135M-Instruct answers most of
them; students pruned from it lose the knowledge or the habit of stating it. The
countries are shuffled with a fixed seed and split, so that the test measures
knowledge the student recovers, not questions it was trained on:

* ``train.jsonl``: every training country under each of the question phrasings;
* ``val.jsonl`` and ``test.jsonl``: countries of their own, first phrasing only.

Each row is a chat example ``{"messages": [user, assistant], "answers": [...],
"reference": ...}``; the assistant turn is a reference answer ("The capital of France is
Paris."), what SFT trains on; ``answers`` are the accepted spellings, for
:func:`is_correct`; ``reference`` is the same answer as a teacher-only context for
self-distillation (``distillation.teacher_context_key: reference``).

Usage: ``python examples/real_model/make_capitals_task.py [--output DIR] [--seed 0]``
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
ANSWER_LIST = HERE / "capitals.tsv"
PHRASINGS = (
    "What is the capital of {country}?",
    "Which city is the capital of {country}?",
    "Name the capital city of {country}.",
)
INSTRUCTION = " Answer in one short sentence."
VAL_COUNTRIES = 16
TEST_COUNTRIES = 40


def read_answer_list(path: Path = ANSWER_LIST) -> list[tuple[str, list[str]]]:
    """``(country, accepted capitals)`` pairs of the tab-separated answer list (``#`` lines are comments)."""
    pairs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        country, _, capitals = line.partition("\t")
        if not capitals:
            raise ValueError(f"{path}, line {number}: expected 'country<TAB>capital[|spelling...]'")
        pairs.append((country.strip(), [name.strip() for name in capitals.split("|")]))
    return pairs


def is_correct(response: str, answers: list[str]) -> bool:
    """Whether ``response`` names one of the accepted ``answers`` as a whole word (case-insensitive)."""
    return any(re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", response, re.IGNORECASE) for answer in answers)


def example(country: str, answers: list[str], phrasing: str) -> dict:
    question = phrasing.format(country=country) + INSTRUCTION
    reference = f"The capital of {country} is {answers[0]}."
    return {
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reference}],
        "answers": answers,
        "reference": f"Reference answer: {reference}",
    }


def write_task(output: Path, seed: int = 0) -> dict[str, int]:
    """Writes the three splits to ``output``; returns the number of rows of each."""
    pairs = read_answer_list()
    random.Random(seed).shuffle(pairs)
    test, val, train = (
        pairs[:TEST_COUNTRIES],
        pairs[TEST_COUNTRIES : TEST_COUNTRIES + VAL_COUNTRIES],
        pairs[TEST_COUNTRIES + VAL_COUNTRIES :],
    )
    splits = {
        "train": [example(country, answers, phrasing) for country, answers in train for phrasing in PHRASINGS],
        "val": [example(country, answers, PHRASINGS[0]) for country, answers in val],
        "test": [example(country, answers, PHRASINGS[0]) for country, answers in test],
    }
    output.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        with open(output / f"{name}.jsonl", "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return {name: len(rows) for name, rows in splits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=HERE / "data" / "capitals")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(write_task(args.output, args.seed)))


if __name__ == "__main__":
    main()
