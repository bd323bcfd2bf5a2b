"""One teacher forward per distinct prompt: the samples of a prompt share its pass.

A causal LM's states over a prefix do not depend on what follows, so (1) the distinct prompts run once each,
right-padded, keeping their keys and values; (2) the cache is expanded to the batch's rows; (3) each row's response
(everything after its prompt: all turns of a multi-turn trajectory) runs on top at the positions after its prompt,
with the padding between a shorter prompt and the widest masked. The hidden states land where a one-pass forward puts
them, so everything computed from them is the one-pass result up to float rounding (padding positions hold zeros).
Rows are grouped by prompt tokens; groups of unequal prompt length share one pass.

A batch is scored in one pass where sharing saves nothing or does not apply (:func:`prompt_groups` returns None),
and a model always is when some layers do not attend to the whole context (:func:`sharing_problem`: sliding-window
or recurrent caches do not hold every earlier key and value).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from opd.data.batched_data_dict import BatchedDataDict
from opd.teachers.scoring import right_padded

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class PromptGroups:
    """Which rows share which prompt: ``group_of_row`` indexes ``prompts`` (in order of first appearance)."""

    group_of_row: list[int]
    prompts: list[list[int]]
    prompt_lengths: list[int]
    input_lengths: list[int]


def sharing_problem(model: PreTrainedModel) -> str | None:
    """Why ``model``'s prompts cannot be shared (its layers are not all full attention), or None."""
    model_config: Any = getattr(model, "config", None)
    if not hasattr(model_config, "get_text_config"):
        return "it is not a transformers model with a config"
    config = model_config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted({layer for layer in layer_types if layer != "full_attention"})
        return f"its layers include {other}" if other else None
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "it attends over a sliding window"
    return None


def prompt_groups(data: BatchedDataDict) -> PromptGroups | None:
    """Rows of right-padded ``data`` grouped by identical prompt tokens, or None where sharing saves nothing.

    None also for packed sequences (``position_ids``), no ``prompt_lengths`` or an empty prompt.
    """
    if "position_ids" in data or "prompt_lengths" not in data:
        return None
    prompt_lengths = [int(length) for length in data["prompt_lengths"].tolist()]
    input_lengths = [int(length) for length in data["input_lengths"].tolist()]
    if any(length < 1 for length in prompt_lengths):
        return None
    # One read of the prompts' columns (the micro-batch is normally still on the host), cut per row in Python.
    prompt_columns = data["input_ids"][:, : max(prompt_lengths)].tolist()
    keys = [tuple(ids[:length]) for ids, length in zip(prompt_columns, prompt_lengths, strict=True)]
    # Distinct prompts in order of first appearance, each numbered.
    index_of = {key: index for index, key in enumerate(dict.fromkeys(keys))}
    if len(index_of) == len(keys):
        return None
    prompts = [list(key) for key in index_of]
    group_of_row = [index_of[key] for key in keys]
    return PromptGroups(group_of_row, prompts, prompt_lengths, input_lengths)


def shared_prompt_hidden_states(
    model: PreTrainedModel, input_ids: torch.Tensor, groups: PromptGroups, device: torch.device
) -> torch.Tensor:
    """Final hidden states ``[B, L, D]`` of right-padded ``input_ids`` (zeros at padding), each prompt run once."""
    decoder = model.get_decoder()
    # The cache argument's name changed within transformers 5 (past_key_values, then cache).
    cache_argument = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    rows, width = input_ids.shape
    prompt_ids, prompt_mask = right_padded(groups.prompts)
    prompt_mask = prompt_mask.to(device)
    # Right padding: every query position sees at least the first token, so no attention
    # row is fully masked and the padded slots' keys and values stay finite.
    prefix = decoder(
        input_ids=prompt_ids.to(device),
        attention_mask=prompt_mask,
        position_ids=torch.arange(prompt_ids.shape[1], device=device).expand(len(groups.prompts), -1),
        use_cache=True,
        **{cache_argument: cache},
    )
    prompt_hidden = prefix.last_hidden_state
    group_of_row = torch.tensor(groups.group_of_row, dtype=torch.long, device=device)
    cache.batch_select_indices(group_of_row)  # each row takes its prompt's keys and values

    response_lengths = [length - prompt for length, prompt in zip(groups.input_lengths, groups.prompt_lengths)]
    spans = list(zip(groups.prompt_lengths, response_lengths))
    longest_response = max(response_lengths)
    hidden = prompt_hidden.new_zeros((rows, width, prompt_hidden.shape[-1]))
    response_hidden = None
    if longest_response > 0:
        responses = [input_ids[row, begin : begin + length].cpu() for row, (begin, length) in enumerate(spans)]
        response_ids, response_mask = right_padded(responses)
        starts = torch.tensor(groups.prompt_lengths, dtype=torch.long, device=device)
        response_hidden = decoder(
            input_ids=response_ids.to(device),
            # Over the cache's slots then the new tokens: a shorter prompt's padding slots are masked.
            attention_mask=torch.cat([prompt_mask[group_of_row], response_mask.to(device)], dim=1),
            # Each response continues at its own prompt's length, as in the one-pass forward.
            position_ids=starts[:, None] + torch.arange(longest_response, device=device),
            use_cache=True,
            **{cache_argument: cache},
        ).last_hidden_state
    for row, (group, begin, length) in enumerate(zip(groups.group_of_row, groups.prompt_lengths, response_lengths)):
        hidden[row, :begin] = prompt_hidden[group, :begin]
        if response_hidden is not None and length > 0:
            hidden[row, begin : begin + length] = response_hidden[row, :length]
    return hidden
