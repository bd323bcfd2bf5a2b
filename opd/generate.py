"""``opd generate``: one model's answers to a dataset's prompts, written as fixed data.

A λ < 1 run trains on teacher pre-generated answers in its fixed-data steps; a dataset with prompts and ground
truths only (pe-nlp/math-cl) has none. This command lets a model (the teacher by default) write them::

    opd generate --config examples/configs/generate_math.yaml
    opd train --config examples/configs/distillation_math.yaml distillation.lambda=0.5 \\
        data.train_path=results/generate_math/teacher_answers.jsonl data.data_format=chat

The config is a training config plus a ``generate`` section; prompts are ``data.train_path`` read as training
reads it, and ``generation.backend`` picks the engine.

Each output row is a chat example: the prompt turns, the answer as a final assistant message (special tokens
removed), the source row's other fields (``ground_truth`` too) and a ``generated`` record
``{"source_index", "sample", "model", "correct", "truncated"}``. A prompt's kept answers are adjacent rows in
source order; a prompt with none kept has no row.

Resuming: batch ``k`` holds usable prompts ``k·B .. k·B+B-1`` (``B = generate.batch_size``) and samples from a
seed of ``(training.seed, k)``. Its rows are appended and synced, then a record line goes to
``<output>.progress.jsonl`` and is synced. A rerun keeps the rows of recorded batches, cuts the rest and
continues, so the finished file does not depend on interruptions. The progress file's first line holds the
settings that decide the answers; a rerun with other settings fails rather than mix answers.

With ``generate.teacher_signal``, the teacher also scores each batch's kept rows as training's fixed-data steps
would (the run's tokenizer and chat template, the teacher in process), and the signal goes to a cache beside the
output (:mod:`opd.distillation.teacher_signal_cache`), written before the batch's rows; a rerun keeps the files of the
recorded batches and removes the rest. Training then reads it instead of running the teacher on those rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from opd.data.batches import build_fixed_data_batch
from opd.data.dataloaders import prepare_examples
from opd.data.datasets import load_chat_dataset, split_prompt_and_response
from opd.data.sequences import encode_texts, render_chat
from opd.distillation.cached_teacher_signal import (
    CachedRequest,
    cache_setting_problem,
    per_row_tensors,
    request_to_json,
    wanted_manifest,
)
from opd.distillation.config import MasterConfig, resolve_micro_batching
from opd.distillation.setup import build_generation, run_tokenizer
from opd.distillation.teacher_loading import RunTeacherLoader, resolve_teacher_path
from opd.distillation.teacher_signal_cache import (
    SIGNAL_KINDS,
    cache_directory,
    describe_signal,
    remove_cache_files,
    resume_cache,
    write_batch_file,
)
from opd.models.decoding import GenerateStrategyConfig
from opd.models.interfaces import GenerationInterface, TeacherInterface
from opd.models.loading import check_output_sizes, load_causal_lm, resolve_device, resolve_dtype
from opd.rollout.environments.math_verifier import is_correct
from opd.run.logger import flatten_dict
from opd.run.run_setup import load_run_tokenizer
from opd.teachers.local_teacher import LocalTeacher
from opd.utils.compile_cache import resolve_compile_kernels
from opd.utils.config import StrictConfig
from opd.utils.errors import ConfigError, DataError
from opd.utils.paths import absolute_model_path

log = logging.getLogger("opd")

PROGRESS_SUFFIX = ".progress.jsonl"
"""The progress file is ``<generate.output_path>`` with this appended."""

PROGRESS_FORMAT = 1
"""Version of the progress file's layout (its first line says which)."""


class GenerateTeacherSignalConfig(StrictConfig):
    """``generate.teacher_signal``: the teacher's signal for the kept rows, stored for training's fixed-data steps."""

    kind: Literal["topk", "token_logprobs"] = Field(
        "topk",
        description="topk: the k most likely tokens' log-probs and ids with the rest mass (what loss_fn.type topk "
        "asks for); token_logprobs: each token's log-prob at temperature 1",
    )
    k: int = Field(64, ge=1, description="kind topk: tokens per position (loss_fn.k)")
    temperature: float = Field(
        1.0, gt=0.0, description="kind topk: log-probs of softmax(logits / temperature) (loss_fn.temperature)"
    )

    def request(self, vocab_size: int) -> CachedRequest:
        """What the teacher is asked; ``vocab_size`` is the run tokenizer's, as the loss's request has it."""
        return SIGNAL_KINDS[self.kind].request(vocab_size, self.k, self.temperature)


class GenerateDataConfig(StrictConfig):
    """The ``generate`` section: what ``opd generate`` writes, with which model, how sampled and filtered."""

    output_path: str = Field(description="chat-format .jsonl to write; a rerun continues it")
    model_path: str | None = Field(
        None, description="the model that answers; null = model.teacher_model_path (the teacher)"
    )
    num_samples_per_prompt: int = Field(1, ge=1, description="answers kept (rows written) per prompt")
    max_attempts_per_prompt: int | None = Field(
        None,
        ge=1,
        description="samples drawn per prompt at most, retries of rejected ones included; "
        "null = num_samples_per_prompt (no retries)",
    )
    only_correct: bool = Field(
        False, description="keep only answers the math verifier accepts against the row's ground_truth"
    )
    keep_truncated: bool = Field(
        False, description="keep answers cut off at max_length (training would append an EOS to them)"
    )
    batch_size: int = Field(8, ge=1, description="prompts per generation call; the unit of resumption")
    generate_strategy: GenerateStrategyConfig = Field(
        default_factory=GenerateStrategyConfig, description="how the model samples (max_length, decoding, ...)"
    )
    progress_bar: bool = Field(True, description="draw a tqdm progress bar over the prompts")
    teacher_signal: GenerateTeacherSignalConfig | None = Field(
        None,
        description="also store the teacher's signal for the kept rows in a directory beside the output (its name "
        "+ .teacher_signal), which training's fixed-data steps read instead of running the teacher "
        "(distillation.teacher_signal_cache); null = off",
    )

    @property
    def attempts(self) -> int:
        """Samples drawn per prompt at most."""
        return self.max_attempts_per_prompt or self.num_samples_per_prompt

    @model_validator(mode="after")
    def _check_sampling(self) -> GenerateDataConfig:
        """Greedy decoding answers a prompt the same way every time: several samples would be copies."""
        if self.attempts < self.num_samples_per_prompt:
            raise ValueError(
                f"generate.max_attempts_per_prompt = {self.max_attempts_per_prompt} is below "
                f"generate.num_samples_per_prompt = {self.num_samples_per_prompt}"
            )
        if self.generate_strategy.is_greedy and self.attempts > 1:
            raise ValueError(
                "generate.generate_strategy.decoding_method = greedy gives the same answer on every attempt; "
                "with generate.num_samples_per_prompt or generate.max_attempts_per_prompt above 1 choose "
                "decoding_method top_p or top_k"
            )
        return self


class GenerateMasterConfig(MasterConfig):
    """A training config plus the ``generate`` section (``opd generate``)."""

    generate: GenerateDataConfig

    @model_validator(mode="after")
    def _check_engine_room(self) -> GenerateMasterConfig:
        """The engine must be able to give answers of the configured length (vLLM's context length)."""
        key = "generate.generate_strategy.max_length"
        problems = self.generation.engine.config_problems(
            self.generation, self.generate.generate_strategy.max_length, key
        )
        if problems:
            raise ValueError(problems[0])
        return self


@dataclass
class SourcePrompt:
    """One usable prompt of the source data.

    Attributes:
        index: 0-based row in the source (after ``max_train_examples``).
        messages: the prompt turns (a final assistant turn of the source is dropped).
        fields: the row's other fields, copied into every output row.
    """

    index: int
    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    ground_truth: str | None
    fields: dict[str, Any]


@dataclass
class BatchRecord:
    """What one batch produced: a line of the progress file (counts are of samples unless named)."""

    batch: int
    prompts: int = 0
    rows: int = 0
    samples: int = 0
    graded: int = 0
    correct: int = 0
    rejected_incorrect: int = 0
    rejected_truncated: int = 0
    prompts_without_answer: int = 0

    def add(self, other: BatchRecord) -> None:
        """Adds ``other``'s counts to these (the ``batch`` field is left alone)."""
        for name in _COUNT_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


_COUNT_FIELDS = tuple(field.name for field in dataclasses.fields(BatchRecord)[1:])
"""Every field of :class:`BatchRecord` but ``batch``."""


@dataclass
class GenerateSummary:
    """The result of :func:`generate_data`: counts over the whole file and this process's share."""

    output_path: Path
    total_prompts: int
    totals: BatchRecord
    resumed_prompts: int
    seconds: float
    skipped_long_prompts: int = 0
    batches_this_run: int = 0
    signal_directory: Path | None = None

    def line(self) -> str:
        """The one summary line the command prints."""
        t = self.totals
        accuracy = f", {t.correct}/{t.graded} samples correct" if t.graded else ""
        resumed = f"; resumed after {self.resumed_prompts} prompts" if self.resumed_prompts else ""
        skipped = (
            f"; {self.skipped_long_prompts} prompts over data.max_prompt_length skipped"
            if self.skipped_long_prompts
            else ""
        )
        signal = f"; the teacher's signal in {self.signal_directory}" if self.signal_directory is not None else ""
        return (
            f"opd generate: {t.rows} rows for {t.prompts} of {self.total_prompts} prompts written to "
            f"{self.output_path}; {t.samples} samples drawn, {t.rows} kept, "
            f"{t.rejected_incorrect + t.rejected_truncated} rejected ({t.rejected_incorrect} incorrect, "
            f"{t.rejected_truncated} truncated){accuracy}; {t.prompts_without_answer} prompts without an answer; "
            f"{self.seconds:.1f} s{resumed}{skipped}{signal}"
        )


# --------------------------------------------------------------------------- entry point


def generate_data(config: GenerateMasterConfig) -> GenerateSummary:
    """Answers every usable prompt of ``data.train_path``, resuming a partial output (see the module docstring).

    Raises:
        ConfigError: a setting the data or the output cannot serve.
        DataError: a malformed data file, or an output file (or its teacher-signal cache) that does not match its
            progress file.
    """
    start = time.perf_counter()
    settings = config.generate
    output, progress = _output_paths(config)
    _check_environment(config)
    model_path = resolve_generation_model(config)
    _check_signal_settings(config)
    tokenizer = load_run_tokenizer(model_path, config.model.trust_remote_code, config.data)
    prompts, skipped = load_source_prompts(config, tokenizer)
    check_prompts_against_settings(config, prompts)
    signal = SignalPlan.from_config(config, output) if settings.teacher_signal is not None else None
    fingerprint = settings_fingerprint(config, model_path, prompts, signal)
    done = resume_output(output, progress, fingerprint)
    if signal is not None:
        resume_cache(signal.directory, signal.manifest, [record.rows for record in done])
    elif not done:  # a fresh output starts without the signal an earlier one may have left
        remove_cache_files(cache_directory(output))
    batches = [prompts[i : i + settings.batch_size] for i in range(0, len(prompts), settings.batch_size)]
    totals = BatchRecord(batch=-1)
    for record in done:
        totals.add(record)
    summary = GenerateSummary(output, len(prompts), totals, totals.prompts, 0.0, skipped)
    summary.signal_directory = signal.directory if signal is not None else None
    if len(done) < len(batches):
        model = _load_model(config, model_path, tokenizer)
        generation = build_generation(config, model, tokenizer)
        try:
            recorder = signal.recorder(config, model, model_path) if signal is not None else None
            summary.batches_this_run = _generate_batches(
                generation, tokenizer, config, model_path, batches, len(done), (output, progress), totals, recorder
            )
        finally:
            generation.close()
    summary.seconds = time.perf_counter() - start
    return summary


def _generate_batches(
    generation: GenerationInterface,
    tokenizer: Any,
    config: GenerateMasterConfig,
    model_path: str,
    batches: list[list[SourcePrompt]],
    first_batch: int,
    files: tuple[Path, Path],
    totals: BatchRecord,
    recorder: SignalRecorder | None = None,
) -> int:
    """Answers ``batches[first_batch:]`` one by one, appending each to the files (its teacher signal first, with a
    ``recorder``); returns how many ran."""
    settings = config.generate
    bar = tqdm(
        total=sum(len(batch) for batch in batches),
        initial=sum(len(batch) for batch in batches[:first_batch]),
        unit="prompt",
        desc="generate",
        disable=not settings.progress_bar,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    with bar, logging_redirect_tqdm(loggers=[log]):
        for number in range(first_batch, len(batches)):
            torch.manual_seed(batch_seed(config.training.seed, number))
            rows, record = answer_batch(generation, tokenizer, batches[number], settings, model_path, number)
            if recorder is not None:  # on disk before the rows: a recorded batch always has its signal
                recorder.record(number, rows)
            append_batch(files[0], files[1], rows, record)
            totals.add(record)
            rejected = totals.rejected_incorrect + totals.rejected_truncated
            bar.set_postfix_str(f"kept={totals.rows} rejected={rejected}", refresh=False)
            bar.update(record.prompts)
    return len(batches) - first_batch


# --------------------------------------------------------------------------- config and data


def resolve_generation_model(config: GenerateMasterConfig) -> str:
    """``generate.model_path``, else the in-process teacher's path; a served teacher raises ConfigError."""
    if config.generate.model_path is not None:
        return config.generate.model_path
    if config.teacher.served:
        raise ConfigError(
            "teacher.backend = remote: the served teacher scores tokens but cannot write answers here; "
            "set generate.model_path to the teacher's model directory or hub name"
        )
    return resolve_teacher_path(config)


def _output_paths(config: GenerateMasterConfig) -> tuple[Path, Path]:
    """The output and progress files; ConfigError for a directory, a non-``.jsonl`` name or the input itself."""
    output = Path(config.generate.output_path).expanduser()
    if output.is_dir():
        raise ConfigError(f"generate.output_path = {output} is a directory; name a .jsonl file to write")
    if output.suffix.lower() != ".jsonl":
        raise ConfigError(
            f"generate.output_path = {output} must end in .jsonl (opd train reads the answers as a JSONL file)"
        )
    source = Path(config.data.train_path).expanduser()
    if source.exists() and source.resolve() == output.resolve():
        raise ConfigError(f"generate.output_path = {output} is data.train_path itself; write to another file")
    return output, output.with_name(output.name + PROGRESS_SUFFIX)


def _check_environment(config: GenerateMasterConfig) -> None:
    """Fails before any data or model is read if the engine cannot run here (vLLM missing, no compiler)."""
    device_type = resolve_device(config.model.device).type
    resolve_compile_kernels(config.generation.compile_decode, device_type, "generation.compile_decode")
    config.generation.engine.check_environment(config.generation)


def load_source_prompts(config: GenerateMasterConfig, tokenizer: Any) -> tuple[list[SourcePrompt], int]:
    """The usable prompts of ``data.train_path`` in source order, rendered, and how many were too long.

    Raises:
        DataError: a malformed data file, or no prompt that fits ``data.max_prompt_length``.
    """
    data = config.data
    rows = load_chat_dataset(
        data.train_path,
        split=data.train_split,
        data_format=data.data_format,
        prompt_file=data.prompt_file,
        max_examples=data.max_train_examples,
    )
    conversations = [split_prompt_and_response(row["messages"])[0] for row in rows]
    # One tokenizer call per block of prompts (encode_texts), not one per prompt: the same ids.
    texts = [render_chat(tokenizer, messages, add_generation_prompt=True) for messages in conversations]
    all_prompt_ids = encode_texts(tokenizer, texts)
    prompts: list[SourcePrompt] = []
    for index, (row, messages, prompt_ids) in enumerate(zip(rows, conversations, all_prompt_ids, strict=True)):
        if data.max_prompt_length is not None and len(prompt_ids) > data.max_prompt_length:
            continue
        ground_truth = row.get("ground_truth")
        fields = {key: value for key, value in row.items() if key not in ("messages", "generated")}
        prompts.append(
            SourcePrompt(index, messages, prompt_ids, None if ground_truth is None else str(ground_truth), fields)
        )
    skipped = len(rows) - len(prompts)
    if skipped:
        log.warning(
            "%s: skipped %d of %d prompts longer than data.max_prompt_length", data.train_path, skipped, len(rows)
        )
    if not prompts:
        raise DataError(f"{data.train_path}: no prompt fits data.max_prompt_length = {data.max_prompt_length}")
    return prompts, skipped


def check_prompts_against_settings(config: GenerateMasterConfig, prompts: list[SourcePrompt]) -> None:
    """Raises ConfigError if ``only_correct`` is set and a row lacks a ground truth to grade against."""
    if not config.generate.only_correct:
        return
    missing = [prompt.index for prompt in prompts if prompt.ground_truth is None]
    if missing:
        raise ConfigError(
            f"generate.only_correct = true grades answers against each row's ground truth, but {len(missing)} of "
            f"{len(prompts)} rows in '{config.data.train_path}' have none (the first is row {missing[0] + 1}); "
            'use data_format math_cl (rows with "ground_truth_answer"), give chat rows a "ground_truth" field, '
            "or set generate.only_correct = false"
        )


def settings_fingerprint(
    config: GenerateMasterConfig, model_path: str, prompts: list[SourcePrompt], signal: SignalPlan | None = None
) -> dict[str, Any]:
    """The settings that decide the output's rows (and its cached signal); a rerun must match them to continue a file.

    The prompts enter as a digest of token ids and ground truths, catching data, template and tokenizer changes.
    """
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(json.dumps([prompt.index, prompt.prompt_ids, prompt.ground_truth]).encode())
    sampling = config.generate.model_dump(mode="json", exclude={"output_path", "progress_bar"})
    return {
        "model": model_path,
        "generation.backend": config.generation.backend,
        "training.seed": config.training.seed,
        "prompts": f"{len(prompts)} prompts, sha256 {digest.hexdigest()}",
        **{f"generate.{key}": value for key, value in flatten_dict(sampling).items()},
        **(
            {
                "teacher_signal.teacher": signal.manifest["teacher"],
                "teacher_signal.dtype": signal.manifest["dtype"],
                "teacher_signal.vocab_size": len(signal.tokenizer),
                "teacher_signal.tokenizer": absolute_model_path(signal.tokenizer_path),
            }
            if signal is not None
            else {}
        ),
    }


def batch_seed(seed: int, batch: int) -> int:
    """The seed of batch ``batch``: independent streams per ``(training.seed, batch)``."""
    return int(np.random.SeedSequence([seed, batch]).generate_state(1, np.uint64)[0] >> 1)


def _load_model(config: GenerateMasterConfig, model_path: str, tokenizer: Any) -> Any:
    """Loads the answering model (``generation.backend`` wraps it in its engine)."""
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    log.info("loading %s (%s on %s) to answer the prompts", model_path, str(dtype).replace("torch.", ""), device)
    model = load_causal_lm(model_path, dtype, device, config.model)
    check_output_sizes(model, len(tokenizer), model_path)
    model.eval()
    return model


# --------------------------------------------------------------------------- the teacher's signal


def _check_signal_settings(config: GenerateMasterConfig) -> None:
    """ConfigError, before anything loads, for a cache that no training run with this config could read."""
    if config.generate.teacher_signal is None:
        return
    problem = cache_setting_problem(config)
    if problem is not None:
        raise ConfigError(
            f"generate.teacher_signal: {problem}, so training would never read the cached signal; "
            "set generate.teacher_signal: null"
        )
    resolve_teacher_path(config)  # ConfigError without model.teacher_model_path


@dataclass
class SignalPlan:
    """What ``generate.teacher_signal`` stores: the request, the cache's manifest and directory, and the run's
    tokenizer, which renders each kept row as training will (so the cache scores the ids training trains on)."""

    request: CachedRequest
    manifest: dict[str, Any]
    directory: Path
    tokenizer: Any
    tokenizer_path: str

    @classmethod
    def from_config(cls, config: GenerateMasterConfig, output: Path) -> SignalPlan:
        """The plan of ``config``; warns when ``loss_fn`` asks for another signal (training would score live)."""
        settings = config.generate.teacher_signal
        assert settings is not None
        tokenizer_path = config.model.tokenizer_path or config.model.student_model_path
        tokenizer = run_tokenizer(config)
        request = settings.request(len(tokenizer))
        loss_request = config.loss_fn.teacher_request(len(tokenizer))
        if loss_request != request:
            log.warning(
                "generate.teacher_signal stores %s, but loss_fn (type %s) asks the teacher for %s: training with this "
                "config scores its fixed data live",
                describe_signal(request_to_json(request)),
                config.loss_fn.type,
                loss_request,
            )
        return cls(request, wanted_manifest(config, request), cache_directory(output), tokenizer, tokenizer_path)

    def recorder(self, config: GenerateMasterConfig, answering: Any, model_path: str) -> SignalRecorder:
        """The recorder scoring with the teacher: the answering model itself where it is the teacher, else loaded."""
        teacher: TeacherInterface
        if absolute_model_path(model_path) == self.manifest["teacher"]:
            teacher = LocalTeacher(answering, share_prompt_forward=config.teacher.share_prompt_forward)
        else:
            loader = RunTeacherLoader(config, self.tokenizer, config.model.student_model_path, None)
            teacher = config.teacher.build(loader, resolve_teacher_path(config))
        rows_per_call, _ = resolve_micro_batching(config)
        return SignalRecorder(self, teacher, rows_per_call, config.distillation.mask_prompt_tokens)


class SignalRecorder:
    """Scores each batch's kept rows as a fixed-data step of training would, and writes them to the cache.

    The teacher is asked for as many rows at a time as a training micro-batch holds, so it needs no more memory
    than in training.
    """

    def __init__(self, plan: SignalPlan, teacher: TeacherInterface, rows_per_call: int, mask_prompt_tokens: bool):
        self.plan = plan
        self.teacher = teacher
        self.rows_per_call = rows_per_call
        self.mask_prompt_tokens = mask_prompt_tokens

    def record(self, number: int, rows: list[dict[str, Any]]) -> None:
        """Scores the output rows of batch ``number`` and writes its cache file."""
        plan = self.plan
        # The rows as training reads them back from the file (a JSON round trip), rendered by its tokenizer.
        readable = [json.loads(json.dumps(row, ensure_ascii=False)) for row in rows]
        examples = prepare_examples(readable, plan.tokenizer, None, f"batch {number}") if readable else []
        token_ids = [example["prompt_ids"] + (example["response_ids"] or []) for example in examples]
        scored: list[tuple[torch.Tensor, ...]] = []
        for first in range(0, len(examples), self.rows_per_call):
            chunk = examples[first : first + self.rows_per_call]
            batch = build_fixed_data_batch(chunk, plan.tokenizer.pad_token_id, self.mask_prompt_tokens)
            signal = self.teacher.score(batch, plan.request)
            lengths = [len(ids) for ids in token_ids[first : first + self.rows_per_call]]
            scored.extend(per_row_tensors(plan.request, signal, lengths))
        write_batch_file(plan.directory, number, SIGNAL_KINDS[plan.manifest["signal"]["kind"]], token_ids, scored)


# --------------------------------------------------------------------------- sampling


def answer_batch(
    generation: GenerationInterface,
    tokenizer: Any,
    batch: list[SourcePrompt],
    settings: GenerateDataConfig,
    model_path: str,
    number: int,
) -> tuple[list[dict[str, Any]], BatchRecord]:
    """Samples until each prompt has ``num_samples_per_prompt`` accepted answers or has used its attempts.

    Returns the output rows (batch order, then order drawn) and the batch's progress record.
    """
    target = settings.num_samples_per_prompt
    kept: list[list[dict[str, Any]]] = [[] for _ in batch]
    attempts = [0] * len(batch)
    record = BatchRecord(batch=number, prompts=len(batch))
    generation.prepare_for_generation()
    try:
        while True:
            wanted = [min(target - len(kept[i]), settings.attempts - attempts[i]) for i in range(len(batch))]
            if not any(want > 0 for want in wanted):
                break
            # One engine call per distinct count (usually one): generate() draws the same number per prompt.
            for count in sorted({want for want in wanted if want > 0}):
                members = [i for i, want in enumerate(wanted) if want == count]
                rollout = generation.generate(
                    [batch[i].prompt_ids for i in members],
                    settings.generate_strategy,
                    num_samples=count,
                    return_logprobs=False,
                )
                for row in range(len(members) * count):
                    i = members[row // count]
                    start, end = int(rollout["prompt_lengths"][row]), int(rollout["input_lengths"][row])
                    text = tokenizer.decode(rollout["input_ids"][row, start:end], skip_special_tokens=True)
                    truncated = bool(rollout["truncated"][row])
                    answer = _grade(batch[i], text, truncated, attempts[i], settings, record, model_path)
                    attempts[i] += 1
                    if answer is not None:
                        kept[i].append(answer)
    finally:
        generation.finish_generation()
    record.rows = sum(len(answers) for answers in kept)
    record.prompts_without_answer = sum(not answers for answers in kept)
    return [answer for answers in kept for answer in answers], record


def _grade(
    prompt: SourcePrompt,
    text: str,
    truncated: bool,
    sample: int,
    settings: GenerateDataConfig,
    record: BatchRecord,
    model_path: str,
) -> dict[str, Any] | None:
    """Grades one sample and counts it in ``record``; returns its output row if it is kept."""
    record.samples += 1
    correct = None if prompt.ground_truth is None else is_correct(text, prompt.ground_truth)
    if correct is not None:
        record.graded += 1
        record.correct += int(correct)
    if truncated and not settings.keep_truncated:
        record.rejected_truncated += 1
        return None
    if settings.only_correct and not correct:
        record.rejected_incorrect += 1
        return None
    return {
        **prompt.fields,
        "messages": [*prompt.messages, {"role": "assistant", "content": text}],
        "generated": {
            "source_index": prompt.index,
            "sample": sample,
            "model": model_path,
            "correct": correct,
            "truncated": truncated,
        },
    }


# --------------------------------------------------------------------------- output and resumption


def append_batch(output: Path, progress: Path, rows: list[dict[str, Any]], record: BatchRecord) -> None:
    """Appends and syncs a batch's rows, then its progress record: a batch is recorded only once on disk."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    _append_synced(output, text)
    _append_synced(progress, json.dumps(vars(record)) + "\n")


def _append_synced(path: Path, text: str) -> None:
    try:
        with path.open("a", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise DataError(f"could not write {path}: {error}") from None


def resume_output(output: Path, progress: Path, fingerprint: dict[str, Any]) -> list[BatchRecord]:
    """Prepares the files for writing and returns the batches already done (in order).

    Raises:
        ConfigError: an output without progress file, recorded batches without output, or changed settings.
        DataError: fewer output rows than recorded, or a corrupt line before the end of either file.
    """
    header, records = _read_progress(progress) if progress.is_file() else (None, [])
    if header is None:  # no progress yet (or a header torn by a crash): nothing was recorded
        if output.is_file() and output.stat().st_size > 0:
            raise ConfigError(
                f"generate.output_path = {output} exists but has no progress file {progress.name}, so it was not "
                "written by opd generate (or its progress file was removed); move it away or choose another "
                "output_path"
            )
        output.parent.mkdir(parents=True, exist_ok=True)
        progress.write_bytes(b"")
        _append_synced(progress, json.dumps({"opd_generate": PROGRESS_FORMAT, "settings": fingerprint}) + "\n")
        output.write_bytes(b"")
        return []
    _check_fingerprint(header, fingerprint, output)
    if not output.is_file():
        if records:
            raise ConfigError(
                f"{progress} records {len(records)} finished batches but their output {output} is missing; "
                f"delete {progress.name} to start over"
            )
        output.write_bytes(b"")
    _cut_output(output, sum(record.rows for record in records), progress)
    return records


def _read_progress(progress: Path) -> tuple[dict[str, Any] | None, list[BatchRecord]]:
    """The header and batch records of a progress file (cutting off a torn last line); ``(None, [])`` if no header."""
    data = progress.read_bytes()
    lines = data.split(b"\n")[:-1]  # the piece after the last newline is a torn write
    end = sum(len(line) + 1 for line in lines)
    parsed: list[Any] = []
    for number, line in enumerate(lines, start=1):
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise DataError(f"progress file {progress}, line {number}: not valid JSON") from None
            # The last line of a crashed write (a file system may leave it full of NUL bytes).
            end -= len(line) + 1
    if end < len(data):
        os.truncate(progress, end)
    if not parsed:
        return None, []
    header = parsed[0]
    if not isinstance(header, dict) or header.get("opd_generate") != PROGRESS_FORMAT:
        raise DataError(f"progress file {progress}: line 1 is not an opd generate header")
    records = []
    for number, entry in enumerate(parsed[1:], start=2):
        if not isinstance(entry, dict) or set(entry) != {"batch", *_COUNT_FIELDS} or entry["batch"] != number - 2:
            raise DataError(f"progress file {progress}, line {number}: expected the record of batch {number - 2}")
        records.append(BatchRecord(**entry))
    return header, records


def _check_fingerprint(header: dict[str, Any], fingerprint: dict[str, Any], output: Path) -> None:
    """Stops a rerun whose settings would write other answers than the rows already in ``output``."""
    recorded = header.get("settings", {})
    changed = [
        f"{key}: {recorded.get(key)!r} -> {fingerprint.get(key)!r}"
        for key in sorted(set(recorded) | set(fingerprint))
        if recorded.get(key) != fingerprint.get(key)
    ]
    if changed:
        raise ConfigError(
            f"{output} was started with other settings ({'; '.join(changed)}); rerun with the same settings "
            "to continue it, or set generate.output_path to a new file"
        )


def _cut_output(output: Path, rows: int, progress: Path) -> None:
    """Keeps the first ``rows`` lines of ``output``; DataError if fewer are there or one is not valid JSON."""
    data = output.read_bytes()
    offset = 0
    for number in range(1, rows + 1):
        newline = data.find(b"\n", offset)
        if newline < 0:
            raise DataError(
                f"{output} holds {number - 1} complete rows but {progress.name} records {rows}; the files do not "
                f"belong together (delete both to start over)"
            )
        try:
            json.loads(data[offset:newline])
        except json.JSONDecodeError:
            raise DataError(f"{output}, line {number}: not valid JSON (a row of a recorded batch)") from None
        offset = newline + 1
    if offset < len(data):
        log.info("%s: dropping %d bytes written after the last recorded batch", output, len(data) - offset)
        os.truncate(output, offset)
