"""The demo task generator (examples/data/make_arithmetic_task.py): deterministic, disjoint, correct traces."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from opd.data.converters import load_prompt_template, math_cl_to_chat
from opd.rollout.environments.math_verifier import is_correct

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "data" / "make_arithmetic_task.py"
PROMPT = REPO / "examples" / "prompts" / "math_think_answer.txt"
SIZES = {"train": 400, "val": 50, "test": 60}


def generate(out_dir: Path, *extra: str) -> dict[str, list[dict]]:
    subprocess.run(
        [sys.executable, str(SCRIPT), "--out-dir", str(out_dir), "--train-size", str(SIZES["train"]),
         "--val-size", str(SIZES["val"]), "--test-size", str(SIZES["test"]), *extra],
        check=True, capture_output=True,
    )
    return {split: [json.loads(line) for line in (out_dir / f"{split}.jsonl").read_text().splitlines()]
            for split in SIZES}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("task"))


def operands(row: dict) -> tuple[int, int]:
    a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\?", row["problem"]).groups()
    return int(a), int(b)


def test_split_sizes_and_disjoint_problems(task):
    assert {split: len(rows) for split, rows in task.items()} == SIZES
    problems = {split: {row["problem"] for row in rows} for split, rows in task.items()}
    assert sum(len(p) for p in problems.values()) == sum(SIZES.values())  # no duplicate anywhere
    assert not problems["train"] & problems["test"] and not problems["val"] & problems["test"]


def test_same_seed_same_files_and_other_seed_other_problems(task, tmp_path):
    assert generate(tmp_path / "again") == task
    assert generate(tmp_path / "other", "--seed", "1")["test"] != task["test"]


def test_held_out_splits_do_not_depend_on_the_train_size(task, tmp_path):
    bigger = subprocess.run(
        [sys.executable, str(SCRIPT), "--out-dir", str(tmp_path), "--train-size", "900",
         "--val-size", str(SIZES["val"]), "--test-size", str(SIZES["test"])], check=True, capture_output=True)
    assert bigger.returncode == 0
    test_rows = [json.loads(line) for line in (tmp_path / "test.jsonl").read_text().splitlines()]
    assert test_rows == task["test"]


def test_every_trace_step_is_correct_arithmetic(task):
    """Replays each trace column by column against the operands' digits and carries."""
    step_pattern = re.compile(r"(\d)\+(\d)(?:\+(\d))?=(\d+) write (\d)(?: carry (\d))?")
    for row in task["train"] + task["test"]:
        a, b = operands(row)
        think = row["solution"].split(" </think>")[0]
        steps = step_pattern.findall(think)
        digits_a, digits_b = str(a)[::-1], str(b)[::-1]
        carry = 0
        for position, (x, y, c, total, written, carry_out) in enumerate(steps):
            assert (int(x), int(y)) == (int(digits_a[position]), int(digits_b[position]))
            assert int(c or 0) == carry
            assert int(total) == int(x) + int(y) + carry and int(written) == int(total) % 10
            carry = int(total) // 10
            assert int(carry_out or 0) == carry
        assert len(steps) == len(digits_a)
        assert think.endswith(f"So {a}+{b}={a + b}.")
        assert str(a + b) == row["ground_truth_answer"]


def test_rows_become_spec_prompts_whose_solution_the_verifier_accepts(task):
    template = load_prompt_template(PROMPT)
    for row in task["val"]:
        messages = math_cl_to_chat(row, template)["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert row["problem"] in messages[0]["content"] and messages[0]["content"].rstrip().endswith("<think>")
        assert is_correct(messages[1]["content"], row["ground_truth_answer"])
        assert not is_correct(messages[1]["content"], str(int(row["ground_truth_answer"]) + 1))


@pytest.mark.parametrize("trace", ["reference", "answer_only"])
def test_other_trace_formats_keep_the_problems_and_a_correct_answer_the_verifier_accepts(task, tmp_path, trace):
    other = generate(tmp_path / trace, "--trace", trace)
    for split in SIZES:
        assert [row["problem"] for row in other[split]] == [row["problem"] for row in task[split]]
    template = load_prompt_template(PROMPT)
    for row, teacher_row in zip(other["train"], task["train"], strict=True):
        a, b = operands(row)
        assert row["solution"] != teacher_row["solution"]  # not the teacher's format
        assert " write " not in row["solution"]
        answer = math_cl_to_chat(row, template)["messages"][1]["content"]
        assert is_correct(answer, str(a + b)) and not is_correct(answer, str(a + b + 1))
    if trace == "answer_only":
        assert all(row["solution"].startswith("</think>") for row in other["train"])


def test_reference_traces_are_correct_arithmetic_in_their_own_format(tmp_path):
    rows = generate(tmp_path / "reference", "--trace", "reference")["train"]
    step_pattern = re.compile(r"(\d)\+(\d)(?:\+(\d))? is (\d+), put (\d)(?:, carry (\d))?")
    for row in rows:
        a, b = operands(row)
        think = row["solution"].split(" </think>")[0]
        digits_a, digits_b = str(a)[::-1], str(b)[::-1]
        carry = 0
        steps = step_pattern.findall(think)
        assert len(steps) == len(digits_a)
        for position, (x, y, c, total, written, carry_out) in enumerate(steps):
            assert (int(x), int(y), int(c or 0)) == (int(digits_a[position]), int(digits_b[position]), carry)
            assert int(total) == int(x) + int(y) + carry and int(written) == int(total) % 10
            carry = int(total) // 10
            assert int(carry_out or 0) == carry
        assert think.endswith(f"{a}+{b}={a + b}.") and (carry == 0 or f"put {carry}." in think)
