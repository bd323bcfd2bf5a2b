"""The real-model example's task (``examples/real_model/make_capitals_task.py``): its answer list, splits and grader."""

from __future__ import annotations

import importlib.util
import json

import pytest
from opd_test_helpers import REPO_ROOT

from opd.data.datasets import load_chat_dataset

SCRIPT = REPO_ROOT / "examples" / "real_model" / "make_capitals_task.py"


@pytest.fixture(scope="module")
def task():
    spec = importlib.util.spec_from_file_location("make_capitals_task", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_answer_list_names_each_country_once_with_its_capitals(task):
    pairs = task.read_answer_list()
    countries = [country for country, _ in pairs]
    assert len(countries) == len(set(countries)) == 127
    assert all(capitals and all(capitals) for _, capitals in pairs)
    # A capital that bears its country's name would be "named" by every answer that repeats the question.
    assert not [country for country, capitals in pairs if any(task.is_correct(country, [c]) for c in capitals)]


def test_the_splits_are_disjoint_by_country_deterministic_and_chat_examples(task, tmp_path):
    sizes = task.write_task(tmp_path / "a", seed=0)
    task.write_task(tmp_path / "b", seed=0)
    assert sizes == {"train": 71 * len(task.PHRASINGS), "val": task.VAL_COUNTRIES, "test": task.TEST_COUNTRIES}
    countries = {}
    for split in ("train", "val", "test"):
        text = (tmp_path / "a" / f"{split}.jsonl").read_text(encoding="utf-8")
        assert text == (tmp_path / "b" / f"{split}.jsonl").read_text(encoding="utf-8")
        rows = [json.loads(line) for line in text.splitlines()]
        countries[split] = {row["messages"][1]["content"].split(" is ")[0] for row in rows}
        assert len(load_chat_dataset(str(tmp_path / "a" / f"{split}.jsonl"))) == len(rows)
        for row in rows:  # the reference answer is right by the task's own grader
            assert task.is_correct(row["messages"][1]["content"], row["answers"])
    assert not countries["train"] & countries["test"] and not countries["val"] & countries["test"]
    assert not countries["train"] & countries["val"]
    other = task.write_task(tmp_path / "c", seed=1)
    assert other == sizes
    assert (tmp_path / "c" / "test.jsonl").read_text() != (tmp_path / "a" / "test.jsonl").read_text()


@pytest.mark.parametrize(
    ("response", "answers", "right"),
    [
        ("The capital of France is Paris.", ["Paris"], True),
        ("paris", ["Paris"], True),
        ("It is Parisian in style.", ["Paris"], False),  # a whole word only
        ("The capital of Tunisia is Tunis.", ["Tunis"], True),
        ("Tunisia is a country.", ["Tunis"], False),
        ("Its capital is Kiev.", ["Kyiv", "Kiev"], True),  # any accepted spelling
        ("Brasília.", ["Brasilia", "Brasília"], True),
        ("The capital of Kuwait is Kuwait.", ["Kuwait City"], False),
        ("", ["Paris"], False),
    ],
)
def test_an_answer_is_right_when_it_names_an_accepted_capital(task, response, answers, right):
    assert task.is_correct(response, answers) is right
