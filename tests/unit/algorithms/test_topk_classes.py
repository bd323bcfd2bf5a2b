"""A top-k answer over classes of student tokens (a teacher with another tokenizer).

Such a teacher names, at each position, classes of tokens both vocabularies can name
(:class:`opd.data.token_alignment.PrefixClasses`), each by its root's student id. The
student's mass on a class is the sum over all its members. Checked against a float64
reference that sums the classes by hand: the divergence and its gradient for every KL
direction and two temperatures, the loss through the plain and the fused (chunked) head,
its metrics, and validation's KL sums.
"""

from __future__ import annotations

import math

import pytest
import torch

from opd.losses.distillation_losses import TopKKLLossFn
from opd.losses.divergences import topk_token_kl
from opd.models.interfaces import TopKLogprobs, TopKRequest
from opd.models.lm_head import LMHeadInput
from opd.run.validation import ValidationKL

V, K = 23, 4
# Classes: roots 0, 5, 10, 15 hold ids up to the next root; 20..22 stand alone (no root: never listed).
ROOTS = [0] * 5 + [5] * 5 + [10] * 5 + [15] * 5 + [20, 21, 22]


def reference(student_logits, teacher_class_logprobs, ids, rest, kl_type, temperature):
    """Float64, position by position: the student's class masses summed by hand, KL over listed + rest."""
    out = []
    for position in range(student_logits.shape[0]):
        q = torch.softmax(student_logits[position].double() / temperature, -1)
        listed = [int(i) for i in ids[position] if i >= 0]
        q_classes = [sum(q[m] for m in range(V) if ROOTS[m] == root) for root in listed]
        q_classes.append(1 - sum(q_classes))
        p_classes = [math.exp(float(v)) for v, i in zip(teacher_class_logprobs[position], ids[position], strict=True)
                     if i >= 0] + [math.exp(float(rest[position]))]
        forward = sum(a * (math.log(a) - torch.log(b)) for a, b in zip(p_classes, q_classes, strict=True) if a > 0)
        reverse = sum(b * (torch.log(b) - math.log(a)) for a, b in zip(p_classes, q_classes, strict=True))
        out.append({"forward": forward, "reverse": reverse, "mixed": 0.5 * forward + 0.5 * reverse}[kl_type])
    return torch.stack(out)


def teacher_over_classes(seed, positions=9):
    """A teacher distribution over the 4 classes, no-root tokens and its listed top (some slots empty)."""
    g = torch.Generator().manual_seed(seed)
    class_logprobs = torch.log_softmax(torch.randn(positions, 5, generator=g, dtype=torch.float64) * 2, -1)
    order = class_logprobs[:, :4].argsort(-1, descending=True)
    ids = torch.tensor([0, 5, 10, 15])[order]
    values = class_logprobs[:, :4].gather(-1, order)
    ids[::3, 3] = -1  # the lightest class unsent at some positions: its mass goes to the rest
    values = values.masked_fill(ids < 0, 0.0)
    rest = torch.logsumexp(torch.cat([class_logprobs[:, 4:], class_logprobs[:, :4].gather(-1, order)[:, 3:]
                                      .masked_fill(ids[:, 3:] >= 0, -math.inf)], -1), -1)
    return values, ids, rest


@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_class_topk_kl_and_its_gradient_equal_the_class_sums_by_hand(kl_type, temperature):
    values, ids, rest = teacher_over_classes(0)
    g = torch.Generator().manual_seed(1)
    student = (torch.randn(ids.shape[0], V, generator=g, dtype=torch.float64) * 3).requires_grad_()
    kl = topk_token_kl(student, values, ids, kl_type, temperature=temperature, teacher_rest_logprobs=rest,
                       student_classes=torch.tensor(ROOTS))
    reference_student = student.detach().clone().requires_grad_()
    expected = reference(reference_student, values, ids, rest, kl_type, temperature)
    torch.testing.assert_close(kl, expected, rtol=1e-10, atol=1e-12)
    weights = torch.rand(ids.shape[0], generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((kl * weights).sum(), student)
    (want,) = torch.autograd.grad((expected * weights).sum(), reference_student)
    torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-12)


def test_the_loss_plain_and_fused_and_its_metrics_compare_classes():
    values, ids, rest = teacher_over_classes(2, positions=10)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(V, 8, generator=g, dtype=torch.float64)
    data = {"input_ids": torch.randint(0, V, (2, 6), generator=g),
            "token_mask": torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])}
    # The teacher's answer laid out [B, L, k] at the 5 + 4 loss positions (and one unused).
    mask = data["token_mask"][:, 1:].bool()
    layout = torch.zeros(2, 6, dtype=torch.long)
    layout[:, :-1][mask] = torch.arange(int(mask.sum()))
    answer = TopKLogprobs(values[layout].float(), ids[layout], rest[layout].float())
    tokens = int(mask.sum())
    results = {}
    for fused in (False, True):
        loss_fn = TopKKLLossFn(kl_type="forward", k=K, fused_lm_head=fused, chunk_size=3)
        loss_fn.student_classes = torch.tensor(ROOTS)
        h = hidden.clone().requires_grad_()
        student = LMHeadInput(h, weight) if fused else h @ weight.T
        loss, metrics = loss_fn(student, data, tokens, 2, teacher_output=answer)
        results[fused] = (loss, torch.autograd.grad(loss, h)[0], metrics)
    reference_hidden = hidden.clone().requires_grad_()
    rows = (reference_hidden @ weight.T)[:, :-1][mask]
    expected = reference(rows, values[: tokens], ids[: tokens], rest[: tokens], "forward", 1.0).sum() / tokens
    (want,) = torch.autograd.grad(expected, reference_hidden)
    for loss, grad, metrics in results.values():
        # The teacher's answer is float32: its rounding bounds the agreement.
        torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad.double(), want, rtol=1e-4, atol=1e-6)
        assert metrics["kl_forward"] == pytest.approx(float(expected.detach()), rel=1e-5)
        # The student's mass on the teacher's listed classes is over their members, not the root token alone.
        q = torch.softmax(rows.detach(), -1)
        on_listed = sum(float(q[r, [m for m in range(V) if ROOTS[m] == int(i)]].sum())
                        for r in range(tokens) for i in ids[r] if i >= 0)
        assert metrics["student_mass_on_teacher_topk"] == pytest.approx(on_listed / tokens, rel=1e-5)


def test_validation_kl_compares_classes():
    values, ids, rest = teacher_over_classes(4, positions=5)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, 6, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(V, 8, generator=g, dtype=torch.float64)
    data = {"token_mask": torch.tensor([[0, 1, 1, 1, 1, 1]])}
    answer = TopKLogprobs(torch.cat([values, values[:1]])[None], torch.cat([ids, ids[:1]])[None],
                          torch.cat([rest, rest[:1]])[None])
    comparison = ValidationKL(TopKRequest(K, 1.0, V), V, chunk_rows=2, student_classes=torch.tensor(ROOTS))
    sums = comparison(LMHeadInput(hidden, weight), answer, data)
    rows = (hidden @ weight.T)[0, :5]
    for direction in ("forward", "reverse"):
        assert sums[f"kl_{direction}"] == pytest.approx(
            float(reference(rows, values, ids, rest, direction, 1.0).sum()), rel=1e-9)
