"""A teacher with another tokenizer (``teacher.cross_tokenizer``).

* with two identical tokenizers, the wrapped answer is the teacher's own top k at every
  response position, and the top-k loss equals the ordinary one (value and gradient);
* with two tokenizers of different merges and vocabularies (the demo's, and one trained
  here on other text with a smaller vocabulary), at each group start the answer equals a
  float64 reference computed by hand: the teacher run on its own rendering of the prompt
  and its own tokens of the response, its top k at the matching position, each token put
  in the class of its longest prefix that both vocabularies have and the classes' masses
  summed, heaviest first; positions inside a group carry nothing (every slot empty, all mass in
  the rest) and add nothing to the loss;
* a response cut by the length limit inside a multi-byte character still scores the
  aligned part;
* the config refuses what the mode does not support, and a mismatched tokenizer without
  it names ``teacher.cross_tokenizer``; a short ``opd train`` with such a teacher runs.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from opd_test_helpers import REPO_ROOT
from transformers import AutoTokenizer

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import encode_prompt, pack_padding_free
from opd.data.token_alignment import token_bytes
from opd.distillation.config import MasterConfig
from opd.losses.distillation_losses import TopKKLLossFn
from opd.models.interfaces import TopKRequest
from opd.models.tiny import build_model_for_tokenizer, train_bpe_tokenizer
from opd.teachers.cross_tokenizer import CrossTokenizerTeacher
from opd.teachers.local_teacher import LocalTeacher
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

DEMO = REPO_ROOT / "examples" / "demo" / "models" / "teacher"
DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"
K = 8
PROMPT = [{"role": "user", "content": "What is 347 + 589? Show your work."}]
RESPONSES = [
    "7+9=16 write 6 carry 1. 4+8+1=13 write 3 carry 1. So 347+589=936. </think> <answer> \\boxed{936} </answer>",
    "Ünïcödé ✓ 中文 carry 🙂 done",
    "",
]


@pytest.fixture(scope="module")
def tokenizers():
    student = AutoTokenizer.from_pretrained(DEMO)
    texts = [f"<|im_start|>user\nWhat is {a} - {b}?<|im_end|>\n<|im_start|>assistant\n{a}-{b} borrow 1, answer {a - b}"
             " Ünïcödé ✓ 中文 🙂<|im_end|>\n" for a in range(100, 400, 3) for b in (7, 58)]
    other = train_bpe_tokenizer(texts, vocab_size=300)
    return student, other


def batch_for(student_tokenizer, teacher_tokenizer, responses, cut_bytes=None):
    """Right-padded student rows [prompt | response + <|im_end|>], with the teacher's own prompts."""
    rows, prompts, teacher_prompts = [], [], []
    for text in responses:
        prompt = encode_prompt(student_tokenizer, PROMPT)
        response = student_tokenizer(text, add_special_tokens=False)["input_ids"]
        if cut_bytes is None:
            response = response + [student_tokenizer.eos_token_id]
        else:  # cut by the length limit: as many tokens as fit in cut_bytes bytes
            pieces = token_bytes(student_tokenizer)
            kept, used = [], 0
            for token in response:
                if used + len(pieces[token]) > cut_bytes:
                    break
                kept.append(token)
                used += len(pieces[token])
            response = kept
        rows.append(prompt + response)
        prompts.append(len(prompt))
        teacher_prompts.append(encode_prompt(teacher_tokenizer, PROMPT))
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), student_tokenizer.pad_token_id)
    token_mask = torch.zeros(len(rows), width)
    for index, (row, prompt_length) in enumerate(zip(rows, prompts, strict=True)):
        input_ids[index, : len(row)] = torch.tensor(row)
        token_mask[index, prompt_length : len(row)] = 1
    return BatchedDataDict(
        input_ids=input_ids, input_lengths=torch.tensor(list(map(len, rows))), prompt_lengths=torch.tensor(prompts),
        token_mask=token_mask, teacher_prompt_ids=teacher_prompts,
    )


def test_identical_tokenizers_give_the_teachers_own_topk_and_the_ordinary_loss(tokenizers):
    student_tokenizer, _ = tokenizers
    model = build_model_for_tokenizer("teacher", student_tokenizer)
    local = LocalTeacher(model)
    cross = CrossTokenizerTeacher(local, student_tokenizer, student_tokenizer)
    data = batch_for(student_tokenizer, student_tokenizer, RESPONSES[:2])
    request = TopKRequest(K, 1.0, len(student_tokenizer))
    mapped = cross.score(data, request)
    own = local.score(data, request)
    mask = data["token_mask"][:, 1:].bool()
    torch.testing.assert_close(mapped[0][:, :-1][mask], own[0][:, :-1][mask])
    assert torch.equal(mapped[1][:, :-1][mask], own[1][:, :-1][mask])
    torch.testing.assert_close(mapped.rest_logprobs[:, :-1][mask], own.rest_logprobs[:, :-1][mask])
    loss_fn = TopKKLLossFn(kl_type="reverse", k=K)
    student_logits = torch.randn(*data["input_ids"].shape, len(student_tokenizer), requires_grad=True)
    tokens = int(mask.sum())
    loss, _ = loss_fn(student_logits, data, tokens, 2, teacher_output=mapped)
    expected, _ = loss_fn(student_logits, data, tokens, 2, teacher_output=own)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(torch.autograd.grad(loss, student_logits)[0],
                               torch.autograd.grad(expected, student_logits)[0])


def _reference(student_tokenizer, teacher_tokenizer, model, data, row):
    """Float64, by hand: the teacher on its own tokens; top k at group starts, each token put in the class
    of its longest prefix that is a token of both vocabularies, the classes' masses summed."""
    student_pieces, teacher_pieces = token_bytes(student_tokenizer), token_bytes(teacher_tokenizer)
    specials = set(student_tokenizer.all_special_ids)
    teacher_strings = {p for i, p in enumerate(teacher_pieces) if i not in teacher_tokenizer.all_special_ids}
    roots = {}
    for index, piece in enumerate(student_pieces):
        if index not in specials and piece in teacher_strings:
            roots.setdefault(piece, index)

    def class_of(teacher_id):
        if teacher_id in teacher_tokenizer.all_special_ids:
            return student_tokenizer.convert_tokens_to_ids(teacher_tokenizer.convert_ids_to_tokens(teacher_id))
        piece = teacher_pieces[teacher_id]
        prefixes = [piece[:end] for end in range(1, len(piece) + 1) if piece[:end] in roots]
        return roots[max(prefixes, key=len)] if prefixes else -1

    prompt_length, length = int(data["prompt_lengths"][row]), int(data["input_lengths"][row])
    response = data["input_ids"][row, prompt_length:length].tolist()
    text = b"".join(student_pieces[t] for t in response if t not in specials).decode("utf-8", errors="ignore")
    teacher_response = teacher_tokenizer(text, add_special_tokens=False)["input_ids"]
    if response and response[-1] == student_tokenizer.eos_token_id:
        teacher_response.append(teacher_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    teacher_row = data["teacher_prompt_ids"][row] + teacher_response
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([teacher_row])).logits[0].double()
    log_probs = torch.log_softmax(logits, -1)
    # Common byte boundaries of the two tokenizations give the group starts.
    def starts(tokens, pieces, special):
        offsets, position = {}, 0
        for index, token in enumerate(tokens):
            offsets.setdefault(position, index)
            position += len(special.get(token, pieces[token]))
        return offsets
    eos_bytes = {student_tokenizer.eos_token_id: b"\x00EOS"}
    teacher_eos = {teacher_tokenizer.convert_tokens_to_ids("<|im_end|>"): b"\x00EOS"}
    student_starts = starts(response, student_pieces, eos_bytes)
    teacher_starts = starts(teacher_response, teacher_pieces, teacher_eos)
    expected = {}
    for offset, j in student_starts.items():
        if offset not in teacher_starts:
            continue
        position = len(data["teacher_prompt_ids"][row]) + teacher_starts[offset] - 1
        values, ids = log_probs[position].topk(K)
        masses = {}
        for value, teacher_id in zip(values.tolist(), ids.tolist(), strict=True):
            if class_of(teacher_id) >= 0:
                masses[class_of(teacher_id)] = masses.get(class_of(teacher_id), 0.0) + math.exp(value)
        rest = math.log(1 - sum(masses.values()))
        expected[prompt_length + j - 1] = (masses, rest)
    return expected


def test_different_tokenizers_send_the_teachers_topk_by_class_at_group_starts(tokenizers):
    student_tokenizer, teacher_tokenizer = tokenizers
    model = build_model_for_tokenizer("teacher", teacher_tokenizer)
    cross = CrossTokenizerTeacher(LocalTeacher(model), student_tokenizer, teacher_tokenizer)
    data = batch_for(student_tokenizer, teacher_tokenizer, RESPONSES)
    answer = cross.score(data, TopKRequest(K, 1.0, len(student_tokenizer)))
    some_inside_groups = several_in_a_class = False
    for row in range(len(RESPONSES)):
        expected = _reference(student_tokenizer, teacher_tokenizer, model, data, row)
        prompt_length, length = int(data["prompt_lengths"][row]), int(data["input_lengths"][row])
        for position in range(prompt_length - 1, length - 1):
            ids = answer[1][row, position].tolist()
            if position not in expected:  # inside a group: nothing listed, all mass in the rest
                some_inside_groups = True
                assert ids == [-1] * K and float(answer.rest_logprobs[row, position]) == 0.0
                continue
            masses, rest = expected[position]
            sent = [(i, v) for i, v in zip(ids, answer[0][row, position].tolist(), strict=True) if i >= 0]
            assert [i for i, _ in sent] == sorted(masses, key=lambda root: -masses[root])  # heaviest first
            for root, value in sent:  # a float32 teacher against float64
                assert math.exp(value) == pytest.approx(masses[root], abs=5e-5)
            assert float(answer.rest_logprobs[row, position]) == pytest.approx(rest, abs=1e-4)
            several_in_a_class = several_in_a_class or len(masses) < sum(1 for i in ids if i >= 0) or any(
                int(cross.student_classes[i]) != i for i in range(len(student_tokenizer))
                if int(cross.student_classes[i]) in masses)
    assert some_inside_groups  # the two tokenizations really differ
    assert several_in_a_class  # and classes of several tokens were sent
    # The top-k loss on it is finite, and the inside-group positions add nothing.
    loss_fn = TopKKLLossFn(kl_type="forward", k=K)
    loss_fn.student_classes = cross.student_classes
    logits = torch.randn(*data["input_ids"].shape, len(student_tokenizer), requires_grad=True)
    loss, _ = loss_fn(logits, data, int(data["token_mask"][:, 1:].sum()), 3, teacher_output=answer)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    inside = (answer[1] < 0).all(-1)
    assert grad[inside].abs().max() < 1e-6  # one class on each side: zero up to rounding


def test_a_packed_micro_batch_gets_the_answer_for_its_rows_packed_like_them(tokenizers):
    student_tokenizer, teacher_tokenizer = tokenizers
    model = build_model_for_tokenizer("teacher", teacher_tokenizer)
    cross = CrossTokenizerTeacher(LocalTeacher(model), student_tokenizer, teacher_tokenizer)
    data = batch_for(student_tokenizer, teacher_tokenizer, RESPONSES)
    request = TopKRequest(K, 1.0, len(student_tokenizer))
    rows, packed = cross.score(data, request), cross.score(pack_padding_free(data), request)
    lengths = data["input_lengths"].tolist()
    for got, expected in zip((*packed, packed.rest_logprobs), (*rows, rows.rest_logprobs), strict=True):
        assert torch.equal(got, torch.cat([expected[row, :length] for row, length in enumerate(lengths)])[None])


def test_a_response_cut_inside_a_multibyte_character_scores_what_is_aligned(tokenizers):
    student_tokenizer, teacher_tokenizer = tokenizers
    text = RESPONSES[1]
    cut = len("Ünïcödé ✓ 中".encode()) - 1  # inside the three bytes of 中
    model = build_model_for_tokenizer("teacher", teacher_tokenizer)
    cross = CrossTokenizerTeacher(LocalTeacher(model), student_tokenizer, teacher_tokenizer)
    data = batch_for(student_tokenizer, teacher_tokenizer, [text], cut_bytes=cut)
    answer = cross.score(data, TopKRequest(K, 1.0, len(student_tokenizer)))
    prompt_length = int(data["prompt_lengths"][0])
    assert (answer[1][0, prompt_length - 1] >= 0).any()  # the first response token is aligned
    assert torch.isfinite(answer.rest_logprobs).all()


CROSS = ["teacher.cross_tokenizer=true", "loss_fn.type=topk", "loss_fn.k=8"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["teacher.cross_tokenizer=true"], "loss_fn.type = full_vocab is not supported with it, use loss_fn.type = topk"),
])
def test_cross_tokenizer_config_mistakes_name_their_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(MasterConfig, DEMO_CONFIG, overrides)


def test_a_run_with_a_teacher_of_another_tokenizer(tokenizers, tmp_path):
    from opd.cli import main

    _, other = tokenizers
    teacher_dir = tmp_path / "teacher"
    build_model_for_tokenizer("teacher", other).save_pretrained(teacher_dir)
    other.save_pretrained(teacher_dir)
    common = [f"model.teacher_model_path={teacher_dir}", "training.max_num_steps=2", "training.batch_size=4",
              "training.micro_batch_size=4", "distillation.generate_strategy.max_length=24",
              "validation.generate_strategy.max_length=24", "data.max_val_examples=4", "validation.batch_size=4",
              "logger.console=false", "training.val_freq=2", "training.save_freq=0",
              "data.max_train_examples=32"]  # two steps of 4: tokenising the file's 20,000 rows took most of the run
    assert main(["train", "--config", str(DEMO_CONFIG), *common, f"output_dir={tmp_path / 'refused'}"]) == 2
    status = main(["train", "--config", str(DEMO_CONFIG), *common, *CROSS, f"output_dir={tmp_path / 'run'}"])
    assert status == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = [record["train/loss"] for record in records if "train/loss" in record]
    assert len(losses) == 2 and all(math.isfinite(loss) and loss > 0 for loss in losses)
    assert any("val/kl_forward" in record for record in records)
