"""Tokenized training examples (prepared once, at start-up) and resumable dataloaders.

The training loader is a ``StatefulDataLoader`` (its ``state_dict`` is checkpointed) whose shuffle order depends on
``(seed, epoch)`` only, so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict, cast

import torch
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import NotRequired  # in typing from Python 3.11

from opd.data.datasets import split_prompt_and_response
from opd.data.episodes import encode_episode, split_at_first_assistant
from opd.data.sequences import cut_after_eos, encode_prompt, encode_texts, render_chat, response_text
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
            per-example context, has a malformed teacher assignment or a malformed episode, or if the chat template
            does not render its prompt as a prefix of the conversation.
    """
    # Three passes, so that each prompt is rendered once and the tokenizer is called once per block of texts (it
    # then encodes on every core it may use): render every prompt, tokenize the prompts and drop the long ones,
    # tokenize the kept examples' responses. Episodes and teacher prompts (rarer) are tokenized per example.
    rendered = [_render_prompt(index, example, tokenizer, source, tools) for index, example in enumerate(examples)]
    prompt_ids = encode_texts(tokenizer, [prompt.text for prompt in rendered])
    kept = [
        (prompt, ids)
        for prompt, ids in zip(rendered, prompt_ids, strict=True)
        if max_prompt_length is None or len(ids) <= max_prompt_length
    ]
    fixed_response = [bool(prompt.episode) and prompt.tools is None for prompt, _ in kept]
    response_texts = [
        _response_text(prompt, tokenizer, source) for (prompt, _), fixed in zip(kept, fixed_response) if fixed
    ]
    encoded_responses = iter(encode_texts(tokenizer, response_texts))
    prepared: list[PreparedExample] = []
    for (prompt, ids), fixed in zip(kept, fixed_response, strict=True):
        ground_truth = prompt.example.get("ground_truth")
        item = PreparedExample(
            prompt_ids=ids,
            response_ids=cut_after_eos(tokenizer, next(encoded_responses)) if fixed else None,
            ground_truth=None if ground_truth is None else str(ground_truth),
        )
        if prompt.tools is not None:
            item["prompt_messages"] = prompt.messages
        if prompt.environment is not None:
            item["environment"] = prompt.environment
        try:
            if prompt.tools is not None and prompt.episode:
                item["response_ids"], item["response_mask"] = encode_episode(
                    tokenizer, prompt.messages, prompt.episode, prompt.tools
                )
            _add_teacher_fields(
                item,
                prompt.example,
                prompt.messages,
                tokenizer,
                teacher_context,
                teacher_choice,
                teacher_tokenizer,
                prompt.tools,
            )
        except DataError as error:
            raise DataError(f"{source}: example {prompt.index + 1}: {error}") from None
        prepared.append(item)
    skipped = len(examples) - len(prepared)
    if skipped:
        log.warning("%s: skipped %d of %d prompts longer than data.max_prompt_length", source, skipped, len(examples))
    if not prepared:
        raise DataError(f"{source}: no prompt fits data.max_prompt_length = {max_prompt_length}")
    return prepared


@dataclass
class _RenderedPrompt:
    """An example split at its prompt's end, with the prompt rendered for generation (``text``)."""

    index: int
    example: dict
    messages: list[dict]
    episode: list[dict]
    """The response as one message, or with tools the recorded episode from the first assistant turn (may be empty)."""
    tools: list[dict] | None
    environment: str | None
    text: str


def _render_prompt(
    index: int, example: dict, tokenizer: Any, source: str, tools: list[dict] | ToolsOf | None
) -> _RenderedPrompt:
    """Splits ``example`` (with its environment's tools, where ``tools`` is a function) and renders its prompt."""
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
    text = render_chat(tokenizer, prompt_messages, add_generation_prompt=True, tools=example_tools)
    return _RenderedPrompt(index, example, prompt_messages, episode, example_tools, environment, text)


def _response_text(prompt: _RenderedPrompt, tokenizer: Any, source: str) -> str:
    """The text of the example's fixed response; DataError naming the source and example if it cannot be split."""
    try:
        return response_text(tokenizer, prompt.messages, prompt.episode[0], prompt.text)
    except DataError as error:
        raise DataError(f"{source}: example {prompt.index + 1}: {error}") from None


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
