"""Peer check: opd's ``generalized_jsd`` against TRL's ``GKDTrainer.generalized_jsd_loss``.

``opd.losses.divergences.generalized_jsd`` claims TRL's convention for the
generalized Jensen-Shannon divergence of GKD (Agarwal et al., 2023): β = 0 is the forward
KL(teacher‖student), β = 1 the reverse KL(student‖teacher), and in between, with
M = (1 − β)·student + β·teacher, JSD(β) = β·KL(teacher‖M) + (1 − β)·KL(student‖M).
``test_divergences.py`` checks the formula against hand-written references; this module
checks the *convention* against the reference implementation people compare us with, so a
swapped β, a swapped KL direction or a different temperature handling would show up here
even if our own references shared the mistake.

TRL is imported directly, not through ``pytest.importorskip``: it is in the ``test`` extra,
and a peer check that silently skips is no check.

How TRL's function is read (trl 1.16, ``trl/experimental/gkd/gkd_trainer.py``):

* ``reduction="none"`` with ``labels=None`` returns the element-wise ``[B, T, V]`` terms;
  summing over the vocabulary gives the per-position divergence our function returns.
* ``labels`` is aligned with the logits positions (TRL's ``compute_loss`` shifts before
  calling); entries equal to −100 are dropped, leaving ``[N, V]`` for the N kept positions.
* ``"batchmean"`` (the default) divides the kept sum by N (clamped to ≥ 1) when ``labels``
  is given, else by the batch size B; ``"sum"`` returns the sum; ``"mean"`` is
  ``Tensor.mean`` over the ``[N, V]`` elements, i.e. it divides by N·V, not by N;
  ``num_items_in_batch`` overrides the reduction with ``sum / num_items_in_batch``.

TRL computes in the input dtype; for float32 and float64 inputs opd does too, so both sides
round the same arithmetic and the tolerances below can be tight.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from opd.losses.divergences import generalized_jsd

with warnings.catch_warnings():
    # trl.experimental warns on import that its APIs are unstable; that is why we pin it.
    warnings.filterwarnings("ignore", message=".*trl.experimental.*")
    from trl.experimental.gkd import GKDTrainer

trl_jsd = GKDTrainer.generalized_jsd_loss

BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)
TEMPERATURES = (1.0, 2.0)
DTYPES = (torch.float32, torch.float64)
SHAPE = (3, 5, 50)
# Both sides evaluate the same formula (log_softmax, logsumexp of the β-weighted logs,
# Σ p·(log p − log m)) in the input dtype, with only the summation order and the
# 0·log 0 guard differing. Measured on CPU: float32 differs by at most ~1.2e-7 absolute /
# ~3.5e-7 relative (a few ulps of values in [0.05, 100]); float64 by at most ~2.2e-16
# absolute / ~4e-16 relative. The bounds leave ~5x (float32) and >1000x (float64) margin;
# β = 0 and β = 1 agree bit for bit in both dtypes.
TOLERANCES = {
    torch.float32: {"rtol": 1e-6, "atol": 1e-7},
    torch.float64: {"rtol": 1e-12, "atol": 1e-14},
}
# Gradients (measured over all β and both temperatures with the extreme row): float32
# differs by at most ~8e-9 absolute, float64 by ~3e-17, only in entries far below the
# gradient's scale, so the same bounds hold with >10x margin.
GRAD_TOLERANCES = TOLERANCES


def make_logits(dtype: torch.dtype, extreme: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random student and teacher logits of shape ``SHAPE``.

    Args:
        dtype: dtype of the returned tensors (drawn in float64, then cast).
        extreme: if True, position ``[1, 2]`` of both tensors holds a permutation of
            ``linspace(-60, 60, V)``, so log-probabilities reach about −120 and many
            probabilities underflow to exactly 0 in float32 (at temperature 1), with the
            two distributions' near-zeros in different vocabulary entries.
        seed: seed of the private generator.

    Returns:
        ``(student_logits, teacher_logits)``.
    """
    generator = torch.Generator().manual_seed(seed)
    student = 3.0 * torch.randn(SHAPE, generator=generator, dtype=torch.float64)
    teacher = 3.0 * torch.randn(SHAPE, generator=generator, dtype=torch.float64)
    if extreme:
        spread = torch.linspace(-60.0, 60.0, SHAPE[-1], dtype=torch.float64)
        student[1, 2] = spread[torch.randperm(SHAPE[-1], generator=generator)]
        teacher[1, 2] = spread[torch.randperm(SHAPE[-1], generator=generator)]
    return student.to(dtype), teacher.to(dtype)


def trl_per_position(
    student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float
) -> torch.Tensor:
    """TRL's per-position divergence: its unreduced ``[B, T, V]`` terms summed over V.

    Args:
        student: ``[B, T, V]`` student logits.
        teacher: ``[B, T, V]`` teacher logits.
        beta: JSD interpolation weight.
        temperature: softmax temperature.

    Returns:
        ``[B, T]`` divergences.
    """
    terms = trl_jsd(student, teacher, labels=None, beta=beta, temperature=temperature, reduction="none")
    assert terms.shape == student.shape
    return terms.sum(dim=-1)


@pytest.mark.parametrize("extreme", [False, True], ids=["random", "extreme"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("beta", BETAS)
def test_per_position_matches_trl(beta: float, temperature: float, dtype: torch.dtype, extreme: bool) -> None:
    """Per-position values agree with TRL's unreduced loss summed over the vocabulary."""
    student, teacher = make_logits(dtype, extreme)
    ours = generalized_jsd(student, teacher, beta, temperature)
    theirs = trl_per_position(student, teacher, beta, temperature)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
def test_student_gradient_matches_trl(beta: float, dtype: torch.dtype) -> None:
    """d/d(student logits) of a randomly weighted sum of per-position values agrees with TRL.

    Random per-position weights make the check cover each position's gradient, not just
    the gradient of the plain sum. The extreme row is included.
    """
    student, teacher = make_logits(dtype, extreme=True, seed=1)
    weights = torch.rand(SHAPE[:-1], generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    temperature = 2.0

    ours_in = student.clone().requires_grad_(True)
    (generalized_jsd(ours_in, teacher, beta, temperature) * weights).sum().backward()
    theirs_in = student.clone().requires_grad_(True)
    (trl_per_position(theirs_in, teacher, beta, temperature) * weights).sum().backward()

    assert torch.isfinite(ours_in.grad).all()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, **GRAD_TOLERANCES[dtype])


def make_labels() -> torch.Tensor:
    """``[B, T]`` labels with −100 on some positions, including one fully masked sequence."""
    labels = torch.arange(SHAPE[0] * SHAPE[1]).reshape(SHAPE[:2]) % SHAPE[-1]
    labels[0, :2] = -100  # a masked prompt
    labels[1, 4] = -100  # a masked tail
    labels[2, :] = -100  # nothing to learn in this sequence
    return labels


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_masked_reductions_match_trl(beta: float, dtype: torch.dtype) -> None:
    """TRL's masked reductions equal the same reductions of our per-position values.

    Covers the default ``"batchmean"`` (sum over kept positions / their count), ``"sum"``,
    ``"mean"`` (which in TRL divides by count·V), ``num_items_in_batch`` and
    ``"batchmean"`` without labels (which divides by the batch size B).
    """
    student, teacher = make_logits(dtype, extreme=True, seed=3)
    temperature = 1.0
    labels = make_labels()
    keep = labels != -100
    num_kept = int(keep.sum())
    ours = generalized_jsd(student, teacher, beta, temperature)
    kept_sum = ours[keep].sum()

    def theirs(**kwargs: object) -> torch.Tensor:
        return trl_jsd(student, teacher, beta=beta, temperature=temperature, **kwargs)

    tol = TOLERANCES[dtype]
    torch.testing.assert_close(theirs(labels=labels), kept_sum / num_kept, **tol)
    torch.testing.assert_close(theirs(labels=labels, reduction="sum"), kept_sum, **tol)
    torch.testing.assert_close(theirs(labels=labels, reduction="mean"), kept_sum / (num_kept * SHAPE[-1]), **tol)
    torch.testing.assert_close(theirs(labels=labels, num_items_in_batch=40), kept_sum / 40, **tol)
    torch.testing.assert_close(theirs(labels=None), ours.sum() / SHAPE[0], **tol)


def test_masked_batchmean_gradient_matches_trl() -> None:
    """The gradient of TRL's default masked loss equals that of our masked token mean."""
    student, teacher = make_logits(torch.float64, extreme=True, seed=4)
    labels = make_labels()
    keep = labels != -100
    beta, temperature = 0.5, 2.0

    ours_in = student.clone().requires_grad_(True)
    generalized_jsd(ours_in, teacher, beta, temperature)[keep].mean().backward()
    theirs_in = student.clone().requires_grad_(True)
    trl_jsd(theirs_in, teacher, labels=labels, beta=beta, temperature=temperature).backward()

    assert (ours_in.grad[~keep] == 0).all()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, **GRAD_TOLERANCES[torch.float64])
