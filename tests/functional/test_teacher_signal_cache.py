"""The teacher-signal cache: ``opd generate`` stores the teacher's signal, λ < 1 training reads it.

Tiny models (``tiny:teacher`` / ``tiny:student``, built locally) and the arithmetic chat data shipped in the repo,
on CPU. ``opd generate`` writes 16 teacher answers in 4 batches with the teacher's top-8 log-probs beside them; a
λ = 0 training run (every step on that fixed data, 6 steps: over an epoch's end, so rows come back) then trains:

* with the cache and without it (``distillation.teacher_signal_cache: false``, the teacher scores live), the runs log the
  same losses and end with the same weights: the cache holds what the live teacher computes for those ids;
* with the cache, the teacher is never asked to score, also under the schedules that score batches ahead;
* when the loss asks for another signal (another k or temperature), the cache is not used (the teacher scores,
  one log line says why); a row whose tokens differ from those the cache scored sends its batches to the teacher;
* a damaged cache file costs its rows the cache (a warning naming it), never the run.

``opd generate`` itself: the cached signal equals the teacher's answer for a training batch of the same rows (top-k
and token log-probs); a rerun after a crash keeps the cache of the recorded batches, drops the rest, and ends with
the files of an uninterrupted run; a recorded batch whose cache file is missing is an error naming it.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors import safe_open

import opd.distillation.step as step_module
from opd.data.batches import build_fixed_data_batch
from opd.data.dataloaders import prepare_examples
from opd.data.datasets import load_chat_dataset
from opd.distillation.teacher_signal_cache import TeacherSignalCache, batch_file, cache_directory
from opd.distillation.cached_teacher_signal import cached_signal
from opd.distillation.config import MasterConfig
from opd.distillation.setup import run_tokenizer, setup
from opd.distillation.step import distillation_train
from opd.generate import PROGRESS_SUFFIX, GenerateMasterConfig, generate_data
from opd.models.interfaces import TokenLogprobsRequest, TopKLogprobs, TopKRequest
from opd.models.loading import load_causal_lm
from opd.teachers.local_teacher import LocalTeacher
from opd.utils.config import load_config
from opd.utils.errors import ConfigError, DataError

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
NUM_ROWS = 16
GENERATE_BATCH = 4  # 4 recorded batches
K = 8
TRAIN_STEPS = 6  # past the end of the first epoch (4 steps of 4 rows)


def generate_config(output: Path, *overrides: str) -> GenerateMasterConfig:
    """The tiny run's config plus a generate section: the tiny teacher answers 16 training prompts."""
    return load_config(
        GenerateMasterConfig,
        TINY_CONFIG,
        [
            f"data.max_train_examples={NUM_ROWS}",
            "data.val_path=null",
            "loss_fn.type=topk",
            f"loss_fn.k={K}",
            f"generate.output_path={output}",
            f"generate.batch_size={GENERATE_BATCH}",
            "generate.keep_truncated=true",  # the untrained tiny teacher rarely stops by itself
            "generate.generate_strategy.max_length=24",
            "generate.generate_strategy.decoding_method=top_p",
            "generate.generate_strategy.temperature=1.0",
            "generate.progress_bar=false",
            # The teacher scores one row per call, as it does for training's micro-batches of 1 (a row alone, not
            # padded): the same computation in generate and in training, so the runs can be compared bitwise.
            "training.micro_batch_size=1",
            "generate.teacher_signal.kind=topk",
            f"generate.teacher_signal.k={K}",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted ``opd generate`` with the top-k cache: the answers every test trains on."""
    output = tmp_path_factory.mktemp("generated") / "answers.jsonl"
    summary = generate_data(generate_config(output))
    assert summary.totals.rows == NUM_ROWS and summary.signal_directory == cache_directory(output)
    return output


@dataclass
class TrainedRun:
    losses: list[float]
    weights: dict[str, torch.Tensor]
    teacher_calls: int
    log: list[str]
    batches: list[list[list[int]]]  # each step's rows (their token ids), in order

    def live_rows(self, cache: TeacherSignalCache) -> int:
        """How many rows the teacher scores when every batch with a row ``cache`` lacks goes to it."""
        return sum(len(rows) for rows in self.batches if any(cache.locate(ids) is None for ids in rows))

    def lines(self, text: str) -> list[str]:
        """The run's log lines that contain ``text``."""
        return [line for line in self.log if text in line]


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train(data: Path, run_dir: Path, *overrides: str) -> TrainedRun:
    """A λ = 0 tiny run on ``data`` (micro-batches of 1), counting the rows the teacher is asked to score."""
    config = load_config(
        MasterConfig,
        TINY_CONFIG,
        [
            f"output_dir={run_dir}",
            f"data.train_path={data}",
            "data.val_path=null",
            "distillation.lambda=0.0",
            "loss_fn.type=topk",
            f"loss_fn.k={K}",
            "training.batch_size=4",
            "training.micro_batch_size=1",
            f"training.max_num_steps={TRAIN_STEPS}",
            "training.num_epochs=2",
            "training.save_freq=0",
            "checkpointing.enabled=false",
            "logger.progress_bar=false",
            *overrides,
        ],
    )
    batches: list[list[list[int]]] = []
    build = step_module.build_fixed_data_batch

    def recorded_build(examples, *args, **kwargs):
        batches.append([example["prompt_ids"] + example["response_ids"] for example in examples])
        return build(examples, *args, **kwargs)

    opd_log, recorder = logging.getLogger("opd"), _Recorder()
    level = opd_log.level
    opd_log.addHandler(recorder)
    opd_log.setLevel(logging.INFO)
    try:
        components = setup(config)
        calls = []
        teacher = components.teacher_policy
        score = teacher.score

        def counted_score(batch, request):
            calls.append(batch.size)
            return score(batch, request)

        teacher.score = counted_score  # score_async calls it too
        try:
            with mock.patch.object(step_module, "build_fixed_data_batch", recorded_build):
                distillation_train(components)
        finally:
            components.close()
    finally:
        opd_log.removeHandler(recorder)
        opd_log.setLevel(level)
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "train/loss" in record]
    assert len(steps) == config.training.max_num_steps and all(step["train/on_policy"] == 0 for step in steps)
    weights = {name: value.detach().clone() for name, value in components.student_policy.model.state_dict().items()}
    return TrainedRun([step["train/loss"] for step in steps], weights, sum(calls), recorder.lines, batches)


@pytest.fixture(scope="module")
def live_run(generated: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """The reference: the same training with the cache off, every fixed-data batch scored by the teacher."""
    return train(generated, tmp_path_factory.mktemp("live"), "distillation.teacher_signal_cache=false")


# --------------------------------------------------------------------------- training


def assert_same_run(actual: TrainedRun, expected: TrainedRun) -> None:
    """Bitwise: the same losses at every step, the same final weights."""
    assert actual.losses == expected.losses
    assert actual.weights.keys() == expected.weights.keys()
    for name, value in actual.weights.items():
        assert torch.equal(value, expected.weights[name]), name


def test_cached_run_equals_live_run_and_never_calls_the_teacher(generated, live_run, tmp_path) -> None:
    cached = train(generated, tmp_path / "cached")
    assert live_run.teacher_calls == TRAIN_STEPS * 4  # every row of every step went to the teacher
    assert cached.teacher_calls == 0
    assert cached.lines(f"{NUM_ROWS} of {NUM_ROWS} training rows found")
    assert cached.batches == live_run.batches
    # The cache holds what the teacher computes for those ids, so the two runs are one computation.
    assert_same_run(cached, live_run)


@pytest.mark.parametrize("scheduler", ["one_step_off", "two_step_off"])
def test_schedules_that_score_ahead_read_the_cache_too(generated, live_run, tmp_path, scheduler) -> None:
    """Fixed data does not depend on the weights, so with the cache these runs train what the sync run trains."""
    run = train(generated, tmp_path / "run", f"training.scheduler={scheduler}")
    assert run.teacher_calls == 0
    assert_same_run(run, live_run)


@pytest.mark.parametrize("override", [f"loss_fn.k={K // 2}", "loss_fn.temperature=2.0"])
def test_another_request_scores_live(generated, tmp_path, override) -> None:
    run = train(generated, tmp_path / "run", override, "training.max_num_steps=2")
    assert run.teacher_calls == 2 * 4
    (line,) = run.lines("not used: it was written for other settings")
    assert "signal: top-k 8 at temperature 1.0" in line


def test_rows_with_other_tokens_are_scored_live(generated, tmp_path) -> None:
    """One edited answer: the cache did not score its tokens, so the batches holding it go to the teacher."""
    lines = generated.read_text().splitlines()
    edited = json.loads(lines[5])
    edited["messages"][-1]["content"] += " (edited)"
    lines[5] = json.dumps(edited)
    data = tmp_path / "answers.jsonl"
    data.write_text("\n".join(lines) + "\n")
    shutil.copytree(cache_directory(generated), cache_directory(data))

    run = train(data, tmp_path / "run")
    assert run.lines(f"{NUM_ROWS - 1} of {NUM_ROWS} training rows found")
    assert len(run.lines("did not score")) == 1  # said once, however many batches hold the row
    live_rows = run.live_rows(TeacherSignalCache(cache_directory(data)))
    assert 0 < live_rows < TRAIN_STEPS * 4
    assert run.teacher_calls == live_rows


def test_a_damaged_cache_file_costs_its_rows_not_the_run(generated, live_run, tmp_path) -> None:
    data = tmp_path / "answers.jsonl"
    shutil.copy(generated, data)
    shutil.copytree(cache_directory(generated), cache_directory(data))
    damaged = batch_file(cache_directory(data), 2)
    damaged.write_bytes(damaged.read_bytes()[:100])

    run = train(data, tmp_path / "run")
    (warning,) = run.lines("could not be read")
    assert str(damaged) in warning and run.lines(f"{NUM_ROWS - GENERATE_BATCH} of {NUM_ROWS} training rows found")
    live_rows = run.live_rows(TeacherSignalCache(cache_directory(data)))
    assert 0 < live_rows < TRAIN_STEPS * 4
    assert run.teacher_calls == live_rows
    assert_same_run(run, live_run)


# --------------------------------------------------------------------------- opd generate


@pytest.mark.parametrize("kind", ["topk", "token_logprobs"])
def test_cached_signal_is_the_teachers_answer_for_each_row(generated, tmp_path, kind) -> None:
    """Each row read back as training reads it and scored alone: the cache holds the teacher's answer, bitwise,
    at every position of the row, and its token ids are the row's."""
    output = generated
    if kind == "token_logprobs":
        output = tmp_path / "answers.jsonl"
        generate_data(generate_config(output, "generate.teacher_signal.kind=token_logprobs"))
    config = generate_config(output)
    tokenizer = run_tokenizer(config)
    examples = prepare_examples(load_chat_dataset(str(output)), tokenizer, None, str(output))
    teacher = LocalTeacher(load_causal_lm("tiny:teacher", torch.float32, torch.device("cpu"), config.model))
    request = TopKRequest(K, 1.0, len(tokenizer)) if kind == "topk" else TokenLogprobsRequest(len(tokenizer))
    cache = TeacherSignalCache(cache_directory(output))
    assert len(cache.index) == NUM_ROWS
    for example in examples:
        ids = example["prompt_ids"] + example["response_ids"]
        cached = cached_signal(cache, [ids], len(ids), torch.device("cpu"))
        live = teacher.score(build_fixed_data_batch([example], tokenizer.pad_token_id, True), request)
        if kind == "topk":
            assert isinstance(cached, TopKLogprobs) and isinstance(live, TopKLogprobs)
            assert torch.equal(cached.logprobs, live.logprobs) and torch.equal(cached.ids, live.ids)
            assert cached.rest_logprobs is not None and torch.equal(cached.rest_logprobs, live.rest_logprobs)
        else:
            assert torch.equal(cached, live)
    assert cached_signal(cache, [[1, 2, 3]], 3, torch.device("cpu")) is None  # ids it did not score


def file_contents(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A safetensors file's metadata and tensors (its bytes order the metadata as they like)."""
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def test_a_rerun_after_a_crash_keeps_the_recorded_signal_and_drops_the_rest(generated, tmp_path) -> None:
    """The files a crash leaves: batch 0 recorded; batch 1's signal and rows on disk, its record not; batch 2's
    signal half-written. The rerun ends with the files of the uninterrupted run, cache included."""
    progress = generated.with_name(generated.name + PROGRESS_SUFFIX)
    rows, records = generated.read_bytes().splitlines(keepends=True), progress.read_bytes().splitlines(keepends=True)
    output = tmp_path / "answers.jsonl"
    output.write_bytes(b"".join(rows[: 2 * GENERATE_BATCH]) + rows[2 * GENERATE_BATCH][:30])
    output.with_name(output.name + PROGRESS_SUFFIX).write_bytes(b"".join(records[:2]))
    reference, cache = cache_directory(generated), cache_directory(output)
    cache.mkdir()
    shutil.copy(reference / "manifest.json", cache)
    shutil.copy(batch_file(reference, 0), cache)
    kept = batch_file(cache, 0).stat().st_mtime_ns
    # Batch 1's signal as another, unrecorded attempt left it: not what the rerun writes.
    batch_file(cache, 1).write_bytes(batch_file(reference, 3).read_bytes())
    batch_file(cache, 2).with_name(batch_file(cache, 2).name + ".tmp").write_bytes(b"torn")

    summary = generate_data(generate_config(output))
    assert summary.resumed_prompts == GENERATE_BATCH and summary.batches_this_run == 3
    assert output.read_bytes() == generated.read_bytes()
    assert batch_file(cache, 0).stat().st_mtime_ns == kept  # the recorded batch's signal is kept, not redone
    assert sorted(path.name for path in cache.iterdir()) == sorted(path.name for path in reference.iterdir())
    assert (cache / "manifest.json").read_bytes() == (reference / "manifest.json").read_bytes()
    for batch in range(NUM_ROWS // GENERATE_BATCH):
        metadata, tensors = file_contents(batch_file(cache, batch))
        expected_metadata, expected = file_contents(batch_file(reference, batch))
        assert metadata == expected_metadata and tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[name], expected[name]) for name in expected), batch


def test_a_recorded_batch_without_its_cache_file_is_an_error_naming_it(generated, tmp_path) -> None:
    output = tmp_path / "answers.jsonl"
    shutil.copy(generated, output)
    shutil.copy(generated.with_name(generated.name + PROGRESS_SUFFIX), tmp_path)
    shutil.copytree(cache_directory(generated), cache_directory(output))
    batch_file(cache_directory(output), 1).unlink()
    with pytest.raises(DataError, match=r"batch_000001\.safetensors could not be read"):
        generate_data(generate_config(output))


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["distillation.teacher_context=Answer briefly."], "the teacher is wrapped in teacher-only context"),
        (["teacher.cross_tokenizer=true"], r"the teacher is wrapped in cross-tokenizer \(classes"),
        (
            ["teacher.backend=remote", "teacher.remote.url=http://127.0.0.1:9", "generate.model_path=tiny:teacher"],
            r"the teacher \(http://127\.0\.0\.1:9, served\) is not a fixed model",
        ),
        (
            ["teacher.self_teacher=ema", "model.teacher_model_path=student"],
            r"the teacher \(student \(ema\), in process\)",
        ),
        (["environment.kind=tool"], "environment: prompts list the environment's tools"),
    ],
)
def test_generate_refuses_a_cache_no_training_run_could_read(tmp_path: Path, overrides: list[str], reason: str) -> None:
    """A teacher that would not answer as the cached signal does (wrapped, served, following the student, or
    scoring an environment's episodes) makes ``opd generate`` refuse the cache before it loads or writes anything."""
    output = tmp_path / "answers.jsonl"
    with pytest.raises(ConfigError, match=rf"generate\.teacher_signal: {reason}.*set generate\.teacher_signal: null"):
        generate_data(generate_config(output, *overrides))
    assert list(tmp_path.iterdir()) == []
