"""Empty top-k slots (id −1): a teacher token with no counterpart in the student's vocabulary.

A cross-tokenizer teacher maps its top k onto the student's ids; a token it cannot map
leaves an empty slot, and its mass is in the teacher's rest. ``topk_token_kl`` must then
be the KL over the listed tokens and one rest class, exactly as if the empty slots had
never been there, against a float64 reference, whatever the placeholder values hold.
"""

from __future__ import annotations

import math

import pytest
import torch

from opd.losses.distillation_losses import TopKKLLossFn
from opd.losses.divergences import topk_token_kl
from opd.models.interfaces import TopKLogprobs

V, K = 17, 6


def reference(student_logits, teacher_logprobs_full, ids, kl_type, temperature):
    """Float64 KL over the valid listed ids plus one rest class, position by position."""
    out = []
    for position in range(student_logits.shape[0]):
        q = torch.softmax(student_logits[position].double() / temperature, -1)
        p = teacher_logprobs_full[position].double().exp()
        listed = [int(i) for i in ids[position] if i >= 0]
        q_classes = [float(q[i]) for i in listed] + [float(1 - q[listed].sum())]
        p_classes = [float(p[i]) for i in listed] + [float(1 - p[listed].sum())]
        forward = sum(a * math.log(a / b) for a, b in zip(p_classes, q_classes, strict=True) if a > 0)
        reverse = sum(b * math.log(b / a) for a, b in zip(p_classes, q_classes, strict=True) if b > 0)
        out.append({"forward": forward, "reverse": reverse, "mixed": 0.5 * forward + 0.5 * reverse}[kl_type])
    return torch.tensor(out, dtype=torch.float64)


def empty_some_slots(seed=0, positions=12, temperature=1.0):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(positions, V, generator=g, dtype=torch.float64) * 2
    teacher = torch.log_softmax(torch.randn(positions, V, generator=g, dtype=torch.float64) * 2 / temperature, -1)
    values, ids = teacher.topk(K, -1)
    empty = torch.rand(positions, K, generator=g) < 0.4
    empty[0] = True  # a position with nothing listed: all mass in the rest
    ids = ids.masked_fill(empty, -1)
    values = values.masked_fill(empty, float("nan"))  # placeholders are never read
    listed = ids.clamp_min(0)
    mask = torch.zeros_like(teacher, dtype=torch.int64).scatter_add_(-1, listed, (~empty).long()) > 0
    rest = torch.logsumexp(teacher.masked_fill(mask, -math.inf), -1)
    return student, teacher, values, ids, rest


@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("send_rest", [True, False])
def test_empty_slots_take_part_in_neither_class(kl_type, temperature, send_rest):
    student, teacher, values, ids, rest = empty_some_slots(temperature=temperature)
    if not send_rest:  # the rest is then computed from the listed log-probs: placeholders must be ignored
        values = values.nan_to_num(nan=3.0)
    student = student.requires_grad_()
    kl = topk_token_kl(student, values, ids, kl_type, temperature=temperature,
                       teacher_rest_logprobs=rest if send_rest else None)
    torch.testing.assert_close(kl, reference(student.detach(), teacher, ids, kl_type, temperature), rtol=1e-9, atol=1e-10)
    (grad,) = torch.autograd.grad(kl.sum(), student)
    assert torch.isfinite(grad).all()
    assert kl[0].abs() < 1e-12  # nothing listed: one class on both sides


def test_empty_slots_equal_the_compacted_answer_in_the_loss():
    """Same positions, the valid entries moved to the front and the empty ones cut off: same loss."""
    g = torch.Generator().manual_seed(3)
    teacher = torch.log_softmax(torch.randn(2, 5, V, generator=g), -1)
    values, ids = teacher.topk(4, -1)
    rest = torch.logsumexp(teacher.scatter(-1, ids, -math.inf), -1)
    with_empty_ids = torch.cat([ids[..., :2], torch.full_like(ids[..., :2], -1)], -1)
    with_empty_values = torch.cat([values[..., :2], torch.zeros_like(values[..., :2])], -1)
    moved = torch.logsumexp(torch.stack([rest, values[..., 2], values[..., 3]]), 0)  # their mass joins the rest
    data = {"input_ids": torch.randint(0, V, (2, 5), generator=g),
            "token_mask": torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 0]])}
    student = torch.randn(2, 5, V, generator=g)
    loss_fn = TopKKLLossFn(kl_type="reverse", k=4)
    loss, metrics = loss_fn(student, data, 5, 2, teacher_output=TopKLogprobs(with_empty_values, with_empty_ids, moved))
    compact, compact_metrics = loss_fn(student, data, 5, 2,
                                       teacher_output=TopKLogprobs(values[..., :2], ids[..., :2], moved))
    torch.testing.assert_close(loss, compact)
    for key in ("kl_forward", "kl_reverse", "teacher_topk_mass", "student_mass_on_teacher_topk"):
        assert metrics[key] == pytest.approx(compact_metrics[key], rel=1e-6)
