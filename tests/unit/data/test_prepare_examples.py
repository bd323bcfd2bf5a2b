"""Preparing a data set (opd/data/dataloaders.py): blocks of texts per tokenizer call, the ids of one call per text.

``prepare_examples`` renders every prompt, tokenizes the prompts in blocks, drops the long
ones and tokenizes the kept responses in blocks. The reference is the plain path, one
example at a time (``encode_prompt`` and ``encode_response``), on the demo's real data,
prompt file and ChatML tokenizer, and on rows of the tiny byte-level tokenizer built to
cross every block boundary: prompts dropped for length on either side of one, rows without
a response between rows with one, responses that hold an EOS of their own.
"""

from __future__ import annotations

import random

import pytest
from opd_test_helpers import REPO_ROOT
from transformers import AutoTokenizer

import opd.data.sequences as sequences
from opd.data.dataloaders import prepare_examples
from opd.data.datasets import load_chat_dataset, split_prompt_and_response
from opd.data.sequences import encode_prompt, encode_response
from opd.models.tiny import build_tiny_tokenizer
from opd.utils.errors import DataError

DEMO_STUDENT = REPO_ROOT / "examples" / "demo" / "models" / "student"
ARITHMETIC_TRAIN = REPO_ROOT / "examples" / "data" / "arithmetic" / "train.jsonl"
PROMPT_FILE = REPO_ROOT / "examples" / "prompts" / "math_think_answer.txt"


def one_at_a_time(rows: list[dict], tokenizer, max_prompt_length: int | None) -> list[dict]:
    """The reference: each example's prompt and response tokenized by a call of its own."""
    expected = []
    for row in rows:
        prompt, response = split_prompt_and_response(row["messages"])
        prompt_ids = encode_prompt(tokenizer, prompt)
        if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
            continue
        ground_truth = row.get("ground_truth")
        expected.append(
            {
                "prompt_ids": prompt_ids,
                "response_ids": encode_response(tokenizer, prompt, response) if response else None,
                "ground_truth": None if ground_truth is None else str(ground_truth),
            }
        )
    return expected


def test_the_demo_data_prepares_as_one_example_at_a_time(monkeypatch):
    monkeypatch.setattr(sequences, "ENCODE_BLOCK", 64)  # 300 rows: five blocks and a partial one
    tokenizer = AutoTokenizer.from_pretrained(DEMO_STUDENT)
    rows = load_chat_dataset(
        str(ARITHMETIC_TRAIN), split="train", max_examples=300, data_format="math_cl", prompt_file=str(PROMPT_FILE)
    )
    expected = one_at_a_time(rows, tokenizer, max_prompt_length=512)  # the demo's limit keeps every prompt
    assert len(expected) == len(rows) and all(item["response_ids"] for item in expected)
    assert prepare_examples(rows, tokenizer, 512, "train.jsonl") == expected


def test_block_boundaries_drops_and_missing_responses_keep_every_example_in_place(monkeypatch):
    monkeypatch.setattr(sequences, "ENCODE_BLOCK", 5)
    tokenizer = build_tiny_tokenizer()
    generator = random.Random(0)
    rows = []
    for index in range(37):
        question = "".join(generator.choice("0123456789 +-*é漢") for _ in range(generator.randint(1, 40)))
        messages = [{"role": "user", "content": f"#{index}: {question}"}]
        if index % 3:  # every third row has no response (an on-policy prompt)
            answer = f"\\boxed{{{index}}}" + ("<|im_end|> and past the end" if index % 7 == 0 else "")
            messages.append({"role": "assistant", "content": answer})
        rows.append({"messages": messages, "ground_truth": index if index % 2 else None})
    expected = one_at_a_time(rows, tokenizer, max_prompt_length=60)
    assert 0 < len(expected) < len(rows)
    assert any(item["response_ids"] is None for item in expected)
    assert prepare_examples(rows, tokenizer, 60, "rows.jsonl") == expected
    everything = prepare_examples(rows, tokenizer, None, "rows.jsonl")
    assert everything == one_at_a_time(rows, tokenizer, None) and len(everything) == len(rows)


def test_a_template_that_renders_the_prompt_otherwise_in_the_conversation_is_refused_naming_the_example():
    tokenizer = build_tiny_tokenizer()
    # The generation prompt ends with a marker that the rendered conversation does not have.
    tokenizer.chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\nThink.\n{% endif %}"
    )
    rows = [
        {"messages": [{"role": "user", "content": "1 + 1?"}]},  # no response: nothing to split
        {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]},
    ]
    with pytest.raises(DataError, match=r"^rows\.jsonl: example 2: the chat template does not render the prompt"):
        prepare_examples(rows, tokenizer, None, "rows.jsonl")
