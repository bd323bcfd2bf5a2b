"""Training batches built from prepared examples, outside any generation engine (fixed data, SFT)."""

from __future__ import annotations

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.dataloaders import PreparedExample
from opd.data.sequences import pack_sequences


def build_fixed_data_batch(
    examples: list[PreparedExample], pad_token_id: int, mask_prompt_tokens: bool
) -> BatchedDataDict:
    """Prompt + the dataset's assistant turn (or recorded episode), one right-padded row per example.

    Raises ``ValueError`` if an example has no response (the data is checked for this at start-up).
    """
    sequences = []
    for example in examples:
        if example["response_ids"] is None:
            raise ValueError("a fixed-data batch needs every example's response; this one has none")
        sequences.append(example["prompt_ids"] + example["response_ids"])
    batch = pack_sequences(
        sequences, [len(example["prompt_ids"]) for example in examples], pad_token_id, mask_prompt_tokens
    )
    batch["response_lengths"] = batch["input_lengths"] - batch["prompt_lengths"]
    batch["truncated"] = torch.zeros(batch.size, dtype=torch.bool)
    for row, example in enumerate(examples):
        # Recorded episode: only the assistant's own turns carry loss (tool results and markup are mask holes).
        if "response_mask" in example:
            start = len(example["prompt_ids"])
            holes = torch.tensor(example["response_mask"], dtype=batch["token_mask"].dtype)
            batch["token_mask"][row, start : start + len(holes)] *= holes
    attach_teacher_fields(batch, examples, 1)
    return batch


def attach_teacher_fields(batch: BatchedDataDict, examples: list[PreparedExample], num_samples: int) -> None:
    """Gives each row its example's teacher fields, where present (samples of one prompt are adjacent).

    ``teacher_prompt_ids`` (list per row), ``teacher_index`` (``[N]`` int64), ``teacher_weights`` (``[N, M]`` float32,
    M teachers).
    """
    if not examples:
        return
    owners = [examples[row // num_samples] for row in range(batch.size)]
    if "teacher_prompt_ids" in examples[0]:
        batch["teacher_prompt_ids"] = [example["teacher_prompt_ids"] for example in owners]
    if "teacher_index" in examples[0]:
        batch["teacher_index"] = torch.tensor([example["teacher_index"] for example in owners], dtype=torch.long)
    if "teacher_weights" in examples[0]:
        batch["teacher_weights"] = torch.tensor([example["teacher_weights"] for example in owners], dtype=torch.float32)


def unique_responses_per_prompt(batch: BatchedDataDict, samples_per_prompt: int) -> float:
    """The mean number of distinct responses (by token ids) among each prompt's ``samples_per_prompt`` adjacent rows.

    1.0 means all samples of a prompt were copies (compute spent for nothing new); ``samples_per_prompt``, all differ.
    """
    responses = [
        tuple(batch["input_ids"][row, int(batch["prompt_lengths"][row]) : int(batch["input_lengths"][row])].tolist())
        for row in range(batch.size)
    ]
    groups = [responses[start : start + samples_per_prompt] for start in range(0, len(responses), samples_per_prompt)]
    return sum(len(set(group)) for group in groups) / max(len(groups), 1)
