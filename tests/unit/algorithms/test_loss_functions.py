"""Tests for ``opd.losses.divergences.token_kl`` and the loss objects (KL and NLL).

Everything is checked against small, deliberately naive float64 references written in this
file (explicit max-subtracted softmax, explicit Σ p·(log p − log q), Python loops over the
token mask), never against the module's own helpers, so a wrong shift, a wrong normaliser or
a wrong KL direction shows up as a numeric mismatch.

Conventions under test: logits at position ``t`` predict token ``t + 1``; ``token_mask`` is
1 on the tokens that carry loss; the loss objects divide by the *global* number of valid
tokens ("mean") or sequences ("sum"), so per-micro-batch losses add up to the whole-batch
loss.
"""

from __future__ import annotations

import math

import pytest
import torch

from opd.data.sequences import shift_token_mask
from opd.losses.distillation_losses import KLLossFn
from opd.losses.divergences import token_kl
from opd.losses.nll import NLLLossFn

KL_TYPES = ("forward", "reverse", "mixed")
TEMPERATURES = (1.0, 0.7, 2.0)
# (kl_type, mixed weight): the weight only matters for "mixed", where we sweep the ends too.
KL_CASES = [
    ("forward", 0.5),
    ("reverse", 0.5),
    ("mixed", 0.0),
    ("mixed", 0.3),
    ("mixed", 0.5),
    ("mixed", 1.0),
]
SHAPES = [(3, 5, 17), (17,), (4, 9)]


# --------------------------------------------------------------------------- references


def ref_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log softmax spelled out in float64: shift by the max, exponentiate, normalise."""
    x = x.to(torch.float64)
    shifted = x - x.max(dim=-1, keepdim=True).values
    return shifted - torch.log(torch.exp(shifted).sum(dim=-1, keepdim=True))


def ref_plogp(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """Σ_v a(v)·(log a(v) − log b(v)), with 0·log 0 = 0 (entries where a(v) is exactly 0)."""
    a = torch.exp(log_a)
    support = a > 0
    # Fill the off-support entries with harmless values *before* the product so that
    # autograd of the reference never sees 0·inf.
    safe_log_a = torch.where(support, log_a, torch.zeros_like(log_a))
    safe_log_b = torch.where(support, log_b, torch.zeros_like(log_b))
    return torch.where(support, a * (safe_log_a - safe_log_b), torch.zeros_like(a)).sum(dim=-1)


def ref_kl(student, teacher, kl_type, weight=0.5, temperature=1.0) -> torch.Tensor:
    """Float64 per-position KL; P = teacher, Q = student."""
    log_q = ref_log_softmax(student.to(torch.float64) / temperature)
    log_p = ref_log_softmax(teacher.to(torch.float64) / temperature)
    forward = ref_plogp(log_p, log_q)
    reverse = ref_plogp(log_q, log_p)
    if kl_type == "forward":
        return forward
    if kl_type == "reverse":
        return reverse
    return weight * forward + (1.0 - weight) * reverse


def ref_masked_kl_sum(student, teacher, token_mask, kl_type, weight=0.5, temperature=1.0):
    """Σ over (b, t) with token_mask[b, t + 1] == 1 of KL(logits[b, t]); also the count."""
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    batch, length = token_mask.shape
    for b in range(batch):
        for t in range(length - 1):
            if token_mask[b, t + 1]:
                total = total + ref_kl(student[b, t], teacher[b, t], kl_type, weight, temperature)
                count += 1
    return total, count


def make_batch(lengths, prompt_lens, seq_len, vocab, seed=0, dtype=torch.float32):
    """Random logits plus a right-padded token mask: prompt, then ``lengths[b]`` response tokens."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    student = torch.randn(batch, seq_len, vocab, generator=g, dtype=dtype)
    teacher = torch.randn(batch, seq_len, vocab, generator=g, dtype=dtype) * 1.5
    input_ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    token_mask = torch.zeros(batch, seq_len, dtype=torch.long)
    for b, (resp, prompt) in enumerate(zip(lengths, prompt_lens)):
        assert prompt + resp <= seq_len
        token_mask[b, prompt : prompt + resp] = 1
    return student, teacher, {"input_ids": input_ids, "token_mask": token_mask}


def global_counts(token_mask: torch.Tensor) -> tuple[int, int]:
    """What the trainer passes: valid loss positions and sequences of the whole batch."""
    return int(token_mask[:, 1:].sum()), int(token_mask.shape[0])


# --------------------------------------------------------------------------- token_kl


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("kl_type,weight", KL_CASES)
def test_token_kl_matches_reference_fp32(shape, temperature, kl_type, weight):
    torch.manual_seed(0)
    student = torch.randn(shape) * 2.0
    teacher = torch.randn(shape) * 2.0
    out = token_kl(student, teacher, kl_type, weight, temperature)
    assert out.shape == shape[:-1]
    assert out.dtype == torch.float32
    expected = ref_kl(student, teacher, kl_type, weight, temperature)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("kl_type,weight", KL_CASES)
def test_token_kl_value_and_grad_fp64(shape, temperature, kl_type, weight):
    torch.manual_seed(1)
    student = (torch.randn(shape, dtype=torch.float64) * 2.0).requires_grad_()
    teacher = torch.randn(shape, dtype=torch.float64) * 2.0
    out = token_kl(student, teacher, kl_type, weight, temperature)
    assert out.dtype == torch.float64

    ref_student = student.detach().clone().requires_grad_()
    expected = ref_kl(ref_student, teacher, kl_type, weight, temperature)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)

    # A non-uniform upstream gradient catches positions being mixed up.
    upstream = torch.rand(out.shape, dtype=torch.float64) + 0.5
    (grad,) = torch.autograd.grad((out * upstream).sum(), student)
    (ref_grad,) = torch.autograd.grad((expected * upstream).sum(), ref_student)
    torch.testing.assert_close(grad, ref_grad, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_forward_kl_grad_is_q_minus_p_over_t(temperature):
    # d/dz_s KL(P‖Q) = (Q − P) / T: an analytic check independent of any autograd reference.
    torch.manual_seed(2)
    student = torch.randn(3, 5, 17, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(3, 5, 17, dtype=torch.float64)
    token_kl(student, teacher, "forward", temperature=temperature).sum().backward()
    q = torch.softmax(student.detach() / temperature, dim=-1)
    p = torch.softmax(teacher / temperature, dim=-1)
    torch.testing.assert_close(student.grad, (q - p) / temperature, atol=1e-12, rtol=1e-10)


def test_token_kl_fp32_grad_matches_reference():
    torch.manual_seed(3)
    student = torch.randn(3, 5, 17, requires_grad=True)
    teacher = torch.randn(3, 5, 17)
    for kl_type in KL_TYPES:
        student.grad = None
        token_kl(student, teacher, kl_type, 0.3, 0.7).sum().backward()
        ref_student = student.detach().double().requires_grad_()
        ref_kl(ref_student, teacher, kl_type, 0.3, 0.7).sum().backward()
        torch.testing.assert_close(student.grad.double(), ref_student.grad, atol=1e-5, rtol=1e-4)


def test_token_kl_bf16_inputs_compute_in_fp32():
    torch.manual_seed(4)
    student = torch.randn(4, 33).to(torch.bfloat16)
    teacher = torch.randn(4, 33).to(torch.bfloat16)
    out = token_kl(student, teacher, "reverse")
    assert out.dtype == torch.float32
    # Reference on the same (already bf16-rounded) numbers: only fp32 error remains.
    torch.testing.assert_close(out.double(), ref_kl(student, teacher, "reverse"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_identical_distributions_give_zero_value_and_grad(kl_type, temperature, dtype):
    torch.manual_seed(5)
    logits = torch.randn(3, 5, 17, dtype=dtype) * 3.0
    student = logits.clone().requires_grad_()
    out = token_kl(student, logits.clone(), kl_type, 0.5, temperature)
    # log P − log Q is computed from identical inputs, so every term is exactly 0.
    assert torch.all(out == 0)
    out.sum().backward()
    # The gradient is Q − P·ΣP: zero up to a few ulps of a probability (≤ 1, so ≤ ~4·eps).
    assert torch.all(student.grad.abs() <= 4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_token_kl_is_non_negative(kl_type):
    torch.manual_seed(6)
    for scale in (0.1, 1.0, 5.0):
        out = token_kl(torch.randn(8, 6, 29) * scale, torch.randn(8, 6, 29) * scale, kl_type)
        # fp32 round-off can make a tiny true value a hair negative, never more.
        assert torch.all(out >= -1e-6)
        assert torch.all(torch.isfinite(out))


def test_mixed_endpoints_equal_forward_and_reverse():
    torch.manual_seed(7)
    student = torch.randn(3, 5, 17, dtype=torch.float64)
    teacher = torch.randn(3, 5, 17, dtype=torch.float64)
    forward = token_kl(student, teacher, "forward", temperature=0.7)
    reverse = token_kl(student, teacher, "reverse", temperature=0.7)
    torch.testing.assert_close(token_kl(student, teacher, "mixed", 1.0, 0.7), forward, atol=1e-12, rtol=0)
    torch.testing.assert_close(token_kl(student, teacher, "mixed", 0.0, 0.7), reverse, atol=1e-12, rtol=0)
    # And the two directions really differ here, so the endpoint checks mean something.
    assert (forward - reverse).abs().max() > 1e-3


def test_forward_and_reverse_are_the_right_directions():
    # P = teacher = [1/2, 1/2], Q = student = [1/4, 3/4]: hand-computed values.
    student = torch.log(torch.tensor([0.25, 0.75], dtype=torch.float64))
    teacher = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    forward = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    reverse = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert token_kl(student, teacher, "forward").item() == pytest.approx(forward, abs=1e-12)
    assert token_kl(student, teacher, "reverse").item() == pytest.approx(reverse, abs=1e-12)


def test_token_kl_rejects_bad_arguments():
    a = torch.randn(2, 5)
    with pytest.raises(ValueError):
        token_kl(a, a, "jsd")
    with pytest.raises(ValueError):
        token_kl(a, torch.randn(2, 6), "forward")
    with pytest.raises(ValueError):
        token_kl(a, a, "forward", temperature=0.0)


# --------------------------------------------------------------------------- extreme logits


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_huge_logits_stay_finite_and_match_reference(kl_type):
    torch.manual_seed(8)
    # Entries of ±1e4 (plus a little noise to break ties) underflow every naive softmax.
    student = torch.sign(torch.randn(4, 19)) * 1e4 + torch.randn(4, 19)
    teacher = torch.sign(torch.randn(4, 19)) * 1e4 + torch.randn(4, 19)
    student.requires_grad_()
    out = token_kl(student, teacher, kl_type, 0.5, 1.0)
    assert torch.all(torch.isfinite(out))
    expected = ref_kl(student.detach(), teacher, kl_type)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-3)
    out.sum().backward()
    assert torch.all(torch.isfinite(student.grad))


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_forward_kl_with_minus_inf_teacher_entries(temperature):
    torch.manual_seed(9)
    student = torch.randn(3, 11, requires_grad=True)
    teacher = torch.randn(3, 11)
    teacher[0, [1, 4, 7]] = float("-inf")  # masked-out vocabulary entries: P(v) = 0 exactly
    teacher[2, :10] = float("-inf")  # a one-hot teacher
    out = token_kl(student, teacher, "forward", temperature=temperature)
    assert torch.all(torch.isfinite(out))
    torch.testing.assert_close(
        out.double(), ref_kl(student.detach(), teacher, "forward", temperature=temperature),
        atol=1e-5, rtol=1e-5,
    )
    out.sum().backward()
    assert torch.all(torch.isfinite(student.grad))
    # The analytic gradient (Q − P)/T, with P = 0 on the -inf entries.
    q = torch.softmax(student.detach().double() / temperature, dim=-1)
    p = torch.softmax(teacher.double() / temperature, dim=-1)
    torch.testing.assert_close(student.grad.double(), (q - p) / temperature, atol=1e-6, rtol=1e-5)


def test_reverse_kl_with_minus_inf_teacher_is_infinite_not_nan():
    # The student always puts mass where the teacher has none, so KL(Q‖P) is truly +inf.
    student = torch.zeros(1, 4)
    teacher = torch.tensor([[0.0, 1.0, float("-inf"), 2.0]])
    out = token_kl(student, teacher, "reverse")
    assert not torch.isnan(out).any()
    assert torch.isinf(out).all()


def test_reverse_kl_with_minus_inf_student_entries_value():
    # Q(v) = 0 exactly on the -inf entries: those terms are 0, and the value is finite.
    torch.manual_seed(10)
    student = torch.randn(2, 7)
    student[0, [2, 5]] = float("-inf")
    teacher = torch.randn(2, 7)
    out = token_kl(student, teacher, "reverse")
    assert torch.all(torch.isfinite(out))
    torch.testing.assert_close(out.double(), ref_kl(student, teacher, "reverse"), atol=1e-5, rtol=1e-5)


def test_reverse_kl_with_minus_inf_student_entries_grad():
    torch.manual_seed(10)
    student = torch.randn(2, 7)
    student[0, [2, 5]] = float("-inf")
    student.requires_grad_()
    teacher = torch.randn(2, 7)
    token_kl(student, teacher, "reverse").sum().backward()
    assert torch.all(torch.isfinite(student.grad))


def test_mixed_weight_one_equals_forward_with_minus_inf_teacher():
    student = torch.zeros(1, 4)
    teacher = torch.tensor([[0.0, 1.0, float("-inf"), 2.0]])
    torch.testing.assert_close(
        token_kl(student, teacher, "mixed", 1.0), token_kl(student, teacher, "forward")
    )


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_large_vocab_one_hot_teacher(kl_type):
    torch.manual_seed(11)
    vocab = 50_000
    student = (torch.randn(2, vocab) * 3.0).requires_grad_()
    teacher = torch.full((2, vocab), -1e4)  # nearly one-hot, but P(v) > 0 in float64 terms
    teacher[0, 123] = 1e4
    teacher[1, 45_678] = 20.0
    teacher[1, :100] = torch.randn(100)  # row 1: a sharp peak plus a few live entries
    out = token_kl(student, teacher, kl_type, 0.5, 1.0)
    assert torch.all(torch.isfinite(out))
    expected = ref_kl(student.detach(), teacher, kl_type)
    assert torch.all(torch.isfinite(expected))
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-3)
    out.sum().backward()
    assert torch.all(torch.isfinite(student.grad))
    if kl_type == "forward":
        # Forward KL to a one-hot teacher is the student's NLL of the hot token.
        nll = -torch.log_softmax(student.detach().double()[0], dim=-1)[123]
        assert out[0].item() == pytest.approx(nll.item(), rel=1e-5)


# --------------------------------------------------------------------------- shift_token_mask


def test_shift_token_mask_selects_response_predicting_positions():
    seq_len, prompt_lens, resp_lens = 12, (3, 5, 2), (4, 2, 0)
    token_mask = torch.zeros(3, seq_len, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        token_mask[b, p : p + r] = 1
    shifted = shift_token_mask(token_mask)
    assert shifted.shape == (3, seq_len - 1)
    for b, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        expected = torch.zeros(seq_len - 1, dtype=torch.long)
        expected[p - 1 : p + r - 1] = 1  # logits p-1 .. p+r-2 predict tokens p .. p+r-1
        assert torch.equal(shifted[b], expected), b


def _shift_case(kl_type):
    """One right-padded and one left-padded row; student == teacher everywhere."""
    torch.manual_seed(12)
    seq_len, vocab = 10, 13
    # row 0: prompt 0..2, response 3..6, padding 7..9
    # row 1: padding 0..1, prompt 2..4, response 5..8, padding 9
    token_mask = torch.zeros(2, seq_len, dtype=torch.long)
    token_mask[0, 3:7] = 1
    token_mask[1, 5:9] = 1
    teacher = torch.randn(2, seq_len, vocab)
    data = {"input_ids": torch.randint(0, vocab, (2, seq_len)), "token_mask": token_mask}
    n_tok, n_seq = global_counts(token_mask)
    loss_fn = KLLossFn(kl_type=kl_type)
    return teacher, data, loss_fn, n_tok, n_seq, {0: range(2, 6), 1: range(4, 8)}


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_loss_only_sees_response_predicting_positions(kl_type):
    teacher, data, loss_fn, n_tok, n_seq, predicting = _shift_case(kl_type)
    assert n_tok == 8

    loss, _ = loss_fn(teacher.clone(), data, n_tok, n_seq, teacher_output=teacher)
    assert loss.item() == 0.0

    # Every single response-predicting position, perturbed alone, must be seen.
    for b, positions in predicting.items():
        for t in positions:
            student = teacher.clone()
            student[b, t] += torch.randn(teacher.shape[-1]) * 2.0
            loss, _ = loss_fn(student, data, n_tok, n_seq, teacher_output=teacher)
            assert loss.item() > 0.0, (b, t)

    # Any other position (prompt, the logits after the last response token, padding,
    # the final position) must be ignored exactly.
    for b, positions in predicting.items():
        for t in range(teacher.shape[1]):
            if t in positions:
                continue
            student = teacher.clone()
            student[b, t] += torch.randn(teacher.shape[-1]) * 5.0
            loss, metrics = loss_fn(student, data, n_tok, n_seq, teacher_output=teacher)
            assert loss.item() == 0.0, (b, t)
            assert metrics["kl_forward"] == 0.0 and metrics["kl_reverse"] == 0.0


# --------------------------------------------------------------------------- KLLossFn

LENGTHS = (3, 0, 5, 1, 4, 2)  # includes an empty response
PROMPTS = (2, 4, 1, 6, 3, 5)
SEQ_LEN, VOCAB = 11, 13


@pytest.mark.parametrize("reduction", ("mean", "sum"))
@pytest.mark.parametrize("temperature", (1.0, 0.7))
@pytest.mark.parametrize("kl_type,weight", KL_CASES)
def test_distillation_loss_matches_reference(kl_type, weight, temperature, reduction):
    student, teacher, data = make_batch(LENGTHS, PROMPTS, SEQ_LEN, VOCAB, seed=13)
    n_tok, n_seq = global_counts(data["token_mask"])
    loss_fn = KLLossFn(kl_type, weight, temperature, reduction)
    loss, metrics = loss_fn(student, data, n_tok, n_seq, teacher_output=teacher)

    total, count = ref_masked_kl_sum(student, teacher, data["token_mask"], kl_type, weight, temperature)
    assert count == sum(LENGTHS) == n_tok
    expected = total / (count if reduction == "mean" else len(LENGTHS))
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-6)


@pytest.mark.parametrize("temperature", (1.0, 2.0))
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_distillation_metrics_match_reference(kl_type, temperature):
    student, teacher, data = make_batch(LENGTHS, PROMPTS, SEQ_LEN, VOCAB, seed=14)
    n_tok, n_seq = global_counts(data["token_mask"])
    loss_fn = KLLossFn(kl_type, 0.3, temperature, "sum")
    _, metrics = loss_fn(student, data, n_tok, n_seq, teacher_output=teacher)
    # kl_forward / kl_reverse are token means of the divergences at the loss temperature
    # (the only one a top-k teacher's answer describes), whatever the reduction.
    fwd, count = ref_masked_kl_sum(student, teacher, data["token_mask"], "forward", temperature=temperature)
    rev, _ = ref_masked_kl_sum(student, teacher, data["token_mask"], "reverse", temperature=temperature)
    assert metrics["kl_forward"] == pytest.approx(fwd.item() / count, rel=1e-5)
    assert metrics["kl_reverse"] == pytest.approx(rev.item() / count, rel=1e-5)
    assert metrics["num_valid_tokens"] == float(sum(LENGTHS))


def test_num_valid_tokens_counts_micro_batch_only_and_ignores_position_zero():
    student, teacher, data = make_batch((2, 3), (0, 2), 6, 5, seed=15)
    # Row 0's response starts at token 0, which no logit predicts: it cannot carry loss.
    assert data["token_mask"][0, 0] == 1
    loss_fn = KLLossFn("forward")
    _, metrics = loss_fn(student, data, 100, 10, teacher_output=teacher)
    assert metrics["num_valid_tokens"] == 1.0 + 3.0


SPLITS = [(2, 4), (1, 5), (3, 3), (1, 1, 1, 1, 1, 1), (6,)]


@pytest.mark.parametrize("reduction", ("mean", "sum"))
@pytest.mark.parametrize("kl_type,weight", [("forward", 0.5), ("reverse", 0.5), ("mixed", 0.3)])
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_gradient_accumulation_matches_full_batch(kl_type, weight, reduction, split):
    student, teacher, data = make_batch(LENGTHS, PROMPTS, SEQ_LEN, VOCAB, seed=16)
    n_tok, n_seq = global_counts(data["token_mask"])
    loss_fn = KLLossFn(kl_type, weight, 0.7, reduction)

    full_student = student.clone().requires_grad_()
    full_loss, full_metrics = loss_fn(full_student, data, n_tok, n_seq, teacher_output=teacher)
    full_loss.backward()

    # Micro-batches backprop into the same leaf, so .grad accumulates like in the trainer.
    acc_student = student.clone().requires_grad_()
    acc_loss = 0.0
    acc_metrics = dict.fromkeys(full_metrics, 0.0)
    start = 0
    for size in split:
        sl = slice(start, start + size)
        micro = {k: v[sl] for k, v in data.items()}
        loss, metrics = loss_fn(acc_student[sl], micro, n_tok, n_seq, teacher_output=teacher[sl])
        loss.backward()
        acc_loss += loss.item()
        for k in acc_metrics:
            acc_metrics[k] += metrics[k]
        start += size
    assert start == len(LENGTHS)

    assert acc_loss == pytest.approx(full_loss.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(acc_student.grad, full_student.grad, atol=1e-6, rtol=1e-5)
    for k, v in full_metrics.items():
        assert acc_metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("reduction", ("mean", "sum"))
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_distillation_gradient_matches_reference(kl_type, reduction):
    student, teacher, data = make_batch(LENGTHS, PROMPTS, SEQ_LEN, VOCAB, seed=17, dtype=torch.float64)
    n_tok, n_seq = global_counts(data["token_mask"])
    student.requires_grad_()
    loss, _ = KLLossFn(kl_type, 0.4, 0.7, reduction)(student, data, n_tok, n_seq, teacher_output=teacher)
    loss.backward()

    ref_student = student.detach().clone().requires_grad_()
    total, count = ref_masked_kl_sum(ref_student, teacher, data["token_mask"], kl_type, 0.4, 0.7)
    (total / (count if reduction == "mean" else n_seq)).backward()
    torch.testing.assert_close(student.grad, ref_student.grad, atol=1e-12, rtol=1e-9)
    # Positions that carry no loss get exactly zero gradient.
    no_loss = ~shift_token_mask(data["token_mask"]).bool()
    assert torch.all(student.grad[:, :-1][no_loss] == 0)
    assert torch.all(student.grad[:, -1] == 0)


@pytest.mark.parametrize("reduction", ("mean", "sum"))
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_all_masked_batch_gives_exact_zero(kl_type, reduction):
    student, teacher, data = make_batch((0, 0, 0), (3, 1, 5), 7, 9, seed=18)
    student.requires_grad_()
    loss_fn = KLLossFn(kl_type, kl_reduction=reduction)
    # Whole global batch empty (normaliser 0) and an empty micro-batch of a non-empty batch.
    for n_tok, n_seq in ((0, 0), (0, 3), (17, 6)):
        student.grad = None
        loss, metrics = loss_fn(student, data, n_tok, n_seq, teacher_output=teacher)
        assert loss.item() == 0.0
        loss.backward()
        assert student.grad is not None and torch.all(student.grad == 0)
        assert all(not math.isnan(v) for v in metrics.values())
        assert metrics["num_valid_tokens"] == 0.0
        assert metrics["kl_forward"] == 0.0 and metrics["kl_reverse"] == 0.0


@pytest.mark.parametrize("reduction", ("mean", "sum"))
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_empty_response_row_contributes_nothing(kl_type, reduction):
    # Changing every logit of the empty-response row must change neither the loss nor
    # the other rows' gradients.
    student, teacher, data = make_batch(LENGTHS, PROMPTS, SEQ_LEN, VOCAB, seed=19)
    n_tok, n_seq = global_counts(data["token_mask"])
    loss_fn = KLLossFn(kl_type, kl_reduction=reduction)
    empty = LENGTHS.index(0)

    a = student.clone().requires_grad_()
    loss_a, _ = loss_fn(a, data, n_tok, n_seq, teacher_output=teacher)
    loss_a.backward()

    b_init = student.clone()
    b_init[empty] = torch.randn(SEQ_LEN, VOCAB) * 50.0
    teacher_b = teacher.clone()
    teacher_b[empty] = torch.randn(SEQ_LEN, VOCAB) * 50.0
    b = b_init.requires_grad_()
    loss_b, _ = loss_fn(b, data, n_tok, n_seq, teacher_output=teacher_b)
    loss_b.backward()

    assert loss_a.item() == loss_b.item()
    assert torch.equal(a.grad, b.grad)
    assert torch.all(b.grad[empty] == 0)


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_vocab_size_slicing_ignores_padded_logits(kl_type):
    student, teacher, data = make_batch(LENGTHS, PROMPTS, SEQ_LEN, VOCAB, seed=20)
    n_tok, n_seq = global_counts(data["token_mask"])
    plain, plain_metrics = KLLossFn(kl_type)(student, data, n_tok, n_seq, teacher_output=teacher)

    # Student and teacher padded to *different* widths with huge random junk.
    g = torch.Generator().manual_seed(21)
    junk_s = torch.randn(len(LENGTHS), SEQ_LEN, 3, generator=g) * 1e4
    junk_t = torch.randn(len(LENGTHS), SEQ_LEN, 7, generator=g) * 1e4
    padded_s = torch.cat([student, junk_s], dim=-1).requires_grad_()
    padded_t = torch.cat([teacher, junk_t], dim=-1)
    sliced_fn = KLLossFn(kl_type, vocab_size=VOCAB)
    sliced, sliced_metrics = sliced_fn(padded_s, data, n_tok, n_seq, teacher_output=padded_t)

    assert sliced.item() == pytest.approx(plain.item(), rel=1e-6)
    for k in ("kl_forward", "kl_reverse", "num_valid_tokens"):
        assert sliced_metrics[k] == pytest.approx(plain_metrics[k], rel=1e-6)
    sliced.backward()
    assert torch.all(padded_s.grad[..., VOCAB:] == 0)

    # Without slicing, the mismatched widths are an error rather than a silent mix-up.
    with pytest.raises(ValueError):
        KLLossFn(kl_type)(padded_s, data, n_tok, n_seq, teacher_output=padded_t)


def test_distillation_loss_rejects_bad_config():
    with pytest.raises(ValueError):
        KLLossFn(kl_type="jsd")
    with pytest.raises(ValueError):
        KLLossFn(kl_type="Forward")
    with pytest.raises(ValueError):
        KLLossFn(kl_reduction="token")
    student, _, data = make_batch((2,), (1,), 4, 5)
    with pytest.raises(ValueError):
        KLLossFn()(student, data, 2, 1, teacher_output=None)


# --------------------------------------------------------------------------- NLLLossFn


def ref_nll_sum(logits, input_ids, token_mask):
    """Σ −log softmax(logits[b, t − 1])[input_ids[b, t]] over tokens with token_mask == 1, t ≥ 1."""
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    batch, length = input_ids.shape
    for b in range(batch):
        for t in range(1, length):
            if token_mask[b, t]:
                total = total - ref_log_softmax(logits[b, t - 1])[input_ids[b, t]]
                count += 1
    return total, count


def test_nll_matches_reference_value_and_grad():
    student, _, data = make_batch(LENGTHS, PROMPTS, SEQ_LEN, VOCAB, seed=22)
    n_tok, n_seq = global_counts(data["token_mask"])
    student = (student * 2.0).requires_grad_()
    loss, metrics = NLLLossFn()(student, data, n_tok, n_seq)

    ref_student = student.detach().double().requires_grad_()
    total, count = ref_nll_sum(ref_student, data["input_ids"], data["token_mask"])
    expected = total / count
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert metrics["num_valid_tokens"] == float(count)

    loss.backward()
    expected.backward()
    torch.testing.assert_close(student.grad.double(), ref_student.grad, atol=1e-6, rtol=1e-5)


def test_nll_uses_the_shift():
    # Logits at t put all mass on token t + 1: perfect prediction only if the shift is right.
    vocab, seq_len = 7, 6
    input_ids = torch.tensor([[3, 1, 4, 1, 5, 2]])
    token_mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    logits = torch.full((1, seq_len, vocab), -30.0)
    for t in range(seq_len - 1):
        logits[0, t, input_ids[0, t + 1]] = 30.0
    loss, _ = NLLLossFn()(logits, {"input_ids": input_ids, "token_mask": token_mask}, 3, 1)
    assert loss.item() < 1e-20
    # Aligning the logits with the *same* position instead is maximally wrong.
    unshifted = torch.full((1, seq_len, vocab), -30.0)
    for t in range(seq_len):
        unshifted[0, t, input_ids[0, t]] = 30.0
    bad, _ = NLLLossFn()(unshifted, {"input_ids": input_ids, "token_mask": token_mask}, 3, 1)
    assert bad.item() > 50.0


@pytest.mark.parametrize("split", [(2, 4), (1, 5), (3, 3)], ids=lambda s: "-".join(map(str, s)))
def test_nll_gradient_accumulation(split):
    student, _, data = make_batch(LENGTHS, PROMPTS, SEQ_LEN, VOCAB, seed=23)
    n_tok, n_seq = global_counts(data["token_mask"])
    full = student.clone().requires_grad_()
    full_loss, _ = NLLLossFn()(full, data, n_tok, n_seq)
    full_loss.backward()
    acc = student.clone().requires_grad_()
    total, start = 0.0, 0
    for size in split:
        sl = slice(start, start + size)
        loss, _ = NLLLossFn()(acc[sl], {k: v[sl] for k, v in data.items()}, n_tok, n_seq)
        loss.backward()
        total += loss.item()
        start += size
    assert total == pytest.approx(full_loss.item(), rel=1e-6)
    torch.testing.assert_close(acc.grad, full.grad, atol=1e-6, rtol=1e-5)


def test_nll_all_masked_is_zero():
    student, _, data = make_batch((0, 0), (2, 3), 6, 5, seed=24)
    student.requires_grad_()
    loss, metrics = NLLLossFn()(student, data, 0, 2)
    assert loss.item() == 0.0 and metrics["num_valid_tokens"] == 0.0
    loss.backward()
    assert torch.all(student.grad == 0)
