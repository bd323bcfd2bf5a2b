"""Context distillation: a teacher-only context, exact alignment, self-distillation, the eval baseline.

* where the context goes (user prefix, system message; multi-turn prompts) and how bad
  per-example contexts are reported;
* alignment: the teacher's answers for each completion token, moved to the student's
  positions by ``ContextTeacher``, equal a straightforward float64 reference that runs
  the teacher on ``[teacher prompt | completion]`` row by row — for logits, top-k,
  token log-probs and hidden states, in padded and packed micro-batches, with prompts
  and contexts of different lengths, an empty completion, and a context whose last
  characters merge with the prompt's first ones when tokenized together;
* the loss built from it equals the loss built from the reference;
* ``teacher_model_path: student``: without a context the first step's KL is 0 (the
  teacher is the student's starting point); with one it is not;
* ``validation.eval_baseline`` logs the student's and the teacher's accuracies and their gap;
* config mistakes name their keys.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from opd_test_helpers import REPO_ROOT
from transformers import AutoTokenizer

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.dataloaders import prepare_examples
from opd.data.sequences import encode_prompt, encode_text, pack_padding_free, render_chat
from opd.data.teacher_context import TeacherContext
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.losses.distillation_losses import KLLossFn, TopKKLLossFn
from opd.models.interfaces import FullVocabRequest, TokenLogprobsRequest, TopKRequest
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.teachers.context_teacher import ContextTeacher
from opd.teachers.local_teacher import LocalTeacher
from opd.utils.config import load_config
from opd.utils.errors import ConfigError, DataError

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
DEMO_TOKENIZER = REPO_ROOT / "examples" / "demo" / "models" / "teacher"
K = 6


# ------------------------------------------------------------------ where the context goes


def test_user_prefix_goes_before_the_first_user_message_only():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]
    out = TeacherContext("Hint", None, "user_prefix", " | ").apply(messages, "Hint")
    assert [m["content"] for m in out] == ["Be brief.", "Hint | 2+2?", "4", "3+3?"]
    assert messages[1]["content"] == "2+2?"  # the student's messages are untouched


def test_system_placement_inserts_or_extends_the_system_message():
    context = TeacherContext("Rules", None, "system", "\n")
    assert context.apply([{"role": "user", "content": "q"}], "Rules") == [
        {"role": "system", "content": "Rules"}, {"role": "user", "content": "q"}]
    assert context.apply([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}], "Rules") == [
        {"role": "system", "content": "Rules\nBe brief."}, {"role": "user", "content": "q"}]


def test_fixed_and_per_example_contexts_are_joined():
    context = TeacherContext("Solve it.", "demo", "user_prefix", "\n\n")
    assert context.context_for({"demo": "1+1=2"}) == "Solve it.\n\n1+1=2"
    assert TeacherContext(None, "demo").context_for({"demo": "x"}) == "x"


def test_a_missing_per_example_context_names_the_file_the_example_and_the_key():
    tokenizer = build_tiny_tokenizer()
    rows = [{"messages": [{"role": "user", "content": "a"}], "demo": "ok"},
            {"messages": [{"role": "user", "content": "b"}]}]
    with pytest.raises(DataError, match=re.escape('train.jsonl: example 2: field "demo" '
                                                  '(distillation.teacher_context_key) must be a non-empty string, '
                                                  'found missing')):
        prepare_examples(rows, tokenizer, None, "train.jsonl", TeacherContext(None, "demo"))


def test_the_teacher_prompt_is_the_whole_rendered_conversation_tokenized_at_once():
    """A context whose last characters merge with the prompt's: only whole-text tokenization is right."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    messages = [{"role": "user", "content": "swer 12 + 30"}, {"role": "assistant", "content": "42"},
                {"role": "user", "content": "and 5 + 5?"}]
    context = TeacherContext("Please an", None, "user_prefix", "")  # "an" + "swer" is the one token "answer"
    rows = [{"messages": messages, "ground_truth": "10"}]
    prepared = prepare_examples(rows, tokenizer, None, "mem", context)[0]
    teacher_messages = context.apply(messages, "Please an")
    assert prepared["teacher_prompt_ids"] == encode_prompt(tokenizer, teacher_messages)
    assert prepared["prompt_ids"] == encode_prompt(tokenizer, messages)
    # Tokenizing the context and the rest separately would give other ids (the merge):
    text = render_chat(tokenizer, teacher_messages, add_generation_prompt=True)
    cut = text.index("Please an") + len("Please an")
    assert encode_text(tokenizer, text[:cut]) + encode_text(tokenizer, text[cut:]) != prepared["teacher_prompt_ids"]


# ------------------------------------------------------------------ exact alignment


@pytest.fixture(scope="module")
def teacher_model():
    return build_tiny_model("teacher").double().eval()


def student_batch(seed: int = 0) -> BatchedDataDict:
    """Rows of different prompt and completion lengths (one completion empty), with longer teacher prompts."""
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths, completion_lengths, teacher_lengths = [5, 9, 3, 7], [6, 3, 8, 0], [11, 9, 20, 12]
    width = max(p + c for p, c in zip(prompt_lengths, completion_lengths))
    input_ids = torch.zeros((4, width), dtype=torch.long)
    token_mask = torch.zeros((4, width))
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        input_ids[row, : p + c] = torch.randint(3, 250, (p + c,), generator=generator)
        token_mask[row, p : p + c] = 1.0
    teacher_prompts = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in teacher_lengths]
    return BatchedDataDict(
        input_ids=input_ids, token_mask=token_mask,
        input_lengths=torch.tensor([p + c for p, c in zip(prompt_lengths, completion_lengths)]),
        prompt_lengths=torch.tensor(prompt_lengths), teacher_prompt_ids=teacher_prompts,
    )


def reference_log_probs(teacher_model, batch: BatchedDataDict) -> list[torch.Tensor]:
    """Per row: float64 log-softmax of the teacher on [teacher prompt | completion], at the completion's predicting positions."""
    out = []
    for row in range(batch.size):
        p, n = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
        completion = batch["input_ids"][row, p:n].tolist()
        sequence = torch.tensor([batch["teacher_prompt_ids"][row] + completion])
        q = len(batch["teacher_prompt_ids"][row])
        with torch.no_grad():
            logits = teacher_model(input_ids=sequence).logits[0].double()
        # position q - 1 + j predicts completion token j
        out.append(torch.log_softmax(logits[q - 1 : q - 1 + len(completion)], dim=-1))
    return out


def test_logits_topk_and_token_logprobs_align_with_the_reference(teacher_model):
    batch = student_batch()
    teacher = ContextTeacher(LocalTeacher(teacher_model), pad_token_id=0)
    reference = reference_log_probs(teacher_model, batch)
    logits = teacher.score(batch, FullVocabRequest())
    values, ids = teacher.score(batch, TopKRequest(K))
    token = teacher.score(batch, TokenLogprobsRequest())
    hidden = teacher.score(batch, FullVocabRequest(prefer_hidden_states=True))
    head_logits = hidden.hidden_states @ hidden.weight.T
    for row, expected in enumerate(reference):
        p, n = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
        completion = batch["input_ids"][row, p:n]
        got = torch.log_softmax(logits[row, p - 1 : n - 1].double(), dim=-1)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.log_softmax(head_logits[row, p - 1 : n - 1].double(), -1), expected,
                                   atol=1e-6, rtol=0)
        top = expected.topk(K, dim=-1)
        torch.testing.assert_close(values[row, p - 1 : n - 1].double(), top.values, atol=1e-6, rtol=0)
        assert torch.equal(ids[row, p - 1 : n - 1], top.indices)
        torch.testing.assert_close(token[row, p:n].double(), expected.gather(-1, completion[:, None]).squeeze(-1),
                                   atol=1e-6, rtol=0)
        # outside the completion: zeros, never another row's or the prompt's answers
        assert (token[row, :p] == 0).all() and (token[row, n:] == 0).all()
        assert (logits[row, : p - 1] == 0).all()
    assert batch.size == 4 and int(batch["input_lengths"][3]) == int(batch["prompt_lengths"][3])  # empty completion


def test_packed_micro_batches_align_like_padded_ones(teacher_model):
    batch = student_batch(seed=1)
    teacher = ContextTeacher(LocalTeacher(teacher_model), pad_token_id=0)
    packed = pack_padding_free(batch)
    assert packed["input_ids"].shape[0] == 1 and len(packed["teacher_prompt_ids"][0]) == batch.size
    padded_token = teacher.score(batch, TokenLogprobsRequest())
    packed_token = teacher.score(packed, TokenLogprobsRequest())
    padded_values, padded_ids = teacher.score(batch, TopKRequest(K))
    packed_values, packed_ids = teacher.score(packed, TopKRequest(K))
    offset = 0
    for row in range(batch.size):
        p, n = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
        torch.testing.assert_close(packed_token[0, offset + p : offset + n], padded_token[row, p:n], atol=1e-9, rtol=0)
        torch.testing.assert_close(packed_values[0, offset + p - 1 : offset + n - 1], padded_values[row, p - 1 : n - 1],
                                   atol=1e-9, rtol=0)
        assert torch.equal(packed_ids[0, offset + p - 1 : offset + n - 1], padded_ids[row, p - 1 : n - 1])
        offset += n


@pytest.mark.parametrize("teacher_signal", ["full_vocab", "topk"])
def test_the_loss_through_the_context_teacher_equals_the_reference_loss(teacher_model, teacher_signal):
    batch = student_batch(seed=2)
    student = build_tiny_model("student").double()
    logits = student(input_ids=batch["input_ids"]).logits.detach()
    vocab = logits.shape[-1]
    loss_fn = (KLLossFn("forward", metrics_topk=K, vocab_size=vocab, fused_lm_head=False)
               if teacher_signal == "full_vocab" else TopKKLLossFn("forward", k=K, vocab_size=vocab, fused_lm_head=False))
    valid = int(batch["token_mask"][:, 1:].sum())
    teacher = ContextTeacher(LocalTeacher(teacher_model), pad_token_id=0)
    loss, _ = loss_fn(logits, batch, valid, batch.size, teacher_output=teacher.score(batch, loss_fn.teacher_request))
    # reference: forward KL(teacher || student) per completion token, from the row-by-row teacher
    total = 0.0
    for row, expected in enumerate(reference_log_probs(teacher_model, batch)):
        p, n = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
        student_log_probs = torch.log_softmax(logits[row, p - 1 : n - 1].double(), dim=-1)
        if teacher_signal == "full_vocab":
            total += float((expected.exp() * (expected - student_log_probs)).sum())
        else:
            top = expected.topk(K, dim=-1)
            rest_t = torch.log1p(-top.values.exp().sum(-1).clamp(max=1 - 1e-12))
            student_top = student_log_probs.gather(-1, top.indices)
            rest_s = torch.log1p(-student_top.exp().sum(-1).clamp(max=1 - 1e-12))
            total += float((top.values.exp() * (top.values - student_top)).sum()
                           + (rest_t.exp() * (rest_t - rest_s)).sum())
    assert float(loss) == pytest.approx(total / valid, rel=1e-6)


# ------------------------------------------------------------------ runs


def run_metrics(tmp_path, name: str, overrides: list[str]) -> list[dict]:
    config = load_config(MasterConfig, TINY_CONFIG, [
        f"output_dir={tmp_path / name}", "checkpointing.enabled=false", "logger.console=false",
        "training.batch_size=4", "training.micro_batch_size=4", "training.max_num_steps=2",
        "training.warmup_steps=0", "distillation.num_samples_per_prompt=1", "data.max_val_examples=8",
        "validation.val_at_start=false", "validation.val_at_end=false",
        "loss_fn.kl_type=forward", "loss_fn.fused_lm_head=false",
    ] + overrides)
    distillation_train(setup(config))
    lines = (tmp_path / name / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_self_distillation_without_context_starts_at_zero_kl_and_with_context_does_not(tmp_path):
    plain = run_metrics(tmp_path, "plain", ["model.teacher_model_path=student"])
    first = next(r for r in plain if "train/loss" in r)
    assert first["train/kl_forward"] == pytest.approx(0.0, abs=1e-6)  # same weights, same prompt
    context = run_metrics(tmp_path, "context", ["model.teacher_model_path=student",
                                                 "distillation.teacher_context=You add numbers very carefully."])
    first = next(r for r in context if "train/loss" in r)
    # Same weights, a different prompt. The random tiny model is close to uniform, so the
    # prompt moves its predictions only a little: still a hundred times the tolerance above.
    assert first["train/kl_forward"] > 1e-4


def test_packed_and_padded_context_runs_give_the_same_losses(tmp_path):
    common = ["distillation.teacher_context=Think step by step.", "distillation.teacher_context_placement=system"]
    padded = run_metrics(tmp_path, "padded", common)
    packed = run_metrics(tmp_path, "packed", common + ["training.sequence_packing=true"])
    losses = {name: [r["train/loss"] for r in rows if "train/loss" in r] for name, rows in
              (("padded", padded), ("packed", packed))}
    assert len(losses["padded"]) == 2
    assert losses["packed"] == pytest.approx(losses["padded"], rel=1e-4)


def test_eval_baseline_logs_both_accuracies_and_their_gap(tmp_path):
    rows = run_metrics(tmp_path, "baseline", ["model.teacher_model_path=student", "validation.eval_baseline=true",
                                              "distillation.teacher_context=The answer is a number."])
    baseline = next(r for r in rows if "val/baseline_accuracy_gap" in r)
    assert baseline["step"] == 0
    assert baseline["val/baseline_accuracy_gap"] == pytest.approx(
        baseline["val/baseline_teacher_accuracy"] - baseline["val/baseline_student_accuracy"])
    assert 0.0 <= baseline["val/baseline_student_accuracy"] <= 1.0


@pytest.mark.parametrize("overrides, message", [
    (["distillation.teacher_context=x", "distillation.mask_prompt_tokens=false"], "set distillation.mask_prompt_tokens = true"),
    (["validation.eval_baseline=true"], "set distillation.teacher_context or teacher_context_key"),
])
def test_context_config_mistakes_name_the_keys(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(MasterConfig, TINY_CONFIG, [f"output_dir={tmp_path}"] + overrides)
