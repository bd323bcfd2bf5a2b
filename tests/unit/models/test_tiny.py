"""The locally built tiny models and tokenizer that tests and the demo share."""

import pytest
import torch

from opd.models.tiny import TINY_PRESETS, build_tiny_model, build_tiny_tokenizer, is_tiny_path, save_tiny_pair
from opd.utils.errors import ConfigError


def test_tokenizer_round_trips_any_text():
    tokenizer = build_tiny_tokenizer()
    for text in ["What is 12 + 34?", "héllo wörld ✓ 中文", "line one\nline two\t\\boxed{7}"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text.encode("utf-8"))  # one token per UTF-8 byte
        assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens_and_chat_template():
    tokenizer = build_tiny_tokenizer()
    assert len(tokenizer) == 259
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.eos_token_id) == 1  # the special token is one id, not its characters


def test_models_are_deterministic_and_distinct():
    first, second = build_tiny_model("student"), build_tiny_model("student")
    other = build_tiny_model("student-b")
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(first.parameters(), other.parameters()))


def test_building_does_not_touch_the_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_tiny_model("teacher")
    assert torch.equal(torch.rand(3), expected)


def test_teacher_is_larger_than_student():
    teacher, student = build_tiny_model("teacher"), build_tiny_model("student")
    assert sum(p.numel() for p in teacher.parameters()) > 4 * sum(p.numel() for p in student.parameters())
    assert teacher.config.vocab_size == student.config.vocab_size == len(build_tiny_tokenizer())


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="tiny:teacher"):
        build_tiny_model("giant")
    assert is_tiny_path("tiny:student") and not is_tiny_path("Qwen/Qwen2.5-1.5B-Instruct")
    assert set(TINY_PRESETS) >= {"teacher", "student"}


def test_saved_pair_reloads_with_auto_classes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = save_tiny_pair(str(tmp_path / "student"), "student")
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    original = build_tiny_model("student")
    for (name, a), b in zip(original.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    assert tokenizer.chat_template == build_tiny_tokenizer().chat_template


def test_task_tokenizer_survives_save_and_auto_reload(tmp_path):
    """AutoTokenizer reloads it (as a Qwen2Tokenizer) with the very same token ids."""
    from transformers import AutoTokenizer

    from opd.models.tiny import build_model_for_tokenizer, train_bpe_tokenizer

    texts = [f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n"
             for a in range(10, 60) for b in range(20, 40)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=400)
    build_model_for_tokenizer("demo-student", tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    sample = texts[123] + " What is 987 + 654? héllo"
    assert reloaded(sample, add_special_tokens=False)["input_ids"] == tokenizer(sample, add_special_tokens=False)["input_ids"]
    ids = tokenizer("12345", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5  # digits stay single tokens
    assert len(tokenizer(texts[0], add_special_tokens=False)["input_ids"]) < len(texts[0].encode()) / 2  # merges help
