"""Tests for opd.data.converters (prompt templates, math-cl rows) and the conversion CLI opd.data.convert_math_cl."""

import json
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet
import pytest

from opd.data.convert_math_cl import main
from opd.data.converters import load_prompt_template, math_cl_to_chat
from opd.data.datasets import load_chat_dataset
from opd.utils.errors import ConfigError, DataError

REPO_ROOT = Path(__file__).resolve().parents[3]
MATH_PROMPT_FILE = REPO_ROOT / "examples" / "prompts" / "math_think_answer.txt"

MATH_ROWS = [
    {"problem": "What is 1+1?", "ground_truth_answer": "2"},
    {"problem": "Compute $\\frac{1}{2} + \\frac{1}{4}$.", "ground_truth_answer": "\\frac{3}{4}"},
    {"problem": "How many primes are below 10?", "ground_truth_answer": 4},
    {"problem": "Écrivez π à deux décimales.", "ground_truth_answer": 3.14},
]


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompt.txt"
    path.write_text("Solve: {prompt}\nPut the answer in \\boxed{{}}.\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def expected_chat(row: dict, template: str) -> dict:
    return {
        "messages": [{"role": "user", "content": template.format(prompt=row["problem"])}],
        "ground_truth": str(row["ground_truth_answer"]),
        "problem": row["problem"],
    }


# ---------------------------------------------------------------------------
# The shipped math prompt
# ---------------------------------------------------------------------------


def test_math_prompt_file_renders_the_specified_prompt():
    template = load_prompt_template(MATH_PROMPT_FILE)
    rendered = template.format(prompt="What is 1+1?")
    assert rendered.startswith("A conversation between User and Assistant. The User asks a question, ")
    assert "<think> reasoning process here </think> <answer> answer here </answer>. User: You must" in rendered
    assert "\\boxed{} tag. What is 1+1?\nAssistant: <think>" in rendered
    assert rendered.endswith("<think>")


def test_math_prompt_file_has_no_trailing_newline_and_single_newline():
    raw = MATH_PROMPT_FILE.read_bytes()
    assert not raw.endswith(b"\n")
    assert raw.count(b"\n") == 1
    assert b"\\boxed{{}} tag. {prompt}\nAssistant: <think>" in raw


# ---------------------------------------------------------------------------
# load_prompt_template
# ---------------------------------------------------------------------------


def test_template_text_is_kept_exactly(prompt_file):
    assert load_prompt_template(prompt_file) == "Solve: {prompt}\nPut the answer in \\boxed{{}}.\n"
    assert load_prompt_template(str(prompt_file)).endswith("}}.\n")


def test_template_without_placeholder(tmp_path):
    path = tmp_path / "no_placeholder.txt"
    path.write_text("Solve the problem.", encoding="utf-8")
    with pytest.raises(
        DataError, match=rf"prompt file {re.escape(str(path))} must contain the \{{prompt\}} placeholder"
    ):
        load_prompt_template(path)


def test_template_with_escaped_placeholder_only(tmp_path):
    # "{{prompt}}" renders as the literal text "{prompt}", so nothing would be substituted.
    path = tmp_path / "escaped.txt"
    path.write_text("Solve {{prompt}}", encoding="utf-8")
    with pytest.raises(DataError, match=r"must contain the \{prompt\} placeholder"):
        load_prompt_template(path)


def test_template_with_unknown_placeholder(tmp_path):
    path = tmp_path / "extra.txt"
    path.write_text("Solve {prompt} and write \\boxed{answer}", encoding="utf-8")
    with pytest.raises(DataError, match=r"unknown placeholder\(s\) \{answer\}; .*literal braces as \{\{ and \}\}"):
        load_prompt_template(path)


def test_template_with_unbalanced_brace(tmp_path):
    path = tmp_path / "brace.txt"
    path.write_text("Solve {prompt} and write \\boxed{", encoding="utf-8")
    with pytest.raises(DataError, match=rf"prompt file {re.escape(str(path))} is not a valid str.format template"):
        load_prompt_template(path)


def test_missing_template_file(tmp_path):
    path = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=rf"prompt file {re.escape(str(path))} not found"):
        load_prompt_template(path)


# ---------------------------------------------------------------------------
# math_cl_to_chat
# ---------------------------------------------------------------------------


def test_math_cl_to_chat_builds_a_user_turn():
    example = math_cl_to_chat({"problem": "What is 1+1?", "ground_truth_answer": 2, "level": 1}, "Q: {prompt} {{}}")
    assert example == {
        "messages": [{"role": "user", "content": "Q: What is 1+1? {}"}],
        "ground_truth": "2",
        "problem": "What is 1+1?",
        "level": 1,  # other columns ride along (e.g. a per-example teacher context)
    }


def test_math_cl_problem_braces_are_not_interpreted():
    # Only the template is a format string; braces in the problem are plain text.
    example = math_cl_to_chat({"problem": "Find {x} if \\frac{1}{2}", "ground_truth_answer": "1"}, "{prompt}")
    assert example["messages"][0]["content"] == "Find {x} if \\frac{1}{2}"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"question": "q", "ground_truth_answer": "1"},
            r"missing \"problem\" .*found keys: ground_truth_answer, question",
        ),
        ({"problem": "", "ground_truth_answer": "1"}, r"\"problem\" must be a non-empty string, got an empty string"),
        ({"problem": ["q"], "ground_truth_answer": "1"}, r"\"problem\" must be a non-empty string, got list"),
        ({"problem": "q", "answer": "1"}, r"missing \"ground_truth_answer\" .*found keys: answer, problem"),
        (
            {"problem": "q", "ground_truth_answer": True},
            r"\"ground_truth_answer\" must be a string or a number, got bool",
        ),
        (
            {"problem": "q", "ground_truth_answer": ["1"]},
            r"\"ground_truth_answer\" must be a string or a number, got list",
        ),
    ],
)
def test_math_cl_to_chat_rejects_bad_rows(row, message):
    with pytest.raises(DataError, match=message):
        math_cl_to_chat(row, "{prompt}")


# ---------------------------------------------------------------------------
# load_chat_dataset(data_format="math_cl")
# ---------------------------------------------------------------------------


def test_math_cl_jsonl_end_to_end(tmp_path):
    source = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    examples = load_chat_dataset(str(source), data_format="math_cl", prompt_file=str(MATH_PROMPT_FILE))

    template = MATH_PROMPT_FILE.read_text(encoding="utf-8")
    assert examples == [expected_chat(row, template) for row in MATH_ROWS]
    first = examples[0]["messages"][0]["content"]
    assert first.endswith("\\boxed{} tag. What is 1+1?\nAssistant: <think>")
    assert [example["ground_truth"] for example in examples] == ["2", "\\frac{3}{4}", "4", "3.14"]


def test_math_cl_from_parquet_and_saved_dataset_match_jsonl(tmp_path, prompt_file):
    template = prompt_file.read_text(encoding="utf-8")
    rows = [row for row in MATH_ROWS if isinstance(row["ground_truth_answer"], str)]  # one Arrow column type
    parquet = tmp_path / "math.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), parquet)
    saved = tmp_path / "saved"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(saved))

    expected = [expected_chat(row, template) for row in rows]
    assert load_chat_dataset(str(parquet), data_format="math_cl", prompt_file=str(prompt_file)) == expected
    assert load_chat_dataset(str(saved), split="test", data_format="math_cl", prompt_file=str(prompt_file)) == expected


def test_math_cl_requires_prompt_file(tmp_path):
    source = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    with pytest.raises(ConfigError, match=r"data.prompt_file is required when data_format is \"math_cl\""):
        load_chat_dataset(str(source), data_format="math_cl")


def test_math_cl_bad_row_names_file_and_line(tmp_path, prompt_file):
    source = write_jsonl(tmp_path / "math.jsonl", [MATH_ROWS[0], MATH_ROWS[1], {"problem": "q"}])
    with pytest.raises(
        DataError, match=rf"data file {re.escape(str(source))}, line 3: missing \"ground_truth_answer\""
    ):
        load_chat_dataset(str(source), data_format="math_cl", prompt_file=str(prompt_file))


def test_math_cl_bad_template_is_reported_before_the_data(tmp_path):
    bad_template = tmp_path / "bad.txt"
    bad_template.write_text("no placeholder here", encoding="utf-8")
    with pytest.raises(DataError, match=r"must contain the \{prompt\} placeholder"):
        load_chat_dataset(str(tmp_path / "does_not_exist.jsonl"), data_format="math_cl", prompt_file=str(bad_template))


# ---------------------------------------------------------------------------
# CLI: python -m opd.data.convert_math_cl
# ---------------------------------------------------------------------------


def test_cli_writes_jsonl_that_loads_back(tmp_path, capsys):
    source = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    output = tmp_path / "out" / "chat.jsonl"  # parent directory does not exist yet

    status = main(["--input", str(source), "--output", str(output), "--prompt-file", str(MATH_PROMPT_FILE)])

    assert status == 0
    assert f"wrote 4 examples to {output}" in capsys.readouterr().out
    text = output.read_text(encoding="utf-8")
    assert "Écrivez π" in text  # ensure_ascii=False keeps non-ASCII readable
    assert len(text.splitlines()) == len(MATH_ROWS)

    template = MATH_PROMPT_FILE.read_text(encoding="utf-8")
    assert load_chat_dataset(str(output)) == [expected_chat(row, template) for row in MATH_ROWS]


def test_cli_reads_a_saved_dataset_split_with_max_examples(tmp_path, prompt_file):
    rows = [row for row in MATH_ROWS if isinstance(row["ground_truth_answer"], str)]
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows)}
    ).save_to_disk(str(saved))
    output = tmp_path / "chat.jsonl"

    status = main(
        [
            "--input", str(saved),
            "--split", "test",
            "--output", str(output),
            "--prompt-file", str(prompt_file),
            "--max-examples", "2",
        ]
    )  # fmt: skip

    assert status == 0
    template = prompt_file.read_text(encoding="utf-8")
    assert load_chat_dataset(str(output)) == [expected_chat(row, template) for row in rows[:2]]


def test_cli_reports_data_errors_with_exit_status_2(tmp_path, prompt_file, capsys):
    source = write_jsonl(tmp_path / "math.jsonl", [MATH_ROWS[0], {"problem": 5, "ground_truth_answer": "5"}])
    output = tmp_path / "chat.jsonl"

    status = main(["--input", str(source), "--output", str(output), "--prompt-file", str(prompt_file)])

    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(f'error: data file {source}, line 2: "problem" must be a non-empty string, got int')
    assert "Traceback" not in err
    assert not output.exists()  # nothing half-written


def test_cli_missing_input_exits_2(tmp_path, prompt_file, capsys):
    missing = tmp_path / "missing.parquet"
    status = main(["--input", str(missing), "--output", str(tmp_path / "o.jsonl"), "--prompt-file", str(prompt_file)])
    assert status == 2
    assert f"data file {missing} not found" in capsys.readouterr().err


def test_cli_runs_as_a_module(tmp_path, prompt_file):
    source = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS[:1])
    output = tmp_path / "chat.jsonl"
    args = ["--input", str(source), "--output", str(output), "--prompt-file", str(prompt_file)]

    ok = subprocess.run(
        [sys.executable, "-m", "opd.data.convert_math_cl", *args], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(output.read_text(encoding="utf-8"))["ground_truth"] == "2"

    bad_args = [*args[:-1], str(tmp_path / "missing_prompt.txt")]
    failed = subprocess.run(
        [sys.executable, "-m", "opd.data.convert_math_cl", *bad_args], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert failed.returncode == 2
    assert failed.stderr.strip() == f"error: prompt file {tmp_path / 'missing_prompt.txt'} not found"


def test_math_cl_solution_becomes_the_assistant_turn():
    template = "Q: {prompt}\nA: <think>"
    example = math_cl_to_chat(
        {"problem": "What is 1 + 2?", "ground_truth_answer": 3, "solution": "1+2=3. </think> <answer> \\boxed{3} </answer>"},
        template,
    )
    assert example["messages"] == [
        {"role": "user", "content": "Q: What is 1 + 2?\nA: <think>"},
        {"role": "assistant", "content": "1+2=3. </think> <answer> \\boxed{3} </answer>"},
    ]
    assert example["ground_truth"] == "3"
    with pytest.raises(DataError, match='"solution"'):
        math_cl_to_chat({"problem": "p", "ground_truth_answer": "1", "solution": ""}, template)
