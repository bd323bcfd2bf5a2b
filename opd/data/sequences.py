"""Turning chat examples into token sequences and padded or packed training batches.

The chat template is applied here only. Rows are right-padded (``[prompt | response | padding]``), so default
position ids are correct for every real token; ``token_mask`` marks the tokens that carry loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from opd.data.batched_data_dict import BatchedDataDict
from opd.utils.errors import DataError


def render_chat(
    tokenizer: Any, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
) -> str:
    """Applies the tokenizer's chat template and returns the text (with the tools' schemas, if any)."""
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Tokenizes rendered chat text; the template already placed every special token."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


ENCODE_BLOCK = 4096
"""Texts per tokenizer call in :func:`encode_texts`: few calls, and a bounded transient result for a large dataset."""


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """:func:`encode_text` of each text, with one tokenizer call per block of texts.

    A fast tokenizer encodes a batch in Rust on every core it may use (``TOKENIZERS_PARALLELISM``); one call per
    text uses one. Each text is still encoded on its own (no padding, no truncation), so the ids are those of
    :func:`encode_text`.
    """
    ids: list[list[int]] = []
    for start in range(0, len(texts), ENCODE_BLOCK):
        block = list(texts[start : start + ENCODE_BLOCK])
        ids.extend(list(row) for row in tokenizer(block, add_special_tokens=False)["input_ids"])
    return ids


def encode_prompt(tokenizer: Any, prompt_messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of a prompt (listing ``tools`` where given), ending with the template's assistant header."""
    return encode_text(tokenizer, render_chat(tokenizer, prompt_messages, add_generation_prompt=True, tools=tools))


def response_text(tokenizer: Any, prompt_messages: list[dict], response: dict, prompt_text: str) -> str:
    """The text the chat template adds for ``response`` after ``prompt_text`` (the prompt rendered for generation).

    Rendered in context but tokenized alone (then :func:`cut_after_eos`), so the prompt ids are those the student
    gets at generation time.

    Raises:
        DataError: if the template does not render the prompt as a prefix of the whole conversation.
    """
    full_text = render_chat(tokenizer, [*prompt_messages, response], add_generation_prompt=False)
    if not full_text.startswith(prompt_text):
        raise DataError(
            "the chat template does not render the prompt (with add_generation_prompt=True) "
            "as a prefix of the full conversation; cannot split prompt and response tokens"
        )
    return full_text[len(prompt_text) :]


def cut_after_eos(tokenizer: Any, ids: list[int]) -> list[int]:
    """The ids of a tokenized :func:`response_text`, cut after the first EOS (the end the student learns)."""
    eos_id = tokenizer.eos_token_id
    if eos_id is not None and eos_id in ids:
        return ids[: ids.index(eos_id) + 1]
    return ids


def encode_response(tokenizer: Any, prompt_messages: list[dict], response: dict) -> list[int]:
    """Token ids that the chat template adds for ``response`` after the prompt, cut after the first EOS.

    Raises:
        DataError: if the template does not render the prompt as a prefix of the whole conversation.
    """
    prompt_text = render_chat(tokenizer, prompt_messages, add_generation_prompt=True)
    return cut_after_eos(
        tokenizer, encode_text(tokenizer, response_text(tokenizer, prompt_messages, response, prompt_text))
    )


def build_token_mask(
    input_lengths: torch.Tensor, prompt_lengths: torch.Tensor, max_length: int, mask_prompt_tokens: bool
) -> torch.Tensor:
    """``[B, L]`` float mask of the tokens that carry loss in right-padded rows (``[B]`` lengths).

    1 on response tokens, or with ``mask_prompt_tokens=False`` on every real token but the first (nothing predicts it).
    """
    positions = torch.arange(max_length).unsqueeze(0)
    start = prompt_lengths.unsqueeze(1) if mask_prompt_tokens else torch.ones_like(prompt_lengths).unsqueeze(1)
    return ((positions >= start) & (positions < input_lengths.unsqueeze(1))).float()


def shift_token_mask(token_mask: torch.Tensor) -> torch.Tensor:
    """The ``[B, L - 1]`` mask for ``logits[:, :-1]`` of a ``[B, L]`` token mask (the one place opd shifts masks).

    Token ``t`` is predicted by the logits at position ``t - 1``.
    """
    return token_mask[:, 1:]


def pack_sequences(
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    pad_token_id: int,
    mask_prompt_tokens: bool = True,
) -> BatchedDataDict:
    """Right-pads prompt + response ids: ``input_ids [B, L]``, ``input_lengths``, ``prompt_lengths``, ``token_mask``."""
    lengths = torch.tensor([len(seq) for seq in sequences], dtype=torch.long)
    width = int(lengths.max()) if len(sequences) else 0
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
    prompts = torch.tensor(list(prompt_lengths), dtype=torch.long)
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=lengths,
        prompt_lengths=prompts,
        token_mask=build_token_mask(lengths, prompts, width, mask_prompt_tokens),
    )


def attention_mask_from_lengths(input_lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """``[B, L]`` 1/0 attention mask for right-padded sequences."""
    positions = torch.arange(max_length, device=input_lengths.device).unsqueeze(0)
    return (positions < input_lengths.unsqueeze(1)).long()


PACKED_TOKEN_FIELDS = ("input_ids", "token_mask", "generation_logprobs")
"""Per-token ``[B, L]`` fields that :func:`pack_padding_free` carries into the packed row."""


PER_SEQUENCE_TOKEN_FIELDS = ("task_reward", "staleness")
"""Per-sequence ``[B]`` fields that :func:`pack_padding_free` spreads over each sequence's tokens (``[1, T]``);
given per token (``[B, L]``: a multi-turn rollout's returns) they are packed as the token fields are."""

PER_SEQUENCE_FIELDS = ("sample_index", "teacher_index", "teacher_weights")
"""Per-sequence ``[B, ...]`` fields that :func:`pack_padding_free` keeps as ``[1, B, ...]``."""

PER_SEQUENCE_LISTS = ("teacher_prompt_ids", "episode_layout")
"""Per-sequence lists (a teacher's own prompt; a multi-turn row's turns and messages) that :func:`pack_padding_free`
keeps as a one-element list of the B entries."""


def pack_padding_free(batch: BatchedDataDict) -> BatchedDataDict:
    """Concatenates the rows of a right-padded batch into one row without padding (sequence packing).

    ``position_ids`` restart at 0 per sequence; called with them, ``attention_mask=None`` and no KV cache,
    transformers builds a block-diagonal causal mask, so each token sees exactly its own row's context. Each
    sequence's first token gets ``token_mask = 0`` (the previous sequence's last token does not predict it).

    Returns a one-row batch: the :data:`PACKED_TOKEN_FIELDS` present, ``position_ids`` and ``segment_ids`` (each
    token's sequence) as ``[1, T]``; ``input_lengths [1]`` (= T); ``sequence_lengths [1, B]``;
    :data:`PER_SEQUENCE_TOKEN_FIELDS` spread to ``[1, T]``; :data:`PER_SEQUENCE_FIELDS` as ``[1, B, ...]``
    (``sample_index``: see :func:`~opd.teachers.signals.signal_rows`). :data:`PER_SEQUENCE_LISTS` as one-element
    lists of the B entries, with ``prompt_lengths [1, B]``. Other per-sequence fields are dropped.
    """
    lengths = [int(length) for length in batch["input_lengths"]]
    packed = BatchedDataDict()
    for field in PACKED_TOKEN_FIELDS:
        if field in batch:
            packed[field] = torch.cat([batch[field][row, :length] for row, length in enumerate(lengths)]).unsqueeze(0)
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    if "token_mask" in packed:
        packed["token_mask"] = packed["token_mask"].clone()
        packed["token_mask"][0, starts] = 0
    device = batch["input_ids"].device
    packed["position_ids"] = torch.cat([torch.arange(length, device=device) for length in lengths]).unsqueeze(0)
    lengths_tensor = torch.tensor(lengths, device=device)
    packed["segment_ids"] = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), lengths_tensor
    ).unsqueeze(0)
    for field in PER_SEQUENCE_TOKEN_FIELDS:
        if field in batch and batch[field].dim() == 2:
            packed[field] = torch.cat([batch[field][row, :length] for row, length in enumerate(lengths)]).unsqueeze(0)
        elif field in batch:
            packed[field] = torch.repeat_interleave(batch[field], lengths_tensor.to(batch[field].device)).unsqueeze(0)
    for field in PER_SEQUENCE_FIELDS:
        if field in batch:
            packed[field] = batch[field].unsqueeze(0)
    packed["input_lengths"] = torch.tensor([sum(lengths)], device=device)
    packed["sequence_lengths"] = torch.tensor([lengths], device=device)
    for field in PER_SEQUENCE_LISTS:
        if field in batch:
            # A teacher that rebuilds each sequence (its own prompt, its own template) needs them per sequence.
            packed[field] = [list(batch[field])]
            packed["prompt_lengths"] = batch["prompt_lengths"].reshape(1, -1)
    return packed


def unpack_padding_free(packed: BatchedDataDict, pad_token_id: int) -> BatchedDataDict:
    """The right-padded rows of a batch packed by :func:`pack_padding_free` (for a scorer that needs rows).

    Returns ``input_ids [B, L]``, ``input_lengths [B]`` and the per-sequence fields the packed row kept.
    """
    lengths = [int(length) for length in packed["sequence_lengths"][0]]
    segments = packed["input_ids"][0].split(lengths)
    rows = BatchedDataDict(input_ids=pad_sequence(segments, batch_first=True, padding_value=pad_token_id))
    rows["input_lengths"] = torch.tensor(lengths, device=packed["input_ids"].device)
    if "prompt_lengths" in packed:
        rows["prompt_lengths"] = packed["prompt_lengths"].reshape(-1)
    for field in PER_SEQUENCE_LISTS:
        if field in packed:
            rows[field] = list(packed[field][0])
    for field in PER_SEQUENCE_FIELDS:
        if field in packed:
            rows[field] = packed[field][0]
    return rows


def select_segments(packed: BatchedDataDict, segments: torch.Tensor) -> tuple[torch.Tensor, BatchedDataDict]:
    """The sequences ``segments`` (``[k]`` indices, in the new order) of a packed row, as a packed row of their own.

    Sequences stay whole, so a loss computes the same on the selection. Returns ``(positions [n], batch)``: the kept
    tokens' positions in ``packed``'s row, in the new row's order, and the new one-row batch.
    """
    lengths = packed["sequence_lengths"][0].cpu()
    starts = torch.cat([torch.zeros(1, dtype=lengths.dtype), lengths.cumsum(0)[:-1]])
    chosen = segments.cpu().long()
    kept_lengths = lengths[chosen]
    positions = torch.cat(
        [torch.arange(int(start), int(start) + int(length)) for start, length in zip(starts[chosen], kept_lengths)]
        or [torch.zeros(0, dtype=torch.long)]
    )
    total = int(packed["input_ids"].shape[1])
    selected = BatchedDataDict()
    for key, value in packed.items():
        if key in PER_SEQUENCE_LISTS:
            selected[key] = [[value[0][int(segment)] for segment in chosen]]
        elif key in ("sequence_lengths", "prompt_lengths", *PER_SEQUENCE_FIELDS):
            selected[key] = value[:, chosen.to(value.device)]
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == total:
            selected[key] = value[:, positions.to(value.device)]
        else:
            selected[key] = value
    device = packed["input_ids"].device
    selected["segment_ids"] = torch.repeat_interleave(torch.arange(len(chosen)), kept_lengths).unsqueeze(0).to(device)
    selected["input_lengths"] = torch.tensor([len(positions)], device=device)
    return positions, selected


def pack_rows(values: torch.Tensor, lengths: Sequence[int], rows: Sequence[int] | None = None) -> torch.Tensor:
    """Lays ``[B, L, ...]`` per-position values out like :func:`pack_padding_free`'s row: ``[1, Σ lengths, ...]``.

    Row ``rows[i]`` (default ``i``) is cut to ``lengths[i]``.
    """
    order = range(len(lengths)) if rows is None else rows
    return torch.cat([values[int(row), :length] for row, length in zip(order, lengths, strict=True)]).unsqueeze(0)


def model_inputs(batch: BatchedDataDict, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Keyword arguments of a causal LM's forward for ``batch`` on ``device``.

    A packed batch gets its ``position_ids`` and no attention mask; a right-padded one the mask of its lengths.
    """
    input_ids = batch["input_ids"].to(device)
    if "position_ids" in batch:
        return {"input_ids": input_ids, "position_ids": batch["position_ids"].to(device), "attention_mask": None}
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask_from_lengths(batch["input_lengths"].to(device), input_ids.shape[1]),
    }
