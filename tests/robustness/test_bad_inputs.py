"""Bad inputs a user can give, each with the exit status and the one-line message it must get.

The table runs ``opd`` in this process on a tiny config; every case must end with exit
status 2, exactly one ``opd: error:`` line matching its pattern, and no traceback. Then
property-based fuzzing (hypothesis, bounded so that CI stays fast) throws arbitrary
override values, data rows and HTTP bodies at the config loader, the data reader and the
teacher server: a user error or success, never a crash, and for the server a 4xx or a
200, never a 5xx and never a hang.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opd_test_helpers import REPO_ROOT, TINY_TRAIN_DATA, RunningServer

from opd.data.datasets import MAX_JSONL_LINE_BYTES, load_chat_dataset
from opd.distillation.config import MasterConfig
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.teachers.scoring import PromptScorer
from opd.teachers.served import wire
from opd.teachers.served.server import TeacherService
from opd.utils.config import load_config
from opd.utils.errors import ConfigError, DataError

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
DEMO_TEACHER = REPO_ROOT / "examples" / "demo" / "models" / "teacher"
TINY_VAL_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "val.jsonl"
GOOD_ROW = {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]}


def write(path: Path, content: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode("utf-8")
    path.write_bytes(content)
    return path


def config_file(tmp: Path, text: bytes | str) -> list[str]:
    return ["--config", str(write(tmp / "bad.yaml", text))]


def data_file(tmp: Path, lines: bytes) -> list[str]:
    path = write(tmp / "data.jsonl", json.dumps(GOOD_ROW).encode() + b"\n" + lines)
    return ["--config", str(TINY), f"data.train_path={path}"]


def damaged_model(tmp: Path) -> list[str]:
    directory = tmp / "model"
    directory.mkdir()
    for file in DEMO_TEACHER.iterdir():
        data = file.read_bytes()
        (directory / file.name).write_bytes(data[: len(data) // 3] if file.suffix == ".safetensors" else data)
    return ["--config", str(TINY), f"model.student_model_path={directory}", f"model.teacher_model_path={directory}"]


def custom_code_model(tmp: Path) -> list[str]:
    """A model directory whose config names Python code of its own (``auto_map``)."""
    directory = tmp / "custom"
    directory.mkdir()
    for file in DEMO_TEACHER.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="opd_custom", auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                                     "AutoModelForCausalLM": "modeling_custom.CustomModel"})
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "configuration_custom.py").write_text(
        "from transformers import PretrainedConfig\n\n\nclass CustomConfig(PretrainedConfig):\n"
        "    model_type = 'opd_custom'\n")
    return ["--config", str(TINY), f"model.student_model_path={directory}", f"model.teacher_model_path={directory}"]


def overlong_line(tmp: Path) -> list[str]:
    path = tmp / "long.jsonl"
    with path.open("wb") as handle:
        handle.write(json.dumps(GOOD_ROW).encode() + b"\n")
        handle.write(b'{"messages": "' + b"x" * (MAX_JSONL_LINE_BYTES + 10) + b'"}\n')
    return ["--config", str(TINY), f"data.train_path={path}"]


# (category, arguments after "opd train" given a scratch directory, pattern of the one error line)
CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "config: yes for a number": (lambda t: ["--config", str(TINY), "training.batch_size=yes"],
                                 r"training\.batch_size = 'yes': expected an integer, got the word 'yes'"),
    "config: on for a number in a file": (
        lambda t: config_file(t, f"defaults: {TINY}\ndistillation:\n  lambda: on\n"),
        r"distillation\.lambda = 'on': expected a number"),
    "config: trainer offload without shared devices": (
        lambda t: ["--config", str(TINY), "cluster.placement=split", "cluster.trainer.offload_during_generation=true"],
        r"cluster\.trainer\.offload_during_generation .* only with cluster\.placement = colocated"),
    "config: a tensor-parallel engine in a colocated rollout worker": (
        lambda t: ["--config", str(TINY), "cluster.placement=colocated", "generation.backend=vllm",
                   "generation.vllm.tensor_parallel_size=2"],
        r"generation\.vllm\.tensor_parallel_size = 2 spans several devices.*set cluster\.placement = split"),
    "config: a section written twice": (
        lambda t: config_file(t, f"defaults: {TINY}\ntraining:\n  batch_size: 2\ntraining:\n  batch_size: 4\n"),
        r"key 'training' appears twice in one mapping \(lines 2 and 4\)"),
    "config: not UTF-8": (lambda t: config_file(t, b"training:\n  batch_size: 2 # \xff\n"),
                          r"bad\.yaml is not UTF-8 text: byte \d+ \(line 2\)"),
    "config: empty": (lambda t: config_file(t, "\n# nothing\n"), r"bad\.yaml is empty"),
    "config: misspelt key": (lambda t: ["--config", str(TINY), "training.learning_rte=1e-4"],
                             r"unknown key 'training\.learning_rte' \(did you mean 'learning_rate'\?\)"),
    "config: out of range": (lambda t: ["--config", str(TINY), "distillation.lambda=1.5"],
                             r"distillation\.lambda = 1\.5: .*less than or equal to 1"),
    "config: missing file": (lambda t: ["--config", str(t / "nowhere.yaml")], r"config file not found"),
    "config: early stop on a metric validation does not report": (
        lambda t: ["--config", str(TINY), "training.early_stop.metric=train/loss", "training.early_stop.patience=2"],
        r"training\.early_stop\.metric = 'train/loss': expected a metric that every validation reports: val/accuracy"),
    "config: early stop with an unknown mode": (
        lambda t: ["--config", str(TINY), "training.early_stop.metric=val/accuracy", "training.early_stop.mode=up",
                   "training.early_stop.patience=2"],
        r"training\.early_stop\.mode = 'up': Input should be 'max' or 'min'"),
    "config: early stop with patience 0": (
        lambda t: ["--config", str(TINY), "training.early_stop.metric=val/accuracy", "training.early_stop.patience=0"],
        r"training\.early_stop\.patience = 0: .*greater than or equal to 1"),
    "config: early stop without a patience or a target": (
        lambda t: ["--config", str(TINY), "training.early_stop.metric=val/accuracy"],
        r"training\.early_stop needs a patience, a target or both"),
    "config: early stop without validation data": (
        lambda t: ["--config", str(TINY), "training.early_stop.metric=val/accuracy", "training.early_stop.patience=2"],
        r"training\.early_stop watches validation, but there is no validation data; set data\.val_path"),
    "config: early stop on the teacher without its baseline": (
        lambda t: ["--config", str(TINY), f"data.val_path={TINY_VAL_DATA}", "training.early_stop.metric=val/accuracy",
                   "training.early_stop.target=teacher"],
        r"training\.early_stop\.target = teacher .*; set validation\.teacher_baseline = true"),
    "config: gloo on GPU workers": (
        lambda t: ["--config", str(TINY), "cluster.backend=gloo", "cluster.gpus_per_worker=1"],
        r"cluster\.backend = gloo with cluster\.gpus_per_worker = 1 would train on the CPUs .*; set cluster\.backend "
        r"= auto"),
    "config: more colocated rollout workers than trainer workers": (
        lambda t: ["--config", str(TINY), "cluster.trainer.workers=1", "cluster.rollout.workers=2"],
        r"cluster\.rollout\.workers = 2 with cluster\.placement = colocated: .*cluster\.trainer\.workers = 1 .*; "
        r"set cluster\.rollout\.workers <= 1"),
    "config: more colocated teacher-pool workers than trainer workers": (
        lambda t: ["--config", str(TINY), "cluster.trainer.workers=1", "cluster.rollout.workers=1",
                   "cluster.teacher.placement=pool", "cluster.teacher.workers=2", "loss_fn.type=topk"],
        r"cluster\.teacher\.workers = 2 with cluster\.placement = colocated: .*cluster\.trainer\.workers = 1"),
    "config: a worker timeout of 0": (lambda t: ["--config", str(TINY), "cluster.rollout.timeout_s=0"],
                                      r"cluster\.rollout\.timeout_s = 0: .*greater than 0"),
    "data: malformed JSON line": (lambda t: data_file(t, b'{"messages": [\n'), r"data\.jsonl, line 2: invalid JSON"),
    "data: not UTF-8": (lambda t: data_file(t, b'{"messages": "\xff"}\n'),
                        r"data\.jsonl, line 2 is not valid UTF-8 \(.* byte 15 of the line"),
    "data: lone surrogate": (lambda t: data_file(t, b'{"messages": [{"role": "user", "content": "\\ud800"}]}\n'),
                             r"data\.jsonl, line 2: a string holds a lone surrogate"),
    "data: line over the limit": (overlong_line, rf"long\.jsonl, line 2 is longer than {MAX_JSONL_LINE_BYTES} bytes"),
    "data: missing file": (lambda t: ["--config", str(TINY), f"data.train_path={t / 'none.jsonl'}"],
                           r"data file .*none\.jsonl not found"),
    "model: missing local directory": (lambda t: ["--config", str(TINY), f"model.teacher_model_path={t}/no/model"],
                                       r"tokenizer directory '.*/no/model' does not exist"),
    "model: truncated weights": (damaged_model, r"the weights file .*model\.safetensors is damaged or truncated"),
    "model: needs its own code": (custom_code_model, r"needs its own Python code; set model\.trust_remote_code = true"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_input_ends_with_status_2_and_one_line_naming_it(case, tmp_path, cli):
    arguments, pattern = CASES[case]
    argv = arguments(tmp_path)
    status, _, err = cli("train", *argv[:2], f"output_dir={tmp_path / 'out'}", f"data.train_path={TINY_TRAIN_DATA}",
                         "data.val_path=null", *argv[2:])
    errors = [line for line in err.splitlines() if line.startswith("opd: error:")]
    assert status == 2, err
    assert "Traceback" not in err
    assert len(errors) == 1 and re.search(pattern, errors[0]), errors


def test_debug_shows_the_traceback_of_a_user_error(tmp_path, cli):
    status, _, err = cli("--debug", "train", "--config", str(TINY), "training.batch_size=yes")
    assert status == 2 and "Traceback" in err and "ConfigError" in err


# --------------------------------------------------------------------------- fuzzing

BOUNDED = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
NUMERIC_KEYS = ["training.batch_size", "training.learning_rate", "distillation.lambda", "loss_fn.temperature",
                "training.max_num_steps", "distillation.generate_strategy.top_p"]


@BOUNDED
@given(key=st.sampled_from(NUMERIC_KEYS), value=st.text(max_size=12))
def test_fuzzed_override_values_are_accepted_or_a_config_error(key, value):
    try:
        load_config(MasterConfig, TINY, [f"{key}={value}"])
    except ConfigError:
        pass  # a user error, with its message; anything else fails the test


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)


@BOUNDED
@given(row=JSON_VALUES | st.fixed_dictionaries({"messages": JSON_VALUES}), raw=st.binary(max_size=40))
def test_fuzzed_data_rows_are_loaded_or_a_data_error(tmp_path, row, raw):
    for index, line in enumerate((json.dumps(row).encode(), raw)):
        path = write(tmp_path / f"fuzz{index}.jsonl", json.dumps(GOOD_ROW).encode() + b"\n" + line + b"\n")
        try:
            load_chat_dataset(str(path))
        except (DataError, ConfigError):
            pass  # a user error with its message is a correct answer; anything else fails the test


@pytest.fixture(scope="module")
def server():
    tokenizer = build_tiny_tokenizer()
    running = RunningServer(TeacherService(PromptScorer(build_tiny_model("teacher"), len(tokenizer)), tokenizer,
                                           "tiny", 16, 64), max_request_bytes=4096, body_timeout_s=2.0)
    yield running
    running.stop()


@BOUNDED
@given(path=st.sampled_from(["/v1/completions", wire.SCORE_PATH, "/tokenize"]),
       body=st.binary(max_size=200) | JSON_VALUES.map(lambda value: json.dumps(value).encode())
       | st.fixed_dictionaries({"sequences": JSON_VALUES, "signal": st.sampled_from(list(wire.SIGNALS)),
                                "k": JSON_VALUES, "first_positions": JSON_VALUES}).map(lambda v: json.dumps(v).encode())
       | st.fixed_dictionaries({"prompt": JSON_VALUES, "max_tokens": JSON_VALUES,
                                "prompt_logprobs": JSON_VALUES}).map(lambda v: json.dumps(v).encode()))
def test_fuzzed_http_bodies_get_a_4xx_or_an_answer_never_a_5xx_or_a_hang(server, path, body):
    response = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"},
                          timeout=30)
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text


@pytest.mark.parametrize("text", ["", "\n", "   "])
def test_a_load_error_without_a_message_is_named_by_its_type(text):
    """An exception whose message is empty still gives one line (its type), not an IndexError."""
    from opd.models.loading import _loading_problem

    assert _loading_problem("/nonexistent/model", OSError(text)) == "cannot load model from '/nonexistent/model': OSError"
