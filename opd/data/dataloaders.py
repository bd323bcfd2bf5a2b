"""Tokenized training examples (prepared once, at start-up) and resumable dataloaders.

The training loader is a ``StatefulDataLoader`` (its ``state_dict`` is checkpointed) whose shuffle order depends on
``(seed, epoch)`` only, so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypedDict, cast

import torch
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import NotRequired  # in typing from Python 3.11

from opd.data.datasets import split_prompt_and_response
from opd.data.episodes import encode_episode, split_at_first_assistant
from opd.data.sequences import encode_prompt, encode_response
from opd.data.teacher_choice import TeacherChoice
from opd.data.teacher_context import TeacherContext
from opd.utils.errors import DataError

log = logging.getLogger("opd")


class PreparedExample(TypedDict):
    """A tokenized example: the prompt ids, the fixed response ids, the ground truth.

    Optional fields: ``teacher_prompt_ids``, the prompt the teacher sees (with its context, or its own tokenizer);
    ``teacher_index`` (routing) or ``teacher_weights`` (mixture), see :mod:`opd.data.teacher_choice`;
    ``prompt_messages``, the prompt conversation a multi-turn rollout renders with the environment's tools;
    ``response_mask``, 1 on the assistant's own response ids of a recorded episode (:mod:`opd.data.episodes`);
    ``environment``, the name of the environment that plays it where a run has several.
    """

    prompt_ids: list[int]
    response_ids: list[int] | None
    ground_truth: str | None
    teacher_prompt_ids: NotRequired[list[int]]
    teacher_index: NotRequired[int]
    teacher_weights: NotRequired[list[float]]
    prompt_messages: NotRequired[list[dict]]
    response_mask: NotRequired[list[int]]
    environment: NotRequired[str]


ToolsOf = Callable[[dict], tuple[str | None, list[dict]]]
"""An example's environment, where a run has several (None: the only one), and the tools its prompt lists; raises
:class:`~opd.utils.errors.DataError` for an example it cannot place."""


def prepare_examples(
    examples: list[dict],
    tokenizer: Any,
    max_prompt_length: int | None,
    source: str,
    teacher_context: TeacherContext | None = None,
    teacher_choice: TeacherChoice | None = None,
    teacher_tokenizer: Any | None = None,
    tools: list[dict] | ToolsOf | None = None,
) -> list[PreparedExample]:
    """Applies the chat template and tokenizes; drops prompts longer than ``max_prompt_length`` (student's prompt).

    ``teacher_context`` / ``teacher_tokenizer`` give each example a teacher prompt, ``teacher_choice`` its teacher
    assignment. With ``tools``, the prompt lists them and ends before the first assistant turn; the rest is a
    recorded episode (:mod:`opd.data.episodes`). ``tools`` given as a function (:data:`ToolsOf`) names each
    example's environment (kept as ``environment``) and its tools.

    Raises:
        DataError: if every prompt is too long, or (naming the source and example) if an example lacks its
            per-example context, has a malformed teacher assignment or a malformed episode.
    """
    prepared: list[PreparedExample] = []
    for index, example in enumerate(examples):
        environment: str | None = None
        example_tools: list[dict] | None = None if callable(tools) else tools
        if callable(tools):  # several environments: the example's own, and its tools
            try:
                environment, example_tools = tools(example)
            except DataError as error:
                raise DataError(f"{source}: example {index + 1}: {error}") from None
        if example_tools is None:
            prompt_messages, response = split_prompt_and_response(example["messages"])
            episode = [response] if response else []
        else:  # an episode starts at the first assistant turn: every later message is part of it
            prompt_messages, episode = split_at_first_assistant(example["messages"])
        prompt_ids = encode_prompt(tokenizer, prompt_messages, example_tools)
        if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
            continue
        ground_truth = example.get("ground_truth")
        item = PreparedExample(
            prompt_ids=prompt_ids,
            response_ids=encode_response(tokenizer, prompt_messages, episode[0])
            if episode and example_tools is None
            else None,
            ground_truth=None if ground_truth is None else str(ground_truth),
        )
        if example_tools is not None:
            item["prompt_messages"] = prompt_messages
        if environment is not None:
            item["environment"] = environment
        try:
            if example_tools is not None and episode:
                item["response_ids"], item["response_mask"] = encode_episode(
                    tokenizer, prompt_messages, episode, example_tools
                )
            _add_teacher_fields(
                item,
                example,
                prompt_messages,
                tokenizer,
                teacher_context,
                teacher_choice,
                teacher_tokenizer,
                example_tools,
            )
        except DataError as error:
            raise DataError(f"{source}: example {index + 1}: {error}") from None
        prepared.append(item)
    skipped = len(examples) - len(prepared)
    if skipped:
        log.warning("%s: skipped %d of %d prompts longer than data.max_prompt_length", source, skipped, len(examples))
    if not prepared:
        raise DataError(f"{source}: no prompt fits data.max_prompt_length = {max_prompt_length}")
    return prepared


def _add_teacher_fields(
    item: PreparedExample,
    example: dict,
    prompt_messages: list[dict],
    tokenizer: Any,
    teacher_context: TeacherContext | None,
    teacher_choice: TeacherChoice | None,
    teacher_tokenizer: Any | None,
    tools: list[dict] | None = None,
) -> None:
    """The example's teacher prompt and assignment; the prompt lists ``tools`` too (the teacher grades their calls)."""
    if teacher_context is not None or teacher_tokenizer is not None:
        messages = prompt_messages
        if teacher_context is not None:
            messages = teacher_context.apply(prompt_messages, teacher_context.context_for(example))
        item["teacher_prompt_ids"] = encode_prompt(teacher_tokenizer or tokenizer, messages, tools)
    if teacher_choice is not None:
        if teacher_choice.routes:
            item["teacher_index"] = teacher_choice.index_for(example)
        else:
            item["teacher_weights"] = teacher_choice.weights_for(example)


def _collate_examples(examples: list[PreparedExample]) -> list[PreparedExample]:
    """Keeps a batch as a list: prompts have different lengths and are padded later."""
    return examples


def make_train_dataloader(
    examples: list[PreparedExample], batch_size: int, shuffle: bool, seed: int
) -> StatefulDataLoader:
    """A resumable loader of full batches (an epoch is ``len(examples) // batch_size`` steps).

    Call ``loader.sampler.set_epoch(e)`` per epoch: a single-replica ``DistributedSampler`` draws each permutation from
    ``seed + epoch`` alone.
    """
    # A list is a map-style dataset (``__getitem__`` and ``__len__``), which is all the sampler reads.
    dataset = cast("Dataset[PreparedExample]", examples)
    sampler: DistributedSampler[PreparedExample] = DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=False
    )
    return StatefulDataLoader(
        examples,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=_collate_examples,
        num_workers=0,
        # Own generator: otherwise each epoch iterator draws from torch's global RNG, and a resumed run (an iterator
        # started mid-epoch) would shift the sampling noise.
        generator=torch.Generator().manual_seed(seed),
    )


def make_eval_dataloader(examples: list[PreparedExample], batch_size: int) -> StatefulDataLoader:
    """A loader over every validation example, in order (with a private generator, as above)."""
    return StatefulDataLoader(
        examples,
        batch_size=batch_size,
        shuffle=False,
        drop_last=False,
        collate_fn=_collate_examples,
        num_workers=0,
        generator=torch.Generator(),
    )
