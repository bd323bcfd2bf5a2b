"""``opd plan``'s padding share: how much of a training step's tokens are padding, from a sample of the data.

A step's rows are right-padded: each micro-batch costs its rows × its longest row (:func:`~opd.policy.hf_policy.
plan_micro_batches`), and the padding share of a step is 1 − real tokens / padded tokens. :func:`estimate_padding`
reads the first :data:`SAMPLE_ROWS` rows of ``data.train_path`` with opd's own loading and chat template, deals
them into steps as the training loader does (``data.shuffle``, ``training.seed``), and cuts each step as the
trainer does: rows dealt over the trainer ranks by tokens, then each rank's rows cut into micro-batches
(:func:`~opd.policy.hf_policy.micro_batch_groups`), and, for comparison, the same rows cut into consecutive
micro-batches without sorting. ``training.sequence_packing`` packs each micro-batch into one padding-free row.

A row is the prompt and a response. The student's own responses are not known before it trains: a row's reference
response (the dataset's final assistant turn, which the fixed-data branch trains on) stands for them, cut at the
response budget (``distillation.generate_strategy.max_length``) as a sampled one would be; a row without one
counts the whole budget. The idle micro-batches that even out the ranks' counts are not counted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from opd.data.dataloaders import PreparedExample, make_train_dataloader, prepare_examples
from opd.data.datasets import load_chat_dataset
from opd.distillation.config import MasterConfig, resolve_micro_batching
from opd.distillation.setup import run_tokenizer
from opd.distributed.batch_plan import balance_by_tokens
from opd.models.tiny import is_tiny_path
from opd.policy.hf_policy import micro_batch_groups
from opd.utils.errors import OpdError, first_line

SAMPLE_ROWS = 2_000
"""The most rows of the training data read (the file's first ones): enough steps for a stable share, and quick."""

_PACKING_REMOVES_IT = "sequence_packing: true removes it"

MicroBatchCut = Callable[[list[int]], Sequence[Sequence[int]]]
"""One rank's row lengths → the row indices of each of its micro-batches."""


@dataclass(frozen=True)
class PaddingShare:
    """The padding share estimated from a sample of the training data (shares from 0 to 1)."""

    sorted_share: float
    """As opd cuts a step: each rank's rows sorted by length, then cut (the configured micro-batches)."""
    unsorted_share: float | None
    """Consecutive micro-batches of ``micro_batch_size`` rows, not sorted; None with a token budget per micro-batch,
    whose micro-batches are formed from sorted rows only."""
    sequence_packing: bool
    cut: str
    """The configured micro-batches, in words."""
    rows: int
    """Data rows (prompts) in the sampled steps."""
    source: str
    reference_rows: int
    """Rows whose response length is their reference response's; the rest count the response budget."""
    response_budget: int

    @property
    def configured_share(self) -> float:
        """The share the configured run pads: none when it packs its micro-batches."""
        return 0.0 if self.sequence_packing else self.sorted_share

    def describe(self) -> str:
        """One line for ``opd plan``: the share, the cut, and the data it was estimated from."""
        unsorted = "" if self.unsorted_share is None else f"; {self.unsorted_share:.1%} unsorted"
        if self.sequence_packing:
            share = (
                f"none: sequence_packing: true packs each micro-batch into one row (unpacked, "
                f"{self.sorted_share:.1%} of a step's tokens with {self.cut}{unsorted})"
            )
        else:
            share = f"{self.sorted_share:.1%} of a step's tokens ({self.cut}{unsorted}; {_PACKING_REMOVES_IT})"
        return f"padding: {share}, from {self.rows:,} rows of {self.source} {self._responses()}"

    def _responses(self) -> str:
        """Which response lengths the rows were given."""
        budget = f"the {self.response_budget:,}-token response budget"
        if self.reference_rows == self.rows:
            return f"with their reference responses (capped at {budget})"
        if self.reference_rows == 0:
            return f"with responses of {budget} (the rows have no reference responses)"
        return (
            f"with reference responses for {self.reference_rows:,} of them (capped at {budget}) and {budget} for "
            "the rest"
        )

    def as_dict(self) -> dict[str, Any]:
        """The estimate as plain JSON values (``opd plan --json``)."""
        return {**asdict(self), "configured_share": self.configured_share, "line": self.describe()}


@dataclass(frozen=True)
class UnknownPadding:
    """No estimate: the training data could not be read here (``reason`` says why)."""

    reason: str
    sequence_packing: bool

    @property
    def configured_share(self) -> float | None:
        """None, unless the run packs its micro-batches (then no padding at all)."""
        return 0.0 if self.sequence_packing else None

    def describe(self) -> str:
        """One line for ``opd plan``: the share is unknown, and why."""
        if self.sequence_packing:
            return (
                "padding: none: sequence_packing: true packs each micro-batch into one row (the unpacked share is "
                f"unknown: {self.reason})"
            )
        return f"padding: unknown ({self.reason}); {_PACKING_REMOVES_IT}"

    def as_dict(self) -> dict[str, Any]:
        """The reason as plain JSON values (``opd plan --json``)."""
        return {**asdict(self), "configured_share": self.configured_share, "line": self.describe()}


def estimate_padding(config: MasterConfig, ranks: int) -> PaddingShare | UnknownPadding:
    """The padding share of ``config``'s training steps on ``ranks`` trainer ranks (see the module docstring).

    Never raises for data it cannot read (absent where opd plan runs, malformed, a tokenizer that will not load):
    the answer is then :class:`UnknownPadding`, saying why.
    """
    packing = config.training.sequence_packing
    if (reason := _unreadable_reason(config)) is not None:
        return UnknownPadding(reason, packing)
    try:
        examples = _sampled_examples(config)
    except (OpdError, OSError, ValueError) as error:
        return UnknownPadding(first_line(error), packing)
    steps = sampled_steps(config, examples)
    if not steps:
        prompts = config.training.batch_size
        return UnknownPadding(f"{len(examples):,} usable rows, fewer than one step's {prompts:,} prompts", packing)
    return share_of_steps(config, steps, ranks)


def share_of_steps(config: MasterConfig, steps: list[list[PreparedExample]], ranks: int) -> PaddingShare:
    """The padding share of ``steps`` of prepared examples, cut as ``config`` cuts a step on ``ranks`` ranks."""
    budget = config.distillation.generate_strategy.max_length
    micro_batch_size, _ = resolve_micro_batching(config)
    tokens = config.training.micro_batch_tokens
    configured_cut = functools.partial(micro_batch_groups, micro_batch_size=micro_batch_size, micro_batch_tokens=tokens)
    unsorted_cut = functools.partial(consecutive_groups, micro_batch_size=micro_batch_size)
    samples = config.distillation.num_samples_per_prompt  # a prompt's samples are adjacent rows of its length
    step_lengths = [[row_length(example, budget) for example in step for _ in range(samples)] for step in steps]
    sampled = [example for step in steps for example in step]
    return PaddingShare(
        sorted_share=padding_share(step_lengths, ranks, configured_cut),
        unsorted_share=None if tokens is not None else padding_share(step_lengths, ranks, unsorted_cut),
        sequence_packing=config.training.sequence_packing,
        cut=_cut_in_words(micro_batch_size, tokens, ranks),
        rows=len(sampled),
        source=config.data.train_path,
        reference_rows=sum(example["response_ids"] is not None for example in sampled),
        response_budget=budget,
    )


def _unreadable_reason(config: MasterConfig) -> str | None:
    """Why the sample cannot be read where opd plan runs, or None if it can be tried."""
    if config.environment is not None:
        return "multi-turn episodes (environment:) are as long as their turns make them, known only once played"
    source = config.data.train_path
    if not Path(source).expanduser().exists():
        return (
            f"data.train_path {source} is no file or directory here (a hub dataset, or data on another machine); "
            "opd plan reads local data only"
        )
    tokenizer = config.model.tokenizer_path or config.model.student_model_path
    if not _tokenizer_is_here(tokenizer):
        return f"the tokenizer {tokenizer} is neither local nor in the Hugging Face cache; opd plan downloads none"
    return None


def _tokenizer_is_here(path: str) -> bool:
    """Whether the tokenizer at ``path`` loads without a download: a tiny preset, a local path, or a cached copy.

    A download that cannot happen (no network) fails only after retries of most of a minute.
    """
    if is_tiny_path(path) or Path(path).expanduser().exists():
        return True
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(path, "tokenizer_config.json"), str)
    except ValueError:  # not a hub name either (HFValidationError)
        return False


def _sampled_examples(config: MasterConfig) -> list[PreparedExample]:
    """The first :data:`SAMPLE_ROWS` training rows (or ``data.max_train_examples``), tokenized as training does.

    Raises:
        OpdError: the data or the tokenizer cannot be read (a malformed row, no prompt that fits).
    """
    data = config.data
    limit = min(SAMPLE_ROWS, data.max_train_examples or SAMPLE_ROWS)
    rows = load_chat_dataset(
        data.train_path,
        split=data.train_split,
        data_format=data.data_format,
        prompt_file=data.prompt_file,
        max_examples=limit,
    )
    return prepare_examples(rows, run_tokenizer(config), data.max_prompt_length, data.train_path)


def sampled_steps(config: MasterConfig, examples: list[PreparedExample]) -> list[list[PreparedExample]]:
    """``examples`` dealt into whole steps of ``training.batch_size`` prompts, in the training loader's order."""
    training = config.training
    loader = make_train_dataloader(examples, training.batch_size, config.data.shuffle, training.seed)
    return list(loader)


def row_length(example: PreparedExample, response_budget: int) -> int:
    """A trained row's tokens: the prompt, and the reference response cut at the budget (else the whole budget)."""
    response = example["response_ids"]
    response_tokens = response_budget if response is None else min(len(response), response_budget)
    return len(example["prompt_ids"]) + response_tokens


def consecutive_groups(lengths: list[int], micro_batch_size: int) -> list[range]:
    """The rows of ``lengths`` cut in their order into micro-batches of ``micro_batch_size`` (the last one smaller),
    as opd cut a step before it sorted the rows."""
    rows = len(lengths)
    return [range(start, min(start + micro_batch_size, rows)) for start in range(0, rows, micro_batch_size)]


def padding_share(step_lengths: list[list[int]], ranks: int, cut: MicroBatchCut) -> float:
    """Of the steps' padded tokens, the share that is padding, with each rank's rows cut into micro-batches by ``cut``.

    Each step's rows are dealt over the ranks by tokens as the trainer deals them
    (:func:`~opd.distributed.batch_plan.balance_by_tokens`); a micro-batch pads its rows to its longest.
    """
    real = padded = 0
    for lengths in step_lengths:
        real += sum(lengths)
        for rank_rows in balance_by_tokens(lengths, ranks):
            rank_lengths = [lengths[row] for row in rank_rows]
            padded += sum(len(group) * max(rank_lengths[row] for row in group) for group in cut(rank_lengths))
    return 1 - real / padded if padded else 0.0


def _cut_in_words(micro_batch_size: int, micro_batch_tokens: int | None, ranks: int) -> str:
    """The configured micro-batches, e.g. ``sorted micro-batches of 4 on each of 8 ranks``."""
    size = f"≤ {micro_batch_tokens:,} padded tokens" if micro_batch_tokens is not None else f"{micro_batch_size:,}"
    where = f" on each of {ranks} ranks" if ranks > 1 else ""
    return f"sorted micro-batches of {size}{where}"
