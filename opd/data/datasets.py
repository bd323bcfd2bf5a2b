"""Loading chat datasets (``{"messages": [...], **other_fields}`` dicts) from files, saved datasets, or the hub.

Other fields (e.g. ``ground_truth``) are kept for reward environments; other layouts are converted on load
(:mod:`opd.data.converters`). A bad example raises :class:`~opd.utils.errors.DataError` naming the source and the
1-based position: ``line N`` (JSONL), ``item N`` (JSON) or ``row N`` (parquet, Hugging Face datasets).
"""

import codecs
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from opd.data.converters import keys_hint, load_prompt_template, math_cl_to_chat, type_name
from opd.utils.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

VALID_ROLES = ("system", "user", "assistant", "tool")
DATA_FORMATS = ("chat", "math_cl")

# Prefixes (and _FILE_READERS suffixes) that make a source a local path: if missing, it is reported "not found"
# rather than sent to the hub, which fails with a confusing repository-name error.
_LOCAL_PREFIXES = ("./", "../", "/", "~")

MAX_JSONL_LINE_BYTES = 16 * 2**20
"""The longest JSONL line read; a longer one is refused after reading only this many bytes of it."""

# (position label, raw row) pairs, e.g. ("line 7", {...}).
_RawRows = Iterator[tuple[str, Any]]


def load_chat_dataset(
    source: str,
    *,
    split: str = "train",
    data_format: str = "chat",
    prompt_file: str | None = None,
    max_examples: int | None = None,
) -> list[dict[str, Any]]:
    """Loads and validates the first ``max_examples`` chat examples of ``source``, in source order.

    ``source``: a ``.jsonl`` file (blank lines skipped), a ``.json`` list (or ``{"data": [...]}``), a ``.parquet``
    file, a ``save_to_disk`` directory, or else a hub dataset name. ``split`` applies only to a saved ``DatasetDict``
    or a hub dataset. ``"math_cl"`` rows are converted with ``prompt_file`` (:mod:`opd.data.converters`).

    Raises:
        ConfigError: if ``data_format`` or ``max_examples`` is invalid, or ``prompt_file`` is missing for math_cl.
        DataError: if the source cannot be found or read, is empty, or an example is malformed.
    """
    if data_format not in DATA_FORMATS:
        raise ConfigError(f"data.data_format must be one of {_quoted(DATA_FORMATS)}, got {data_format!r}")
    # bool is a subclass of int; max_examples=True is a config typo, not "1".
    valid_count = isinstance(max_examples, int) and not isinstance(max_examples, bool) and max_examples >= 1
    if max_examples is not None and not valid_count:
        raise ConfigError(f"max_examples must be a positive integer or None, got {max_examples!r}")

    prompt_template = None
    if data_format == "math_cl":
        if not prompt_file:
            raise ConfigError('data.prompt_file is required when data_format is "math_cl"')
        # Read the template before the data so a bad template fails fast.
        prompt_template = load_prompt_template(prompt_file)

    examples = []
    for where, raw in _iter_raw_rows(source, split):
        if prompt_template is not None:  # data_format math_cl
            try:
                raw = math_cl_to_chat(raw, prompt_template)
            except DataError as err:
                raise DataError(f"{where}: {err}") from None
        examples.append(_validate_chat_example(raw, where))
        # Stop before reading further rows, so a bad row past the cut-off is not reported.
        if max_examples is not None and len(examples) >= max_examples:
            break

    if not examples:
        raise DataError(f"{_describe_source(source, split)} contains no examples")
    logger.info("Loaded %d examples from %s", len(examples), _describe_source(source, split))
    return examples


def split_prompt_and_response(
    messages: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Splits off a final assistant turn: ``(prompt, response or None)``; a new prompt list, messages not copied."""
    if messages and messages[-1].get("role") == "assistant":
        return list(messages[:-1]), messages[-1]
    return list(messages), None


# --- Validation ---


def _validate_chat_example(raw: Any, where: str) -> dict[str, Any]:
    """Checks one chat example and returns it as ``{"messages": [...], **other_fields}``."""
    if not isinstance(raw, dict):
        raise DataError(f'{where}: expected an object with a "messages" list, got {type_name(raw)}')

    if "messages" not in raw:
        hint = ' (rows with "problem" and "ground_truth_answer" need data_format="math_cl")' if "problem" in raw else ""
        raise DataError(f'{where}: missing "messages"{hint}; {keys_hint(raw)}')

    messages = raw["messages"]
    if not isinstance(messages, list):
        raise DataError(f'{where}: "messages" must be a list of {{"role", "content"}} dicts, got {type_name(messages)}')
    if not messages:
        raise DataError(f'{where}: "messages" must not be empty')

    clean_messages = [_validate_message(message, f"{where}: messages[{i}]") for i, message in enumerate(messages)]

    if not any(message["role"] == "user" for message in clean_messages):
        roles = ", ".join(message["role"] for message in clean_messages)
        raise DataError(f'{where}: "messages" needs at least one "user" message, found roles: {roles}')

    # Build a new dict so callers can modify examples without touching the source.
    return {"messages": clean_messages, **{key: value for key, value in raw.items() if key != "messages"}}


def _validate_message(message: Any, where: str) -> dict[str, Any]:
    """Checks one message; ``where`` already names the example and the message index."""
    if not isinstance(message, dict):
        raise DataError(f'{where} must be a {{"role", "content"}} dict, got {type_name(message)}')

    role = message.get("role")
    if role not in VALID_ROLES:
        got = "nothing (missing)" if role is None else repr(role)
        raise DataError(f'{where}: "role" must be one of {_quoted(VALID_ROLES)}, got {got}')

    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        content = ""  # an assistant turn that only calls tools (the OpenAI format writes its content as null)
    if not isinstance(content, str):
        raise DataError(f'{where}: "content" must be a string, got {type_name(content)}')

    # Arrow stores messages as structs with the union of all keys, absent ones None; dropping None extras makes
    # parquet and saved datasets load the same messages as the JSONL they were made from.
    extras = {key: value for key, value in message.items() if key not in ("role", "content") and value is not None}
    return {"role": role, "content": content, **extras}


# --- Readers: each yields (position label, raw row) pairs ---


def _iter_raw_rows(source: str, split: str) -> _RawRows:
    """Picks a reader for ``source``: a local file, a saved dataset, or a hub name."""
    path = Path(source).expanduser()
    if path.is_dir():
        return _iter_saved_dataset(path, source, split)
    if path.is_file():
        reader = _FILE_READERS.get(path.suffix.lower())
        if reader is not None:
            return reader(path, source)
        raise DataError(
            f"data file {source} has unsupported extension {path.suffix!r}; expected {_quoted(_LOCAL_SUFFIXES)}"
        )
    if source.lower().endswith(_LOCAL_SUFFIXES) or source.startswith(_LOCAL_PREFIXES):
        raise DataError(f"data file {source} not found")
    return _iter_hub_dataset(source, split)


def _iter_jsonl(path: Path, source: str, max_line_bytes: int = MAX_JSONL_LINE_BYTES) -> _RawRows:
    """Streams a JSONL file line by line, never reading more than ``max_line_bytes`` + 1 bytes at once."""
    try:
        with path.open("rb") as f:
            offset = 0
            for line_number in itertools.count(1):
                raw = f.readline(max_line_bytes + 1)
                if not raw:
                    return
                where = f"data file {source}, line {line_number}"
                if len(raw) > max_line_bytes:
                    raise DataError(
                        f"{where} is longer than {max_line_bytes} bytes (MAX_JSONL_LINE_BYTES), the longest "
                        "line opd reads; split the example or shorten it"
                    )
                if line_number == 1 and raw.startswith(codecs.BOM_UTF8):
                    raw, offset = raw[len(codecs.BOM_UTF8) :], len(codecs.BOM_UTF8)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(
                        f"{where} is not valid UTF-8 ({err.reason} at byte {err.start + 1} of the line, "
                        f"byte {offset + err.start + 1} of the file); save the file as UTF-8"
                    ) from None
                offset += len(raw)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
                except RecursionError:
                    raise DataError(f"{where}: the JSON is nested too deeply") from None
                _check_unicode(row, where)
                yield where, row
    except OSError as err:
        raise DataError(f"data file {source} could not be read: {err}") from None


def _check_unicode(value: Any, where: str) -> None:
    """Refuses strings that are not valid Unicode (a lone surrogate, which JSON's \\uXXXX escapes allow)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as err:
                raise DataError(
                    f"{where}: a string holds a lone surrogate ({item[err.start]!r}), which is not valid Unicode; "
                    "fix the \\u escape in the data"
                ) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _iter_json(path: Path, source: str) -> _RawRows:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as err:
        raise DataError(
            f"data file {source}, line {err.lineno}: invalid JSON ({err.msg} at column {err.colno})"
        ) from None
    except UnicodeDecodeError as err:
        raise DataError(f"data file {source} is not valid UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise DataError(f"data file {source} could not be read: {err}") from None

    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(
            f'data file {source}: expected a JSON list of examples or an object with a "data" list, '
            f"got {type_name(data)}"
        )
    for item_number, row in enumerate(data, start=1):
        yield f"data file {source}, item {item_number}", row


def _iter_parquet(path: Path, source: str) -> _RawRows:
    import pyarrow
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as err:
        raise DataError(f"data file {source} could not be read as parquet: {err}") from None
    for row_number, row in enumerate(rows, start=1):
        yield f"data file {source}, row {row_number}", row


_FILE_READERS: dict[str, Callable[[Path, str], _RawRows]] = {
    ".jsonl": _iter_jsonl,
    ".json": _iter_json,
    ".parquet": _iter_parquet,
}
"""The reader of each data file suffix."""
_LOCAL_SUFFIXES = tuple(_FILE_READERS)


def _iter_saved_dataset(path: Path, source: str, split: str) -> _RawRows:
    # Importing `datasets` takes about a second, so only sources that need it pay for it.
    import datasets

    # save_to_disk writes state.json (Dataset) or dataset_dict.json (DatasetDict); load_from_disk reads nothing else.
    if not (path / "state.json").is_file() and not (path / "dataset_dict.json").is_file():
        raise DataError(
            f"data directory {source} is not a dataset saved with Dataset.save_to_disk or "
            "DatasetDict.save_to_disk (no state.json or dataset_dict.json)"
        )
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as err:
        raise DataError(f"data directory {source} could not be loaded: {_short_reason(err)}") from None

    where = f"dataset {source}"
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise DataError(f"dataset {source} has no split {split!r}; available splits: {', '.join(sorted(dataset))}")
        dataset = dataset[split]
        where = f"dataset {source} (split {split})"
    for row_number, row in enumerate(dataset, start=1):
        yield f"{where}, row {row_number}", row


def _iter_hub_dataset(source: str, split: str) -> _RawRows:
    import datasets

    try:
        dataset = datasets.load_dataset(source, split=split)
    except Exception as err:
        raise DataError(
            f"dataset {source!r} does not exist locally and could not be loaded from the Hugging Face hub "
            f"(split {split!r}): {_short_reason(err)}"
        ) from None
    for row_number, row in enumerate(dataset, start=1):
        yield f"dataset {source} (split {split}), row {row_number}", row


# --- Message helpers ---


def _describe_source(source: str, split: str) -> str:
    path = Path(source).expanduser()
    if path.is_file():
        return f"data file {source}"
    if path.is_dir() and not (path / "dataset_dict.json").is_file():
        return f"dataset {source}"
    return f"dataset {source} (split {split})"


def _quoted(names: tuple[str, ...]) -> str:
    return ", ".join(f'"{name}"' for name in names)


def _short_reason(err: Exception) -> str:
    """First line of an exception message, trimmed: library errors can be pages long."""
    lines = str(err).strip().splitlines()
    text = lines[0] if lines else ""
    reason = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return reason if len(reason) <= 300 else reason[:297] + "..."
