"""Validation's KL is computed where the student's hidden states are, chunk by chunk, and equals the whole-logits KL.

* :class:`~opd.run.validation.ValidationKL` on random hidden states and heads,
  against every kind of teacher answer (hidden states and head, logits, top-k with and
  without the teacher's rest mass), in chunks far smaller than the batch, equals the
  float64 :func:`token_kl` / :func:`topk_token_kl` of the whole logits;
* the in-process student's :meth:`HFPolicy.compare_with_teacher`, with one teacher, two
  routed teachers, a mixture and a teacher with a teacher-only context, full vocabulary
  and top-k, equals the computation
  validation made before (the student's and the teacher's whole ``[B, L, V]`` logits);
* the student's ``[B, L, V]`` logits are never made: its forward stops at the decoder.
"""

from __future__ import annotations

import pytest
import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import build_token_mask, shift_token_mask
from opd.losses.divergences import token_kl, topk_token_kl
from opd.models.config import ModelLoadingConfig, OptimizerConfig
from opd.models.interfaces import (
    FullVocabRequest,
    SeveralTeachersSignal,
    TopKLogprobs,
    TopKRequest,
)
from opd.models.lm_head import LMHeadInput
from opd.models.loading import load_causal_lm
from opd.policy.hf_policy import HFPolicy
from opd.run.validation import ValidationKL
from opd.teachers.context_teacher import ContextTeacher
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.several_teachers import RoutedTeachers, TeacherMixture

B, L, D, HEAD_WIDTH, VOCAB, K = 3, 7, 8, 40, 37, 5  # the heads are wider than the vocabulary (padding)


def random_case(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    student = LMHeadInput(
        torch.randn(B, L, D, generator=generator, dtype=torch.float64),
        torch.randn(HEAD_WIDTH, D, generator=generator, dtype=torch.float64),
        torch.randn(HEAD_WIDTH, generator=generator, dtype=torch.float64),
    )
    teacher = LMHeadInput(
        torch.randn(B, L, D + 4, generator=generator, dtype=torch.float64),
        torch.randn(HEAD_WIDTH, D + 4, generator=generator, dtype=torch.float64),
        logit_softcap=5.0,  # a teacher's transform is applied as its forward would
    )
    lengths, prompts = torch.tensor([7, 4, 6]), torch.tensor([2, 1, 3])
    data = BatchedDataDict({"token_mask": build_token_mask(lengths, prompts, L, True)})
    return student, teacher, data


def whole_logits(head: LMHeadInput) -> torch.Tensor:
    return head.logits()[..., :VOCAB]


def reference(student: LMHeadInput, data: BatchedDataDict, kl) -> dict[str, float]:
    """The sums from whole float64 logits: ``kl(student_rows, direction, mask)``."""
    mask = shift_token_mask(data["token_mask"]).bool()
    rows = whole_logits(student)[:, :-1][mask]
    return {
        "kl_forward": float(kl(rows, "forward", mask).sum()),
        "kl_reverse": float(kl(rows, "reverse", mask).sum()),
        "tokens": float(mask.sum()),
    }


def assert_sums_equal(actual: dict[str, float], expected: dict[str, float]) -> None:
    assert actual.keys() == expected.keys()
    assert actual["tokens"] == expected["tokens"] > 0
    for key in ("kl_forward", "kl_reverse"):
        assert actual[key] == pytest.approx(expected[key], rel=1e-10, abs=1e-12), key
        assert actual[key] > 0


@pytest.mark.parametrize("answer", ["hidden_states", "logits"])
def test_full_vocabulary_sums_in_chunks_equal_the_whole_logits_kl(answer):
    student, teacher, data = random_case()
    teacher_output = teacher if answer == "hidden_states" else teacher.logits()  # [B, L, HEAD_WIDTH]
    mask = shift_token_mask(data["token_mask"]).bool()
    teacher_rows = whole_logits(teacher)[:, :-1][mask]
    expected = reference(student, data, lambda rows, direction, _: token_kl(rows, teacher_rows, direction))
    # 3 positions per chunk: the 13 response positions take 5 chunks.
    actual = ValidationKL(FullVocabRequest(), VOCAB, chunk_rows=3)(student, teacher_output, data)
    assert_sums_equal(actual, expected)


def test_the_teachers_logits_are_made_once_per_chunk_for_both_directions(monkeypatch):
    student, teacher, data = random_case()
    chunks_made = []
    whole = LMHeadInput.logits

    def counted(head: LMHeadInput, rows: slice | None = None) -> torch.Tensor:
        if head.head()[0].data_ptr() == teacher.head()[0].data_ptr():  # the teacher's output layer, not the student's
            chunks_made.append(rows)
        return whole(head, rows)

    monkeypatch.setattr(LMHeadInput, "logits", counted)
    ValidationKL(FullVocabRequest(), VOCAB, chunk_rows=3)(student, teacher, data)
    positions = int(shift_token_mask(data["token_mask"]).sum())
    chunks = -(-positions // 3)
    # Each chunk of 3 response positions made once, not once per direction.
    assert chunks >= 2 and len(chunks_made) == len(set(map(str, chunks_made))) == chunks


@pytest.mark.parametrize("with_rest", [True, False], ids=["teacher_rest", "rest_from_topk"])
def test_topk_sums_in_chunks_equal_the_whole_logits_kl(with_rest):
    student, teacher, data = random_case(1)
    log_p = torch.log_softmax(whole_logits(teacher), dim=-1)
    top = log_p.topk(K, dim=-1)
    rest = torch.logsumexp(log_p.scatter(-1, top.indices, float("-inf")), dim=-1)
    answer = TopKLogprobs(top.values, top.indices, rest if with_rest else None)
    mask = shift_token_mask(data["token_mask"]).bool()
    values, ids, rests = top.values[:, :-1][mask], top.indices[:, :-1][mask], rest[:, :-1][mask]

    def kl(rows, direction, _):
        return topk_token_kl(rows, values, ids, direction, teacher_rest_logprobs=rests if with_rest else None)

    expected = reference(student, data, kl)
    actual = ValidationKL(TopKRequest(K, 1.0, VOCAB), VOCAB, chunk_rows=4)(student, answer, data)
    assert_sums_equal(actual, expected)


def test_a_full_vocabulary_request_asks_for_hidden_states():
    assert ValidationKL(FullVocabRequest(), VOCAB).teacher_request == FullVocabRequest(prefer_hidden_states=True)


# --------------------------------------------------------------------------- the in-process student


def tiny(preset: str):
    return load_causal_lm(f"tiny:{preset}", torch.float32, torch.device("cpu"), ModelLoadingConfig())


@pytest.fixture(scope="module")
def models():
    return {name: tiny(name) for name in ("student", "teacher", "student-b")}


def validation_batch() -> BatchedDataDict:
    generator = torch.Generator().manual_seed(5)
    lengths = torch.tensor([9, 4, 7, 9, 6])
    prompts = torch.tensor([3, 2, 2, 4, 1])
    ids = torch.randint(3, 200, (5, 9), generator=generator) * (torch.arange(9)[None, :] < lengths[:, None])
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": lengths,
            "prompt_lengths": prompts,
            "token_mask": build_token_mask(lengths, prompts, 9, True),
            "teacher_index": torch.tensor([0, 1, 1, 0, 1]),
            "teacher_weights": torch.tensor([[0.3, 0.7], [0.5, 0.5], [1.0, 0.0], [0.2, 0.8], [0.6, 0.4]]),
            # A teacher-only context: the teacher sees each response under its own longer prompt.
            "teacher_prompt_ids": [torch.randint(3, 200, (n,), generator=generator).tolist() for n in (6, 3, 8, 5, 2)],
        }
    )


def old_validation_sums(batch, policy: HFPolicy, teacher, request, vocab: int) -> dict[str, float]:
    """What validation computed before: both models' whole ``[B, L, V]`` logits, here in float64."""
    answer = teacher.score(batch, request)
    if isinstance(answer, SeveralTeachersSignal):
        answer = answer.combined()
    student_logits = policy.get_logits(batch).double()
    mask = shift_token_mask(batch["token_mask"]).bool()
    rows = student_logits[:, :-1][..., :vocab][mask]
    sums = {"tokens": float(mask.sum())}
    for direction in ("forward", "reverse"):
        if isinstance(answer, tuple):
            rest = answer.rest_logprobs if isinstance(answer, TopKLogprobs) else None
            kl = topk_token_kl(
                rows,
                answer[0][:, :-1][mask].double(),
                answer[1][:, :-1][mask],
                direction,
                teacher_rest_logprobs=None if rest is None else rest[:, :-1][mask].double(),
            )
        else:
            kl = token_kl(rows, answer.double()[..., :vocab][:, :-1][mask], direction)
        sums[f"kl_{direction}"] = float(kl.sum())
    return sums


def build_teacher(kind: str, models):
    teacher, other = LocalTeacher(models["teacher"]), LocalTeacher(models["student-b"])
    if kind == "one":
        return teacher
    if kind == "routed":
        return RoutedTeachers(["a", "b"], [teacher, other])
    if kind == "context":
        return ContextTeacher(teacher, pad_token_id=0)
    return TeacherMixture(["a", "b"], [teacher, other])


@pytest.mark.parametrize("kind", ["one", "routed", "mixture", "context"])
@pytest.mark.parametrize("request_", [FullVocabRequest(), TopKRequest(6, 1.0, 200)], ids=["full_vocab", "topk"])
def test_in_process_student_sums_equal_the_old_whole_logits_path(models, kind, request_, monkeypatch):
    from opd.run import validation

    policy = HFPolicy(models["student"], OptimizerConfig(), micro_batch_size=2, total_steps=1)
    teacher = build_teacher(kind, models)
    batch = validation_batch()
    vocab = 200  # below the tiny models' head width: the padding outputs are cut
    expected = old_validation_sums(batch, policy, teacher, request_, vocab)
    comparison = ValidationKL(request_, vocab, chunk_rows=5)

    # The student's forward never reaches its head: the logits are made chunk by chunk.
    def no_head(*args, **kwargs):
        raise AssertionError("the student's full logits were computed")

    monkeypatch.setattr(models["student"], "forward", no_head)
    actual = policy.compare_with_teacher(
        batch, comparison, lambda rows: validation._one_answer(teacher, comparison.teacher_request, rows)
    )
    assert actual["tokens"] == expected["tokens"]
    for key in ("kl_forward", "kl_reverse"):
        assert actual[key] == pytest.approx(expected[key], rel=1e-5), key
