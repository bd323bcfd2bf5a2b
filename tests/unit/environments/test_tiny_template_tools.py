"""The tiny tokenizer's template: plain ChatML without tools (byte for byte), Qwen2.5's tool format with them."""

from __future__ import annotations

import pytest

from opd.models.tiny import build_tiny_tokenizer
from opd.rollout.tools.calculator import calculator_tool

PLAIN_CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_the_text_is_plain_chatml(messages, add_generation_prompt):
    tokenizer, plain = build_tiny_tokenizer(), build_tiny_tokenizer()
    plain.chat_template = PLAIN_CHATML
    assert tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    ) == plain.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_tools_are_listed_and_results_come_back_in_one_user_turn():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<tool_call>...</tool_call>"},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]
    schema = calculator_tool().schema()
    text = build_tiny_tokenizer().apply_chat_template(
        messages, tools=[schema], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1 and '\n{"type": "function", "function": {"name": "calculator"' in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
