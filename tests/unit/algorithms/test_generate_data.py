"""Tests for ``opd generate`` (:mod:`opd.generate`): teacher-made fixed data.

Every run uses the committed demo teacher (``examples/demo/models/teacher``, which solves
3-digit addition) on a math-cl-shaped file (``problem`` / ``ground_truth_answer`` rows, the
layout of pe-nlp/math-cl, built here from the arithmetic task without its solutions) and
the specification's math prompt, on CPU.

What is checked:

* the output is chat data that ``opd train``'s loader reads back: prompt turns + one final
  assistant answer per row, the ground truth kept, source order;
* the same command writes the same bytes; a rerun of a finished file draws nothing;
* resumption: after a torn last line, rows of a batch that was written but not recorded,
  or a torn progress line, the rerun ends with exactly the bytes of an uninterrupted run
  (no row lost, none written twice);
* rejection sampling: only rows the math verifier accepts are kept, retries stay within
  ``max_attempts_per_prompt``, and the counts add up;
* a λ = 0.5 distillation run on the generated file trains, and its fixed-data steps train
  on exactly the generated answers;
* bad input is one clear error: a missing ground truth with ``only_correct``, an output
  that is a directory or not ``.jsonl``, a rerun with other settings, a foreign output
  file, greedy decoding asked for several samples, a served teacher without a model path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import opd.distillation.step as schedule_module
from opd.cli import main
from opd.data.converters import load_prompt_template, math_cl_to_chat
from opd.data.dataloaders import prepare_examples
from opd.data.datasets import load_chat_dataset
from opd.data.sequences import encode_prompt, encode_response
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.generate import (
    PROGRESS_SUFFIX,
    GenerateDataConfig,
    GenerateMasterConfig,
    GenerateSummary,
    generate_data,
)
from opd.models.decoding import GenerateStrategyConfig
from opd.models.loading import load_tokenizer
from opd.rollout.environments.math_verifier import is_correct
from opd.utils.config import load_config
from opd.utils.errors import ConfigError, DataError

REPO_ROOT = Path(__file__).resolve().parents[3]
GENERATE_CONFIG = REPO_ROOT / "examples" / "configs" / "generate_demo.yaml"
DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"
TEACHER = REPO_ROOT / "examples" / "demo" / "models" / "teacher"
STUDENT = REPO_ROOT / "examples" / "demo" / "models" / "student"
PROMPT_FILE = REPO_ROOT / "examples" / "prompts" / "math_think_answer.txt"
ARITHMETIC = REPO_ROOT / "examples" / "data" / "arithmetic" / "val.jsonl"

NUM_ROWS = 6
BATCH_SIZE = 3  # 2 batches


def write_math_cl(path: Path, rows: int = NUM_ROWS) -> Path:
    """A math-cl file: the first ``rows`` arithmetic problems without their worked solutions."""
    lines = []
    for line in ARITHMETIC.read_text().splitlines()[:rows]:
        row = json.loads(line)
        lines.append(json.dumps({"problem": row["problem"], "ground_truth_answer": row["ground_truth_answer"]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def generate_config(source: Path, output: Path, *overrides: str) -> GenerateMasterConfig:
    """The demo generate config on ``source``, writing ``output``, sampling hot (so seeds matter)."""
    return load_config(
        GenerateMasterConfig,
        GENERATE_CONFIG,
        [
            f"model.teacher_model_path={TEACHER}",
            f"model.student_model_path={STUDENT}",
            f"data.train_path={source}",
            f"data.prompt_file={PROMPT_FILE}",
            "data.val_path=null",
            f"generate.output_path={output}",
            f"generate.batch_size={BATCH_SIZE}",
            "generate.max_attempts_per_prompt=null",
            "generate.only_correct=false",
            # Hot enough that the demo teacher's answers vary (about a third are wrong), so equal
            # outputs come from the seeds; answers cut off at max_length are kept unless a test says not.
            "generate.generate_strategy.temperature=1.5",
            "generate.keep_truncated=true",
            "generate.progress_bar=false",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_math_cl(tmp_path_factory.mktemp("source") / "math_cl.jsonl")


@pytest.fixture(scope="module")
def reference(source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GenerateSummary]:
    """One uninterrupted run: the output every other run is compared with."""
    output = tmp_path_factory.mktemp("reference") / "answers.jsonl"
    return output, generate_data(generate_config(source, output))


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------- format


def test_output_is_chat_fixed_data_that_the_training_loader_reads(source: Path, reference) -> None:
    output, summary = reference
    rows = read_rows(output)
    assert summary.totals.rows == len(rows) == NUM_ROWS
    assert summary.totals.samples == NUM_ROWS and summary.batches_this_run == NUM_ROWS // BATCH_SIZE
    assert [row["generated"]["source_index"] for row in rows] == list(range(NUM_ROWS))

    loaded = load_chat_dataset(str(output), data_format="chat")
    template = load_prompt_template(PROMPT_FILE)
    sources = [json.loads(line) for line in source.read_text().splitlines()]
    for example, source_row, row in zip(loaded, sources, rows):
        expected_prompt = math_cl_to_chat(source_row, template)["messages"]
        assert example["messages"][:-1] == expected_prompt
        answer = example["messages"][-1]
        assert answer["role"] == "assistant" and answer["content"].strip()
        assert "<|im_end|>" not in answer["content"]  # the EOS is the template's to add, not the text's
        assert example["ground_truth"] == source_row["ground_truth_answer"]
        assert row["generated"]["correct"] == is_correct(answer["content"], source_row["ground_truth_answer"])
        assert row["generated"]["model"] == str(TEACHER)

    # What `opd train` makes of it: every example has a fixed response ending in the EOS and a ground truth.
    tokenizer = load_tokenizer(str(STUDENT))
    prepared = prepare_examples(loaded, tokenizer, None, str(output))
    assert all(item["response_ids"] and item["response_ids"][-1] == tokenizer.eos_token_id for item in prepared)
    assert [item["ground_truth"] for item in prepared] == [row["ground_truth_answer"] for row in sources]
    # The demo teacher solves most sums even at temperature 1.5: the graded counts reflect it.
    assert summary.totals.graded == NUM_ROWS
    assert summary.totals.correct == sum(row["generated"]["correct"] for row in rows) > NUM_ROWS // 2


def test_same_command_writes_same_bytes_and_a_finished_rerun_draws_nothing(source, reference, tmp_path) -> None:
    """Equal bytes come from the per-batch seeds: at this temperature two samples of one prompt
    differ (test_several_answers_per_prompt_are_adjacent_and_distinct_samples)."""
    output, _ = reference
    again = tmp_path / "again.jsonl"
    generate_data(generate_config(source, again))
    assert again.read_bytes() == output.read_bytes()

    progress = again.with_name(again.name + PROGRESS_SUFFIX).read_bytes()
    summary = generate_data(generate_config(source, again))
    assert summary.batches_this_run == 0 and summary.resumed_prompts == NUM_ROWS
    assert summary.totals.rows == NUM_ROWS
    assert again.read_bytes() == output.read_bytes()
    assert again.with_name(again.name + PROGRESS_SUFFIX).read_bytes() == progress
    assert f"{NUM_ROWS} rows for {NUM_ROWS} of {NUM_ROWS} prompts" in summary.line()


# --------------------------------------------------------------------------- resumption


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


@pytest.mark.parametrize(
    "case",
    ["unrecorded_batch_and_torn_row", "torn_progress_line", "torn_header"],
)
def test_resume_after_a_crash_loses_no_row_and_writes_none_twice(source, reference, tmp_path, case) -> None:
    """The files a crash can leave behind (rows are synced before their batch's record)."""
    output, _ = reference
    progress = output.with_name(output.name + PROGRESS_SUFFIX)
    rows, records = _lines(output), _lines(progress)  # records[0] is the header
    partial = tmp_path / "answers.jsonl"
    partial_progress = partial.with_name(partial.name + PROGRESS_SUFFIX)
    done_batches = {"torn_progress_line": 1}.get(case, 0)
    kept_rows = rows[: done_batches * BATCH_SIZE]
    kept_records = records[: 1 + done_batches]
    if case == "unrecorded_batch_and_torn_row":
        kept_rows = rows[:BATCH_SIZE]  # batch 0's rows made it to disk, its record did not
    if case == "torn_progress_line":
        kept_rows = rows  # batch 1's rows made it to disk, its record only in part
    torn_row = rows[len(kept_rows)][:40] if case == "unrecorded_batch_and_torn_row" else b""
    torn_record = records[2][:15] if case == "torn_progress_line" else b""
    if case == "torn_header":
        kept_records, torn_record = [], records[0][:30]
    partial.write_bytes(b"".join(kept_rows) + torn_row)
    partial_progress.write_bytes(b"".join(kept_records) + torn_record)

    summary = generate_data(generate_config(source, partial))
    assert summary.resumed_prompts == done_batches * BATCH_SIZE
    assert summary.batches_this_run == NUM_ROWS // BATCH_SIZE - done_batches
    assert partial.read_bytes() == output.read_bytes()
    assert partial_progress.read_bytes() == progress.read_bytes()
    indices = [row["generated"]["source_index"] for row in read_rows(partial)]
    assert indices == list(range(NUM_ROWS))


def test_resume_refuses_an_output_shorter_than_its_progress(source, reference, tmp_path) -> None:
    output, _ = reference
    partial = tmp_path / "answers.jsonl"
    partial.write_bytes(b"".join(_lines(output)[:2]))
    progress = output.with_name(output.name + PROGRESS_SUFFIX)
    partial.with_name(partial.name + PROGRESS_SUFFIX).write_bytes(b"".join(_lines(progress)[:3]))
    with pytest.raises(DataError, match=r"holds 2 complete rows but answers\.jsonl\.progress\.jsonl records 6"):
        generate_data(generate_config(source, partial))


# --------------------------------------------------------------------------- rejection sampling


def test_only_correct_keeps_verified_answers_and_retries_within_the_limit(source, tmp_path) -> None:
    output = tmp_path / "verified.jsonl"
    config = generate_config(
        source,
        output,
        "generate.only_correct=true",
        "generate.max_attempts_per_prompt=3",
        "generate.keep_truncated=false",
    )
    summary = generate_data(config)
    totals = summary.totals
    rows = read_rows(output)
    sources = [json.loads(line) for line in source.read_text().splitlines()]
    assert totals.rejected_incorrect > 0, "no answer was rejected: the test would not show the filter"
    assert len(rows) == totals.rows > 0
    for row in rows:
        truth = sources[row["generated"]["source_index"]]["ground_truth_answer"]
        assert row["generated"]["correct"] is True
        assert is_correct(row["messages"][-1]["content"], truth)
        assert 0 <= row["generated"]["sample"] < 3
    # Every drawn sample is either kept or rejected for a reason; retries stay within the limit.
    assert totals.samples == totals.rows + totals.rejected_incorrect + totals.rejected_truncated
    assert NUM_ROWS < totals.samples <= 3 * NUM_ROWS
    assert any(row["generated"]["sample"] > 0 for row in rows), "no answer was kept on a retry"
    answered = {row["generated"]["source_index"] for row in rows}
    assert len(answered) == len(rows)  # one answer per prompt at most
    assert totals.prompts_without_answer == NUM_ROWS - len(answered)
    line = summary.line()
    assert f"{totals.rows} kept" in line and f"({totals.rejected_incorrect} incorrect" in line


def test_several_answers_per_prompt_are_adjacent_and_distinct_samples(source, tmp_path) -> None:
    output = tmp_path / "two.jsonl"
    config = generate_config(
        source,
        output,
        "generate.num_samples_per_prompt=2",
        "data.max_train_examples=4",
    )
    summary = generate_data(config)
    rows = read_rows(output)
    assert summary.totals.rows == summary.totals.samples == len(rows) == 8
    keys = [(row["generated"]["source_index"], row["generated"]["sample"]) for row in rows]
    assert keys == [(index, sample) for index in range(4) for sample in range(2)]
    # Two samples of one prompt are drawn independently: at temperature 1.5 not all pairs coincide.
    assert any(rows[i]["messages"][-1] != rows[i + 1]["messages"][-1] for i in range(0, 8, 2))


# --------------------------------------------------------------------------- training on the output


def test_lambda_half_training_uses_the_generated_answers(reference, tmp_path, monkeypatch) -> None:
    output, _ = reference
    answers = {row["messages"][-1]["content"] for row in read_rows(output)}
    config = load_config(
        MasterConfig,
        DEMO_CONFIG,
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.teacher_model_path={TEACHER}",
            f"model.student_model_path={STUDENT}",
            f"data.train_path={output}",
            "data.data_format=chat",
            "data.val_path=null",
            "distillation.lambda=0.5",
            "distillation.generate_strategy.max_length=8",
            "training.batch_size=2",
            "training.micro_batch_size=2",
            "training.max_num_steps=4",
            "training.num_epochs=2",
            "training.save_freq=0",
            "checkpointing.enabled=false",
            "logger.progress_bar=false",
        ],
    )
    fixed_batches: list[list[dict]] = []
    build = schedule_module.build_fixed_data_batch

    def recording_build(examples, *args, **kwargs):
        fixed_batches.append(list(examples))
        return build(examples, *args, **kwargs)

    monkeypatch.setattr(schedule_module, "build_fixed_data_batch", recording_build)
    components = setup(config)
    try:
        distillation_train(components)
    finally:
        components.close()

    records = [json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    decisions = [record["train/on_policy"] for record in records if "train/loss" in record]
    assert len(decisions) == 4 and 0 in decisions and 1 in decisions
    assert len(fixed_batches) == decisions.count(0)
    # Each fixed-data row: its prompt, then exactly the generated answer (+ EOS) as the chat template renders it.
    tokenizer = components.tokenizer
    expected = {}
    for row in read_rows(output):
        prompt, answer = row["messages"][:-1], row["messages"][-1]
        expected[tuple(encode_prompt(tokenizer, prompt))] = encode_response(tokenizer, prompt, answer)
    trained = [example for examples in fixed_batches for example in examples]
    assert len(trained) == 2 * decisions.count(0)
    for example in trained:
        assert example["response_ids"] == expected[tuple(example["prompt_ids"])]
        assert tokenizer.decode(example["response_ids"], skip_special_tokens=True) in answers


# --------------------------------------------------------------------------- errors


def test_only_correct_without_ground_truth_is_one_clear_error(tmp_path) -> None:
    chat = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "What is 1 + 1?"}]},
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "ground_truth": "4"},
    ]
    chat.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = generate_config(chat, tmp_path / "out.jsonl", "data.data_format=chat", "generate.only_correct=true")
    with pytest.raises(
        ConfigError,
        match=r"only_correct = true .* 1 of 2 rows in '.*chat.jsonl' have none "
        r"\(the first is row 1\)",
    ):
        generate_data(config)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    ("name", "message"),
    [("a_directory", "is a directory"), ("answers.json", "must end in .jsonl")],
)
def test_unusable_output_path_is_one_clear_error(source, tmp_path, name, message) -> None:
    output = tmp_path / name
    if name == "a_directory":
        output.mkdir()
    with pytest.raises(ConfigError, match=message):
        generate_data(generate_config(source, output))


def test_output_is_the_input_is_an_error(tmp_path) -> None:
    chat = write_math_cl(tmp_path / "data.jsonl")
    with pytest.raises(ConfigError, match=r"is data\.train_path itself"):
        generate_data(generate_config(chat, chat))


def test_rerun_with_other_settings_names_what_changed(source, reference, tmp_path) -> None:
    output, _ = reference
    copy = tmp_path / "answers.jsonl"
    copy.write_bytes(output.read_bytes())
    progress = output.with_name(output.name + PROGRESS_SUFFIX)
    copy.with_name(copy.name + PROGRESS_SUFFIX).write_bytes(progress.read_bytes())
    with pytest.raises(ConfigError, match=r"generate.generate_strategy.temperature: 1.5 -> 0.5.*new file"):
        generate_data(generate_config(source, copy, "generate.generate_strategy.temperature=0.5"))
    with pytest.raises(ConfigError, match=r"prompts: '6 prompts.* -> '4 prompts"):
        generate_data(generate_config(source, copy, "data.max_train_examples=4"))
    assert copy.read_bytes() == output.read_bytes()


def test_an_output_without_progress_file_is_not_overwritten(source, tmp_path) -> None:
    output = tmp_path / "answers.jsonl"
    output.write_text('{"messages": []}\n')
    with pytest.raises(ConfigError, match="has no progress file"):
        generate_data(generate_config(source, output))
    assert output.read_text() == '{"messages": []}\n'


def test_greedy_with_several_samples_is_a_config_error(source, tmp_path) -> None:
    with pytest.raises(ConfigError, match="greedy gives the same answer on every attempt"):
        generate_config(
            source,
            tmp_path / "o.jsonl",
            "generate.generate_strategy.decoding_method=greedy",
            "generate.max_attempts_per_prompt=2",
        )
    with pytest.raises(ConfigError, match="max_attempts_per_prompt = 1 is below"):
        generate_config(
            source, tmp_path / "o.jsonl", "generate.num_samples_per_prompt=2", "generate.max_attempts_per_prompt=1"
        )
    with pytest.raises(ConfigError, match=r"unknown key 'generate\.num_samples'"):
        generate_config(source, tmp_path / "o.jsonl", "generate.num_samples=2")


def test_a_served_teacher_needs_a_model_path(source, tmp_path) -> None:
    config = generate_config(
        source,
        tmp_path / "o.jsonl",
        "teacher.backend=remote",
        "teacher.remote.url=http://127.0.0.1:1",
        "loss_fn.type=topk",
    )
    with pytest.raises(ConfigError, match=r"set generate\.model_path"):
        generate_data(config)


def test_cli_prints_the_summary_and_reports_errors_in_one_line(source, tmp_path, capsys) -> None:
    output = tmp_path / "cli.jsonl"
    args = [
        "generate",
        "--config",
        str(GENERATE_CONFIG),
        f"model.teacher_model_path={TEACHER}",
        f"model.student_model_path={STUDENT}",
        f"data.train_path={source}",
        f"data.prompt_file={PROMPT_FILE}",
        "data.max_train_examples=4",
        "generate.max_attempts_per_prompt=1",
        "generate.progress_bar=false",
    ]
    assert main([*args, f"generate.output_path={output}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("opd generate: 4 rows for 4 of 4 prompts written to")
    assert len(read_rows(output)) == 4
    assert main([*args, f"generate.output_path={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("opd: error: generate.output_path") and "is a directory" in err[-1]


@pytest.mark.parametrize("name", ["generate_math.yaml", "generate_demo.yaml"])
def test_example_configs_load(name: str) -> None:
    config = load_config(GenerateMasterConfig, REPO_ROOT / "examples" / "configs" / name)
    assert config.generate.only_correct and config.data.data_format == "math_cl"
    assert config.data.prompt_file == "examples/prompts/math_think_answer.txt"


def test_generate_math_yaml_documents_every_generate_key() -> None:
    section = yaml.safe_load((REPO_ROOT / "examples" / "configs" / "generate_math.yaml").read_text())["generate"]
    assert set(section) == set(GenerateDataConfig.model_fields)
    assert set(section["generate_strategy"]) == set(GenerateStrategyConfig.model_fields)
    config = load_config(GenerateMasterConfig, REPO_ROOT / "examples" / "configs" / "generate_math.yaml")
    assert config.model.teacher_model_path == "Qwen/Qwen2.5-32B-Instruct" and config.generate.model_path is None
    assert config.data.train_path == "pe-nlp/math-cl"
