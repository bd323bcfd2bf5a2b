"""The top-k rest mass without cancellation, the argument checks of the loss API, and the
temperature of the KL metrics.

* :func:`log1mexp` and the two ways of getting log(1 − Σ_k P) (from the top-k in
  float64, from the full distribution by the teacher) against references computed with
  Python's ``decimal`` / ``math.fsum``;
* :func:`topk_token_kl` on float32 inputs whose rest mass is 1e-2 … 1e-7, value and
  gradient, against float64 references written out here (no opd helpers);
* edge cases: k = vocabulary (rest exactly 0), Σ_k P rounding above 1, all-masked rows,
  extreme logits;
* the teacher-sent rest (LocalTeacher, :class:`TopKLogprobs`) reaching the loss;
* ``ValueError`` for ``mixed_kl_weight`` / ``jsd_beta`` / ``temperature`` / k out of range,
  in the pure functions and the loss object alike;
* the KL metrics at the loss temperature for both teacher signals (full vocabulary and
  top-k with k = vocabulary agree at T ≠ 1; fused and unfused agree).
"""

from __future__ import annotations

import decimal
import math

import pytest
import torch
from opd_test_helpers import json_from_a_process_of_its_own

from opd.data.batched_data_dict import BatchedDataDict
from opd.kernels.fused_lm_head import LMHeadInput
from opd.kernels.topk_rest import (
    log1mexp,
    rest_logprobs_from_topk,
    rest_logprobs_outside,
    rest_logprobs_outside_summed_in_float64,
)
from opd.losses.distillation_losses import DistillationLossFn, JSDLossFn, KLLossFn, TopKKLLossFn
from opd.losses.divergences import full_vocab_divergence_with_grad, generalized_jsd, token_kl, topk_token_kl
from opd.models.interfaces import TopKLogprobs, TopKRequest
from opd.models.tiny import build_tiny_model
from opd.teachers.context_teacher import ContextTeacher
from opd.teachers.local_teacher import LocalTeacher

KL_TYPES = ("forward", "reverse", "mixed")
REST_MASSES = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7)
V, K = 64, 8


# --------------------------------------------------------------------------- references


def decimal_log1mexp(x: float) -> float:
    """log(1 − exp(x)) with 50 significant digits."""
    with decimal.localcontext() as context:
        context.prec = 50
        return float((1 - decimal.Decimal(x).exp()).ln())


def teacher_with_rest_mass(rest: float, rows: int = 3, seed: int = 0) -> torch.Tensor:
    """``[rows, V]`` float64 teacher logits whose top K tokens hold exactly 1 − ``rest`` of the mass."""
    generator = torch.Generator().manual_seed(seed)
    top = torch.randn(rows, K, generator=generator, dtype=torch.float64)
    others = 0.5 * torch.randn(rows, V - K, generator=generator, dtype=torch.float64)
    # Shift the other tokens so that Σ_others exp / Σ_all exp = rest exactly.
    shift = torch.log(torch.tensor(rest / (1 - rest), dtype=torch.float64)) + top.logsumexp(-1) - others.logsumexp(-1)
    return torch.cat([top, others + shift[:, None]], dim=-1)


def student_logits(rows: int = 3, seed: int = 1) -> torch.Tensor:
    """Float32 student logits spread over the whole vocabulary (about 85% of its mass off the teacher's top K)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=generator).float()


def reference_topk_kl(
    student: torch.Tensor,
    topk_logprobs: torch.Tensor,
    topk_ids: torch.Tensor,
    kl_type: str,
    weight: float = 0.3,
    rest: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Float64 KL over the K + 1 classes, written out; the teacher's rest is 1 − Σ_k P in float64 unless given.

    Differentiable in ``student`` (float64 autograd), for the gradient references.
    """
    s = student.to(torch.float64) / temperature
    q = torch.exp(s - s.max(-1, keepdim=True).values)
    q = q / q.sum(-1, keepdim=True)
    q_top = q.gather(-1, topk_ids)
    q_rest = q.sum(-1) - q_top.sum(-1)  # float64: the student's rest here is large (no cancellation concern)
    p_top = topk_logprobs.to(torch.float64).exp()
    p_rest = 1.0 - p_top.sum(-1) if rest is None else rest.to(torch.float64)
    p = torch.cat([p_top, p_rest[:, None]], -1)
    q_all = torch.cat([q_top, q_rest[:, None]], -1)
    forward = (p * (p.log() - q_all.log())).sum(-1)
    reverse = (q_all * (q_all.log() - p.log())).sum(-1)
    return {"forward": forward, "reverse": reverse, "mixed": weight * forward + (1 - weight) * reverse}[kl_type]


def float32_topk(teacher64: torch.Tensor, k: int = K) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float32 teacher's answer: top-k log-probs (rounded to float32), ids, and the exact float64 rest mass."""
    log_p = torch.log_softmax(teacher64, -1)
    values, ids = log_p.topk(k, -1)
    rest = log_p.scatter(-1, ids, float("-inf")).logsumexp(-1).exp()
    return values.float(), ids, rest


# --------------------------------------------------------------------------- log1mexp and the rest


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_log1mexp_matches_a_50_digit_reference(dtype):
    xs = [-1e-20, -1e-10, -1e-7, -1e-3, -0.3, -0.69, -0.7, -1.0, -5.0, -20.0, -50.0, -700.0]
    got = log1mexp(torch.tensor(xs, dtype=dtype))
    for x, value in zip(xs, got.tolist()):
        # The input is rounded to dtype first; the reference takes that rounded input.
        exact = decimal_log1mexp(float(torch.tensor(x, dtype=dtype)))
        assert value == pytest.approx(exact, rel=4 * torch.finfo(dtype).eps, abs=1e-300), x
    assert log1mexp(torch.tensor([0.0, -math.inf], dtype=dtype)).tolist() == [-math.inf, 0.0]


def test_log1mexp_gradient_is_finite_below_zero():
    x = torch.tensor([-1e-12, -0.5, -0.7, -30.0, -math.inf], dtype=torch.float64, requires_grad=True)
    log1mexp(x).sum().backward()
    assert torch.isfinite(x.grad).all()
    # d/dx log(1 − e^x) = −e^x / (1 − e^x)
    expected = [-math.exp(v) / -math.expm1(v) for v in (-1e-12, -0.5, -0.7, -30.0)] + [0.0]
    torch.testing.assert_close(x.grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=0)


@pytest.mark.parametrize("rest", REST_MASSES)
def test_rest_from_float32_topk_is_exact_for_the_given_log_probs(rest):
    values, _, _ = float32_topk(teacher_with_rest_mass(rest))
    got = rest_logprobs_from_topk(values)
    assert got.dtype == torch.float64
    for row, value in zip(values.double().tolist(), got.tolist()):
        expected = 1.0 - math.fsum(math.exp(v) for v in row)  # float64: error ~1e-16, relative 1e-9 at 1e-7
        assert math.exp(value) == pytest.approx(expected, rel=1e-7)


@pytest.mark.parametrize("rest", REST_MASSES)
def test_rest_from_the_full_distribution_keeps_float32_relative_precision(rest):
    teacher64 = teacher_with_rest_mass(rest)
    _, ids, exact = float32_topk(teacher64)
    got = rest_logprobs_outside(torch.log_softmax(teacher64.float(), -1), ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double().exp(), exact, rtol=1e-5, atol=0)


@pytest.mark.parametrize("rest", [*REST_MASSES, 1e-40])
def test_the_servers_float64_sum_of_the_rest_matches_the_float64_reference(rest):
    """What opd serve-teacher sends: relative error ~1e-7, even for a rest below float32's range."""
    teacher64 = teacher_with_rest_mass(rest)
    log_p = torch.log_softmax(teacher64.float(), -1)
    ids = log_p.topk(K, dim=-1).indices
    got = rest_logprobs_outside_summed_in_float64(log_p, ids)
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    # The reference: the same float32 log-probs, every step in float64.
    reference = torch.logsumexp(log_p.double().scatter(-1, ids, -math.inf), dim=-1)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-6)
    all_ids = torch.arange(log_p.shape[-1]).expand(log_p.shape[0], -1)
    assert rest_logprobs_outside_summed_in_float64(log_p, all_ids).tolist() == [-math.inf] * log_p.shape[0]


def test_rest_is_minus_inf_not_nan_when_the_topk_rounds_to_one_or_more():
    # Σ exp = 1 + 6e-8 in float32 arithmetic: the rest is empty, not log of a negative number.
    values = torch.log(torch.tensor([[0.5, 0.25, 0.25000006]], dtype=torch.float32))
    assert rest_logprobs_from_topk(values).tolist() == [-math.inf]
    assert rest_logprobs_from_topk(torch.full((1, 3), -math.inf)).tolist() == [0.0]
    all_ids = torch.arange(5).expand(2, 5)
    assert rest_logprobs_outside(torch.log_softmax(torch.randn(2, 5), -1), all_ids).tolist() == [-math.inf] * 2


# --------------------------------------------------------------------------- the top-k divergence


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("rest", REST_MASSES)
def test_topk_kl_on_float32_inputs_matches_the_float64_reference(kl_type, rest):
    values, ids, _ = float32_topk(teacher_with_rest_mass(rest))
    student = student_logits().requires_grad_(True)
    got = topk_token_kl(student, values, ids, kl_type, 0.3)
    (grad,) = torch.autograd.grad(got.sum(), student)
    leaf = student.detach().double().requires_grad_(True)
    expected = reference_topk_kl(leaf, values, ids, kl_type)
    (expected_grad,) = torch.autograd.grad(expected.sum(), leaf)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected.detach(), rtol=2e-6, atol=0)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("rest", REST_MASSES)
def test_the_teacher_sent_rest_gives_the_exact_divergence(kl_type, rest):
    """With the rest the teacher summed itself, the divergence is that of its true
    distribution, however the float32 top-k log-probs were rounded."""
    values, ids, exact_rest = float32_topk(teacher_with_rest_mass(rest, seed=5))
    student = student_logits(seed=6).requires_grad_(True)
    sent = exact_rest.log().float()
    got = topk_token_kl(student, values, ids, kl_type, 0.3, teacher_rest_logprobs=sent)
    (grad,) = torch.autograd.grad(got.sum(), student)
    leaf = student.detach().double().requires_grad_(True)
    expected = reference_topk_kl(leaf, values, ids, kl_type, rest=exact_rest)
    (expected_grad,) = torch.autograd.grad(expected.sum(), leaf)
    torch.testing.assert_close(got.double(), expected.detach(), rtol=2e-6, atol=0)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_topk_covering_the_vocabulary_is_the_full_kl_with_no_nan(kl_type, temperature):
    generator = torch.Generator().manual_seed(3)
    teacher = torch.randn(4, 16, generator=generator) * 3
    student = (torch.randn(4, 16, generator=generator) * 3).requires_grad_(True)
    log_p = torch.log_softmax(teacher / temperature, -1)
    values, ids = log_p.topk(16, -1)
    expected = token_kl(student.detach().double(), teacher.double(), kl_type, 0.3, temperature)
    for rest in (None, torch.full((4,), -math.inf), rest_logprobs_outside(log_p, ids)):
        got = topk_token_kl(student, values, ids, kl_type, 0.3, temperature=temperature, teacher_rest_logprobs=rest)
        (grad,) = torch.autograd.grad(got.sum(), student)
        assert torch.isfinite(got).all() and torch.isfinite(grad).all()
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_extreme_logits_and_an_empty_teacher_rest_stay_finite(kl_type):
    # The student puts everything on one token; the teacher has no mass outside its top 3
    # (its other logits are -inf), although those 3 do not cover the vocabulary.
    student = torch.tensor([[1e4, -1e4, 0.0, -1e4, 3.0, 2.0]], requires_grad=True)
    teacher = torch.tensor([[5.0, 1e4, 2.0, -math.inf, -math.inf, -math.inf]])
    values, ids = torch.log_softmax(teacher, -1).topk(3, -1)
    for rest in (None, torch.tensor([-math.inf])):
        got = topk_token_kl(student, values, ids, kl_type, teacher_rest_logprobs=rest)
        (grad,) = torch.autograd.grad(got.sum(), student)
        assert torch.isfinite(got).all() and torch.isfinite(grad).all()
        assert float(got) > 0


# --------------------------------------------------------------------------- the signal reaching the loss


def topk_batch(rest: float, seed: int = 0):
    """A [2, 5] micro-batch: row 0 has loss on tokens 2-4, row 1 is all masked."""
    teacher64 = teacher_with_rest_mass(rest, rows=10, seed=seed).reshape(2, 5, V)
    student = student_logits(rows=10, seed=seed + 1).reshape(2, 5, V)
    token_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float32)
    return teacher64, student, {"token_mask": token_mask, "input_ids": torch.zeros(2, 5, dtype=torch.long)}


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_the_loss_uses_the_rest_the_teacher_sent(kl_type):
    teacher64, student, data = topk_batch(1e-6)
    log_p = torch.log_softmax(teacher64, -1)
    values, ids = log_p.topk(K, -1)
    exact_rest = log_p.scatter(-1, ids, float("-inf")).logsumexp(-1)
    loss_fn = TopKKLLossFn(kl_type, 0.3, k=K)
    sent = TopKLogprobs(values.float(), ids, exact_rest.float())
    loss, metrics = loss_fn(student, data, 3, 2, teacher_output=sent)
    triple, _ = loss_fn(student, data, 3, 2, teacher_output=(values.float(), ids, exact_rest.float()))
    pair, _ = loss_fn(student, data, 3, 2, teacher_output=(values.float(), ids))
    rows = data["token_mask"][:, 1:].bool()
    expected = (
        reference_topk_kl(
            student[:, :-1][rows],
            values.float()[:, :-1][rows],
            ids[:, :-1][rows],
            kl_type,
            rest=exact_rest.exp()[:, :-1][rows],
        ).sum()
        / 3
    )
    assert float(loss) == pytest.approx(float(expected), rel=2e-6)
    assert float(triple) == float(loss)
    assert float(pair) == pytest.approx(float(loss), rel=1e-3)  # from the rounded top-k: close, not equal
    # A different rest changes the loss (by 20 float32 ulps and more): it is really read.
    wrong = TopKLogprobs(values.float(), ids, exact_rest.float() + 1.0)
    assert abs(float(loss_fn(student, data, 3, 2, teacher_output=wrong)[0]) - float(loss)) > 1e-5
    assert metrics["num_valid_tokens"] == 3.0


@pytest.mark.parametrize("fused", [False, True])
def test_an_all_masked_topk_batch_is_exactly_zero(fused):
    teacher64, student, data = topk_batch(1e-7)
    data["token_mask"] = torch.zeros(2, 5)
    log_p = torch.log_softmax(teacher64, -1)
    values, ids = log_p.topk(V, -1)  # k = vocabulary: every rest is -inf
    answer = TopKLogprobs(values.float(), ids, torch.full((2, 5), -math.inf))
    loss_fn = TopKKLLossFn("mixed", 0.3, k=V, fused_lm_head=fused, temperature=2.0)
    if fused:
        hidden = torch.randn(2, 5, 4, requires_grad=True)
        weight = torch.randn(V, 4, requires_grad=True)
        loss, metrics = loss_fn(LMHeadInput(hidden, weight, None), data, 0, 2, teacher_output=answer)
        loss.backward()
        grads = [hidden.grad, weight.grad]
    else:
        leaf = student.clone().requires_grad_(True)
        loss, metrics = loss_fn(leaf, data, 0, 2, teacher_output=answer)
        loss.backward()
        grads = [leaf.grad]
    assert float(loss) == 0.0
    assert all(grad is None or (grad == 0).all() for grad in grads)
    assert all(value == 0.0 for value in metrics.values())


def test_local_teacher_sends_its_rest_from_the_full_distribution():
    teacher = LocalTeacher(build_tiny_model("teacher", dtype=torch.float32))
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 200, (2, 6), generator=generator)
    batch = BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor([6, 4]))
    logits = teacher.get_logits(batch).double()
    vocab = logits.shape[-1] - 3
    log_p = torch.log_softmax(logits[..., :vocab], -1)
    answer = teacher.score(batch, TopKRequest(5, 1.0, vocab))
    assert isinstance(answer, TopKLogprobs)
    values, ids = answer  # still unpacks as the (log-probs, ids) pair
    assert answer.rest_logprobs is not None and answer.rest_logprobs.shape == (2, 6)
    expected = log_p.scatter(-1, ids, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(answer.rest_logprobs.double(), expected, rtol=0, atol=1e-5)
    # The teacher's top k and its rest add up to 1.
    total = values.double().exp().sum(-1) + answer.rest_logprobs.double().exp()
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=1e-5)
    everything = teacher.get_topk_logprobs(batch, vocab + 10, 2.0, vocab)  # k ≥ vocabulary: capped, rest empty
    assert everything.logprobs.shape[-1] == vocab
    assert everything.rest_logprobs is not None and (everything.rest_logprobs == -math.inf).all()


def test_a_context_teacher_moves_the_rest_with_the_top_k():
    """The context-distillation wrapper re-positions the wrapped teacher's rest like its top k."""
    model = build_tiny_model("teacher", dtype=torch.float64)
    generator = torch.Generator().manual_seed(4)
    prompt, completion, teacher_prompt = [3, 4, 5], torch.randint(3, 200, (4,), generator=generator).tolist(), [7] * 6
    batch = BatchedDataDict(
        input_ids=torch.tensor([prompt + completion]),
        token_mask=torch.tensor([[0.0] * 3 + [1.0] * 4]),
        input_lengths=torch.tensor([7]),
        prompt_lengths=torch.tensor([3]),
        teacher_prompt_ids=[teacher_prompt],
    )
    answer = ContextTeacher(LocalTeacher(model), pad_token_id=0).score(batch, TopKRequest(5))
    assert isinstance(answer, TopKLogprobs) and answer.rest_logprobs is not None
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([teacher_prompt + completion])).logits[0]
    # Teacher positions 5 … 8 predict the completion; they sit at the student's positions 2 … 5.
    log_p = torch.log_softmax(logits[5:9].double(), -1)
    expected = log_p.scatter(-1, log_p.topk(5, -1).indices, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(answer.rest_logprobs[0, 2:6].double(), expected, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- argument checks


def test_pure_functions_reject_arguments_out_of_range():
    student, teacher = torch.randn(2, 6), torch.randn(2, 6)
    values, ids = torch.log_softmax(teacher, -1).topk(3, -1)
    for weight in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"mixed_kl_weight must be in \[0, 1\]"):
            token_kl(student, teacher, "mixed", weight)
        with pytest.raises(ValueError, match=r"mixed_kl_weight must be in \[0, 1\]"):
            topk_token_kl(student, values, ids, "mixed", weight)
        with pytest.raises(ValueError, match=r"mixed_kl_weight must be in \[0, 1\]"):
            full_vocab_divergence_with_grad(student, teacher, "mixed", weight)
        with pytest.raises(ValueError, match=r"jsd_beta must be in \[0, 1\]"):
            full_vocab_divergence_with_grad(student, teacher, jsd_beta=weight)
        with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
            generalized_jsd(student, teacher, weight)
    for temperature in (0.0, -1.0, math.inf, math.nan):
        message = r"temperature must be a finite number > 0"
        with pytest.raises(ValueError, match=message):
            token_kl(student, teacher, "forward", temperature=temperature)
        with pytest.raises(ValueError, match=message):
            topk_token_kl(student, values, ids, "forward", temperature=temperature)
        with pytest.raises(ValueError, match=message):
            generalized_jsd(student, teacher, 0.5, temperature=temperature)
        with pytest.raises(ValueError, match=message):
            full_vocab_divergence_with_grad(student, teacher, temperature=temperature)
    with pytest.raises(ValueError, match="k >= 1"):
        topk_token_kl(student, values[..., :0], ids[..., :0], "forward")
    with pytest.raises(ValueError, match="teacher_rest_logprobs has shape"):
        topk_token_kl(student, values, ids, "forward", teacher_rest_logprobs=torch.zeros(3))


@pytest.mark.parametrize(
    ("loss_class", "kwargs", "message"),
    [
        (KLLossFn, {"mixed_kl_weight": 1.5}, r"mixed_kl_weight must be in \[0, 1\], got 1.5"),
        (TopKKLLossFn, {"mixed_kl_weight": -0.2}, r"mixed_kl_weight must be in \[0, 1\]"),
        (JSDLossFn, {"beta": 2.0}, r"jsd_beta must be in \[0, 1\], got 2.0"),
        (KLLossFn, {"temperature": 0.0}, r"temperature must be a finite number > 0, got 0.0"),
        (TopKKLLossFn, {"temperature": math.inf}, r"temperature must be a finite number > 0"),
        (TopKKLLossFn, {"k": 0}, r"k must be >= 1, got 0"),
        (KLLossFn, {"metrics_topk": 0}, r"metrics_topk must be >= 1, got 0"),
        (JSDLossFn, {"vocab_size": 0}, r"vocab_size must be >= 1"),
        (KLLossFn, {"chunk_size": 0, "fused_lm_head": True}, r"chunk_size must be >= 1"),
    ],
)
def test_the_loss_object_rejects_arguments_out_of_range(loss_class, kwargs, message):
    with pytest.raises(ValueError, match=message):
        loss_class(**kwargs)


def test_topk_request_rejects_bad_k_and_temperature():
    with pytest.raises(ValueError, match=r"TopKRequest\.k must be >= 1"):
        TopKRequest(0)
    with pytest.raises(ValueError, match=r"TopKRequest\.temperature must be a finite number > 0"):
        TopKRequest(4, temperature=0.0)


# --------------------------------------------------------------------------- metric temperature


def _metrics(loss_fn: DistillationLossFn, student, data, teacher_output) -> dict[str, float]:
    tokens = int(data["token_mask"][:, 1:].sum())
    return loss_fn(student, data, tokens, data["token_mask"].shape[0], teacher_output=teacher_output)[1]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_full_vocab_and_topk_covering_the_vocabulary_log_the_same_metrics(temperature):
    generator = torch.Generator().manual_seed(11)
    student = torch.randn(2, 6, 20, generator=generator) * 2
    teacher = torch.randn(2, 6, 20, generator=generator) * 2
    data = {"token_mask": torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]], dtype=torch.float32)}
    full = _metrics(KLLossFn("mixed", 0.3, temperature, metrics_topk=20), student, data, teacher)
    log_p = torch.log_softmax(teacher / temperature, -1)
    values, ids = log_p.topk(20, -1)
    topk_loss = TopKKLLossFn("mixed", 0.3, k=20, temperature=temperature)
    for answer in ((values, ids), TopKLogprobs(values, ids, rest_logprobs_outside(log_p, ids))):
        topk = _metrics(topk_loss, student, data, answer)
        assert set(topk) == set(full)
        for key, value in full.items():
            assert topk[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # ... and they are the divergences at the loss temperature, not at 1.
    rows = data["token_mask"][:, 1:].bool()
    forward = token_kl(
        student[:, :-1][rows].double(), teacher[:, :-1][rows].double(), "forward", temperature=temperature
    )
    assert full["kl_forward"] == pytest.approx(float(forward.sum()) / int(rows.sum()), rel=1e-5)
    at_one = token_kl(student[:, :-1][rows].double(), teacher[:, :-1][rows].double(), "forward")
    assert abs(full["kl_forward"] - float(at_one.sum()) / int(rows.sum())) > 1e-2


def test_fused_metrics_at_a_temperature_equal_the_unfused_ones():
    generator = torch.Generator().manual_seed(12)
    hidden = torch.randn(2, 6, 8, generator=generator)
    weight = torch.randn(30, 8, generator=generator)
    teacher_hidden = torch.randn(2, 6, 5, generator=generator)
    teacher_weight = torch.randn(30, 5, generator=generator)
    data = {"token_mask": torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]], dtype=torch.float32)}
    student_head, teacher_head = LMHeadInput(hidden, weight, None), LMHeadInput(teacher_hidden, teacher_weight, None)
    for kl_type in ("forward", "reverse"):
        unfused = _metrics(
            KLLossFn(kl_type, temperature=1.7, metrics_topk=4),
            hidden @ weight.T,
            data,
            teacher_hidden @ teacher_weight.T,
        )
        fused = _metrics(
            KLLossFn(kl_type, temperature=1.7, metrics_topk=4, fused_lm_head=True, chunk_size=3),
            student_head,
            data,
            teacher_head,
        )
        for key, value in unfused.items():
            assert fused[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        # The metric of the optimised direction is the loss itself (per token, mean reduction).
        assert fused[f"kl_{kl_type}"] == pytest.approx(fused["loss"], rel=1e-5)


# A process of its own reads its resident-memory high-water mark around one call: the rest mass's kernels make their
# temporaries inside aten (a logsumexp's exponentials), where no Python-level memory tracker sees them.
_REST_PEAK_SCRIPT = """
import ctypes, json, torch
from opd.kernels.topk_rest import rest_logprobs_outside
torch.set_num_threads(1)
def kib(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
log_probs = torch.randn(256, 151_669).log_softmax(-1)
ids = log_probs.topk(8, dim=-1).indices
rest_logprobs_outside(log_probs[:2], ids[:2])
ctypes.CDLL("libc.so.6").malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM restarts from VmRSS
before = kib("VmRSS")
rest_logprobs_outside(log_probs, ids)
print(json.dumps({"peak_bytes": (kib("VmHWM") - before) * 1024, "input_bytes": log_probs.numel() * 4}))
"""


def test_the_rest_mass_makes_one_vocabulary_wide_copy():
    # The copy with the top k masked is needed (the input stays the caller's); torch.logsumexp of it would add its
    # exponentials, a second [rows × V] tensor in a teacher's peak.
    result = json_from_a_process_of_its_own(["-c", _REST_PEAK_SCRIPT], timeout_s=120)
    assert result["peak_bytes"] < 1.5 * result["input_bytes"], result
