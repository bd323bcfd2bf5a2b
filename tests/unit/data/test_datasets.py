"""Tests for opd.data.datasets: every source kind, validation errors, prompt/response split."""

import json
import re
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet
import pytest

from opd.data.datasets import load_chat_dataset, split_prompt_and_response
from opd.utils.errors import ConfigError, DataError

EXAMPLES = [
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "ground_truth": "4",
    },
    {
        "messages": [
            {"role": "user", "content": "Say hi in French."},
            {"role": "assistant", "content": "Bonjour — salut !"},
        ],
        "ground_truth": "Bonjour",
    },
    {
        "messages": [{"role": "user", "content": "Name a prime."}],
        "ground_truth": "2",
    },
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def bad_example(**fields) -> list[str]:
    """A JSONL file body whose third line is ``{"messages": ..., **fields}`` and the rest are valid."""
    good = json.dumps(EXAMPLES[0])
    return [good, good, json.dumps(fields), good]


# ---------------------------------------------------------------------------
# Sources: every format loads the same examples
# ---------------------------------------------------------------------------


@pytest.fixture
def sources(tmp_path: Path) -> dict[str, str]:
    """The same three examples stored in every supported local format."""
    jsonl = write_jsonl(tmp_path / "train.jsonl", EXAMPLES)

    json_list = tmp_path / "list.json"
    json_list.write_text(json.dumps(EXAMPLES, indent=2), encoding="utf-8")

    json_data = tmp_path / "wrapped.json"
    json_data.write_text(json.dumps({"version": 1, "data": EXAMPLES}), encoding="utf-8")

    parquet = tmp_path / "train.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(EXAMPLES), parquet)

    saved_dataset = tmp_path / "saved_dataset"
    datasets.Dataset.from_list(EXAMPLES).save_to_disk(str(saved_dataset))

    saved_dict = tmp_path / "saved_dict"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(EXAMPLES),
            "test": datasets.Dataset.from_list(EXAMPLES[:1]),
        }
    ).save_to_disk(str(saved_dict))

    return {
        "jsonl": str(jsonl),
        "json_list": str(json_list),
        "json_data": str(json_data),
        "parquet": str(parquet),
        "saved_dataset": str(saved_dataset),
        "saved_dict": str(saved_dict),
    }


@pytest.mark.parametrize("kind", ["jsonl", "json_list", "json_data", "parquet", "saved_dataset", "saved_dict"])
def test_every_format_loads_the_same_examples(sources, kind):
    assert load_chat_dataset(sources[kind]) == EXAMPLES


def test_saved_dataset_dict_uses_requested_split(sources):
    assert load_chat_dataset(sources["saved_dict"], split="test") == EXAMPLES[:1]


def test_unknown_split_lists_available_splits(sources):
    with pytest.raises(DataError, match=r"no split 'validation'; available splits: test, train"):
        load_chat_dataset(sources["saved_dict"], split="validation")


def test_extra_fields_are_preserved(tmp_path):
    row = {
        "id": 17,
        "messages": [{"role": "user", "content": "hi", "name": "alice"}],
        "ground_truth": "x",
        "meta": {"source": "unit-test", "tags": ["a", "b"]},
    }
    [example] = load_chat_dataset(str(write_jsonl(tmp_path / "extra.jsonl", [row])))
    assert example == row
    assert next(iter(example)) == "messages"


def test_arrow_null_padding_in_messages_is_dropped(tmp_path):
    # Arrow gives every message the union of keys, so "name" becomes None on the first row.
    rows = [
        {"messages": [{"role": "user", "content": "a"}]},
        {"messages": [{"role": "user", "content": "b", "name": "bob"}]},
    ]
    path = tmp_path / "padded.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    assert load_chat_dataset(str(path)) == rows


def test_blank_lines_in_jsonl_are_skipped(tmp_path):
    lines = ["", json.dumps(EXAMPLES[0]), "   ", json.dumps(EXAMPLES[1]), ""]
    assert load_chat_dataset(str(write_lines(tmp_path / "blank.jsonl", lines))) == EXAMPLES[:2]


def test_max_examples_keeps_the_first_n(sources):
    assert load_chat_dataset(sources["parquet"], max_examples=2) == EXAMPLES[:2]


def test_max_examples_stops_before_a_bad_row_past_the_cut_off(tmp_path):
    path = write_lines(tmp_path / "cut.jsonl", [json.dumps(EXAMPLES[0]), "{not json"])
    assert load_chat_dataset(str(path), max_examples=1) == EXAMPLES[:1]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_max_examples_must_be_a_positive_int(sources, bad):
    with pytest.raises(ConfigError, match=r"max_examples must be a positive integer or None, got "):
        load_chat_dataset(sources["jsonl"], max_examples=bad)


def test_unknown_data_format(sources):
    with pytest.raises(ConfigError, match=r"data_format must be one of \"chat\", \"math_cl\", got 'sharegpt'"):
        load_chat_dataset(sources["jsonl"], data_format="sharegpt")


def test_returned_examples_do_not_alias_each_other(sources):
    first = load_chat_dataset(sources["jsonl"])
    first[0]["messages"].append({"role": "assistant", "content": "4"})
    assert load_chat_dataset(sources["jsonl"]) == EXAMPLES


# ---------------------------------------------------------------------------
# Malformed data: one clear message naming file and position
# ---------------------------------------------------------------------------


def test_malformed_json_line_names_file_and_line(tmp_path):
    good = json.dumps(EXAMPLES[0])
    path = write_lines(tmp_path / "broken.jsonl", [good, good, '{"messages": [', good])
    with pytest.raises(DataError, match=rf"data file {re.escape(str(path))}, line 3: invalid JSON"):
        load_chat_dataset(str(path))


def test_line_numbers_count_blank_lines(tmp_path):
    path = write_lines(tmp_path / "gap.jsonl", [json.dumps(EXAMPLES[0]), "", "", "[1, 2]"])
    with pytest.raises(DataError, match=r", line 4: expected an object with a \"messages\" list, got list"):
        load_chat_dataset(str(path))


def test_wrong_role(tmp_path):
    path = write_lines(
        tmp_path / "role.jsonl",
        bad_example(messages=[{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]),
    )
    with pytest.raises(
        DataError,
        match=r"line 3: messages\[1\]: \"role\" must be one of "
        r"\"system\", \"user\", \"assistant\", \"tool\", got 'bot'",
    ):
        load_chat_dataset(str(path))


def test_missing_role(tmp_path):
    path = write_lines(tmp_path / "norole.jsonl", bad_example(messages=[{"content": "q"}]))
    with pytest.raises(DataError, match=r"line 3: messages\[0\]: \"role\" must be one of .* got nothing \(missing\)"):
        load_chat_dataset(str(path))


@pytest.mark.parametrize(("content", "type_name"), [(["a", "b"], "list"), (7, "int"), (None, "null")])
def test_non_string_content(tmp_path, content, type_name):
    path = write_lines(tmp_path / "content.jsonl", bad_example(messages=[{"role": "user", "content": content}]))
    with pytest.raises(DataError, match=rf"line 3: messages\[0\]: \"content\" must be a string, got {type_name}"):
        load_chat_dataset(str(path))


def test_message_that_is_not_a_dict(tmp_path):
    path = write_lines(tmp_path / "msg.jsonl", bad_example(messages=["hello"]))
    with pytest.raises(DataError, match=r"line 3: messages\[0\] must be a \{\"role\", \"content\"\} dict, got str"):
        load_chat_dataset(str(path))


def test_missing_messages_lists_found_keys(tmp_path):
    path = write_lines(tmp_path / "nomsg.jsonl", bad_example(prompt="hi", answer="x"))
    with pytest.raises(DataError, match=r"line 3: missing \"messages\"; found keys: answer, prompt"):
        load_chat_dataset(str(path))


def test_missing_messages_on_math_rows_suggests_math_cl(tmp_path):
    path = write_lines(tmp_path / "math.jsonl", bad_example(problem="1+1", ground_truth_answer="2"))
    with pytest.raises(DataError, match=r"line 3: missing \"messages\" \(.*data_format=\"math_cl\"\)"):
        load_chat_dataset(str(path))


def test_messages_must_be_a_list(tmp_path):
    path = write_lines(tmp_path / "str.jsonl", bad_example(messages="hello"))
    with pytest.raises(
        DataError,
        match=rf"data file {re.escape(str(path))}, line 3: "
        r"\"messages\" must be a list of \{\"role\", \"content\"\} dicts, got str",
    ):
        load_chat_dataset(str(path))


def test_messages_must_not_be_empty(tmp_path):
    path = write_lines(tmp_path / "empty_msgs.jsonl", bad_example(messages=[]))
    with pytest.raises(DataError, match=r"line 3: \"messages\" must not be empty"):
        load_chat_dataset(str(path))


def test_no_user_message(tmp_path):
    messages = [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]
    path = write_lines(tmp_path / "nouser.jsonl", bad_example(messages=messages))
    with pytest.raises(DataError, match=r"line 3: .*at least one \"user\" message, found roles: system, assistant"):
        load_chat_dataset(str(path))


def test_json_errors_report_item_number(tmp_path):
    path = tmp_path / "items.json"
    path.write_text(json.dumps([EXAMPLES[0], EXAMPLES[1], {"messages": [{"role": "user"}]}]), encoding="utf-8")
    with pytest.raises(
        DataError, match=rf"data file {re.escape(str(path))}, item 3: messages\[0\]: \"content\" must be a string"
    ):
        load_chat_dataset(str(path))


def test_invalid_json_file_reports_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"messages": []},\n  oops\n]\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"data file {re.escape(str(path))}, line 3: invalid JSON"):
        load_chat_dataset(str(path))


def test_json_file_must_hold_a_list(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text(json.dumps({"rows": EXAMPLES}), encoding="utf-8")
    with pytest.raises(
        DataError, match=r"expected a JSON list of examples or an object with a \"data\" list, got dict"
    ):
        load_chat_dataset(str(path))


def test_parquet_errors_report_row_number(tmp_path):
    rows = [EXAMPLES[0], {"messages": [{"role": "assistant", "content": "no user here"}], "ground_truth": "x"}]
    path = tmp_path / "rows.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=rf"data file {re.escape(str(path))}, row 2: .*at least one \"user\" message"):
        load_chat_dataset(str(path))


def test_saved_dataset_errors_report_split_and_row(tmp_path):
    rows = [EXAMPLES[2], {"messages": [{"role": "robot", "content": "x"}], "ground_truth": "y"}]
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(saved))
    with pytest.raises(
        DataError, match=rf"dataset {re.escape(str(saved))} \(split train\), row 2: messages\[0\]: \"role\""
    ):
        load_chat_dataset(str(saved))


def test_unreadable_parquet(tmp_path):
    path = tmp_path / "junk.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match=rf"data file {re.escape(str(path))} could not be read as parquet"):
        load_chat_dataset(str(path))


def test_non_utf8_jsonl_names_the_line_and_the_byte_from_the_start_of_the_file(tmp_path):
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    path = tmp_path / "latin1.jsonl"
    # Far past the reader's first 8 KiB, where a chunked reader would count from its chunk.
    path.write_bytes(good.encode() * 200 + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    byte_in_line = len(b'{"messages": [{"role": "user", "content": "caf') + 1
    byte_in_file = len(good.encode()) * 200 + byte_in_line
    with pytest.raises(DataError, match=rf"data file {re.escape(str(path))}, line 201 is not valid UTF-8 "
                                        rf"\(invalid continuation byte at byte {byte_in_line} of the line, "
                                        rf"byte {byte_in_file} of the file\)"):
        load_chat_dataset(str(path))


def test_a_lone_surrogate_is_refused_with_its_line(tmp_path):
    path = tmp_path / "surrogate.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"}]}\n'
                    '{"messages": [{"role": "user", "content": "bad \\udc80"}, '
                    '{"role": "assistant", "content": "x"}]}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"line 2: a string holds a lone surrogate \('\\udc80'\)"):
        load_chat_dataset(str(path))


def test_an_overlong_line_is_refused_with_bounded_memory(tmp_path):
    """A 50 MB line: refused before parsing, having read at most MAX_JSONL_LINE_BYTES of it."""
    import tracemalloc

    from opd.data.datasets import MAX_JSONL_LINE_BYTES

    path = tmp_path / "huge.jsonl"
    with path.open("wb") as handle:
        handle.write(b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}\n')
        handle.write(b'{"messages": [{"role": "user", "content": "' + b"a" * (50 * 2**20) + b'"}]}\n')
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=rf"line 2 is longer than {MAX_JSONL_LINE_BYTES} bytes"):
            load_chat_dataset(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2.5 * MAX_JSONL_LINE_BYTES  # the 50 MB line was never held whole


@pytest.mark.parametrize("name", ["empty.jsonl", "blank.jsonl", "empty.json"])
def test_empty_file(tmp_path, name):
    path = tmp_path / name
    path.write_text({"empty.jsonl": "", "blank.jsonl": "\n  \n", "empty.json": "[]"}[name], encoding="utf-8")
    with pytest.raises(DataError, match=rf"data file {re.escape(str(path))} contains no examples"):
        load_chat_dataset(str(path))


def test_empty_saved_split(tmp_path):
    saved = tmp_path / "saved"
    splits = {"train": datasets.Dataset.from_list(EXAMPLES), "test": datasets.Dataset.from_list(EXAMPLES).select([])}
    # One shard each: datasets cannot load back an empty split saved with zero shards.
    datasets.DatasetDict(splits).save_to_disk(str(saved), num_shards={"train": 1, "test": 1})
    with pytest.raises(DataError, match=r"\(split test\) contains no examples"):
        load_chat_dataset(str(saved), split="test")


# ---------------------------------------------------------------------------
# Paths that do not resolve
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("relative", ["missing.jsonl", "missing.json", "missing.parquet"])
def test_missing_local_file(tmp_path, relative):
    path = tmp_path / relative
    with pytest.raises(DataError, match=rf"data file {re.escape(str(path))} not found"):
        load_chat_dataset(str(path))


@pytest.mark.parametrize("source", ["./no/such/dir", "../no/such/dir", "relative/name.JSONL"])
def test_path_like_sources_are_not_sent_to_the_hub(monkeypatch, source):
    def fail_if_called(*args, **kwargs):
        raise AssertionError("load_dataset must not be called for a local-looking path")

    monkeypatch.setattr(datasets, "load_dataset", fail_if_called)
    with pytest.raises(DataError, match="not found"):
        load_chat_dataset(source)


def test_unsupported_extension(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("messages\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"unsupported extension '.csv'; expected \".jsonl\", \".json\", \".parquet\""):
        load_chat_dataset(str(path))


def test_directory_that_is_not_a_saved_dataset(tmp_path):
    (tmp_path / "notes.txt").write_text("hi", encoding="utf-8")
    with pytest.raises(DataError, match=rf"data directory {re.escape(str(tmp_path))} is not a dataset saved with"):
        load_chat_dataset(str(tmp_path))


def test_hub_name_is_loaded_with_the_requested_split(monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(EXAMPLES)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_chat_dataset("some-org/some-dataset", split="test") == EXAMPLES
    assert calls == [("some-org/some-dataset", "test")]


def test_hub_failure_is_a_data_error_with_the_reason(monkeypatch):
    def fake_load_dataset(name, split):
        raise ConnectionError("Couldn't reach the Hub\nlong traceback-ish detail")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(DataError) as info:
        load_chat_dataset("some-org/some-dataset")
    message = str(info.value)
    assert "'some-org/some-dataset' does not exist locally" in message
    assert "could not be loaded from the Hugging Face hub" in message
    assert "ConnectionError: Couldn't reach the Hub" in message
    assert "traceback-ish" not in message


def test_hub_offline_fails_with_a_data_error(monkeypatch):
    # The real load_dataset, forced offline so it can never touch the network.
    # datasets reads HF_HUB_OFFLINE at import time, so patch its constants too.
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="does not exist locally and could not be loaded from the Hugging Face hub"):
        load_chat_dataset("opd-unit-test-no-such-org/no-such-dataset")


# ---------------------------------------------------------------------------
# split_prompt_and_response
# ---------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "s"}
USER_1 = {"role": "user", "content": "u1"}
ASSISTANT_1 = {"role": "assistant", "content": "a1"}
USER_2 = {"role": "user", "content": "u2"}
ASSISTANT_2 = {"role": "assistant", "content": "a2"}


def test_split_when_conversation_ends_with_assistant():
    prompt, response = split_prompt_and_response([SYSTEM, USER_1, ASSISTANT_1])
    assert prompt == [SYSTEM, USER_1]
    assert response == ASSISTANT_1


def test_split_when_conversation_ends_with_user():
    messages = [SYSTEM, USER_1]
    prompt, response = split_prompt_and_response(messages)
    assert prompt == messages
    assert response is None
    assert prompt is not messages  # a new list, so callers can append a generated turn


def test_split_multi_turn_takes_only_the_last_assistant_message():
    prompt, response = split_prompt_and_response([USER_1, ASSISTANT_1, USER_2, ASSISTANT_2])
    assert prompt == [USER_1, ASSISTANT_1, USER_2]
    assert response == ASSISTANT_2


def test_split_multi_turn_ending_with_user_keeps_earlier_assistant_turns():
    prompt, response = split_prompt_and_response([USER_1, ASSISTANT_1, USER_2])
    assert prompt == [USER_1, ASSISTANT_1, USER_2]
    assert response is None


def test_split_of_a_loaded_example(sources):
    second = load_chat_dataset(sources["jsonl"])[1]
    prompt, response = split_prompt_and_response(second["messages"])
    assert prompt == [{"role": "user", "content": "Say hi in French."}]
    assert response == {"role": "assistant", "content": "Bonjour — salut !"}
