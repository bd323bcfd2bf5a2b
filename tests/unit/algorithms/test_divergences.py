"""The loss kernels beyond token_kl (generalized_jsd, topk_token_kl, sampled-token policy gradient)
against plain float64 references, with their invariants.

The references loop over positions and vocabulary entries in Python floats, sharing no
code with opd.losses (divergences, sampled_token).
"""

from __future__ import annotations

import math

import pytest
import torch

from opd.losses.divergences import generalized_jsd, token_kl, topk_token_kl
from opd.losses.sampled_token import sampled_token_advantages, sampled_token_pg_loss

KL_TYPES = ("forward", "reverse", "mixed")


def softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def kl(p: list[float], q: list[float]) -> float:
    """KL(p‖q) with 0·log 0 = 0."""
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)


def combine(p: list[float], q: list[float], kl_type: str, weight: float) -> float:
    if kl_type == "forward":
        return kl(p, q)
    if kl_type == "reverse":
        return kl(q, p)
    return weight * kl(p, q) + (1 - weight) * kl(q, p)


def reference_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    out = []
    for s_row, t_row in zip(student.reshape(-1, student.shape[-1]).tolist(), teacher.reshape(-1, teacher.shape[-1]).tolist()):
        q = softmax([x / temperature for x in s_row])
        p = softmax([x / temperature for x in t_row])
        if beta == 0:
            out.append(kl(p, q))
        elif beta == 1:
            out.append(kl(q, p))
        else:
            m = [(1 - beta) * qi + beta * pi for qi, pi in zip(q, p)]
            out.append(beta * kl(p, m) + (1 - beta) * kl(q, m))
    return torch.tensor(out, dtype=torch.float64).reshape(student.shape[:-1])


def teacher_topk(teacher_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    log_p = torch.log_softmax(teacher_logits.double(), dim=-1)
    values, ids = log_p.topk(k, dim=-1)
    return values, ids


def reference_topk(student: torch.Tensor, topk_logprobs: torch.Tensor, topk_ids: torch.Tensor,
                   kl_type: str, weight: float, tail: bool) -> torch.Tensor:
    out = []
    vocab = student.shape[-1]
    for s_row, lp_row, id_row in zip(student.reshape(-1, vocab).tolist(),
                                     topk_logprobs.reshape(-1, topk_logprobs.shape[-1]).tolist(),
                                     topk_ids.reshape(-1, topk_ids.shape[-1]).tolist()):
        q_full = softmax(s_row)
        q = [q_full[i] for i in id_row]
        p = [math.exp(x) for x in lp_row]
        if tail:
            q_rest = sum(q_full[i] for i in range(vocab) if i not in set(id_row))
            p_rest = max(1.0 - sum(p), 0.0) if len(set(id_row)) < vocab else 0.0
            p, q = p + [p_rest], q + [q_rest]
        else:
            p = [x / sum(p) for x in p]
            q = [x / sum(q) for x in q]
        out.append(combine(p, q, kl_type, weight))
    return torch.tensor(out, dtype=torch.float64).reshape(student.shape[:-1])


def random_logits(*shape: int, scale: float = 3.0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale,
            torch.randn(*shape, generator=generator, dtype=torch.float64) * scale)


# --------------------------------------------------------------------------- generalized JSD


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_jsd_matches_reference(beta, temperature):
    student, teacher = random_logits(3, 5, 11, seed=int(beta * 10))
    got = generalized_jsd(student, teacher, beta, temperature)
    torch.testing.assert_close(got, reference_jsd(student, teacher, beta, temperature), rtol=1e-10, atol=1e-12)
    got32 = generalized_jsd(student.float(), teacher.float(), beta, temperature)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), reference_jsd(student, teacher, beta, temperature), rtol=1e-4, atol=1e-6)


def test_jsd_end_points_are_the_two_kls():
    student, teacher = random_logits(4, 9)
    torch.testing.assert_close(generalized_jsd(student, teacher, 0.0), token_kl(student, teacher, "forward"))
    torch.testing.assert_close(generalized_jsd(student, teacher, 1.0), token_kl(student, teacher, "reverse"))


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_jsd_gradcheck(beta):
    student, teacher = random_logits(2, 3, 6, seed=3)
    student.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: generalized_jsd(s, teacher, beta, 1.3), (student,))


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
def test_jsd_invariants(beta):
    student, teacher = random_logits(50, 13, seed=5)
    values = generalized_jsd(student, teacher, beta)
    assert (values >= 0).all()
    assert generalized_jsd(teacher, teacher, beta).abs().max() < 1e-12
    if 0 < beta < 1:  # bounded by the binary entropy of beta
        bound = -(beta * math.log(beta) + (1 - beta) * math.log(1 - beta))
        assert (values <= bound + 1e-12).all()


def test_jsd_extreme_logits_stay_finite_with_finite_gradient():
    student = torch.tensor([[1e4, -1e4, 0.0, -math.inf]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[-1e4, 1e4, -math.inf, 0.0]], dtype=torch.float64)
    for beta in (0.2, 0.5, 0.8):
        value = generalized_jsd(student, teacher, beta)
        assert torch.isfinite(value).all()
        (grad,) = torch.autograd.grad(value.sum(), student)
        assert torch.isfinite(grad).all()
        # The two distributions are disjoint: JSD reaches its bound, the binary entropy.
        assert value.item() == pytest.approx(-(beta * math.log(beta) + (1 - beta) * math.log(1 - beta)), rel=1e-9)


def test_jsd_rejects_bad_arguments():
    student, teacher = random_logits(2, 5)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(student, teacher, 1.5)
    with pytest.raises(ValueError, match="temperature"):
        generalized_jsd(student, teacher, 0.5, temperature=0.0)
    with pytest.raises(ValueError, match="shape"):
        generalized_jsd(student, teacher[..., :4], 0.5)


# --------------------------------------------------------------------------- top-k teacher signal


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("k", [1, 4, 11])
@pytest.mark.parametrize("tail", [True, False])
def test_topk_matches_reference(kl_type, k, tail):
    student, teacher = random_logits(3, 4, 11, seed=k)
    values, ids = teacher_topk(teacher, k)
    got = topk_token_kl(student, values, ids, kl_type, mixed_kl_weight=0.3, tail=tail)
    torch.testing.assert_close(got, reference_topk(student, values, ids, kl_type, 0.3, tail), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_topk_with_k_equal_vocab_is_the_exact_kl(kl_type):
    student, teacher = random_logits(5, 7, 17, seed=2)
    values, ids = teacher_topk(teacher, 17)
    got = topk_token_kl(student, values, ids, kl_type)
    torch.testing.assert_close(got, token_kl(student, teacher, kl_type), rtol=1e-9, atol=1e-12)
    # fp32 inputs: the teacher's rounding leaves a tiny "rest" that must not become +inf.
    got32 = topk_token_kl(student.float(), values.float(), ids, kl_type)
    assert torch.isfinite(got32).all()
    torch.testing.assert_close(got32.double(), token_kl(student, teacher, kl_type), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_topk_tail_is_a_true_divergence_below_the_exact_one(kl_type, k):
    student, teacher = random_logits(40, 16, seed=7)
    values, ids = teacher_topk(teacher, k)
    tail_values = topk_token_kl(student, values, ids, kl_type)
    assert (tail_values >= 0).all()
    # Coarsening can only lose information (data-processing inequality).
    assert (tail_values <= token_kl(student, teacher, kl_type) + 1e-12).all()
    same_values, same_ids = teacher_topk(student, k)
    assert topk_token_kl(student, same_values, same_ids, kl_type).abs().max() < 1e-12


def test_renormalised_topk_can_miss_a_real_difference():
    """Same top-k shape, different tail mass: renormalised sees 0, the tail variant does not."""
    teacher = torch.tensor([[2.0, 1.0, -5.0, -5.0]], dtype=torch.float64)
    student = torch.tensor([[2.0, 1.0, 1.5, 1.5]], dtype=torch.float64)
    values, ids = teacher_topk(teacher, 2)
    assert topk_token_kl(student, values, ids, "forward", tail=False).item() == pytest.approx(0.0, abs=1e-12)
    assert topk_token_kl(student, values, ids, "forward", tail=True).item() > 0.1


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("tail", [True, False])
def test_topk_gradcheck(kl_type, tail):
    student, teacher = random_logits(2, 2, 7, seed=4)
    values, ids = teacher_topk(teacher, 3)
    student.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: topk_token_kl(s, values, ids, kl_type, 0.4, tail), (student,))


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_topk_extreme_logits_stay_finite(kl_type):
    student = torch.tensor([[1e4, -1e4, 0.0, -1e4, 3.0]], dtype=torch.float32, requires_grad=True)
    teacher = torch.tensor([[-1e4, 1e4, 2.0, 0.0, -1e4]], dtype=torch.float32)
    values, ids = teacher_topk(teacher, 2)
    value = topk_token_kl(student, values.float(), ids, kl_type, tail=True)
    (grad,) = torch.autograd.grad(value.sum(), student)
    assert torch.isfinite(grad).all()
    assert not torch.isnan(value).any()


def test_topk_rejects_mismatched_shapes():
    student, teacher = random_logits(2, 3, 9)
    values, ids = teacher_topk(teacher, 4)
    with pytest.raises(ValueError, match="differ in shape"):
        topk_token_kl(student, values[..., :3], ids, "forward")
    with pytest.raises(ValueError, match="positions"):
        topk_token_kl(student[:1], values, ids, "forward")
    with pytest.raises(ValueError, match="kl_type"):
        topk_token_kl(student, values, ids, "backward")


# --------------------------------------------------------------------------- sampled-token policy gradient


def reference_advantages(student, teacher, mask, teacher_tau, student_tau, discount, reward, adv_tau):
    rows = []
    for b in range(student.shape[0]):
        a = [(teacher_tau * teacher[b, t].item() - student_tau * student[b, t].item()
              + (adv_tau * reward[b].item() if reward is not None else 0.0)) * mask[b, t].item()
             for t in range(student.shape[1])]
        out = []
        for t in range(len(a)):
            out.append(sum(discount ** (u - t) * a[u] for u in range(t, len(a))) * mask[b, t].item()
                       if discount > 0 else a[t])
        rows.append(out)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("with_reward", [False, True])
def test_advantages_match_reference(discount, with_reward):
    generator = torch.Generator().manual_seed(11)
    student = -torch.rand(3, 6, generator=generator, dtype=torch.float64) * 4
    teacher = -torch.rand(3, 6, generator=generator, dtype=torch.float64) * 4
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    reward = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64) if with_reward else None
    got = sampled_token_advantages(student, teacher, mask, 0.8, 1.2, discount, reward, adv_tau=0.5)
    expected = reference_advantages(student, teacher, mask, 0.8, 1.2, discount, reward, 0.5)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert (got[2] == 0).all()  # an all-masked row (empty response) has no advantage


def test_expected_pg_gradient_is_the_reverse_kl_gradient():
    """Σ_v Q(v)·∇loss(v) with a fresh sampler (r = 1) equals ∇ KL(Q‖P), position by position."""
    generator = torch.Generator().manual_seed(3)
    student_logits = torch.randn(2, 9, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher_logits = torch.randn(2, 9, generator=generator, dtype=torch.float64)
    log_q = torch.log_softmax(student_logits, dim=-1)
    log_p = torch.log_softmax(teacher_logits, dim=-1)
    expected_loss = torch.zeros((), dtype=torch.float64)
    for v in range(9):  # every token as "the sampled one", weighted by its probability
        sampled_q, sampled_p = log_q[:, v:v + 1], log_p[:, v:v + 1]
        advantages = sampled_token_advantages(sampled_q, sampled_p, torch.ones_like(sampled_q))
        loss = sampled_token_pg_loss(sampled_q, sampled_q.detach(), advantages, clip_ratio=0.2)
        expected_loss = expected_loss + (log_q[:, v].detach().exp() * loss[:, 0]).sum()
    (pg_grad,) = torch.autograd.grad(expected_loss, student_logits)
    (kl_grad,) = torch.autograd.grad(token_kl(student_logits, teacher_logits, "reverse").sum(), student_logits)
    torch.testing.assert_close(pg_grad, kl_grad, rtol=1e-10, atol=1e-12)


def test_pg_loss_clips_the_ratio_on_the_side_the_advantage_favours():
    student = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)).requires_grad_(True)
    sampler = torch.log(torch.tensor([[0.25, 0.25, 1.0, 1.0]], dtype=torch.float64))  # r = 2, 2, 0.5, 0.5
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    loss = sampled_token_pg_loss(student, sampler, advantages, clip_ratio=0.2)
    # r = 2, A > 0: clipped at 1.2, no gradient. r = 2, A < 0: −min(−2, −1.2) = 2, gradient flows.
    # r = 0.5, A > 0: −min(0.5, 0.8) = −0.5, gradient flows. r = 0.5, A < 0: clipped at 0.8.
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 2.0, -0.5, 0.8]], dtype=torch.float64))
    (grad,) = torch.autograd.grad(loss.sum(), student)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2.0, -0.5, 0.0]], dtype=torch.float64))
    unclipped = sampled_token_pg_loss(student, sampler, advantages, clip_ratio=None)
    torch.testing.assert_close(unclipped, torch.tensor([[-2.0, 2.0, -0.5, 0.5]], dtype=torch.float64))


def test_advantages_reject_bad_discount():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="discount"):
        sampled_token_advantages(x, x, x, discount=1.5)


def reference_advantages_over_student_tokens(student, teacher, mask, discount, segments=None):
    """Plain-Python float64: each student token collects γ^k · a of the student tokens after it,
    k counting student tokens only (observation positions between turns are no steps)."""
    rows = []
    for b in range(student.shape[0]):
        length = student.shape[1]
        a = [float(teacher[b, t]) - float(student[b, t]) for t in range(length)]
        out = []
        for t in range(length):
            if not mask[b, t]:
                out.append(0.0)
                continue
            total, steps = 0.0, 0
            for u in range(t, length):
                if segments is not None and segments[b][u] != segments[b][t]:
                    break
                if mask[b, u]:
                    total += discount**steps * a[u]
                    steps += 1
            out.append(total)
        rows.append(out)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("discount", [0.5, 0.9, 1.0])
def test_discount_counts_student_tokens_only_on_multi_turn_masks(discount):
    """Holes in the mask (tool observations between turns) are not discount steps."""
    generator = torch.Generator().manual_seed(5)
    student = -torch.rand(3, 12, generator=generator, dtype=torch.float64) * 4
    teacher = -torch.rand(3, 12, generator=generator, dtype=torch.float64) * 4
    mask = torch.tensor([
        [0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1, 0],  # prompt, turn, observation, turn, observation, turn, padding
        [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1],
        [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0],  # one turn: the single-turn case
    ], dtype=torch.bool)
    got = sampled_token_advantages(student, teacher, mask, discount=discount)
    expected = reference_advantages_over_student_tokens(student, teacher, mask, discount)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # Packed rows: the sum still stops where the next sequence begins.
    segments = torch.tensor([[0] * 5 + [1] * 7, [0] * 6 + [1] * 6, [0] * 12])
    got = sampled_token_advantages(student, teacher, mask, discount=discount, segment_ids=segments)
    expected = reference_advantages_over_student_tokens(student, teacher, mask, discount, segments.tolist())
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
