"""Stop tokens: every id of the model's generation config ends a response, in both HF decode loops.

* :func:`stop_token_ids` merges the tokenizer's EOS with ``generation_config.eos_token_id``
  (an int, a list or None);
* a tiny model whose generation config lists two stop ids ends each greedy response at
  the first of either, keeps that token, marks the row as not truncated, and the
  response mask covers exactly the kept tokens; opd's loop and ``model.generate`` agree;
* the start-up check warns when the student's and teacher's stop tokens differ, and fails
  when the student stops at a token the teacher never emits (the committed demo teacher,
  trained on arithmetic only, never emits most letters).
"""

from __future__ import annotations

import json

import pytest
import torch
from opd_test_helpers import REPO_ROOT
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.data.converters import load_prompt_template, math_cl_to_chat
from opd.data.sequences import build_token_mask
from opd.models.decoding import GenerateStrategyConfig
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.rollout.hf_generation import HFGeneration
from opd.rollout.stop_tokens import (
    check_stop_tokens,
    highest_teacher_probability,
    never_emitted_threshold,
    stop_token_ids,
)
from opd.utils.errors import ModelCompatibilityError

TEACHER_DIR = REPO_ROOT / "examples" / "demo" / "models" / "teacher"
GREEDY = GenerateStrategyConfig(decoding_method="greedy", max_length=16)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def prompts(tokenizer) -> list[list[int]]:
    texts = ["What is 2 + 3?", "hi", "Count to five, please.", "Name three colours."]
    rendered = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        for text in texts
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]


def cut_at_first(response: list[int], stops: set[int]) -> list[int]:
    """A float-free reference: the response up to and including its first stop token."""
    for position, token in enumerate(response):
        if token in stops:
            return response[: position + 1]
    return response


@pytest.mark.parametrize(
    ("generation_eos", "expected_extra"),
    [(None, []), (7, [7]), ([7, 9], [7, 9]), ([], [])],
    ids=["none", "int", "list", "empty"],
)
def test_stop_ids_merge_tokenizer_and_generation_config(tokenizer, generation_eos, expected_extra):
    model = build_tiny_model("student")
    model.generation_config.eos_token_id = generation_eos
    assert stop_token_ids(tokenizer, model) == tuple(sorted({tokenizer.eos_token_id, *expected_extra}))
    assert stop_token_ids(tokenizer) == (tokenizer.eos_token_id,)


@pytest.mark.parametrize("decode_loop", ["opd", "generate"])
def test_a_second_stop_id_in_the_generation_config_ends_the_response(tokenizer, decode_loop):
    model = build_tiny_model("teacher").eval()
    ids = prompts(tokenizer)
    # The full greedy continuations, with no stop token at all.
    unstopped = HFGeneration(model, tokenizer, decode_loop, stop_ids=[]).generate(ids, GREEDY)
    responses = [
        unstopped["input_ids"][row, len(ids[row]) : int(unstopped["input_lengths"][row])].tolist()
        for row in range(len(ids))
    ]
    assert all(len(response) == GREEDY.max_length for response in responses)
    # The token row 0 emits third becomes the model's second stop id.
    second_stop = responses[0][2]
    assert second_stop != tokenizer.eos_token_id and second_stop not in responses[0][:2]
    stops = {tokenizer.eos_token_id, second_stop}
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, second_stop]
    batch = HFGeneration(model, tokenizer, decode_loop).generate(ids, GREEDY)
    for row, response in enumerate(responses):
        expected = cut_at_first(response, stops)
        length = int(batch["response_lengths"][row])
        start = len(ids[row])
        assert batch["input_ids"][row, start : start + length].tolist() == expected
        assert bool(batch["truncated"][row]) == (expected[-1] not in stops)
        assert (batch["input_ids"][row, start + length :] == tokenizer.pad_token_id).all()
    assert int(batch["response_lengths"][0]) == 3 and not bool(batch["truncated"][0])
    mask = build_token_mask(batch["input_lengths"], batch["prompt_lengths"], batch["input_ids"].shape[1], True)
    assert torch.equal(mask.sum(dim=1).long(), batch["response_lengths"].long())


def test_both_decode_loops_agree_with_two_stop_ids(tokenizer):
    model = build_tiny_model("teacher").eval()
    ids = prompts(tokenizer)
    probe = HFGeneration(model, tokenizer).generate(ids, GREEDY)
    tokens = [int(probe["input_ids"][row, len(ids[row]) + 4]) for row in range(len(ids))]
    stops = [tokenizer.eos_token_id, tokens[1], tokens[3]]
    ours = HFGeneration(model, tokenizer, "opd", stop_ids=stops).generate(ids, GREEDY)
    theirs = HFGeneration(model, tokenizer, "generate", stop_ids=stops).generate(ids, GREEDY)
    for key in ("input_ids", "input_lengths", "response_lengths", "truncated"):
        assert torch.equal(ours[key], theirs[key]), key
    assert int(ours["response_lengths"].min()) <= 5


# ------------------------------------------------------------------ the start-up check


@pytest.fixture(scope="module")
def demo_teacher():
    return AutoModelForCausalLM.from_pretrained(TEACHER_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(TEACHER_DIR)


def demo_prompts(tokenizer) -> list[list[int]]:
    """The demo's training prompts (its task in the specification's prompt), as the run would probe them."""
    template = load_prompt_template(REPO_ROOT / "examples" / "prompts" / "math_think_answer.txt")
    with open(REPO_ROOT / "examples" / "data" / "arithmetic" / "train.jsonl", encoding="utf-8") as handle:
        rows = [json.loads(line) for line, _ in zip(handle, range(4))]
    conversations = [math_cl_to_chat(row, template)["messages"][:1] for row in rows]
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"])
            for c in conversations]


def never_emitted_token(teacher, tokenizer) -> int:
    """A token the arithmetic teacher gives almost no probability to anywhere ('Q' never occurs in its data)."""
    token_id = tokenizer.convert_tokens_to_ids("Q")
    assert token_id != tokenizer.unk_token_id
    return token_id


def test_same_stop_tokens_pass_silently(demo_teacher, demo_tokenizer):
    eos = demo_tokenizer.eos_token_id
    assert check_stop_tokens(demo_tokenizer, (eos,), (eos,), demo_teacher, demo_prompts(demo_tokenizer)) is None


def test_differing_stop_tokens_the_teacher_emits_are_a_warning(demo_teacher, demo_tokenizer):
    eos = demo_tokenizer.eos_token_id
    ids = demo_prompts(demo_tokenizer)
    # '<|im_start|>' opens the assistant turn after the user's '<|im_end|>\n': the teacher predicts it there.
    emitted = demo_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert highest_teacher_probability(demo_teacher, ids, [emitted])[emitted] > never_emitted_threshold(demo_teacher)
    warning = check_stop_tokens(demo_tokenizer, (eos, emitted), (eos,), demo_teacher, ids)
    assert warning is not None and "differ from the teacher's" in warning and str(emitted) in warning


def test_a_stop_token_the_teacher_never_emits_is_an_error(demo_teacher, demo_tokenizer):
    eos = demo_tokenizer.eos_token_id
    ids = demo_prompts(demo_tokenizer)
    never = never_emitted_token(demo_teacher, demo_tokenizer)
    assert highest_teacher_probability(demo_teacher, ids, [never])[never] < never_emitted_threshold(demo_teacher)
    with pytest.raises(ModelCompatibilityError, match=r"stops at 'Q' .* never emits") as error:
        check_stop_tokens(demo_tokenizer, (eos, never), (eos,), demo_teacher, ids)
    assert "generation.stop_token_ids" in str(error.value)
    # A served teacher's stop tokens are unknown: nothing to compare.
    assert check_stop_tokens(demo_tokenizer, (eos, never), None, None, ids) is None


def test_highest_teacher_probability_matches_a_float64_reference(demo_teacher, demo_tokenizer):
    ids = demo_prompts(demo_tokenizer)
    tokens = [demo_tokenizer.eos_token_id, ids[0][3], never_emitted_token(demo_teacher, demo_tokenizer)]
    got = highest_teacher_probability(demo_teacher, ids, tokens)
    teacher64 = AutoModelForCausalLM.from_pretrained(TEACHER_DIR, dtype=torch.float64).eval()
    with torch.no_grad():
        probabilities = [torch.softmax(teacher64(input_ids=torch.tensor([p])).logits[0], dim=-1) for p in ids]
    for token in tokens:
        expected = max(float(p[:, token].max()) for p in probabilities)
        assert got[token] == pytest.approx(expected, rel=1e-4, abs=1e-12)


# ----------------------------------------------------------------- through opd's setup


def demo_run_config(tmp_path, student_dir, *overrides):
    from opd.distillation.config import MasterConfig
    from opd.utils.config import load_config

    return load_config(
        MasterConfig,
        REPO_ROOT / "examples" / "configs" / "demo.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.student_model_path={student_dir}",
            f"data.train_path={REPO_ROOT / 'examples' / 'data' / 'arithmetic' / 'train.jsonl'}",
            "data.val_path=null",
            "data.max_train_examples=64",  # the file has 20,000 rows; the check probes 8
            "training.batch_size=8",
            "training.max_num_steps=1",
            *overrides,
        ],
    )


def student_stopping_at(tmp_path, extra_stop: int):
    """A copy of the demo student whose generation config also stops at ``extra_stop``."""
    import shutil

    student_dir = tmp_path / "student"
    shutil.copytree(REPO_ROOT / "examples" / "demo" / "models" / "student", student_dir)
    path = student_dir / "generation_config.json"
    generation_config = json.loads(path.read_text())
    generation_config["eos_token_id"] = [generation_config["eos_token_id"], extra_stop]
    path.write_text(json.dumps(generation_config))
    return student_dir


def test_setup_refuses_a_student_stop_token_the_teacher_never_emits(tmp_path, demo_tokenizer):
    from opd.distillation.setup import setup

    never = demo_tokenizer.convert_tokens_to_ids("Q")
    student_dir = student_stopping_at(tmp_path, never)
    with pytest.raises(ModelCompatibilityError, match="never emits"):
        setup(demo_run_config(tmp_path, student_dir))
    # generation.stop_token_ids overrides the student's list: the run then sets up, and its
    # engine stops where the config says.
    components = setup(demo_run_config(tmp_path, student_dir, f"generation.stop_token_ids=[{demo_tokenizer.eos_token_id}]"))
    try:
        assert components.student_generation.stop_ids == (demo_tokenizer.eos_token_id,)
    finally:
        components.close()


def test_setup_warns_when_stop_tokens_differ(tmp_path, demo_tokenizer, caplog):
    import logging

    from opd.distillation.setup import setup

    emitted = demo_tokenizer.convert_tokens_to_ids("<|im_start|>")
    components = setup(demo_run_config(tmp_path, student_stopping_at(tmp_path, emitted)))
    try:
        assert sorted(components.student_generation.stop_ids) == sorted([demo_tokenizer.eos_token_id, emitted])
    finally:
        components.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("differ from the teacher's" in message for message in warnings), warnings


def test_an_empty_stop_list_is_refused():
    """An empty list would mean responses never end: only null (the model's list) or ids are allowed."""
    from opd.distillation.config import MasterConfig
    from opd.utils.config import load_config
    from opd.utils.errors import ConfigError

    with pytest.raises(ConfigError, match=r"generation.stop_token_ids = \[\]"):
        load_config(MasterConfig, REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml",
                    ["generation.stop_token_ids=[]"])
